"""Countdown ("3 5 7 -> 22:" -> "3*5+7"): reach a target using each given number exactly once.

Every generated problem is solvable by construction: the target is the value of a random expression
over the numbers, and that expression is the problem's ideal completion.

The verifier reads the completion as untrusted text. It parses with `ast` and walks a whitelist of node
types (integer literals, + - * /); it never calls `eval`, and it never raises on what a policy writes.
"""

from __future__ import annotations

import ast
import collections
import fractions
from collections.abc import Sequence

import numpy as np

from rl_fusion_jax.rewards import base

__all__ = ["CountdownTask", "parse_expression"]

_OPS = "+-*/"
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_LEAF_PRECEDENCE = 3
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
# Checked before parsing. It rules out names, calls and attributes early, and literals such as 0x10 or
# 1_0 that `ast` would read as ints the prompt never showed. "**" and "//" pass it; the AST walk stops them.
_ALLOWED_CHARS = frozenset("0123456789+-*/() ")
_MAX_COMPLETION_CHARS = 256  # Bounds parser work and nesting depth on adversarial completions.
_MAX_GENERATION_ATTEMPTS = 100


class CountdownTask:
  """Numbers drawn uniformly from [min_number, max_number]; targets are positive integers.

  Format ok iff the stripped completion parses as + - * / over integer literals (parentheses allowed,
  no unary minus, no "=" part) and its literals are exactly the given numbers as a multiset. Correct
  iff format ok and its exact (Fraction) value equals the target; division by zero is not correct.
  """

  name = "countdown"

  def __init__(
      self,
      seed: int = 0,
      num_numbers: int = 3,
      max_number: int = 10,
      min_number: int = 1,
      format_reward: float = 0.1,
      correct_reward: float = 1.0,
  ):
    base.check_seed("CountdownTask", seed)
    base.check_reward_weights("CountdownTask", format_reward, correct_reward)
    if not isinstance(num_numbers, int) or not 2 <= num_numbers <= 6:
      raise ValueError(f"CountdownTask: num_numbers must be in [2, 6], got {num_numbers!r}")
    if not isinstance(min_number, int) or min_number < 1:
      raise ValueError(f"CountdownTask: min_number must be an int >= 1, got {min_number!r}")
    if not isinstance(max_number, int) or max_number < min_number:
      raise ValueError(
          f"CountdownTask: max_number must be an int >= min_number={min_number}, got {max_number!r}"
      )
    self.seed = int(seed)
    self.num_numbers, self.min_number, self.max_number = num_numbers, min_number, max_number
    self.format_reward, self.correct_reward = float(format_reward), float(correct_reward)

  def max_lengths(self) -> tuple[int, int]:
    """Upper bounds on (prompt, target) length in characters over every index.

    Over positive integers each of + - * / gives at most (a + 1)(b + 1) - 1, so a target is at most
    (max_number + 1) ** num_numbers - 1. A solution has num_numbers literals, one operator fewer, and at
    most two pairs of parentheses per operator.
    """
    n, digits = self.num_numbers, len(str(self.max_number))
    target_digits = len(str((self.max_number + 1) ** n - 1))
    prompt = n * digits + (n - 1) + len(" -> ") + target_digits + len(":")
    return prompt, n * digits + (n - 1) * 5

  def problem(self, index: int) -> base.Problem:
    rng = np.random.default_rng([self.seed, base.check_index("CountdownTask", index)])
    numbers = [int(n) for n in rng.integers(self.min_number, self.max_number + 1, self.num_numbers)]
    value, expression = _solvable_expression(numbers, rng)
    prompt = f"{' '.join(map(str, numbers))} -> {value}:"
    return base.Problem(
        prompt=prompt, answer=str(value), target=expression, meta={"numbers": tuple(numbers), "target": value}
    )

  def score(self, problem: base.Problem, completion: str) -> base.Score:
    numbers, target = _meta(problem)
    parsed = parse_expression(completion)
    format_ok = parsed is not None and collections.Counter(parsed[0]) == collections.Counter(numbers)
    correct = format_ok and parsed[1] is not None and parsed[1] == target
    return base.make_score(format_ok, correct, self.format_reward, self.correct_reward)


