"""Python's cyclic garbage collector in a process that traces and compiles JAX programs.

Tracing and lowering allocate hundreds of thousands of short-lived Python objects per program, so at
Python's default thresholds (700, 10, 10) the collector runs hundreds of times while a run starts, and each
full collection walks every object the process holds (jax, flax and the run's own). A profile of the main
job's first steps (`perf record`, 1 layer, compilation cache filled) put 11% of the process's CPU time in
the collector. ``tune`` moves what exists when it is called (the imported libraries: never garbage) out of
the collector's reach (``gc.freeze``) and collects less often. The binaries (``experiments/common.setup_jax``)
and the worker processes the tests start call it after importing jax; ``tests/conftest.py`` makes the same
two calls.

Cycles are still collected, later: a young generation of 10,000 objects instead of 700.
"""
from __future__ import annotations

import gc

THRESHOLDS = (10_000, 20, 20)


def tune() -> None:
  gc.freeze()
  gc.set_threshold(*THRESHOLDS)
