r"""stalesync-longtail: the arithmetic model, random init, with long-tail response lengths (speed only).

The main job's model shape (vocab 128, hidden 128, 4 layers, 4 heads, 2 KV heads, MLP 384, float32,
random init, no warm-up); 16 prompts x 8 samples, 128 engine slots, up to 64 new tokens. Each training
sample's response length is forced (EOS ignored) to a clipped log-normal draw, median 8, sigma 0.8,
seeded by (run.seed, sample id), so every schedule generates the same lengths for the same samples;
greedy evaluation (not forced) on 16 problems, before and after RL only. The update runs on packed rows
(its cost follows the real tokens, not the 72-token padded width) with ``decoupled_ppo`` in every
variant, so it costs the same with and without StaleSync.

  python experiments/benchmark_stalesync_main.py --out=/tmp/stalesync_longtail.json

Hardware: 2 CPU cores. Expected runtime and results: BENCHMARKS.md, "StaleSync on a long tail".
"""
import os
import runpy

_ARITHMETIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic.py")


def get_config(arg: str = ""):
  c = runpy.run_path(_ARITHMETIC)["get_config"]()
  c.model.max_position_embeddings = 72
  c.rollout.max_new_tokens = 64
  c.rollout.num_slots = 128
  c.rollout.forced_length_median = 8       # sigma: the default 0.8
  c.algo.policy_loss = "decoupled_ppo"
  c.optim.pack_rows = True
  c.optim.fixed_row_count = True           # the update compiles once (no row bucket met mid-run)
  c.task.eval_problems = 16
  c.task.eval_samples = 0                  # greedy evaluation only (the main job's pass@8 is off)
  c.warmup.steps = 0
  c.run.steps = 11
  c.run.checkpoint_every = 0
  c.run.eval_every = 0
  if arg:
    raise ValueError(f"unknown variant {arg!r} of stalesync_longtail.py (none)")
  return c
