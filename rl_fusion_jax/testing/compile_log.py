"""What the binaries a test starts spend tracing, lowering and compiling, reported back to the test.

``tests/conftest.py`` names a file in ``RLFJ_COMPILE_LOG`` for each pytest process, and the binaries and
workers that the tests start inherit it (with ``PYTEST_CURRENT_TEST``, the test that started them); the
conftest reads the new lines at the end of each test phase and adds them to that test's figures.
Each of those processes calls ``install()`` once JAX is set up; on a normal exit it appends one JSON line
to the file: the test, its command, the seconds JAX's compile events took in it (``jax.monitoring``:
tracing, lowering to MLIR, XLA's compile; the persistent cache's hits count as compiles that took the
cache's read time) and its own CPU seconds. A process that is killed, or that ends with ``os._exit``,
writes nothing. Without the variable ``install`` does nothing: users' runs never write the file.
"""
from __future__ import annotations

import atexit
import json
import os
import sys

ENV = "RLFJ_COMPILE_LOG"
# The duration events JAX records for one program: tracing, lowering, XLA's compile (or a cache read).
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s"}

_installed = False


def install() -> None:
  """Counts this process's compile events and appends its line at exit, when ``RLFJ_COMPILE_LOG`` names a
  file; otherwise nothing. Idempotent."""
  global _installed
  path = os.environ.get(ENV)
  if not path or _installed:
    return
  _installed = True
  from jax import monitoring  # pylint: disable=g-import-not-at-top
  totals = dict.fromkeys(EVENTS.values(), 0.0)

  def on_duration(event: str, duration: float, **kwargs) -> None:
    del kwargs
    key = EVENTS.get(event)
    if key is not None:
      totals[key] += duration

  monitoring.register_event_duration_secs_listener(on_duration)
  test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]   # without " (setup)", " (call)"
  command = os.path.basename(sys.argv[0]) if sys.argv else ""

  def write() -> None:
    times = os.times()
    line = {"test": test, "command": command, "pid": os.getpid(), **{k: round(v, 4) for k, v in totals.items()},
            "cpu_s": round(times.user + times.system, 3)}
    # One write of one line in append mode: lines of processes that end at once do not interleave. A
    # figure that cannot be written is lost, never an error at the process's exit.
    try:
      fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
      try:
        os.write(fd, (json.dumps(line) + "\n").encode())
      finally:
        os.close(fd)
    except OSError:
      pass

  atexit.register(write)
