r"""Generation schedules on a long-tail workload: static batching vs continuous refill vs partial rollout.

  python experiments/benchmark_generate_main.py --devices=1 --repeats=3

Same model (tiny-grpo shape by default: vocab 512, hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 688,
f32, random init), same requests (GRPO groups; forced response lengths from a clipped log-normal), same
slots for every schedule. Every schedule is compiled and warmed up first, then all are timed
``--repeats`` times, interleaved; one JSON line per schedule (median tokens/s and seconds) and one with
the ratios to static. Static batching decodes each batch in one chunk of ``max_new_tokens`` steps (its
best case).
"""
import json
import statistics

from absl import app, flags

import common

_DEVICES = flags.DEFINE_integer("devices", 1, "Virtual CPU devices (set before JAX starts).")
_VOCAB = flags.DEFINE_integer("vocab", 512, "Vocabulary size.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Hidden size.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Decoder layers.")
_HEADS = flags.DEFINE_integer("heads", 4, "Attention heads.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 2, "KV heads.")
_MLP = flags.DEFINE_integer("mlp", 688, "MLP hidden size.")
_SLOTS = flags.DEFINE_integer("slots", 64, "Engine slots.")
_SAMPLES = flags.DEFINE_integer("samples", 512, "Samples per schedule.")
_GROUP = flags.DEFINE_integer("group_size", 8, "Samples per prompt (GRPO group).")
_CHUNK = flags.DEFINE_integer("chunk", 64, "Max decode steps per chunk (continuous, partial).")
_PREFILL_ROWS = flags.DEFINE_integer("prefill_rows", 8, "Rows per prefill call (0: slots / 4).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt length (and max_prompt_len).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Max response length.")
_MEDIAN = flags.DEFINE_float("median_len", 16.0, "Median forced response length.")
_SIGMA = flags.DEFINE_float("sigma", 0.8, "Log-normal sigma of response lengths.")
_PHASE = flags.DEFINE_integer("phase_samples", 0, "Partial rollout: samples per phase (0: slots).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats per schedule (medians reported).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of weights, prompts and lengths.")
_PRESET = flags.DEFINE_enum("preset", "", ["", "0.5b", "1.5b"], "Model shape preset (overrides the size "
                            "flags): 0.5b = Qwen2-0.5B shape (vocab 151936, hidden 896, 24 layers, 14/2 "
                            "heads, MLP 4864, tied); 1.5b = Qwen2.5-1.5B (hidden 1536, 28 layers, 12/2 heads, "
                            "MLP 8960, tied).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Param and compute dtype.")
_HBM = flags.DEFINE_float("hbm_gb_per_s", 4800.0, "Memory bandwidth for the decode roofline (H200: 4800).")

PRESETS = {"0.5b": dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                        intermediate_size=4864, tie_word_embeddings=True),
           "1.5b": dict(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                        intermediate_size=8960, tie_word_embeddings=True)}


def model_config(models):
  sizes = dict(vocab_size=_VOCAB.value, hidden_size=_HIDDEN.value, num_layers=_LAYERS.value,
               num_heads=_HEADS.value, num_kv_heads=_KV_HEADS.value, intermediate_size=_MLP.value)
  sizes.update(PRESETS.get(_PRESET.value, {}))
  return models.ModelConfig(**sizes, qkv_bias=True, dtype=_DTYPE.value, param_dtype=_DTYPE.value,
                            max_position_embeddings=_PROMPT_LEN.value + _MAX_NEW.value)


def roofline(cfg, params, slots: int, seq_len: int, measured: float) -> dict:
  """Decode upper bound: every step reads all weights and the whole fixed-shape KV cache once."""
  import jax  # pylint: disable=g-import-not-at-top
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  itemsize = 2 if cfg.dtype == "bfloat16" else 4
  kv_bytes = 2 * cfg.num_layers * slots * seq_len * cfg.num_kv_heads * cfg.head_dim * itemsize
  step_s = (weight_bytes + kv_bytes) / (_HBM.value * 1e9)
  bound = slots / step_s
  return {"roofline": {"weight_bytes": weight_bytes, "kv_cache_bytes": kv_bytes,
                       "bound_tokens_per_s": round(bound, 1), "continuous_tokens_per_s": measured,
                       "fraction_of_bound": round(measured / bound, 4)}}
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache ('' disables).")


