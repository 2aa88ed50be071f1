r"""Step-time benchmark of the GRPO loop: warm-up steps, then N measured steps, one JSON line out.

  python experiments/benchmark_main.py --config=experiments/configs/tiny_grpo.py --steps=10

Prints median step time and per-phase seconds and tokens/s (generate, train, overhead = everything else:
host scoring, reference log-probs, batch assembly), plus the first step's time (compile included; the
persistent compilation cache makes later runs' first step fast).
"""
import json
import statistics
import time

from absl import app, flags
from ml_collections import config_flags

import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 10, "Measured steps.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 2, "Unmeasured steps after the first one.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache ('' disables).")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  t_start = time.perf_counter()
  from rl_fusion_jax import config as config_lib
  cfg = config_lib.experiment_from_dict(_CONFIG.value)
  common.setup_jax(cfg.mesh.cpu_devices, _CACHE.value)
  import jax
  from rl_fusion_jax.orchestration import loop
  from rl_fusion_jax.sharding import mesh as mesh_lib
  from rl_fusion_jax.train import state as state_lib

  setup = loop.validate(cfg, jax.device_count())
  mesh = mesh_lib.make_mesh(cfg.mesh)
  programs = loop.Programs(cfg, mesh, setup.tokenizer)
  params = loop.init_policy(setup, programs)
  ref = jax.tree.map(lambda x: x.copy(), params) if cfg.algo.needs_reference else None
  state = state_lib.create_train_state(params, programs.tx, programs.state_shardings)
  rng = jax.random.key(cfg.run.seed)
  t0 = time.perf_counter()
  state, first = loop.rl_step(setup, programs, state, ref, 0, rng)
  first_s = time.perf_counter() - t0
  rows = []
  for step in range(1, 1 + _WARMUP.value + _STEPS.value):
    state, m = loop.rl_step(setup, programs, state, ref, step, rng)
    if step > _WARMUP.value:
      rows.append(m)
  med = lambda k: statistics.median(r[k] for r in rows)
  step_s, gen_s, train_s = med("step_s"), med("generate_s"), med("train_s")
  out = {
      "config": cfg.model.config.model_type, "devices": jax.device_count(),
      "platform": jax.devices()[0].platform, "mesh": dict(mesh.shape), "steps": len(rows),
      "median_step_s": round(step_s, 4), "first_step_s": round(first_s, 3),
      "startup_s": round(t0 - t_start, 3),
      "generate_s": round(gen_s, 4), "train_s": round(train_s, 4),
      "overhead_s": round(med("reward_s") + med("ref_s") + (step_s - gen_s - train_s
                                                             - med("reward_s") - med("ref_s")), 4),
      "generate_tokens_per_s": round(med("generate_tokens_per_s"), 1),
      "train_tokens_per_s": round(med("train_tokens_per_s"), 1),
      "response_len_mean": round(med("response_len_mean"), 2),
      "batch": cfg.rollout.batch_size, "seq_len": cfg.rollout.seq_len,
  }
  del first
  print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
  app.run(main)
