"""Test-wide setup: 8 virtual CPU devices and a persistent compilation cache.

XLA reads its flags once, when the backend starts, so they are set here before anything imports jax.
"""
import os

# 8 virtual devices share 2 cores, so one device's part of a collective can wait for CPU time behind the
# others' work (XLA warns after 20 s: "This thread has been waiting ... may be stuck"; seen under load,
# resolving). XLA:CPU aborts the whole process when a wait passes its terminate timeout (40 s by
# default): 600 s keeps a slow rendezvous a slow test. (A real deadlock, as seen in loop runs with a rolled
# layer scan, rl_fusion_jax/testing/experiments.py, then costs 600 s before the same abort.)
#
# The tests compile many small programs and run each a few times, so compiling is most of their time:
# `--xla_backend_optimization_level=0` (LLVM's code generation without its optimization passes; the HLO
# the programs compute is the same) halves XLA:CPU's compile of the RL update (5.2 s -> 2.7 s,
# tiny-grpo's model) and runs its steps about 1.5x slower. Binaries and workers the tests start get the
# same flags (`rl_fusion_jax/testing/launch.child_env`). Users' runs keep XLA's default.
_FLAGS = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = (
    _FLAGS + " --xla_force_host_platform_device_count=8"
    " --xla_cpu_collective_call_terminate_timeout_seconds=600"
    + ("" if "xla_backend_optimization_level" in _FLAGS else " --xla_backend_optimization_level=0")).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("RLFJ_TEST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rl_fusion_jax_tests")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# ----------------------------------------------------------------------------------------------------
# Per-test wall and compile seconds, and the 15 slowest tests at the end of the run.
# ----------------------------------------------------------------------------------------------------
import time  # noqa: E402

import pytest  # noqa: E402
from jax import monitoring  # noqa: E402

# The duration events JAX records while tracing, lowering and compiling a program in this process
# (compiles inside subprocesses a test starts are not seen here).
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_s = [0.0]
_timings: list[tuple[float, float, str]] = []   # (wall s, compile s, test id)


def _on_duration(event: str, duration: float, **kwargs) -> None:
  del kwargs
  if event in _COMPILE_EVENTS:
    _compile_s[0] += duration


monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  start, compile_start = time.perf_counter(), _compile_s[0]
  yield
  _timings.append((time.perf_counter() - start, _compile_s[0] - compile_start, item.nodeid))


def pytest_terminal_summary(terminalreporter):
  if not _timings:
    return
  wall, compile_s = sum(t[0] for t in _timings), sum(t[1] for t in _timings)
  terminalreporter.section("slowest tests (wall s, of which tracing + compiling in this process)")
  for w, c, name in sorted(_timings, reverse=True)[:15]:
    terminalreporter.write_line(f"{w:8.1f} s  {c:7.1f} s compile  {name}")
  terminalreporter.write_line(f"{len(_timings)} tests: {wall:.0f} s, {compile_s:.0f} s of it compiling in this "
                              "process")
