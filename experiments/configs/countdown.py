r"""Countdown with three numbers: supervised warm-up on one solution per problem, then GRPO.

Command (CPU, 2 cores):

  python experiments/grpo_main.py --config=experiments/configs/countdown.py --workdir=/tmp/countdown

The same 4-layer Qwen2-style char-level model as arithmetic.py; prompts like ``9 7 6 -> 378:``, rewards
0.1 for an expression that uses each given number exactly once and 1.0 when it also hits the target.
Expected runtime: a few minutes on 2 cores. Expected result: the final line prints greedy accuracy on
512 held-out problems before and after RL (README lists no figure for this config yet).
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
  return c
