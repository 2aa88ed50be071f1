"""GSM8K-format word problems from a local JSONL file, scored on the number after "####".

Each line is `{"question": str, "answer": str}` where the answer text ends with `#### <number>`, as in
the GSM8K release. The file is read once, eagerly, so a malformed line fails at start with its path and
line number rather than mid-run.

Scoring is strict, with no fallback to the last number in the completion: format ok iff the completion
contains `#### <number>`; correct iff format ok and the first such number equals the answer numerically
(commas dropped, so "1,234" == "1234.0"). Taking the first marker means a completion cannot list many
guesses and win on any of them.
"""

from __future__ import annotations

import fractions
import json
import os
import re
from typing import Any

import numpy as np

from rl_fusion_jax.rewards import base

__all__ = ["ANSWER_CUE", "GSM8KTask", "marked_number", "parse_number"]

ANSWER_CUE = "\nEnd your answer with '#### <number>'.\n"
_NUMBER = r"-?[0-9][0-9,]*(?:\.[0-9]+)?"
_ANSWER_NUMBER = re.compile(_NUMBER)
_MARKED_NUMBER = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_MAX_NUMBER_CHARS = 64  # Fraction(str) refuses strings past 4300 digits; no GSM8K answer is close.


def parse_number(text: str) -> fractions.Fraction | None:
  """Exact value of a decimal like "-1,234.5", or None when `text` is not one."""
  if len(text) > _MAX_NUMBER_CHARS or _ANSWER_NUMBER.fullmatch(text) is None:
    return None
  return fractions.Fraction(text.replace(",", ""))


def marked_number(completion: str) -> fractions.Fraction | None:
  """The value of the first ``#### <number>`` in a completion, or None when it has none."""
  match = _MARKED_NUMBER.search(completion)
  return parse_number(match.group(1)) if match else None


class GSM8KTask:
  """problem(index) walks a seeded permutation of the file, a fresh one for each pass (epoch)."""

  name = "gsm8k"

  def __init__(
      self, path: str | os.PathLike, seed: int = 0, format_reward: float = 0.1, correct_reward: float = 1.0
  ):
    base.check_seed("GSM8KTask", seed)
    base.check_reward_weights("GSM8KTask", format_reward, correct_reward)
    self.path = os.fspath(path)
    self.seed = int(seed)
    self.format_reward, self.correct_reward = float(format_reward), float(correct_reward)
    self.records = _load_records(self.path)
    self._epoch_order: tuple[int, np.ndarray] | None = None

  def __len__(self) -> int:
    return len(self.records)

  def problem(self, index: int) -> base.Problem:
    index = base.check_index("GSM8KTask", index)
    epoch, position = divmod(index, len(self.records))
    record = self.records[int(self._order(epoch)[position])]
    return base.Problem(
        prompt=record["question"] + ANSWER_CUE,
        answer=record["number"],
        target=record["answer"],
        meta={"line": record["line"]},
    )

  def score(self, problem: base.Problem, completion: str) -> base.Score:
    value = marked_number(completion)
    format_ok = value is not None
    correct = format_ok and value == parse_number(problem.answer)
    return base.make_score(format_ok, correct, self.format_reward, self.correct_reward)

  def _order(self, epoch: int) -> np.ndarray:
    # Training reads indices in order, so caching the current epoch's permutation is enough.
    if self._epoch_order is None or self._epoch_order[0] != epoch:
      order = np.random.default_rng([self.seed, epoch]).permutation(len(self.records))
      self._epoch_order = (epoch, order)
    return self._epoch_order[1]


def _load_records(path: str) -> list[dict[str, Any]]:
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"GSM8KTask: cannot read {path}: {e}") from e
  records = [_parse_line(path, number, line) for number, line in enumerate(lines, start=1) if line.strip()]
  if not records:
    raise ValueError(f"GSM8KTask: {path} holds no problems")
  return records


def _parse_line(path: str, line_number: int, line: str) -> dict[str, Any]:
  where = f"GSM8KTask: {path}:{line_number}"
  try:
    row = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not valid JSON ({e})") from e
  if not isinstance(row, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
  for field in ("question", "answer"):
    if not isinstance(row.get(field), str):
      raise ValueError(f"{where}: missing string field {field!r}")
  if "####" not in row["answer"]:
    raise ValueError(f"{where}: field 'answer' has no '####' before the final number")
  final = row["answer"].rsplit("####", 1)[1].strip()
  value = parse_number(final)
  if value is None:
    raise ValueError(f"{where}: text after '####' is not a number: {final!r}")
  return {
      "question": row["question"].strip(),
      "answer": row["answer"],
      "number": final.replace(",", ""),
      "line": line_number,
  }
