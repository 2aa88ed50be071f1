"""Two local processes through jax.distributed: the global batch and one RL update match one process."""
import json
import os
import socket
import subprocess
import sys

import pytest

from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.testing import multihost_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_one():
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  procs = [subprocess.Popen([sys.executable, "-m", "rl_fusion_jax.testing.multihost_worker", str(port), str(i)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
           for i in range(2)]
  outs = []
  for p in procs:
    stdout, stderr = p.communicate(timeout=240)
    assert p.returncode == 0, stderr[-3000:]
    outs.append(json.loads(stdout.strip().splitlines()[-1]))
  assert sorted(o["process_index"] for o in outs) == [0, 1]
  assert all(o["devices"] == 4 and o["local_devices"] == 2 for o in outs)
  # The same update in this process, on 4 of its 8 devices with the same mesh shape.
  import jax
  from rl_fusion_jax.sharding import mesh as mesh_lib
  original = mesh_lib.make_mesh
  mesh_lib.make_mesh = lambda cfg, devices=None: original(cfg, jax.devices()[:4])
  try:
    single = multihost_worker.update_metrics(MeshConfig(data=2, fsdp=2, tensor=1))
  finally:
    mesh_lib.make_mesh = original
  for key in ("loss", "grad_norm", "entropy", "ratio"):
    for o in outs:
      assert o[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key
