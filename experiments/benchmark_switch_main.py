r"""Benchmark of the phase switch (``to_phase``): train -> generate -> train round trips, one JSON line out.

  python experiments/benchmark_switch_main.py --model=tiny --bucket_mb=1
  python experiments/benchmark_switch_main.py --model=100m --bucket_mb=16
  python experiments/benchmark_switch_main.py --model=100m --bucket_mb=1000000   # one bucket: whole tree

Presets: ``tiny`` is the tiny-grpo model (Qwen2-style, vocab 512, hidden 256, 4 layers, 4 heads, 2 KV
heads, MLP 688, untied, float32; 3.2M params); ``100m`` is Qwen2-style with vocab 32000, hidden 768,
12 layers, 12 heads, 4 KV heads, MLP 2048, tied embeddings, float32 (100.1M params).

Prints the median seconds of each direction over ``--repeats`` untracked switches, then one tracked
round trip: bytes moved, buckets, peak live bytes per device (all memory kinds) against the params'
bytes. On CPU every memory kind is host RAM and times say little; the bytes and ratios are the result.
"""
import gc
import json
import statistics

from absl import app, flags

import common

_MODEL = flags.DEFINE_enum("model", "tiny", ["tiny", "100m", "0.5b"], "Model size preset.")
_BUCKET_MB = flags.DEFINE_float("bucket_mb", 16.0, "Bucket size in MiB (per-device destination bytes).")
_OFFLOAD = flags.DEFINE_bool("offload_optimizer", True, "Move the optimizer state to pinned host memory.")
_MESH = flags.DEFINE_list("mesh", ["2", "2", "2"], "Mesh sizes data,fsdp,tensor.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "Virtual CPU devices (set before JAX starts).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed round trips after one warm-up round trip.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache ('' disables).")

_PRESETS = {
    "tiny": dict(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=688, qkv_bias=True, tie_word_embeddings=False),
    "100m": dict(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                 intermediate_size=2048, qkv_bias=True, tie_word_embeddings=True),
    # Qwen2-0.5B shape (494M params, tied embedding), float32: the GPU check of the RL Fusion issue.
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                 intermediate_size=4864, qkv_bias=True, tie_word_embeddings=True),
}


def _setup():
  """Mesh, layouts and a train-layout TrainState with the chosen preset."""
  import jax  # pylint: disable=g-import-not-at-top  (after common.setup_jax)
  from rl_fusion_jax import config as config_lib, models
  from rl_fusion_jax.sharding import mesh as mesh_lib, reshard
  from rl_fusion_jax.train import state as state_lib
  data, fsdp, tensor = (int(v) for v in _MESH.value)
  mesh = mesh_lib.make_mesh(config_lib.MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
  cfg = models.ModelConfig(**_PRESETS[_MODEL.value])
  tx = state_lib.make_optimizer(config_lib.OptimConfig(learning_rate=1e-4))
  abstract = models.abstract_params(cfg)
  layouts = reshard.make_layouts(mesh, abstract, models.param_logical_axes(cfg), tx)
  shardings = state_lib.state_shardings(tx, abstract, layouts.params[reshard.Phase.TRAIN], mesh)
  params = jax.device_put(models.init_params(cfg, jax.random.key(0)), shardings.params)
  return mesh, layouts, state_lib.create_train_state(params, tx, shardings)


def _switch(state, layouts, phase, track):
  from rl_fusion_jax.sharding.reshard import to_phase  # pylint: disable=g-import-not-at-top
  return to_phase(state, phase, layouts=layouts, bucket_bytes=max(1, int(_BUCKET_MB.value * 2**20)),
                  offload_optimizer=_OFFLOAD.value, track_memory=track)


def _per_device(tree) -> int:
  """Bytes of ``tree`` on its fullest device."""
  import jax  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.sharding import memory  # pylint: disable=g-import-not-at-top
  return max(memory.per_device(memory.live_bytes(jax.tree.leaves(tree))).values())


def _timed(state, layouts):
  """Median seconds of each direction over --repeats untracked round trips (after one warm-up)."""
  from rl_fusion_jax.sharding.reshard import Phase  # pylint: disable=g-import-not-at-top
  times = []
  for _ in range(1 + _REPEATS.value):
    state, to_gen = _switch(state, layouts, Phase.GENERATE, track=False)
    state, to_train = _switch(state, layouts, Phase.TRAIN, track=False)
    times.append((to_gen.seconds, to_train.seconds))
  times = times[1:]
  return state, *(round(statistics.median(t[k] for t in times), 5) for k in (0, 1))


def _direction(name, stats, params_bytes):
  peak, extra = max(stats.peak_per_device.values()), stats.peak_extra_bytes()
  return {f"{name}_buckets": stats.buckets, f"{name}_largest_bucket_bytes": stats.largest_bucket_bytes,
          f"{name}_peak_bytes_per_device": peak, f"{name}_peak_extra_bytes_per_device": extra,
          f"{name}_transient_bytes_per_device": stats.transient_bytes(),
          f"{name}_ratio_peak_to_params": round(peak / params_bytes, 4),
          f"{name}_ratio_extra_to_params": round(extra / params_bytes, 4)}


def main(argv):
  del argv
  common.setup_jax(_CPU_DEVICES.value, _CACHE.value)
  import jax  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.sharding import memory  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.sharding.reshard import Phase  # pylint: disable=g-import-not-at-top
  mesh, layouts, state = _setup()
  params_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
  out = {"model": _MODEL.value, "params": sum(x.size for x in jax.tree.leaves(state.params)),
         "params_bytes": params_bytes, "platform": jax.devices()[0].platform,
         "devices": jax.device_count(), "mesh": dict(mesh.shape),
         "bucket_bytes": int(_BUCKET_MB.value * 2**20), "offload_optimizer": _OFFLOAD.value,
         "repeats": _REPEATS.value, "params_bytes_per_device_train": _per_device(state.params),
         "optimizer_bytes_per_device_train": _per_device(state.opt_state)}
  state, out["to_generate_median_s"], out["to_train_median_s"] = _timed(state, layouts)
  gc.collect()   # garbage freed during the tracked switch would understate its peak
  state, to_gen = _switch(state, layouts, Phase.GENERATE, track=True)
  out["params_bytes_per_device_generate"] = _per_device(state.params)
  state, to_train = _switch(state, layouts, Phase.TRAIN, track=True)
  out |= {"params_bytes_moved": to_gen.params_bytes, "optimizer_bytes_moved": to_gen.offload_bytes,
          **_direction("to_generate", to_gen, params_bytes), **_direction("to_train", to_train, params_bytes)}
  stats = memory.device_memory_stats()
  if stats is not None:   # the allocator's own view (GPU): its peak includes everything, not only arrays
    out["allocator_peak_bytes_in_use"] = max(s.get("peak_bytes_in_use", 0) for s in stats.values())
  print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
  app.run(main)
