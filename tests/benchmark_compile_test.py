"""experiments/benchmark_compile_main.py: every repeat compiles afresh, and --phases reads XLA:CPU's events."""
import json
import os
import subprocess
import sys

from rl_fusion_jax.testing import launch


def test_every_repeat_compiles_and_phases_are_parts_of_one_compile():
  cmd = [sys.executable, os.path.join(launch.ROOT, "experiments", "benchmark_compile_main.py"),
         "--config=" + os.path.join(launch.ROOT, "experiments", "configs", "tiny_grpo.py"),
         "--layers=1", "--scan_unroll=0", "--repeats=2", "--phases"]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=launch.child_env(), cwd=launch.ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
  first, second = out["compile_s_each"]
  # The second repeat's program equals the first's: without forgetting the first, the process's caches
  # answer it and it takes no time at all.
  assert first > 0.05 and second > 0.25 * first, out
  phases = out["phases_s"]
  whole = phases["PjRtCpuClient::Compile"]
  assert whole > 0.05, phases
  parts = ["HLO passes through layout assignment", "HLO passes after layout assignment", "CpuCompiler::RunBackend"]
  assert all(phases[p] > 0 for p in parts), phases
  assert sum(phases[p] for p in parts) <= whole * 1.01 + 1e-3, phases      # nested inside the one compile
  assert phases["Codegen"] <= phases["CpuCompiler::RunBackend"] + 1e-3, phases
  assert isinstance(phases["fused_kernels"], int), phases
