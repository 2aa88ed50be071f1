"""Two local processes through jax.distributed: per-group queue reads, and one RL update matching one process.

Each worker (``rl_fusion_jax/testing/multihost_worker.py``) builds the global batch twice on each of two
meshes over its 2 + the other's 2 CPU devices: from a whole host batch, and from a DistQueue read only
for its own devices' rows. The expected rows of each process are derived here from the mesh's device grid.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.testing import multihost_worker
from rl_fusion_jax.testing import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = ("loss", "grad_norm", "entropy", "ratio")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers() -> list[dict]:
  port = _free_port()
  env = launch.child_env()
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  cmd = [sys.executable, "-m", "rl_fusion_jax.testing.multihost_worker", str(port)]
  # Files, not pipes: a worker blocked on a full pipe would stall the other one inside a collective.
  logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(2)]
  procs = [subprocess.Popen(cmd + [str(i)], stdout=out, stderr=err, text=True, env=env, cwd=ROOT)
           for i, (out, err) in enumerate(logs)]
  results = []
  for p, (out, err) in zip(procs, logs):
    p.wait(timeout=240)
    out.seek(0), err.seek(0)
    assert p.returncode == 0, err.read()[-3000:]
    results.append(json.loads(out.read().strip().splitlines()[-1]))
  return sorted(results, key=lambda o: o["process_index"])


def _single_process(sizes: dict) -> dict:
  """The same update in this process, on 4 of its 8 devices with the same mesh shape."""
  import jax
  from rl_fusion_jax.sharding import mesh as mesh_lib
  original = mesh_lib.make_mesh
  mesh_lib.make_mesh = lambda cfg, devices=None: original(cfg, jax.devices()[:4])
  try:
    return multihost_worker.update_metrics(MeshConfig(**sizes))
  finally:
    mesh_lib.make_mesh = original


def _expected_rows(mesh_device_ids, rows: int) -> dict[int, tuple[int, int]]:
  """Device id -> its rows: the batch splits over (data, fsdp) in grid order; tensor peers share rows."""
  grid = np.asarray(mesh_device_ids)[0]  # [stage=1, data, fsdp, tensor] -> [data, fsdp, tensor]
  groups = grid.shape[0] * grid.shape[1]
  per = rows // groups
  return {int(grid[d, f, t]): ((d * grid.shape[1] + f) * per, (d * grid.shape[1] + f + 1) * per)
          for d, f, t in np.ndindex(grid.shape)}


def _check_reads(outs: list[dict], name: str) -> None:
  """Each process read its own devices' rows, each distinct slice once; together every row exactly once."""
  rows, ids = outs[0][name]["rows"], outs[0][name]["mesh_device_ids"]
  expected = _expected_rows(ids, rows)
  read_rows = []
  for o in outs:
    mine = sorted({expected[d] for d in o["local_devices"]})
    reads = o[name]["reads"]
    assert sorted((r[0], r[-1] + 1) for r in reads) == mine, (name, o["process_index"])
    assert all(r == list(range(r[0], r[-1] + 1)) for r in reads)  # sample index = row here
    assert {int(d): tuple(v) for d, v in o[name]["device_rows"].items()} == \
        {d: expected[d] for d in o["local_devices"]}
    tensor = np.shape(ids)[-1]
    assert len(reads) == len(o["local_devices"]) // tensor  # once per group, not once per device
    read_rows += [i for r in reads for i in r]
  assert sorted(read_rows) == list(range(rows))  # disjoint, and [0, rows) covered


def _check_metrics(outs: list[dict], name: str, single: dict) -> None:
  for o in outs:
    for key in METRICS:
      assert o[name]["queue"][key] == o[name]["host"][key], (name, key)
      assert o[name]["queue"][key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), (name, key)


def test_two_processes_read_own_rows_and_match_one():
  outs = _run_workers()
  assert [o["process_index"] for o in outs] == [0, 1]
  assert all(o["devices"] == 4 and len(o["local_devices"]) == 2 for o in outs)
  for name, (sizes, update) in multihost_worker.MESHES.items():
    _check_reads(outs, name)
    assert all(o[name]["same_shards"] for o in outs), name  # queue-built batch == host-batch path
    if update:
      _check_metrics(outs, name, _single_process(sizes))
  # The layouts this test is about. dp2_fsdp2: each process holds half the rows, as two groups of 2 rows;
  # fsdp2_tp2: each process holds one group of half the rows on both its devices (a tensor pair), read once.
  rows = outs[0]["dp2_fsdp2"]["rows"]
  assert [[len(r) for r in o["dp2_fsdp2"]["reads"]] for o in outs] == [[rows // 4] * 2] * 2
  assert [[len(r) for r in o["fsdp2_tp2"]["reads"]] for o in outs] == [[rows // 2]] * 2
  # processes.fill_rows: each process ends with every row its devices train on (rows 0-3 on process 0, 4-7
  # on 1) equal to the full batch's, and the other process's rows it does not need still blank. What
  # crossed: the other process's payload (7 bytes a response token at this vocabulary and its lowest
  # version, 4 bytes), padded to a power of two of at least 256 bytes.
  readers = np.asarray(multihost_worker.READERS)
  for p, o in enumerate(outs):
    f = o["fill_rows"]
    need = np.asarray(f["need"])
    assert need[p].tolist() == [b // 4 == p for b in range(8)]
    for b in range(8):
      assert f["same"][b] == (need[p, b] or readers[b] == p), (p, b)
      assert f["blank"][b] == (not need[p, b] and readers[b] != p), (p, b)
    sent = [7 * sum(f["response_len"][b] for b in range(8) if readers[b] == q and need[1 - q, b]) + 4
            for q in (0, 1)]
    assert f["crossed"] == max(256, 1 << (max(sent) - 1).bit_length()) and min(sent) > 0
  # The engine over both processes: rows by process (local_rows) against every row exchanged, the same
  # samples back. Each process holds exactly the rows of the samples it read (readers: the same on both,
  # each process some), equal to the exchanged rows; the others are blank until hold_finished fills every
  # unreturned one from its holder, also where only one process lacks one (no hang: both exchange). The
  # oldest versions come out the same without the rows.
  engines = [o["engine"] for o in outs]
  assert engines[0]["readers"] == engines[1]["readers"]
  filled = []
  for p, e in enumerate(engines):
    readers = {int(s): r for s, r in e["readers"].items()}
    ids = e["returned"] + e["unreturned"]
    assert e["same_samples"] and e["full_readers"] == {} and len(e["returned"]) == 2 and e["unreturned"]
    assert sorted(readers) == sorted(ids) and set(readers.values()) == {0, 1}
    for s in ids:
      assert e["same"][str(s)] == (readers[s] == p) and e["blank"][str(s)] == (readers[s] != p), (p, s)
    assert sorted(int(s) for s in e["same_after"]) == sorted(e["unreturned"]) and all(e["same_after"].values())
    assert e["filled"] == sum(readers[s] != p for s in e["unreturned"])
    assert e["min_version"][0] == e["min_version"][1]
    filled.append(e["filled"])
  assert sorted(filled) == [0, 1]   # one process lacked the unreturned row; both joined the exchange
  # model.dtype='auto' resolved differently on the processes (their CPUs): refused on both, naming the field.
  own = outs[0]["precision"]["own"]
  other = {"float32": "bf16_matmul", "bf16_matmul": "float32"}[own]
  for o in outs:
    assert o["precision"]["own"] == own
    assert o["precision"]["error"].startswith("config.model.dtype: 'auto' resolved differently on the processes "
                                              f"(process 0: {own}, process 1: {other};"), o["precision"]
