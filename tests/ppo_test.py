"""PPO with a critic (algo.advantage='gae') and DAPO's dynamic sampling, end to end on 8 devices."""
import jax
import numpy as np
import pytest

from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax import models
from rl_fusion_jax.checkpointing import Checkpointer
from rl_fusion_jax.errors import ConfigError
from rl_fusion_jax.models import value_model
from rl_fusion_jax.orchestration import loop
from rl_fusion_jax.orchestration.programs import Programs, make_placement
from rl_fusion_jax.orchestration.setup import validate
from rl_fusion_jax.sharding import reshard
from rl_fusion_jax.testing.experiments import tiny

PPO = {"algo.advantage": "gae", "algo.lam": 0.95, "critic.learning_rate": 1e-3}


def rl_rows(workdir):
  return [r for r in metrics_lib.read_metrics(str(workdir)) if "loss" in r]


def test_ppo_runs_trains_the_critic_and_resumes_exactly(tmp_path):
  # KL in the reward (per token, against the warmed-up policy) makes the returns non-zero from step 2 on
  # even when no sample of the tiny policy earns a reward.
  ppo = {**PPO, "algo.kl_coef": 0.1, "algo.kl_mode": "reward"}
  straight = tmp_path / "straight"
  loop.run(tiny(**ppo), str(straight))
  rows = rl_rows(straight)
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r in rows:
    for key in ("critic/value_loss", "critic/value_explained_var", "critic/grad_norm", "return_mean",
                "value_old_mean", "critic_s"):
      assert np.isfinite(r[key]), key
    assert r["critic/nonfinite"] == 0.0
  # The critic starts as the warmed-up body with a zero head: its first values are all 0.
  assert rows[0]["value_old_mean"] == 0.0 and rows[2]["value_old_mean"] != 0.0
  assert rows[1]["critic/return_mean"] != 0.0
  # Resume after step 2 (the critic's params, optimizer state and step are in the checkpoint).
  resumed = tmp_path / "resumed"
  loop.run(tiny(**ppo, **{"run.steps": 2}), str(resumed))
  loop.run(tiny(**ppo), str(resumed))
  again = rl_rows(resumed)
  for key in ("loss", "critic/value_loss", "value_old_mean", "return_mean", "grad_norm", "critic/grad_norm"):
    assert again[2][key] == rows[2][key], key


def test_ppo_on_packed_rows_equals_the_padded_rows(tmp_path):
  # With optim.pack_rows the critic's values, GAE and the critic's update run on packed rows (no padded
  # batch): every step equals the padded run's to rounding.
  ppo = {**PPO, "algo.kl_coef": 0.1, "algo.kl_mode": "reward"}
  loop.run(tiny(**ppo), str(tmp_path / "padded"))
  loop.run(tiny(**ppo, **{"optim.pack_rows": True}), str(tmp_path / "packed"))
  padded, packed = rl_rows(tmp_path / "padded"), rl_rows(tmp_path / "packed")
  assert len(packed) == len(padded) == 3 and all("pack/rows" in r for r in packed)
  for a, b in zip(padded, packed):
    for key in ("loss", "grad_norm", "return_mean", "value_old_mean", "advantage_abs_mean", "critic/value_loss",
                "critic/grad_norm", "critic/value_explained_var"):
      assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["step"], key)


