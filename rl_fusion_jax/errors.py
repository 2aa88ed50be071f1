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