def parse_expression(text: str) -> tuple[list[int], fractions.Fraction | None] | None:
  """(integer literals in order, exact value or None on division by zero), or None if not allowed."""
  text = text.strip()
  if not text or len(text) > _MAX_COMPLETION_CHARS or not set(text) <= _ALLOWED_CHARS:
    return None
  try:
    tree = ast.parse(text, mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return None
  literals: list[int] = []
  try:
    value = _evaluate(tree.body, literals)
  except _NotAllowed:
    return None
  return literals, value


class _NotAllowed(Exception):
  """A node outside the whitelist; never escapes parse_expression."""


def _evaluate(node: ast.AST, literals: list[int]) -> fractions.Fraction | None:
  """Exact value of a whitelisted expression; None once any division by zero happened."""
  if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is an int subclass.
    literals.append(node.value)
    return fractions.Fraction(node.value)
  if not (isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS):
    raise _NotAllowed(type(node).__name__)
  # Both sides are walked even after a zero division, so every literal is still counted.
  left, right = _evaluate(node.left, literals), _evaluate(node.right, literals)
  if left is None or right is None:
    return None
  return _apply(_AST_OPS[type(node.op)], left, right)


def _apply(op: str, left: fractions.Fraction, right: fractions.Fraction) -> fractions.Fraction | None:
  if op == "/":
    return None if right == 0 else left / right
  return {"+": left + right, "-": left - right, "*": left * right}[op]


def _meta(problem: base.Problem) -> tuple[Sequence[int], int]:
  for field in ("numbers", "target"):
    if field not in problem.meta:
      raise ValueError(f"CountdownTask.score: problem.meta lacks field {field!r}")
  return problem.meta["numbers"], problem.meta["target"]


# ----------------------------------------------------------------------------------------------------
# Generation: a random expression tree over the numbers, written with minimal parentheses.
# ----------------------------------------------------------------------------------------------------


def _solvable_expression(numbers: Sequence[int], rng: np.random.Generator) -> tuple[int, str]:
  """(target, expression) with every intermediate a non-negative integer and the target positive."""
  for _ in range(_MAX_GENERATION_ATTEMPTS):
    result = _random_expression(numbers, rng)
    if result is not None and result[0] > 0:
      return result
  # Only + always keeps the rules above; reached only when the random draws keep failing.
  return sum(numbers), "+".join(map(str, numbers))


def _random_expression(numbers: Sequence[int], rng: np.random.Generator) -> tuple[int, str] | None:
  # Each node is (value, text, precedence of its top operator).
  nodes = [(n, str(n), _LEAF_PRECEDENCE) for n in numbers]
  while len(nodes) > 1:
    i, j = (int(k) for k in rng.choice(len(nodes), size=2, replace=False))
    op = _OPS[int(rng.integers(len(_OPS)))]
    combined = _combine(nodes[i], op, nodes[j])
    if combined is None:
      return None
    nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [combined]
  value, text, _ = nodes[0]
  return value, text


def _combine(left: tuple[int, str, int], op: str, right: tuple[int, str, int]) -> tuple[int, str, int] | None:
  """Node for `left op right`, or None if the value leaves the non-negative integers."""
  (a, a_text, a_prec), (b, b_text, b_prec) = left, right
  if op == "/" and (b == 0 or a % b):
    return None
  value = a // b if op == "/" else {"+": a + b, "-": a - b, "*": a * b}[op]
  if value < 0:
    return None
  prec = _PRECEDENCE[op]
  # Left-associative: the right side needs parentheses at equal precedence only under - and /.
  if a_prec < prec:
    a_text = f"({a_text})"
  if b_prec < prec or (b_prec == prec and op in "-/"):
    b_text = f"({b_text})"
  return value, f"{a_text}{op}{b_text}", prec
