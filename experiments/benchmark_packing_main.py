r"""Train-step time on right-padded rows vs packed rows, same batch, one JSON line out.

  python experiments/benchmark_packing_main.py --config=experiments/configs/tiny_grpo.py

The batch is synthetic but shaped like a GRPO rollout of the config: ``num_prompts`` groups of
``group_size`` samples sharing a prompt of 5-9 tokens, response lengths from a clipped log-normal (a long
tail up to ``max_new_tokens``). The padded step takes [B, W], W the longest sample rounded up to a width
bucket (``step.train_width``, as the loop does); the packed step takes [R, --width] rows from
``train/packing.py`` (R the smallest row bucket that fits). Both split into micro-batches as the loop does
(``optim.micro_batches``, else ``optim.tokens_per_micro_batch``; counts reported). Both steps
are compiled and run ``--warmup`` times, then timed ``--steps`` times each, interleaved; medians reported,
plus rows / tokens / padding fraction of both layouts and the host time to plan and pack the batch.
"""
import json
import statistics
import time

from absl import app, flags
from ml_collections import config_flags

import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per layout.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps per layout (the first compiles).")
_WIDTH = flags.DEFINE_integer("width", 0, "Packed row width (0: the padded row length).")
_PER_DOUBLING = flags.DEFINE_integer("per_doubling", 1, "Row buckets per doubling of the row count.")
_MEDIAN = flags.DEFINE_float("median_len", 8.0, "Median response length.")
_SIGMA = flags.DEFINE_float("sigma", 0.8, "Log-normal sigma of response lengths.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the batch.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache ('' disables).")
flags.mark_flags_as_required(["config"])


def synthetic_batch(cfg, np):
  """Host fields of a right-padded GRPO batch (prompt then response) and each sample's length."""
  from rl_fusion_jax.rollout.workload import long_tail_lengths
  r, rng = cfg.rollout, np.random.default_rng(_SEED.value)
  prompt_b = np.repeat(rng.integers(5, 10, size=r.num_prompts), r.group_size)
  response_b = long_tail_lengths(rng, r.batch_size, median=_MEDIAN.value, sigma=_SIGMA.value,
                                 max_len=r.max_new_tokens)
  length_b, col = prompt_b + response_b, np.arange(r.seq_len)[None]
  mask = ((col >= prompt_b[:, None]) & (col < length_b[:, None])).astype(np.float32)
  tokens = np.where(col < length_b[:, None], rng.integers(3, cfg.model.config.vocab_size,
                                                          size=mask.shape), 0).astype(np.int32)
  fields = dict(tokens_bt=tokens, mask_bt=mask,
                advantages_bt=rng.normal(size=(r.batch_size, 1)).astype(np.float32) * mask,
                behaviour_logp_bt=(rng.normal(size=mask.shape) * 0.1 - 6).astype(np.float32) * mask,
                ref_logp_bt=np.zeros_like(mask), version_bt=np.where(mask > 0, 0, -1).astype(np.int32))
  return fields, length_b


def timed(step, state, batch):
  t0 = time.perf_counter()
  state, metrics = step(state, batch)
  metrics = {k: float(v) for k, v in metrics.items()}   # waits for the step
  return state, metrics, time.perf_counter() - t0


def main(argv):
  del argv
  from rl_fusion_jax import config as config_lib
  cfg = config_lib.experiment_from_dict(_CONFIG.value)
  common.setup_jax(cfg.mesh.cpu_devices, _CACHE.value)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from rl_fusion_jax import models
  from rl_fusion_jax.sharding import mesh as mesh_lib, rules
  from rl_fusion_jax.train import packed_step, packing, state as state_lib, step as step_lib
  from rl_fusion_jax.types import TrainBatch

  m, r = cfg.model.config, cfg.rollout
  mesh = mesh_lib.make_mesh(cfg.mesh)
  axes = models.param_logical_axes(m)
  psh = rules.param_shardings(models.abstract_params(m), axes, mesh, rules.TRAIN_RULES)
  tx = state_lib.make_optimizer(cfg.optim)
  ssh = state_lib.state_shardings(tx, models.abstract_params(m), psh, mesh)
  params = models.init_params(m, jax.random.key(cfg.run.seed), init_std=cfg.model.init_std)
  new_state = lambda: state_lib.create_train_state(jax.device_put(params, psh), tx, ssh)
  micro = step_lib.MicroBatching.from_optim(cfg.optim, jax.devices()[0].platform)
  args = (m, cfg.algo, r.temperature, tx, micro, mesh, r.max_new_tokens, ssh)
  steps = {"padded": step_lib.make_rl_step(*args), "packed": packed_step.make_packed_rl_step(*args)}

  fields, length_b = synthetic_batch(cfg, np)
  padded_width = step_lib.train_width(int(length_b.max()), r.seq_len)
  fields = {k: v[:, :padded_width] if v.ndim == 2 else v for k, v in fields.items()}
  width = _WIDTH.value or r.seq_len
  multiple = packing.row_multiple(mesh_lib.batch_shards(mesh), cfg.optim.micro_batches)
  buckets = packing.row_buckets(r.batch_size, multiple, _PER_DOUBLING.value)
  t0 = time.perf_counter()
  layout = packing.plan(length_b, width, buckets)
  host = packing.pack_batch(layout, **fields)
  pack_s = time.perf_counter() - t0
  batches = {"padded": jax.device_put(TrainBatch(**{k: jnp.asarray(v) for k, v in fields.items()}),
                                      step_lib.batch_shardings(mesh)),
             "packed": packed_step.device_batch(mesh, host)}
  states = {name: new_state() for name in steps}
  seconds, losses = {name: [] for name in steps}, {}
  for i in range(_WARMUP.value + _STEPS.value):
    for name in steps:
      states[name], metrics, s = timed(steps[name], states[name], batches[name])
      losses.setdefault(name, metrics["loss"])
      if i >= _WARMUP.value:
        seconds[name].append(s)
  med = {name: statistics.median(v) for name, v in seconds.items()}
  tokens = int(length_b.sum())
  out = {
      "devices": jax.device_count(), "platform": jax.devices()[0].platform, "mesh": dict(mesh.shape),
      "batch": r.batch_size, "steps": _STEPS.value, "micro_batches": cfg.optim.micro_batches,
      "tokens_per_micro_batch": micro.tokens,
      "padded_step_s": round(med["padded"], 4), "packed_step_s": round(med["packed"], 4),
      "speedup": round(med["padded"] / med["packed"], 3), "pack_host_s": round(pack_s, 4),
      "padded": {"rows": r.batch_size, "width": padded_width, "tokens": tokens,
                 "padding_fraction": round(1 - tokens / (r.batch_size * padded_width), 4),
                 "micro": micro.num_micro(r.batch_size, padded_width, mesh_lib.batch_shards(mesh))},
      "packed": {k: round(v, 4) for k, v in layout.stats().items()} | {
          "buckets": list(buckets),
          "micro": micro.num_micro(layout.num_rows, width, mesh_lib.batch_shards(mesh))},
      "first_step_loss_abs_diff": abs(losses["padded"] - losses["packed"]),
      "response_len_mean": round(float(fields["mask_bt"].sum(1).mean()), 2),
  }
  print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
  app.run(main)
