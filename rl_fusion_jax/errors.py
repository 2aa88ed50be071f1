"""Errors a user can act on: each message names the config field, flag or path to change.

The experiment binaries print these as one line (no traceback) and exit with a non-zero code; any other
exception is a bug and keeps its traceback. ``ConfigError`` and ``ResumeError`` are ``ValueError``s, so
code that catches bad input as ``ValueError`` keeps working.
"""
from __future__ import annotations


class RunError(Exception):
  """Base of the errors the binaries report without a traceback."""


class ConfigError(RunError, ValueError):
  """A config field, flag or input file is invalid (raised before anything is compiled or written)."""


class ResumeError(RunError, ValueError):
  """The workdir holds a run this config may not continue, or no checkpoint of it can be restored."""


class CheckpointError(RunError):
  """One checkpoint cannot be restored (missing or corrupt files, wrong shapes, checksum mismatch)."""

  def __init__(self, path: str, reason: str):
    super().__init__(f"{path}: {reason}")
    self.path, self.reason = path, reason


class DivergenceError(RunError):
  """Training produced a non-finite loss, gradient or parameter and the policy is to stop."""


class ProcessError(RunError):
  """Another process of a multi-process run failed or disagreed (its message is carried here)."""


class WriteError(RunError):
  """A file of the run could not be written (disk full, permissions): names the path and the errno text."""


PREEMPTED_EXIT = 75   # os.EX_TEMPFAIL: a temporary failure; the same command resumes the run


class Preempted(RunError):
  """The run stopped on SIGTERM / SIGINT after writing a checkpoint; the same command resumes it.
  The binaries exit with ``PREEMPTED_EXIT`` (``orchestration/preemption.py``)."""

  def __init__(self, signame: str, phase: str, step: int, checkpoint: str):
    super().__init__(f"stopped by {signame} after {phase} step {step}; checkpoint {checkpoint} written; "
                     "run the same command to resume")
    self.signame, self.phase, self.step, self.checkpoint = signame, phase, step, checkpoint
