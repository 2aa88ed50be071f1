"""experiments/benchmark_main.py's per-program compile seconds (``CompileEvents``), from JAX's own events."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a fresh interpreter: the binary defines absl flags at import, which other experiments define too.
_SCRIPT = """
import json, sys, time
sys.path.insert(0, {experiments!r})
import jax, jax.numpy as jnp
import benchmark_main
events = benchmark_main.CompileEvents()
jax.monitoring.register_event_duration_secs_listener(events.record)
jax.config.update("jax_enable_compilation_cache", False)

def big(x):
  for i in range(300):     # enough ops that tracing, lowering and compiling each take a while
    x = jnp.sin(x) * (i + 1.0) + jnp.cos(x)
  return x

t0 = time.perf_counter()
jax.jit(big)(jnp.ones(8)).block_until_ready()
wall = time.perf_counter() - t0
first = events.take()
second = events.take()
print("OUT=" + json.dumps({{"first": first, "second": second, "wall": wall}}))
"""


def test_compile_events_per_program_and_since_the_last_take():
  code = _SCRIPT.format(experiments=os.path.join(ROOT, "experiments"))
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.split("OUT=")[-1])
  first, second, wall = out["first"], out["second"], out["wall"]
  prog = first["programs"]["big"]             # "jit(big)" and "big" are one program
  assert set(prog) == {"trace", "lower", "compile"} and all(v > 0 for v in prog.values()), prog
  assert sum(prog.values()) <= wall           # parts of the one call that compiled it
  for kind, seconds in first["total"].items():  # the total holds every program, listed or under 0.05 s
    assert seconds >= sum(p[kind] for p in first["programs"].values()) - 1e-3
  assert all(sum(p.values()) >= 0.05 for p in first["programs"].values())
  assert second == {"total": {"trace": 0.0, "lower": 0.0, "compile": 0.0}, "programs": {}}
