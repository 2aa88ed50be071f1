"""Chained arithmetic with worked steps ("3+5-2+7=" -> "8,6,13"): responses whose length the problem sets.

A problem chains ``terms`` one-digit operands with ``+`` and ``-``; the completion writes the running
result after each operation, comma-separated, so its length grows with the number of operands (about 2
to 3 characters per step). The number of operands is drawn from a geometric tail: most problems are
short, a few are long, as the responses of a reasoning task are. Only the worked form counts: a
completion is well-formed iff it is exactly ``terms - 1`` comma-separated integers, and correct iff it
is well-formed and its last number is the value of the expression (the intermediate numbers are not
checked, so the reward is the final answer's, as on a reasoning task).
"""

from __future__ import annotations

import re

import numpy as np

from rl_fusion_jax.rewards import base

__all__ = ["ArithmeticStepsTask"]

_STEPS = re.compile(r"-?[0-9]{1,3}(,-?[0-9]{1,3})*")


class ArithmeticStepsTask:
  """``terms`` operands of one digit (``min_terms`` + a geometric draw with mean ``tail``, at most
  ``max_terms``), each operation ``+`` or ``-``; the target is the running result after each."""

  name = "arithmetic_steps"

  def __init__(self, seed: int = 0, min_terms: int = 2, max_terms: int = 12, tail: float = 2.0,
               format_reward: float = 0.1, correct_reward: float = 1.0):
    base.check_seed("ArithmeticStepsTask", seed)
    base.check_reward_weights("ArithmeticStepsTask", format_reward, correct_reward)
    if isinstance(min_terms, bool) or not isinstance(min_terms, int) or not 2 <= min_terms <= 32:
      raise ValueError(f"ArithmeticStepsTask: min_terms must be in [2, 32], got {min_terms!r}")
    if isinstance(max_terms, bool) or not isinstance(max_terms, int) or not min_terms <= max_terms <= 32:
      raise ValueError(f"ArithmeticStepsTask: max_terms must be in [min_terms={min_terms}, 32], got "
                       f"{max_terms!r}")
    if isinstance(tail, bool) or not isinstance(tail, (int, float)) or not 0 <= tail <= 32:
      raise ValueError(f"ArithmeticStepsTask: tail must be a number in [0, 32], got {tail!r}")
    self.seed, self.min_terms, self.max_terms, self.tail = int(seed), min_terms, max_terms, float(tail)
    self.format_reward, self.correct_reward = float(format_reward), float(correct_reward)

  def problem(self, index: int) -> base.Problem:
    rng = np.random.default_rng([self.seed, base.check_index("ArithmeticStepsTask", index)])
    extra = int(rng.geometric(1.0 / (1.0 + self.tail))) - 1 if self.tail else 0
    terms = min(self.min_terms + extra, self.max_terms)
    operands = [int(x) for x in rng.integers(0, 10, size=terms)]
    ops = ["+" if x else "-" for x in rng.integers(0, 2, size=terms - 1)]
    running, value = [], operands[0]
    for op, x in zip(ops, operands[1:]):
      value = value + x if op == "+" else value - x
      running.append(value)
    prompt = str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:])) + "="
    target = ",".join(str(v) for v in running)
    return base.Problem(prompt=prompt, answer=str(value), target=target, meta={"terms": terms})

  def max_lengths(self) -> tuple[int, int]:
    """Upper bounds on (prompt, target) length in characters: ``2 * max_terms`` (digits, operators and
    ``=``) and ``max_terms - 1`` running results of at most 3 characters (``-99`` .. ``99``) with commas."""
    return 2 * self.max_terms, 4 * (self.max_terms - 1) - 1

  def score(self, problem: base.Problem, completion: str) -> base.Score:
    text = completion.strip()
    format_ok = _STEPS.fullmatch(text) is not None and text.count(",") == int(problem.meta["terms"]) - 2
    correct = format_ok and int(text.rsplit(",", 1)[-1]) == int(problem.answer)
    return base.make_score(format_ok, correct, self.format_reward, self.correct_reward)
