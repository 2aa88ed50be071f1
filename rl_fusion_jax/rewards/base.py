"""The task interface: problems, scores, and batch scoring shared by every rule-based task.

A task is a deterministic function of (seed, index) -> Problem plus a verifier Problem x completion ->
Score. Determinism in the index is what makes the data stream restartable: a checkpoint stores the next
index, not an iterator. Verifiers are plain Python on decoded text; they must never raise on what a
policy writes (any string is a legal completion), only on misuse by the caller.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from jaxtyping import Bool, Float32, Float64

__all__ = [
    "Problem",
    "Score",
    "Task",
    "check_index",
    "check_reward_weights",
    "check_seed",
    "make_score",
    "pass_at_k",
    "score_batch",
]


@dataclasses.dataclass(frozen=True)
class Problem:
  """One task instance.

  Attributes:
    prompt: what the policy sees.
    answer: the canonical answer, for the verifier and for logs.
    target: an ideal completion for supervised warm-up, without the eos token.
    meta: task-specific facts the verifier needs (e.g. countdown's numbers and target).
  """

  prompt: str
  answer: str
  target: str
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Score:
  """reward = format_reward * format_ok + correct_reward * correct, with the task's weights."""

  reward: float
  format_ok: bool
  correct: bool


@runtime_checkable
class Task(Protocol):
  name: str

  def problem(self, index: int) -> Problem:
    """Deterministic in (the task's seed, index) and independent of call order."""

  def score(self, problem: Problem, completion: str) -> Score:
    """Never raises on the completion's content."""


def make_score(format_ok: bool, correct: bool, format_reward: float, correct_reward: float) -> Score:
  reward = format_reward * float(format_ok) + correct_reward * float(correct)
  return Score(reward=float(reward), format_ok=bool(format_ok), correct=bool(correct))


def check_reward_weights(owner: str, format_reward: float, correct_reward: float) -> None:
  for field, value in (("format_reward", format_reward), ("correct_reward", correct_reward)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      raise ValueError(f"{owner}: {field} must be a finite number, got {value!r}")


def check_seed(owner: str, seed: int) -> None:
  # np.random.default_rng([seed, index]) needs non-negative integers.
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"{owner}: seed must be a non-negative int, got {seed!r}")


def check_index(owner: str, index: int) -> int:
  if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
    raise ValueError(f"{owner}.problem: index must be a non-negative int, got {index!r}")
  return int(index)


def score_batch(
    task: Task, problems: Sequence[Problem], completions: Sequence[str]
) -> tuple[Float32[np.ndarray, "B"], Bool[np.ndarray, "B"], Bool[np.ndarray, "B"]]:
  """Scores B (problem, completion) pairs: (rewards f32[B], format_ok bool[B], correct bool[B])."""
  if len(problems) != len(completions):
    raise ValueError(f"score_batch: {len(problems)} problems but {len(completions)} completions")
  scores = [task.score(p, c) for p, c in zip(problems, completions)]
  rewards_b = np.array([s.reward for s in scores], dtype=np.float32)
  format_ok_b = np.array([s.format_ok for s in scores], dtype=bool)
  correct_b = np.array([s.correct for s in scores], dtype=bool)
  return rewards_b, format_ok_b, correct_b


def pass_at_k(num_samples: int, num_correct: Any, k: int) -> float | Float64[np.ndarray, "..."]:
  """Unbiased pass@k estimate from n samples per problem of which c are correct (Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code", eq. 1 and its numerically stable form):

      pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

  The product never forms a binomial coefficient, so it neither overflows nor loses precision for large
  n. When n - c < k every k-subset holds a correct sample and the estimate is exactly 1.

  Args:
    num_samples: n >= 1, the samples drawn per problem.
    num_correct: c, an int or an integer array of per-problem counts, each in [0, n].
    k: 1 <= k <= n.

  Returns:
    A float for a scalar count, else a float64 array shaped like num_correct (one estimate per problem).
  """
  if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
    raise ValueError(f"pass_at_k: num_samples must be an int >= 1, got {num_samples!r}")
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= num_samples:
    raise ValueError(f"pass_at_k: k must be an int in [1, num_samples={num_samples}], got {k!r}")
  counts = np.asarray(num_correct)
  if counts.dtype == bool or not np.issubdtype(counts.dtype, np.integer):
    raise ValueError(f"pass_at_k: num_correct must hold integer counts, got dtype {counts.dtype}")
  if np.any(counts < 0) or np.any(counts > num_samples):
    raise ValueError(f"pass_at_k: every num_correct must be in [0, num_samples={num_samples}], got {num_correct!r}")
  counts_p1 = counts.reshape(-1, 1)
  # n - c < k: certain success. Those rows are set to 1 directly instead of through the product, whose
  # factors for i < k are negative and large (1 - k / 1 = 1 - k) and could overflow to inf before the
  # exact 0 at i = k arrives (inf * 0 = NaN). Elsewhere every factor lies in (0, 1).
  certain_p1 = num_samples - counts_p1 < k
  i_n = np.arange(1, num_samples + 1, dtype=np.float64)
  factors_pn = np.where((i_n > num_samples - counts_p1) & ~certain_p1, 1.0 - k / i_n, 1.0)
  estimate = np.where(certain_p1[:, 0], 1.0, 1.0 - np.prod(factors_pn, axis=1)).reshape(counts.shape)
  return float(estimate) if estimate.ndim == 0 else estimate
