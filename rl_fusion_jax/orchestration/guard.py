"""Host side of the divergence guard: acts on ``metrics["nonfinite"]`` by ``run.on_nonfinite``.

The device side lives in ``train/step.py::update``: every update checks its loss, gradients, new
parameters and optimizer state for non-finite values and applies itself only when all are finite, so
the state the host holds (and checkpoints) is always finite. The flag travels with the metrics the
loop fetches anyway; this class adds no device round trip. It never decides anything on the device.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from absl import logging

from rl_fusion_jax.config import RunConfig
from rl_fusion_jax.errors import DivergenceError
from rl_fusion_jax.train.step import NONFINITE_NAMES, PROMPT_CODE, WINDOW_CODE


def _quantity(code: int, metrics: Mapping[str, float]) -> str:
  """The device's category, refined to the metric names when the loss or a loss metric failed."""
  if code == 1:
    bad = [k for k, v in metrics.items() if k != "nonfinite" and not math.isfinite(float(v))
           and k not in ("grad_norm",)]
    return "loss" if "loss" in bad or not bad else "loss metric " + ", ".join(sorted(bad))
  return NONFINITE_NAMES.get(code, str(code))


class DivergenceGuard:
  """Counts skipped updates; raises DivergenceError per the policy (``stop``, or ``skip`` up to N in a row)."""

  def __init__(self, run: RunConfig, phase: str, skipped: int = 0, consecutive: int = 0):
    self.policy, self.limit, self.phase = run.on_nonfinite, run.max_consecutive_skips, phase
    self.skipped, self.consecutive = skipped, consecutive

  def check(self, step: int, metrics: Mapping[str, float]) -> bool:
    """True when the update of ``step`` (1-based) was applied; False when it was skipped."""
    code = int(metrics.get("nonfinite", 0))
    if code == 0:
      self.consecutive = 0
      return True
    if code in (WINDOW_CODE, PROMPT_CODE):   # broken invariants, not divergence: always stop
      raise RuntimeError(f"{self.phase} step {step}: {NONFINITE_NAMES[code]}; the update was not applied")
    what = (f"{self.phase} step {step}: non-finite {_quantity(code, metrics)} (loss {metrics.get('loss')}, "
            f"grad_norm {metrics.get('grad_norm')}); the update was not applied")
    if self.policy == "stop":
      raise DivergenceError(f"{what}. Stopping (config.run.on_nonfinite='stop'); every checkpoint written "
                            "holds finite values. Lower the learning rate, or set run.on_nonfinite='skip'.")
    self.skipped += 1
    self.consecutive += 1
    if self.consecutive >= self.limit:
      raise DivergenceError(f"{what}; {self.consecutive} non-finite updates in a row "
                            f"(config.run.max_consecutive_skips={self.limit}). Stopping.")
    logging.warning("%s; skipped (%d in a row, %d in all)", what, self.consecutive, self.skipped)
    return False

  def scalars(self, applied: bool) -> dict[str, float]:
    return {"update_skipped": float(not applied), "updates_skipped_total": float(self.skipped)}

  def state(self) -> dict[str, int]:
    return {"skipped": self.skipped, "consecutive": self.consecutive}
