"""RL on an MoE policy: GRPO in every deployment mode gives the same metrics (router losses and
per-expert load included), compiles nothing new after the first steps, and runs under StaleSync."""
import pytest

from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.orchestration import loop
from rl_fusion_jax.testing.experiments import TINY_MOE, rl_step_traces, tiny

MODES = ("colocated", "full", "separated", "hybrid")
STEPS = 3


def moe_cfg(mode, **over):
  base = {**TINY_MOE, "fusion.mode": mode, "fusion.bucket_bytes": 32768, "algo.kl_coef": 0.05,
          "rollout.num_slots": 8, "rollout.chunk_steps": 2, "run.steps": STEPS, "run.checkpoint_every": 0}
  if mode == "hybrid":
    base["fusion.aux_devices"] = 4
  return tiny(**{**base, **over})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One run per mode; also counts the jaxpr traces of every RL step."""
  out = {}
  with rl_step_traces() as per_step:
    for mode in MODES:
      workdir = str(tmp_path_factory.mktemp(mode))
      summary = loop.run(moe_cfg(mode), workdir)
      out[mode] = (summary, [r for r in metrics_lib.read_metrics(workdir) if "loss" in r])
  out["traces"] = per_step
  return out


MOE_KEYS = ("moe/load_balance_loss", "moe/router_z_loss") + tuple(f"moe/expert_load/e{i}" for i in range(8))


def test_router_metrics_are_reported(runs):
  _, rows = runs["colocated"]
  for row in rows:
    loads = [row[f"moe/expert_load/e{i}"] for i in range(8)]
    assert sum(loads) == pytest.approx(1.0, rel=1e-5)     # fractions of the routed assignments
    assert row["moe/load_balance_loss"] >= 1.0             # >= k * (min over balanced) / k, > 0
    assert row["moe/router_z_loss"] > 0.0
    assert row["moe/dropped_fraction"] == 0.0               # dropless


@pytest.mark.parametrize("mode", ["full", "separated", "hybrid"])
def test_modes_give_the_same_metrics(runs, mode):
  """As tests/fusion_test.py: full equals colocated on every step; separated and hybrid (other meshes,
  other reduction orders) on the first step."""
  base_summary, base = runs["colocated"]
  summary, rows = runs[mode]
  assert [r["step"] for r in rows] == [r["step"] for r in base] == list(range(1, STEPS + 1))
  assert summary["accuracy_before"] == base_summary["accuracy_before"]
  steps = base if mode == "full" else base[:1]
  abs_tol = 1e-6 if mode == "full" else 1e-4
  for a, b in zip(steps, rows):
    for key in ("reward", "loss", "grad_norm", "entropy", "kl") + MOE_KEYS:
      assert b[key] == pytest.approx(a[key], rel=1e-4, abs=abs_tol), (mode, a["step"], key)


def test_no_traces_after_the_first_steps(runs):
  seen = runs["traces"]
  # The first run builds every program it needs (the later ones may share them: shared_programs).
  assert seen[(MODES[0], 0)] > 0, "the listener saw no traces at all: the check would be vacuous"
  for mode in MODES:
    assert seen[(mode, STEPS - 1)] == 0, (mode, seen)


def test_stalesync_trains_an_moe_policy(tmp_path):
  over = {"stalesync.enabled": True, "stalesync.max_staleness": 1, "stalesync.train_fraction": 0.5,
          "rollout.num_slots": 16, "algo.policy_loss": "decoupled_ppo"}
  loop.run(moe_cfg("colocated", **over), str(tmp_path))
  rows = [r for r in metrics_lib.read_metrics(str(tmp_path)) if "loss" in r]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert max(r["stalesync/staleness_max"] for r in rows) == 1
  assert all(r["moe/load_balance_loss"] > 0 for r in rows)


def test_experts_not_dividing_the_expert_parallel_degree_fail_before_writing(tmp_path):
  """8 devices, experts over fsdp x data = 8 while training: 4 experts cannot be split."""
  with pytest.raises(ValueError, match=r"model\.num_experts=4"):
    loop.run(moe_cfg("colocated", **{"model.num_experts": 4}), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()
