"""Graceful stop on SIGTERM / SIGINT: finish the step, checkpoint, exit with ``PREEMPTED_EXIT``.

SIGTERM is what SLURM, Kubernetes and cloud preemption send first (SIGKILL follows after a grace period);
SIGINT is Ctrl-C. ``Preemption`` (a context manager around ``loop.run``) turns the first of either into a
request: the loop finishes the step it is in, writes a checkpoint like the periodic ones (queue and
in-flight samples included), flushes the metrics, and ``loop.run`` raises ``errors.Preempted``, which the binary
prints as one line before exiting with status ``errors.PREEMPTED_EXIT`` (75, ``EX_TEMPFAIL``: run the same
command again to resume). A second signal ends the process at once, by that signal, with no checkpoint.

Several processes agree on the step (``should_stop``): each step, every process says whether it was
signalled (``distributed.exchange``), and all stop after the same step if any was, so every process takes
part in the collective save or none does. One process needs no exchange.

Why not orbax's ``CheckpointManager.reached_preemption``: it asks JAX's preemption sync manager, which
exists only under ``jax.distributed`` (one process never stops) and listens to SIGTERM alone; this
covers one process and many alike, and SIGINT too. What is lost on SIGKILL stays bounded by
``run.checkpoint_every``.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from absl import logging

from rl_fusion_jax import distributed
from rl_fusion_jax.errors import Preempted

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
  """Installs the handlers for its ``with`` block (main thread only; elsewhere it never fires) and
  restores the previous ones after."""

  def __init__(self):
    self.signame: str | None = None   # the first signal received (this process)
    self._agreed: str | None = None
    self._previous: dict[int, object] = {}

  def __enter__(self) -> "Preemption":
    if threading.current_thread() is threading.main_thread():
      for sig in SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      # None: the previous handler was not installed from Python (e.g. by JAX's runtime): the default.
      signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    self._previous.clear()

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signame is not None:   # the second signal: end now, by that signal
      sys.stderr.write(f"{name} again: exiting now, without a checkpoint\n")
      sys.stderr.flush()
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    self.signame = name
    logging.warning("%s received: finishing this step, then a checkpoint and exit (send it again to exit "
                    "at once)", name)

  def request(self, signame: str = "SIGTERM") -> None:
    """As if ``signame`` had arrived (tests, and callers that learn of a preemption another way)."""
    self.signame = self.signame or signame

  def should_stop(self) -> bool:
    """Whether the run stops after the step it just finished: this process was signalled or, with several
    processes, any was. Every process calls it once per step, in the same order."""
    if self._agreed is not None:
      return True
    if distributed.process_count() == 1:
      self._agreed = self.signame
    else:
      names = [n for n in distributed.exchange("preempt", self.signame or "") if n]
      self._agreed = names[0] if names else None
    return self._agreed is not None

  def stopped(self, phase: str, step: int, checkpoint: str) -> Preempted:
    """The error to raise once the checkpoint of ``phase`` step ``step`` is written at ``checkpoint``."""
    logging.warning("stopping after %s step %d on %s; checkpoint %s", phase, step, self._agreed, checkpoint)
    return Preempted(self._agreed or "a signal", phase, step, checkpoint)
