"""One run per workdir: an advisory lock file holding the owner's pid, host and start time.

``WorkdirLock(workdir)`` takes ``WORKDIR/.lock`` (``fcntl.flock``, exclusive, non-blocking) before the
run writes anything else there. A second run on the same workdir fails at start with a ``ResumeError``
naming the holder. The kernel releases a ``flock`` when its process dies (SIGKILL included), so a lock
file left behind by a dead run is not held: the next run takes it over and logs whose it was. The file
is removed when the run ends, so a finished workdir holds only the run's outputs.

Several processes of one run share the workdir: process ``p`` of a multi-process run locks
``.lock.p<p>``, so a second run of any shape collides with the first on at least one lock file (its
process 0 takes ``.lock`` or ``.lock.p0``). ``flock`` on a network filesystem is only as good as that
filesystem's lock support (NFSv4 and Lustre with ``flock`` mounts honour it).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from absl import logging

from rl_fusion_jax import distributed
from rl_fusion_jax.errors import ResumeError


def lock_name(process_index: int = 0, process_count: int = 1) -> str:
  return ".lock" if process_count == 1 else f".lock.p{process_index}"


def _read_holder(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.loads(f.read() or "{}")
  except (OSError, ValueError):
    return {}


def _describe(holder: dict) -> str:
  if not holder:
    return "another process"
  started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
  return f"pid {holder.get('pid')} on host {holder.get('host')} (since {started})"


class WorkdirLock:
  """``with WorkdirLock(workdir):`` holds the workdir for this run; ResumeError when another run does."""

  def __init__(self, workdir: str, process_index: int = 0, process_count: int = 1):
    self.workdir = workdir
    self.path = os.path.join(os.path.abspath(workdir), lock_name(process_index, process_count))
    self._fd: int | None = None

  def acquire(self) -> None:
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        raise ResumeError(f"--workdir={self.workdir}: in use by {_describe(_read_holder(self.path))} "
                          f"(lock {self.path}); one run per workdir: wait for it, or pick another workdir")
      # The file may have been removed by its previous holder between our open and our flock: then the
      # lock we hold is on a deleted file; open the path again.
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    stale = _read_holder(self.path)
    if stale:
      logging.warning("workdir lock %s was left by %s, which no longer holds it (it ended without "
                      "releasing it); taking it over", self.path, _describe(stale))
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode(), 0)
    self._fd = fd

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> "WorkdirLock":
    if self._fd is None:
      self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def hold(workdir: str) -> WorkdirLock:
  """This process's lock on ``workdir``, taken on every process of the run or on none: when any process
  is refused, every process raises its ResumeError (all of them learn it through ``distributed.exchange``)."""
  lock = WorkdirLock(workdir, distributed.process_index(), distributed.process_count())
  try:
    lock.acquire()
    refused = ""
  except ResumeError as e:
    refused = str(e)
  if distributed.process_count() > 1:
    refused = next((r for r in distributed.exchange("workdir_lock", refused) if r), "")
  if refused:
    lock.release()
    raise ResumeError(refused)
  return lock
