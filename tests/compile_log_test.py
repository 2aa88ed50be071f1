"""rl_fusion_jax/testing/compile_log.py: a process the tests start reports its compile and CPU seconds."""
import json
import os
import subprocess
import sys

from rl_fusion_jax.testing import launch

# One jitted program, traced, lowered and compiled (no persistent cache: the compile is XLA's), then a
# second call of it, which compiles nothing.
_CHILD = """
import jax, jax.numpy as jnp
from rl_fusion_jax.testing import compile_log
compile_log.install()
compile_log.install()   # idempotent: one line, not two
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
f(jnp.ones((64, 64))).block_until_ready()
f(jnp.ones((64, 64))).block_until_ready()
"""


def _run_child(tmp_path, log) -> subprocess.CompletedProcess:
  env = launch.child_env()
  env.pop("RLFJ_COMPILE_LOG", None)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  if log is not None:
    env["RLFJ_COMPILE_LOG"] = str(log)
  env["PYTEST_CURRENT_TEST"] = "tests/x_test.py::test_y (call)"
  return subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=tmp_path, capture_output=True, text=True,
                        timeout=120, check=True)


def test_a_started_process_appends_one_line_with_its_compile_and_cpu_seconds(tmp_path):
  log = tmp_path / "log.jsonl"
  log.write_text('{"earlier": 1}\n')            # appended to, never overwritten
  _run_child(tmp_path, log)
  lines = log.read_text().splitlines()
  assert len(lines) == 2 and json.loads(lines[0]) == {"earlier": 1}
  line = json.loads(lines[1])
  assert line["test"] == "tests/x_test.py::test_y" and line["command"] == "-c"
  # The one program's tracing, lowering and compile were counted (each takes time), and they are part of
  # the process's CPU seconds, which also hold importing JAX.
  assert line["trace_s"] > 0 and line["lower_s"] > 0 and line["compile_s"] > 0
  assert line["cpu_s"] > line["trace_s"] + line["lower_s"]


def test_without_the_variable_nothing_is_written(tmp_path):
  _run_child(tmp_path, None)
  assert os.listdir(tmp_path) == []


def test_a_log_that_cannot_be_written_is_no_error_at_exit(tmp_path):
  done = _run_child(tmp_path, tmp_path / "missing" / "log.jsonl")   # check=True: exit status 0
  assert "Traceback" not in done.stderr and not (tmp_path / "missing").exists()