def test_ppo_epochs_on_packed_rows_with_a_critic(tmp_path):
  # Two epochs of two mini-batches with GAE advantages, padded and packed: one policy version per batch,
  # the critic one step per batch, and the packed run's first step the padded one's.
  over = {**PPO, "algo.kl_coef": 0.1, "algo.kl_mode": "reward", "rollout.num_prompts": 8, "run.steps": 2,
          "algo.ppo_epochs": 2, "algo.mini_batches": 2}
  loop.run(tiny(**over), str(tmp_path / "padded"))
  loop.run(tiny(**over, **{"optim.pack_rows": True}), str(tmp_path / "packed"))
  padded, packed = rl_rows(tmp_path / "padded"), rl_rows(tmp_path / "packed")
  for rows in (padded, packed):
    assert [r["policy_version"] for r in rows] == [1.0, 2.0]
    assert all(r["nonfinite"] == 0.0 and r["critic/nonfinite"] == 0.0 for r in rows)
  for key in ("loss", "grad_norm", "ppo/epoch0/loss", "ppo/epoch1/loss", "ppo/epoch1/kl_proximal", "return_mean",
              "critic/value_loss", "critic/grad_norm"):
    assert packed[0][key] == pytest.approx(padded[0][key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("mode,params_on_host,opt_on_host", [
    ("colocated", False, True), ("full", True, True), ("separated", False, False)])
def test_critic_rests_where_the_mode_says_while_generating(mode, params_on_host, opt_on_host):
  cfg = tiny(**PPO, **{"fusion.mode": mode, "mesh.fsdp": 1})
  setup = validate(cfg, jax.device_count())
  programs = Programs(setup, make_placement(cfg))
  critic = programs.critic
  critic.start(jax.jit(lambda: models.init_params(cfg.model.config, jax.random.key(0)),
                       out_shardings=programs.param_shardings)())
  kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
  device = kinds(critic.state.params)
  assert device != {reshard.HOST}
  critic.park()
  assert kinds(critic.state.params) == ({reshard.HOST} if params_on_host else device)
  assert kinds(critic.state.opt_state) == ({reshard.HOST} if opt_on_host else device)
  with pytest.raises(RuntimeError, match="parked"):
    critic.values(None)
  critic.unpark()
  assert kinds(critic.state.params) == device and kinds(critic.state.opt_state) == device


def test_critic_init_from_a_value_model_and_bad_shapes_fail_at_start(tmp_path):
  cfg = tiny(**PPO)
  good = tmp_path / "good"
  params = value_model.init_value_params(cfg.model.config, jax.random.key(1))
  value_model.save_value_model(cfg.model.config, params, str(good))
  setup = validate(tiny(**PPO, **{"critic.init": str(good)}), jax.device_count())
  np.testing.assert_array_equal(setup.critic_params["score"]["kernel"], params["score"]["kernel"])
  # A value model of another width: named at start, nothing written.
  other = tiny(**PPO, **{"model.hidden_size": 64, "model.intermediate_size": 64}).model.config
  bad = tmp_path / "bad"
  value_model.save_value_model(other, value_model.init_value_params(other, jax.random.key(1)), str(bad))
  with pytest.raises(ConfigError, match="config.critic.init: .*the value model must have the policy's shapes"):
    loop.run(tiny(**PPO, **{"critic.init": str(bad)}), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_dynamic_sampling_fills_the_batch_with_informative_groups(tmp_path):
  cfg = tiny(**{"algo.dynamic_sampling": True, "algo.dynamic_sampling_rounds": 3, "run.steps": 2})
  loop.run(cfg, str(tmp_path / "run"))
  rows = rl_rows(tmp_path / "run")
  drawn = 0
  for r in rows:
    rounds = r["dynamic_sampling/rounds"]
    assert 1 <= rounds <= 4
    # Every group of a round is either kept or filtered: informative + filtered = rounds * num_prompts.
    informative = r["dynamic_sampling/informative_frac"] * rounds * 4
    assert informative + r["dynamic_sampling/groups_filtered"] == pytest.approx(rounds * 4)
    assert (informative < 4) == (r["dynamic_sampling/short_batches"] == 1.0)
    assert (rounds == 4) or informative >= 4      # a round is added only while the batch is short
    drawn += rounds * 4
  # The data position advances by every prompt drawn, so a later step never redraws a problem.
  meta = Checkpointer(str(tmp_path / "run" / "checkpoints"), create=False).read_meta(2)
  assert meta["data_position"] == drawn


def test_ppo_under_stalesync(tmp_path):
  # The critic goes through the bounded-staleness schedule's phases too (parked while generating, values
  # of the admitted groups, one update per RL step).
  cfg = tiny(**PPO, **{"stalesync.enabled": True, "stalesync.max_staleness": 1,
                       "stalesync.train_fraction": 0.5, "rollout.num_slots": 16,
                       "algo.policy_loss": "decoupled_ppo", "run.steps": 2})
  loop.run(cfg, str(tmp_path / "run"))
  rows = rl_rows(tmp_path / "run")
  assert len(rows) == 2 and all(np.isfinite(r["critic/value_loss"]) for r in rows)
  assert max(r["stalesync/staleness_max"] for r in rows) <= 1


def test_a_nonfinite_critic_update_stops_the_run_naming_the_critic(tmp_path, monkeypatch):
  # The critic step never applies a non-finite update (train/step.py::update); the host acts on its flag
  # with run.on_nonfinite like on the policy's: 'stop' names the critic and the step.
  from rl_fusion_jax.errors import DivergenceError
  from rl_fusion_jax.orchestration import critic_stage
  real = critic_stage.CriticStage.update

  def failing(self, batch):
    metrics = real(self, batch)
    return metrics | {"critic/nonfinite": np.float32(2.0), "critic/grad_norm": np.float32(np.nan)}
  monkeypatch.setattr(critic_stage.CriticStage, "update", failing)
  with pytest.raises(DivergenceError, match="critic step 1: non-finite gradients"):
    loop.run(tiny(**PPO), str(tmp_path / "run"))
