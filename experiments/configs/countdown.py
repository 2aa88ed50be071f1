r"""Countdown with three numbers: supervised warm-up on one solution per problem, then GRPO.

Command (CPU, 2 cores):

  python experiments/grpo_main.py --config=experiments/configs/countdown.py --workdir=/tmp/countdown

The same 4-layer Qwen2-style char-level model and GRPO settings as arithmetic.py, with 1,000 warm-up steps
(its rows of 36 tokens cost 2.6x an arithmetic row); prompts like ``9 7 6 -> 378:``, rewards 0.1 for an
expression that uses each given number exactly once and 1.0 when it also hits the target.
Runtime: 418 s on a 2-core Intel Xeon, beside another run of the same size. Expected result (that
machine, run.seed 0):
  accuracy before RL: 0.324  after RL: 0.445  pass@1 0.205 -> 0.390  pass@8 0.660 -> 0.662  (300 RL steps)
with the format rate 0.750 -> 0.912 (docs/configs.md "Tasks"; BENCHMARKS.md "Countdown").
"""
import os
import runpy

# Config files are loaded by path, not imported as a package: the base config is run by path too.
_ARITHMETIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic.py")


def get_config(arg: str = ""):
  c = runpy.run_path(_ARITHMETIC)["get_config"](arg)
  c.task.name = "countdown"
  c.task.kwargs = dict(num_numbers=3, max_number=10)
  c.rollout.max_prompt_len = 18     # BOS + up to "10 10 10 -> 1330:" (CountdownTask.max_lengths)
  c.rollout.max_new_tokens = 18     # a solution of up to 16 characters + EOS
  c.warmup.steps = 1000             # rows of 36 tokens: 2.6x the arithmetic warm-up's cost per step
  return c
