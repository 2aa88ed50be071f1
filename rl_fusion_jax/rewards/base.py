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
from jaxtyping import Bool, Float32

__all__ = [
    "Problem",
    "Score",
    "Task",
    "check_index",
    "check_reward_weights",
    "check_seed",
    "make_score",
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
