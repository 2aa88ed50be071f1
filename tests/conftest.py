"""Test-wide setup: 8 virtual CPU devices, a persistent compilation cache, per-test timings.

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
# `--xla_cpu_use_fusion_emitters=false` emits XLA:CPU's fusions with its older LLVM IR emitters instead of
# the MLIR ones: a third less compile time (a fused-mode loop test, cold cache: 34 s -> 23 s of compiling).
# `--xla_cpu_parallel_codegen_split_count=1` emits each program as one LLVM module instead of several compiled
# on parallel threads: at this optimization level the split costs more than it saves, and the suite's
# workers already keep both cores busy (the main job's RL update on 8 devices: 2.1-2.3 -> 1.7-1.9 CPU s
# to compile; tests/multihost_run_test.py alone, cold: 345 CPU s before this flag and that file's one-layer
# model, 215 s after).
_FLAGS = os.environ.get("XLA_FLAGS", "")
_TEST_FLAGS = {"--xla_force_host_platform_device_count": "8",
               "--xla_cpu_collective_call_terminate_timeout_seconds": "600",
               "--xla_backend_optimization_level": "0",
               "--xla_cpu_use_fusion_emitters": "false",
               "--xla_cpu_parallel_codegen_split_count": "1"}
os.environ["XLA_FLAGS"] = " ".join(
    [_FLAGS] + [f"{k}={v}" for k, v in _TEST_FLAGS.items()
                if k == "--xla_force_host_platform_device_count" or k not in _FLAGS]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)

# The same folder as rl_fusion_jax.testing.launch.TEST_CACHE, which the binaries tests start are given.
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("RLFJ_TEST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rl_fusion_jax_tests")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Python's garbage collector as rl_fusion_jax/gc_policy.py sets it in the binaries (not imported here: every
# py_test would need it in its BUILD deps). At Python's defaults a worker spends about a tenth of its time in
# the collector (tests/loop_test.py alone: 3.9 s of 40 s, 1.7 s with this).
import gc  # noqa: E402
gc.freeze()
gc.set_threshold(10_000, 20, 20)


# ----------------------------------------------------------------------------------------------------
# Per-test wall and compile seconds, and the 15 slowest tests at the end of the run.
# ----------------------------------------------------------------------------------------------------
import time  # noqa: E402

import pytest  # noqa: E402
from jax import monitoring  # noqa: E402

# The duration events JAX records while tracing, lowering and compiling a program in this process.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_s = [0.0]

# The binaries and workers a test starts report theirs, and their CPU seconds, as JSON lines appended to
# a file of this process's (rl_fusion_jax/testing/compile_log.py, not imported here: every py_test would
# need it in its BUILD deps; they inherit the variable, and PYTEST_CURRENT_TEST).
import json  # noqa: E402
import tempfile  # noqa: E402

_CHILD_LOG = os.path.join(tempfile.gettempdir(), f"rlfj_compile_log_{os.getpid()}.jsonl")
os.environ["RLFJ_COMPILE_LOG"] = _CHILD_LOG
_child_offset = [0]


def _read_child_log() -> list[dict]:
  """The complete lines appended since the last call."""
  if not os.path.exists(_CHILD_LOG):
    return []
  with open(_CHILD_LOG, "rb") as f:
    f.seek(_child_offset[0])
    data = f.read()
  end = data.rfind(b"\n") + 1
  _child_offset[0] += end
  return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def _on_duration(event: str, duration: float, **kwargs) -> None:
  del kwargs
  if event in _COMPILE_EVENTS:
    _compile_s[0] += duration


monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """Each phase's report (setup, call, teardown) carries the compile seconds this process spent in it, so
  the figures reach the controller when pytest-xdist runs the tests in workers."""
  del call
  outcome = yield
  spent = _compile_s[0] - getattr(item, "_rlfj_compile_mark", 0.0)
  item._rlfj_compile_mark = _compile_s[0]
  # What the processes this phase started (and waited for) wrote when they ended.
  children = _read_child_log()
  props = outcome.get_result().user_properties
  props.append(("compile_s", spent))
  props.append(("child_compile_s", sum(c["trace_s"] + c["lower_s"] + c["compile_s"] for c in children)))
  props.append(("child_cpu_s", sum(c["cpu_s"] for c in children)))
  props.append(("children", len(children)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
  item._rlfj_compile_mark = _compile_s[0]
  yield


# test id -> [wall s, compile s in the test's process, compile s in the processes it started, their CPU s,
# how many], summed over its phases
_per_test: dict[str, list[float]] = {}
_FIGURES = ("compile_s", "child_compile_s", "child_cpu_s", "children")


def pytest_runtest_logreport(report):
  entry = _per_test.setdefault(report.nodeid.split("@")[0], [0.0] * 5)   # without pytest-xdist's "@group"
  entry[0] += report.duration
  for i, key in enumerate(_FIGURES, start=1):
    entry[i] += sum(v for k, v in report.user_properties if k == key)


def pytest_terminal_summary(terminalreporter, config):
  if hasattr(config, "workerinput") or not _per_test:   # a pytest-xdist worker: the controller reports
    return
  timings = sorted(((*figures, name) for name, figures in _per_test.items()), reverse=True)
  wall, compile_s, child_compile_s, child_cpu_s, children = (sum(t[i] for t in timings) for i in range(5))
  terminalreporter.section("slowest tests (wall s; tracing + compiling in the test's process, and in the "
                           "binaries it started)")
  for w, c, cc, _, n, name in timings[:15]:
    started = f"  {cc:6.1f} s in {int(n)} process{'es' if n != 1 else ''} it started" if n else ""
    terminalreporter.write_line(f"{w:8.1f} s  {c:7.1f} s compile{started}  {name}")
  terminalreporter.write_line(f"{len(timings)} tests: {wall:.0f} s, {compile_s:.0f} s of it compiling in the "
                              "tests' processes (summed over workers); the binaries they started: "
                              f"{int(children)} processes, {child_cpu_s:.0f} CPU s, {child_compile_s:.0f} s "
                              "of it compiling")
  path = os.environ.get("RLFJ_TEST_TIMINGS")   # every test's figures, as tab-separated lines
  if path:
    with open(path, "w") as f:
      f.writelines(f"{w:.2f}\t{c:.2f}\t{name}\t{cc:.2f}\t{cpu:.2f}\t{int(n)}\n"
                   for w, c, cc, cpu, n, name in timings)


def pytest_unconfigure(config):
  del config
  if os.path.exists(_CHILD_LOG):
    os.remove(_CHILD_LOG)


# ----------------------------------------------------------------------------------------------------
# pytest-xdist (pytest.ini: `-n auto --dist loadgroup --no-loadscope-reorder`): tests run in worker
# processes, a file's tests in one worker so that its module fixtures and compiled programs are made once,
# except in the files of _SPREAD, whose tests each start binaries of their own and share nothing in the
# test process. Workers take the work in collection order, and the files that take longest come first
# (cold-cache seconds of one run, 2 cores): a long file started last would leave one worker running it
# alone at the end.
# ----------------------------------------------------------------------------------------------------
_SPREAD = ("multihost_run_test.py", "preemption_test.py", "pulse_test.py", "report_test.py")
_LONGEST_FIRST = ("multihost_run_test.py", "report_test.py", "ppo_test.py", "pulse_test.py", "preemption_test.py",
                  "resume_test.py", "separated_test.py", "stalesync_test.py", "loop_test.py",
                  "compile_once_test.py", "fusion_test.py", "moe_loop_test.py", "train_step_test.py",
                  "pipeline_test.py", "aot_memory_test.py", "reshard_test.py", "engine_test.py")


def pytest_xdist_auto_num_workers(config):
  del config
  return max(1, min(os.cpu_count() or 1, 4))


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))   # stable: file order kept
  for item in items:
    if os.path.basename(str(item.path)) not in _SPREAD:
      item.add_marker(pytest.mark.xdist_group(os.path.basename(str(item.path))))
