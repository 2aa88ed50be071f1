"""StaleSync in separated mode with one process per side (orchestration/separated.py), end to end on CPU.

Five launches of ``rl_fusion_jax/testing/separated_worker.py`` (2 CPU devices per process), shared by the
tests below: the one-process synchronous loop on 4 devices (the reference), and the two-process schedule
with s = 0 (kv weights), s = 1 reproducible with each weight transport (collective, kv) and s = 1
opportunistic. Everything that needs no launch (config errors, the plan, the wire format, the overlap
arithmetic) is checked in this process.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.errors import ConfigError
from rl_fusion_jax.orchestration import separated
from rl_fusion_jax.testing import launch
from rl_fusion_jax.testing import separated_worker
from rl_fusion_jax.testing.experiments import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("reward", "loss", "grad_norm", "entropy", "response_len_mean", "accuracy", "kl_seq", "format_rate")
STEPS, NUM_PROMPTS = 3, 4
RUNS = {"s0": dict(staleness=0, transport="kv"),
        "s1_collective": dict(staleness=1, transport="collective"),
        "s1_kv": dict(staleness=1, transport="kv"),
        # ... and two epochs of two mini-batches per batch on the trainer (algo.ppo_epochs, algo.mini_batches).
        "s1_opportunistic": dict(staleness=1, transport="kv", schedule="opportunistic", epochs=2)}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(workdir: str, processes, opts: dict, timeout: float = 240) -> dict:
  """Runs the worker as ``processes`` (ids) in parallel; returns process 0's summary. A failing process
  ends the others at once (they would otherwise wait for it until their timeout)."""
  env = launch.child_env()
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  cmd = [sys.executable, "-m", "rl_fusion_jax.testing.separated_worker", str(_free_port())]
  args = [f"{k}={v}" for k, v in {"steps": STEPS, **opts}.items()]
  # Files, not pipes: a worker blocked on a full pipe would stall the other one.
  logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in processes]
  procs = [subprocess.Popen(cmd + [str(p), workdir] + args, stdout=out, stderr=err, text=True, env=env, cwd=ROOT)
           for p, (out, err) in zip(processes, logs)]
  deadline = time.monotonic() + timeout
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    if any(p.returncode not in (None, 0) for p in procs):
      break
    time.sleep(0.2)
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
  outputs = []
  for p, (out, err) in zip(procs, logs):
    out.seek(0), err.seek(0)
    assert p.returncode == 0, err.read()[-4000:]
    outputs.append(json.loads(out.read().strip().splitlines()[-1]))
  return outputs[0]


def _rows(workdir: str) -> list[dict]:
  return [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """name -> (summary, metric rows) of every launch."""
  base = tmp_path_factory.mktemp("separated")
  out = {"sync": str(base / "sync")}
  summaries = {"sync": _launch(out["sync"], ["sync"], {"staleness": 0})}
  for name, opts in RUNS.items():
    out[name] = str(base / name)
    summaries[name] = _launch(out[name], [0, 1], opts)
  return {name: (summaries[name], _rows(workdir)) for name, workdir in out.items()}


def assert_equal_rows(a, b, keys):
  assert len(a) == len(b) == STEPS
  for ra, rb in zip(a, b, strict=True):
    assert ra["step"] == rb["step"]
    for key in keys:
      assert key in ra and key in rb, key
      assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])


# ------------------------------------------------------------------------------------------ launches


def test_staleness_zero_is_the_synchronous_loop(runs):
  (sync_summary, sync), (summary, s0) = runs["sync"], runs["s0"]
  assert [r["step"] for r in s0] == [r["step"] for r in sync] == list(range(1, STEPS + 1))
  assert_equal_rows(sync, s0, KEYS)
  assert any(r["loss"] != 0 for r in s0) and any(r["advantage_abs_mean"] > 0 for r in s0)  # not a no-op
  for key in ("accuracy_before", "accuracy_after", "format_rate_before", "format_rate_after"):
    assert summary[key] == sync_summary[key], key
  assert [r["separated/generated_with_version"] for r in s0] == list(range(STEPS))
  assert all(r["separated/token_staleness_max"] == 0 for r in s0)


def test_reproducible_schedule_gives_equal_metrics_in_two_runs(runs):
  """Two s = 1 runs (one per weight transport) agree on every non-timing metric."""
  (_, a), (_, b) = runs["s1_collective"], runs["s1_kv"]
  shared = sorted(k for k in set(a[0]) & set(b[0])
                  if not (k.endswith("_s") or "per_s" in k or "bytes" in k or k.startswith("verify/")))
  assert set(KEYS) <= set(shared)
  assert_equal_rows(a, b, shared)
  for rows in (a, b):   # batch k is generated with version max(0, k - s) exactly
    assert [r["separated/generated_with_version"] for r in rows] == [max(0, k - 1) for k in range(STEPS)]


@pytest.mark.parametrize("name", ["s1_collective", "s1_kv", "s1_opportunistic"])
def test_trained_tokens_stay_within_the_bound(runs, name):
  _, rows = runs[name]
  assert len(rows) == STEPS
  assert all(r["separated/token_staleness_max"] <= 1 and r["stalesync/staleness_max"] <= 1 for r in rows)
  assert all(r["separated/generated_with_version"] >= r["step"] - 2 for r in rows)   # >= k - s, k = step - 1
  if name != "s1_opportunistic":
    assert max(r["separated/token_staleness_max"] for r in rows) == 1   # older weights were trained on


@pytest.mark.parametrize("name", list(RUNS))
def test_every_group_is_trained_or_counted_once(runs, name):
  summary, rows = runs[name]
  groups = summary["groups"]
  assert groups["shipped"] == list(range(STEPS * NUM_PROMPTS))
  accounted = groups["trained"] + groups["discarded"] + groups["waiting"]
  assert sorted(accounted) == groups["shipped"]                       # nothing lost, nothing twice
  assert len(groups["trained"]) == STEPS * NUM_PROMPTS == rows[-1]["separated/trained_groups_total"]
  assert rows[-1]["separated/discarded_groups_total"] == len(groups["discarded"])


def test_overlap_and_transport_sizes_are_measured(runs):
  for name in RUNS:
    summary, rows = runs[name]
    for prefix in ("overlap/", "overlap_after_first/"):
      assert summary[prefix + "wall_s"] > 0
      for key in ("both_busy_frac", "rollout_idle_frac", "train_idle_frac", "generate_while_train_frac"):
        assert 0 <= summary[prefix + key] <= 1, (name, prefix + key)
    assert all(r["separated/rollout_bytes"] < r["separated/rollout_bytes_padded"] for r in rows)
  assert runs["s0"][0]["overlap/generate_while_train_frac"] == 0     # s = 0: one side at a time
  pushes = [r["separated/push_bytes"] for r in runs["s1_collective"][1] if "separated/push_bytes" in r]
  assert pushes and all(b == pushes[0] > 0 for b in pushes)


# ---------------------------------------------------------------------------------------- no launch


@pytest.mark.parametrize("over,processes,match", [
    ({"fusion.mode": "colocated"}, [0, 0, 1, 1], "config.fusion.mode"),
    ({"stalesync.enabled": False}, [0, 0, 1, 1], "config.stalesync.enabled"),
    ({"stalesync.max_staleness": 1, "stalesync.train_fraction": 0.5}, [0, 0, 1, 1],
     "config.stalesync.train_fraction"),
    ({}, [0, 0, 0, 0], "exactly 2 processes"),
    ({"fusion.rollout_device_fraction": 0.25}, [0, 0, 1, 1], "config.fusion.rollout_device_fraction"),
])
def test_bad_input_is_named(over, processes, match):
  cfg = tiny(**{"fusion.mode": "separated", "stalesync.enabled": True, **over})
  separated.check(tiny(**{"fusion.mode": "separated", "stalesync.enabled": True}), [0, 0, 1, 1])
  with pytest.raises(ConfigError, match=match):
    separated.check(cfg, processes)


def test_run_refuses_one_process_and_a_checkpointed_workdir(tmp_path):
  cfg = separated_worker.experiment({**separated_worker.OPTIONS, "staleness": 0})
  with pytest.raises(ConfigError, match="exactly 2 processes"):
    separated.run(cfg, str(tmp_path / "run"), separated.Options(weight_transport="kv"))
  assert not os.path.exists(tmp_path / "run")
  os.makedirs(tmp_path / "old" / "checkpoints" / "0")
  with pytest.raises(ConfigError, match="not supported"):
    separated.check_workdir(str(tmp_path / "old"))
  with pytest.raises(ConfigError, match="reproducible"):
    separated.Options(reproducible=False, weight_transport="collective")


def test_weight_plan():
  # s = 0: every boundary takes the newest version; the trainer pushes it right before that chunk.
  assert separated.weight_plan(3, 0) == [(0, 0), (1, 1), (2, 2), (3, 3)]
  # s = 2: batches 0..2 use version 0, batch 3 version 1, batch 4 version 2; then the final weights.
  assert separated.weight_plan(5, 2) == [(0, 0), (3, 1), (4, 2), (5, 5)]
  assert [separated.trainer_point(k, 5, 2) for k in (0, 3, 4, 5)] == [0, 2, 3, 5]
  assert [separated.trainer_point(k, 3, 0) for k in (0, 1, 2, 3)] == [0, 1, 2, 3]
  assert separated.weight_plan(0, 1) == [(0, 0)]


def test_wire_format_round_trip():
  arrays = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.array([True, False]),
            "c": np.array([1.5, -2.0], jnp.bfloat16), "empty": np.zeros((0,), np.float32)}
  out, meta = separated.decode(separated.encode(arrays, {"step": 3}))
  assert meta == {"step": 3} and list(out) == list(arrays)
  for name, value in arrays.items():
    assert out[name].dtype == value.dtype and np.array_equal(out[name], value), name


def test_overlap_arithmetic():
  # Rollout busy [0, 2) and [3, 4); train busy [1, 3.5): both busy 1 + 0.5 s of a 4 s window.
  out = separated.overlap([(0, 2), (3, 4)], [(1, 2.5), (2, 3.5)])
  assert out["wall_s"] == 4 and out["both_busy_frac"] == pytest.approx(1.5 / 4)
  assert out["rollout_idle_frac"] == pytest.approx(1 / 4) and out["train_idle_frac"] == pytest.approx(1.5 / 4)


def test_several_updates_per_batch_run_on_the_separated_trainer(runs):
  rows = runs["s1_opportunistic"][1]
  assert len(rows) == STEPS and all(r["ppo/epoch1/kl_proximal"] >= 0 and "ppo/epoch0/clip_frac" in r for r in rows)
  assert all("ppo/epoch0/clip_frac" not in r for r in runs["s1_kv"][1])
