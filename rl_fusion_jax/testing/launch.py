"""Starting an experiment binary as several local processes joined by ``jax.distributed`` (tests, benchmarks).

``start`` runs ``experiments/<binary>`` once per process with the standard settings (docs/multihost.md):
the same command line plus ``--coordinator_address=127.0.0.1:PORT --num_processes=N --process_id=i``,
each process with ``devices`` virtual CPU devices. Output goes to files, never pipes: a process blocked
on a full pipe would stall the others inside a collective.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

from rl_fusion_jax.orchestration.processes import is_timing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tests' persistent compilation cache (tests/conftest.py), which binaries a test starts are pointed at
# (--compilation_cache=) so that they share it and never read the users' default cache.
TEST_CACHE = os.environ.get("RLFJ_TEST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rl_fusion_jax_tests"))


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
  """The environment for a binary or worker a test starts: ``env`` (default: this process's) with the
  virtual device count taken out of ``XLA_FLAGS`` (the binary picks its own, one device per core), the
  other XLA settings kept (the tests' compile level and collective timeout, ``tests/conftest.py``)."""
  base = dict(os.environ if env is None else env)
  base.pop("XLA_FLAGS", None)
  flags = xla_flags(devices=None, env=env)
  if flags:
    base["XLA_FLAGS"] = flags
  return base


def xla_flags(devices: int | None, env: dict[str, str] | None = None) -> str:
  """``XLA_FLAGS`` of ``env`` (default: this process's) with the virtual device count set to ``devices``
  (None: left out)."""
  kept = [f for f in (os.environ if env is None else env).get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
  if devices is not None:
    kept.append(f"--xla_force_host_platform_device_count={devices}")
  return " ".join(kept)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class Processes:
  """The processes of one run, and their logs (``logs[i]``: process i's stdout and stderr)."""
  procs: list[subprocess.Popen]
  logs: list[str]

  def wait(self, timeout: float) -> list[int]:
    """Exit codes; kills every process still running after ``timeout`` seconds (then raises)."""
    deadline = time.monotonic() + timeout
    try:
      return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in self.procs]
    except subprocess.TimeoutExpired:
      self.kill()
      raise

  def kill(self, index: int | None = None) -> None:
    for i, p in enumerate(self.procs):
      if (index is None or i == index) and p.poll() is None:
        p.send_signal(signal.SIGKILL)
        p.wait()

  def signal(self, sig: int, index: int = 0) -> None:
    """Sends ``sig`` to process ``index`` (SIGTERM / SIGINT: a graceful stop, ``preemption.py``)."""
    self.procs[index].send_signal(sig)

  def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.02) -> None:
    """Polls ``predicate()`` every ``interval`` seconds until true; AssertionError with the logs' tails
    when every process has ended first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
      if time.monotonic() > deadline or all(p.poll() is not None for p in self.procs):
        raise AssertionError(f"never saw {what}:\n" + "\n".join(self.log(i)[-3000:] for i in range(len(self.procs))))
      time.sleep(interval)

  def log(self, index: int) -> str:
    with open(self.logs[index], errors="replace") as f:
      return f.read()


def start(binary: str, args: list[str], *, processes: int, devices: int, log_dir: str,
          coordinator: bool = True, extra: dict[int, list[str]] | None = None,
          env: dict[str, str] | None = None) -> Processes:
  """``processes`` copies of ``experiments/<binary> args`` joined on a fresh local port (``coordinator``
  False: no distributed settings at all, a plain one-process run); ``extra[i]``: more arguments for
  process i (e.g. a different config, to test the refusal)."""
  os.makedirs(log_dir, exist_ok=True)
  base = child_env(env)
  base.update(XLA_FLAGS=xla_flags(devices, env), JAX_PLATFORMS="cpu",
              PYTHONPATH=ROOT + os.pathsep + base.get("PYTHONPATH", ""))
  port = free_port()
  procs, logs = [], []
  for i in range(processes):
    cmd = [sys.executable, os.path.join(ROOT, "experiments", binary), *args, *(extra or {}).get(i, [])]
    if coordinator:
      cmd += [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}", f"--process_id={i}"]
    logs.append(os.path.join(log_dir, f"process{i}.log"))
    with open(logs[-1], "w") as out:
      procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=base, cwd=ROOT))
  return Processes(procs, logs)


def comparable(rows: list[dict]) -> list[dict]:
  """Metric rows without their timing entries."""
  return [{k: v for k, v in row.items() if not is_timing(k)} for row in rows]
