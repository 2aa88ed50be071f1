r"""Compiled per-device memory of the real-scale programs at Qwen2.5-0.5B / 1.5B shapes, without running them.

  python experiments/aot_memory_main.py                       # remat full, the table in BENCHMARKS.md
  python experiments/aot_memory_main.py --remat=none --programs=grad
  python experiments/aot_memory_main.py --param_dtype=bfloat16 --programs=grad,update --meshes=1

Each program is lowered with abstract arguments and compiled ahead of time on CPU
(`rl_fusion_jax.testing.aot_memory`); `memory_analysis()` gives per-device temporary bytes (what the
program allocates beyond its arguments and outputs) and argument bytes. `bound` is the sum of the parts
the module derives from the shapes (the tests assert temp <= bound). Programs: `grad` (jax.grad of the
summed token log-probs on one device, the model's share of an update), `update` (the GRPO step: forward,
backward, AdamW, guarded), `ref` (reference log-probs), `decode` (one decode chunk of the engine).
Meshes: `1` (one device), `8` (the default mesh on 8 devices: data-parallel), `8f` (8-way FSDP).
"""
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

_PRESETS = flags.DEFINE_list("presets", ["0.5b", "1.5b"], "Qwen2.5 shapes (testing.aot_memory.PRESETS).")
_MESHES = flags.DEFINE_list("meshes", ["1", "8", "8f"], "1, 8 (data-parallel) or 8f (fsdp=8).")
_PROGRAMS = flags.DEFINE_list("programs", ["grad", "update", "ref", "decode"], "Programs to compile.")
_REMAT = flags.DEFINE_enum("remat", "full", ["none", "full", "matmuls"], "model.remat.")
_CHUNK = flags.DEFINE_integer("logits_chunk", 1024, "model.logits_chunk.")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", "float32", ["float32", "bfloat16"],
                                 "model.param_dtype: float32 master weights, or a checkpoint's bfloat16 as stored.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "model.dtype (the precision policy).")
_ROWS = flags.DEFINE_integer("rows_per_device", 4, "Training rows per device.")
_WIDTH = flags.DEFINE_integer("width", 1024, "Tokens per training row.")
_SLOTS = flags.DEFINE_integer("slots", 64, "Decode slots per device group (the engine's num_slots).")
_PROMPT = flags.DEFINE_integer("prompt_len", 512, "max_prompt_len of the decode program.")
_NEW = flags.DEFINE_integer("new_tokens", 512, "max_new_tokens of the decode program.")

MESHES = {"1": dict(devices=1), "8": dict(devices=8), "8f": dict(devices=8, fsdp=8)}


def main(argv):
  del argv
  from rl_fusion_jax.testing import aot_memory as am  # pylint: disable=g-import-not-at-top
  gb = lambda n: round(n / 1e9, 3)
  rows_md = ["| preset | mesh | program | temp GB | bound GB | args GB | compile s |", "|---|---|---|---|---|---|---|"]
  for preset in _PRESETS.value:
    cfg = am.preset_config(preset, remat=_REMAT.value, logits_chunk=_CHUNK.value, param_dtype=_PARAM_DTYPE.value,
                           dtype=_DTYPE.value)
    for mesh_name in _MESHES.value:
      spec = MESHES[mesh_name]
      mesh = am.make_mesh(**spec)
      shards = spec.get("fsdp", 1)
      rows = _ROWS.value * spec["devices"]
      for program in _PROGRAMS.value:
        if program == "grad" and mesh_name != "1":
          continue
        start = time.perf_counter()
        if program == "grad":
          memory = am.grad_logprobs_memory(cfg, _ROWS.value, _WIDTH.value)
          parts = am.activation_parts(cfg, _ROWS.value, _WIDTH.value)
        elif program == "update":
          memory = am.update_memory(cfg, mesh, rows, _WIDTH.value)
          parts = am.update_parts(cfg, _ROWS.value, _WIDTH.value, param_shards=shards)
        elif program == "ref":
          memory = am.logprob_memory(cfg, mesh, rows, _WIDTH.value)
          parts = am.logprob_parts(cfg, _ROWS.value, _WIDTH.value)
        else:
          memory = am.decode_memory(cfg, mesh, _SLOTS.value, _PROMPT.value, _NEW.value)
          # As tests/aot_memory_test.py counts them: the on-device refill's rows split over the data axis at
          # the prompt width, and the outbox (2 x the slots) replicated.
          data = mesh.shape["data"]
          parts = am.decode_parts(cfg, _SLOTS.value // data, _PROMPT.value + _NEW.value,
                                  refill_rows=am.refill_rows(mesh, _SLOTS.value) // data,
                                  refill_width=_PROMPT.value, outbox_rows=2 * _SLOTS.value)
        seconds = time.perf_counter() - start
        line = dict(preset=preset, mesh=mesh_name, program=program, remat=cfg.remat, param_dtype=cfg.param_dtype,
                    dtype=cfg.dtype, **memory,
                    bound=sum(parts.values()), parts=parts, compile_s=round(seconds, 1))
        print(json.dumps(line), flush=True)
        rows_md.append(f"| {preset} | {mesh_name} | {program} | {gb(memory['temp'])} | {gb(sum(parts.values()))} "
                       f"| {gb(memory['args'])} | {seconds:.1f} |")
  print("\n".join(rows_md))


if __name__ == "__main__":
  sys.exit(app.run(main))
