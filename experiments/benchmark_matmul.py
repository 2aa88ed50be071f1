r"""Matmul rates of this machine under each precision policy, at a config's own shapes.

  python experiments/benchmark_matmul.py --config=experiments/configs/tiny_grpo.py

For every projection shape of the model (q, k / v, o, gate / up, down, lm head: [rows, in, out]) at
three row counts (the whole batch, batch x seq_len; the most full rows in one micro-batch per device
under the CPU token budget; the decode step's batch) plus the
1024^3 reference, prints GFLOP/s (2 per multiply-add, median of --repeats) of the three forms the
precision policies use: float32 (`float32`), bfloat16 inputs with float32 accumulation and output
(`bf16_matmul`), bfloat16 in and out (`bfloat16`). One device, the machine's default XLA flags.
"""
import json

import common
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls per shape and form.")
flags.mark_flags_as_required(["config"])


def shapes(cfg) -> list[tuple[int, int, int]]:
  """[rows, in, out] of the config's projections at three row counts."""
  from rl_fusion_jax.train import step
  m, r = cfg.model.config, cfg.rollout
  q = m.num_heads * m.head_dim
  kv = m.num_kv_heads * m.head_dim
  per_layer = [(m.hidden_size, q), (m.hidden_size, kv), (q, m.hidden_size),
               (m.hidden_size, m.intermediate_size), (m.intermediate_size, m.hidden_size),
               (m.hidden_size, m.vocab_size)]
  budget = step.DEFAULT_TOKENS_PER_MICRO_BATCH["cpu"]
  rows = sorted({r.batch_size * r.seq_len, budget // r.seq_len * r.seq_len, r.batch_size}, reverse=True)
  return [(1024, 1024, 1024)] + [(n, k, o) for n in rows for k, o in per_layer]


def main(argv):
  del argv
  from rl_fusion_jax import config as config_lib
  cfg = config_lib.experiment_from_dict(_CONFIG.value)
  import jax
  import jax.numpy as jnp
  bf16, f32 = jnp.bfloat16, jnp.float32
  forms = {
      "float32": jax.jit(lambda a, b: a @ b),
      "bf16_matmul": jax.jit(lambda a, b: jnp.dot(a.astype(bf16), b.astype(bf16), preferred_element_type=f32)),
      "bfloat16": jax.jit(lambda a, b: a.astype(bf16) @ b.astype(bf16)),
  }
  out = []
  for m, k, n in shapes(cfg):
    a, b = jnp.ones((m, k), f32) * 0.5, jnp.ones((k, n), f32) * 0.25
    row = {"shape": [m, k, n]}
    for name, fn in forms.items():
      row[name] = round(2 * m * k * n / common.median_seconds(fn, a, b, repeats=_REPEATS.value) / 1e9, 1)
    out.append(row)
    print(json.dumps(row), flush=True)
  print(json.dumps({"gflop_per_s": out, "platform": jax.devices()[0].platform}))


if __name__ == "__main__":
  app.run(main)
