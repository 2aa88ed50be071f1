"""Integer arithmetic ("12+345=" -> "357"): the smallest task a char-level policy learns on CPU.

Prompts stay a few characters long on purpose, so tests and the quickstart can show reward going up
within minutes on two cores.
"""

from __future__ import annotations

import re

import numpy as np

from rl_fusion_jax.rewards import base

__all__ = ["ArithmeticTask"]

_ALLOWED_OPS = "+-*"  # No "/": the answer must be an integer.
_INTEGER = re.compile(r"-?[0-9]+")  # [0-9], not \d: \d also matches non-ASCII digits.
# int() refuses strings past 4300 digits; no answer here comes near this, so longer ones are wrong.
_MAX_COMPARED_CHARS = 64


class ArithmeticTask:
  """`a op b=` with operands of min_digits..max_digits digits and op drawn from `ops`.

  Format ok iff the stripped completion is an optionally negative decimal integer; correct iff its
  value equals the answer (so "0357" counts as 357).
  """

  name = "arithmetic"

  def __init__(
      self,
      seed: int = 0,
      min_digits: int = 1,
      max_digits: int = 3,
      ops: str = "+-",
      format_reward: float = 0.1,
      correct_reward: float = 1.0,
  ):
    base.check_seed("ArithmeticTask", seed)
    base.check_reward_weights("ArithmeticTask", format_reward, correct_reward)
    if not isinstance(min_digits, int) or not 1 <= min_digits <= 18:
      raise ValueError(f"ArithmeticTask: min_digits must be in [1, 18], got {min_digits!r}")
    if not isinstance(max_digits, int) or not min_digits <= max_digits <= 18:
      raise ValueError(
          f"ArithmeticTask: max_digits must be in [min_digits={min_digits}, 18], got {max_digits!r}"
      )
    if not isinstance(ops, str) or not ops or not set(ops) <= set(_ALLOWED_OPS):
      raise ValueError(f"ArithmeticTask: ops must be a non-empty subset of {_ALLOWED_OPS!r}, got {ops!r}")
    self.seed = int(seed)
    self.min_digits, self.max_digits = min_digits, max_digits
    self.ops = "".join(dict.fromkeys(ops))  # Drop repeats so each op is equally likely.
    self.format_reward, self.correct_reward = float(format_reward), float(correct_reward)

  def problem(self, index: int) -> base.Problem:
    rng = np.random.default_rng([self.seed, base.check_index("ArithmeticTask", index)])
    op = self.ops[int(rng.integers(len(self.ops)))]
    a, b = self._operand(rng), self._operand(rng)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return base.Problem(
        prompt=f"{a}{op}{b}=", answer=str(value), target=str(value), meta={"a": a, "b": b, "op": op}
    )

  def max_lengths(self) -> tuple[int, int]:
    """Upper bounds on (prompt, target) length in characters over every index: `a op b=` and the value.

    Operands have at most max_digits digits; a sum has one digit more, a difference a sign more, a
    product twice the digits.
    """
    d = self.max_digits
    return 2 * d + 2, max({"+": d + 1, "-": d + 1, "*": 2 * d}[op] for op in self.ops)

  def score(self, problem: base.Problem, completion: str) -> base.Score:
    text = completion.strip()
    format_ok = _INTEGER.fullmatch(text) is not None
    correct = format_ok and len(text) <= _MAX_COMPARED_CHARS and int(text) == int(problem.answer)
    return base.make_score(format_ok, correct, self.format_reward, self.correct_reward)

  def _operand(self, rng: np.random.Generator) -> int:
    digits = int(rng.integers(self.min_digits, self.max_digits + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)  # One digit includes 0.
    return int(rng.integers(low, 10**digits))
