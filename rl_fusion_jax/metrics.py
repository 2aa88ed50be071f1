"""Metric writers (JSONL by default, TensorBoard when tensorboardX is installed) and progress lines.

Writers take host scalars only: the loop fetches a step's metrics with one ``jax.device_get`` and hands
plain floats here, so writing never syncs the device mid-step.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping

from absl import logging


class JsonlWriter:
  """Appends one JSON object per step to ``path`` (flushed per line, so a crash loses at most one)."""

  def __init__(self, path: str):
    self._f = open(path, "a", encoding="utf-8")

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    record = {"step": int(step)}
    for k, v in scalars.items():
      v = float(v)
      record[k] = v if math.isfinite(v) else str(v)
    self._f.write(json.dumps(record, sort_keys=True) + "\n")
    self._f.flush()

  def close(self) -> None:
    self._f.close()


class TensorBoardWriter:
  def __init__(self, logdir: str):
    from tensorboardX import SummaryWriter  # optional extra: pip install .[tensorboard]
    self._w = SummaryWriter(logdir)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    for k, v in scalars.items():
      self._w.add_scalar(k, float(v), int(step))

  def close(self) -> None:
    self._w.close()


class MultiWriter:
  def __init__(self, writers):
    self._writers = list(writers)

  def write(self, step, scalars):
    for w in self._writers:
      w.write(step, scalars)

  def close(self):
    for w in self._writers:
      w.close()


def make_writer(workdir: str, tensorboard: bool = False) -> MultiWriter:
  writers = [JsonlWriter(os.path.join(workdir, "metrics.jsonl"))]
  if tensorboard:
    writers.append(TensorBoardWriter(os.path.join(workdir, "tb")))
  return MultiWriter(writers)


def filter_jsonl(path: str, keep, *, sort_keys: bool = True) -> int:
  """Keeps the records of a JSON-lines file for which ``keep(record)`` holds; returns lines dropped.

  A torn line (a kill mid-write) is dropped. The file is replaced atomically; a missing file is a no-op.
  """
  if not os.path.exists(path):
    return 0
  kept, dropped = [], 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        dropped += 1
        continue
      if keep(record):
        kept.append(json.dumps(record, sort_keys=sort_keys) + "\n")
      else:
        dropped += 1
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)
  return dropped


def eval_examples_path(workdir: str) -> str:
  """The held-out responses each evaluation writes (``task.eval_examples``), one JSON object a line."""
  return os.path.join(workdir, "eval_examples.jsonl")


def truncate_metrics(workdir: str, last_step: int | None) -> int:
  """Keeps the rows of steps <= ``last_step`` (None: none) in metrics.jsonl and eval_examples.jsonl;
  returns the metric rows dropped.

  A resumed run calls this with its checkpoint's step, so every step appears once.
  """
  keep = lambda r: last_step is not None and r.get("step", math.inf) <= last_step
  if os.path.exists(eval_examples_path(workdir)):
    filter_jsonl(eval_examples_path(workdir), keep)
  return filter_jsonl(os.path.join(workdir, "metrics.jsonl"), keep)


def read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


class Progress:
  """Logs 'step s/N, steps/s, ETA, reward' at most every ``every_s`` seconds (and on the last step)."""

  def __init__(self, total: int, start_step: int, every_s: float):
    self.total, self.every_s = total, every_s
    self._t0 = time.perf_counter()
    self._s0 = start_step
    self._last = -math.inf

  def update(self, step: int, scalars: Mapping[str, float]) -> str | None:
    now = time.perf_counter()
    if now - self._last < self.every_s and step < self.total:
      return None
    self._last = now
    rate = (step - self._s0) / max(now - self._t0, 1e-9)
    eta = (self.total - step) / rate if rate > 0 else math.inf
    line = (f"step {step}/{self.total} | {rate:.2f} steps/s | ETA {eta:.0f}s | "
            f"reward {scalars.get('reward', math.nan):.3f} | acc {scalars.get('accuracy', math.nan):.3f}")
    logging.info(line)
    return line