def main(argv):
  del argv
  common.setup_jax(_DEVICES.value, _CACHE.value)
  import jax
  import numpy as np
  from rl_fusion_jax import config as config_lib
  from rl_fusion_jax import models
  from rl_fusion_jax.rollout import engine as engine_lib
  from rl_fusion_jax.rollout import workload
  from rl_fusion_jax.rollout.decode import GenerateSpec
  from rl_fusion_jax.rollout.sampling import SamplingParams
  from rl_fusion_jax.sharding import mesh as mesh_lib
  from rl_fusion_jax.sharding.rules import GENERATE_RULES, param_shardings

  cfg = model_config(models)
  mesh = mesh_lib.make_mesh(config_lib.MeshConfig(data=-1))
  shardings = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh,
                              GENERATE_RULES)
  params = jax.jit(lambda k: models.init_params(cfg, k), out_shardings=shardings)(jax.random.key(_SEED.value))
  spec = GenerateSpec(cfg, SamplingParams(1.0), _PROMPT_LEN.value, _MAX_NEW.value, eos_id=0)
  base = engine_lib.EngineConfig(spec, num_slots=_SLOTS.value, chunk_steps=_CHUNK.value,
                                 prefill_rows=_PREFILL_ROWS.value, group_size=_GROUP.value, seed=_SEED.value)
  rng = np.random.default_rng(_SEED.value)
  lengths = workload.long_tail_lengths(rng, _SAMPLES.value, median=_MEDIAN.value, sigma=_SIGMA.value,
                                       max_len=_MAX_NEW.value)
  requests = workload.make_requests(rng, lengths, group_size=_GROUP.value, prompt_len=_PROMPT_LEN.value,
                                    vocab_size=cfg.vocab_size)
  lens = {"p50": float(np.percentile(lengths, 50)), "p99": float(np.percentile(lengths, 99)),
          "mean": float(lengths.mean()), "max": int(lengths.max())}
  phase = _PHASE.value or _SLOTS.value
  engines = {s: lambda s=s: engine_lib.Engine(workload.schedule_config(base, s), mesh, shardings)
             for s in workload.SCHEDULES}
  for schedule, make in engines.items():     # compile and warm up every program first
    workload.run_schedule(schedule, make(), params, requests[:2 * _SLOTS.value], phase_samples=phase)
  runs = {s: [] for s in engines}
  for _ in range(_REPEATS.value):            # interleaved, so load from other processes hits all alike
    for schedule, make in engines.items():
      runs[schedule].append(workload.run_schedule(schedule, make(), params, requests, phase_samples=phase))
  medians = {}
  for schedule, rs in runs.items():
    row = dict(rs[0])
    for key in ("seconds", "tokens_per_s", "median_phase_s"):
      if key in row:
        row[key] = round(statistics.median(r[key] for r in rs), 4)
    row.update(tokens_per_s_all=[round(r["tokens_per_s"], 1) for r in rs], repeats=len(rs),
               slots=_SLOTS.value, chunk=base.chunk_steps if schedule != "static" else _MAX_NEW.value,
               samples=_SAMPLES.value, devices=jax.device_count(), lengths=lens,
               slot_utilization=round(row["slot_utilization"], 3))
    medians[schedule] = row
    print(json.dumps(row, sort_keys=True), flush=True)
  static = medians["static"]["tokens_per_s"]
  print(json.dumps({"ratios_vs_static": {s: round(m["tokens_per_s"] / static, 3) for s, m in medians.items()},
                    "p99_over_p50": round(lens["p99"] / lens["p50"], 2)}, sort_keys=True))
  print(json.dumps(roofline(cfg, params, _SLOTS.value, spec.seq_len, medians["continuous"]["tokens_per_s"]),
                   sort_keys=True))


if __name__ == "__main__":
  app.run(main)
