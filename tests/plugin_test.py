"""A loss in one file: experiments/cispo_loss.py registers CISPO with its hyperparameter dataclass, a run
loads it through algo.plugins, and bad names or hyperparameters fail at config time naming the field."""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.algorithms import registry
from rl_fusion_jax.orchestration import loop
from rl_fusion_jax.testing.experiments import tiny
from rl_fusion_jax.train import step as step_lib

PLUGIN = str(pathlib.Path(__file__).resolve().parents[1] / "experiments" / "cispo_loss.py")


def test_cispo_by_hand():
  algo = config_lib.AlgoConfig(plugins=PLUGIN, policy_loss="cispo", loss_kwargs="eps_high=0.2")
  assert algo.loss_hparams == {"eps_high": 0.2}
  # Token 0: p = 0.6 now, 0.4 when sampled: r = 1.5, weight min(1.5, 1.2) = 1.2 (PPO's clip would give
  # it no gradient); token 1: r = 1. Advantage +1, token-mean weights 1/2.
  logp = jnp.log(jnp.array([[0.6, 0.5]]))
  behaviour = jnp.log(jnp.array([[0.4, 0.5]]))
  mask = jnp.ones((1, 2))
  fn = lambda lp: step_lib.rl_loss_from_logprobs(
      algo, lp, jnp.zeros_like(lp), behaviour_logp_bt=behaviour, advantages=jnp.ones((1,)), mask_bt=mask,
      ref_logp_bt=jnp.zeros_like(lp), weights=(mask / 2, mask / 2))
  (loss, sums), grad = jax.value_and_grad(fn, has_aux=True)(logp)
  assert float(loss) == pytest.approx(-(1.2 + 1.0) / 2, abs=1e-6)
  np.testing.assert_allclose(grad, [[-0.6, -0.5]], atol=1e-6)
  assert float(sums["clip_frac"]) == pytest.approx(0.5)


def test_a_plugin_loss_runs_end_to_end(tmp_path):
  over = {"rollout.num_prompts": 8, "run.steps": 2, "warmup.steps": 20, "warmup.learning_rate": 3e-3,
          "algo.plugins": PLUGIN, "algo.policy_loss": "cispo", "algo.loss_kwargs": "eps_high=0.3"}
  loop.run(tiny(**over), str(tmp_path / "run"))
  rows = [r for r in metrics_lib.read_metrics(str(tmp_path / "run")) if "loss" in r]
  assert len(rows) == 2 and all(np.isfinite(r["loss"]) and r["nonfinite"] == 0 for r in rows)
  assert "cispo" in registry.POLICY_LOSSES and registry.POLICY_LOSS_PARAMS["cispo"].__name__ == "CISPOParams"


def test_bad_plugins_and_hyperparameters_name_the_field():
  with pytest.raises(ValueError, match="config.algo.plugins: cannot import 'no_such_module_xyz'"):
    config_lib.AlgoConfig(plugins="no_such_module_xyz")
  with pytest.raises(ValueError, match=r"config.algo.loss_kwargs.eps: not a hyperparameter of the policy loss 'cispo'"):
    config_lib.AlgoConfig(plugins=PLUGIN, policy_loss="cispo", loss_kwargs="eps=0.1")
  with pytest.raises(ValueError, match="eps_high must be > 0"):
    config_lib.AlgoConfig(plugins=PLUGIN, policy_loss="cispo", loss_kwargs="eps_high=-1")
  with pytest.raises(ValueError, match="config.algo.policy_loss: unknown name 'cispo2'"):
    config_lib.AlgoConfig(plugins=PLUGIN, policy_loss="cispo2")
  with pytest.raises(ValueError, match="config.algo.advantage_kwargs: the advantage estimator 'grpo' takes no"):
    config_lib.AlgoConfig(advantage_kwargs="scale=1")
  # The shipped losses take their hyperparameters from the algo fields, or from loss_kwargs.
  assert config_lib.AlgoConfig(policy_loss="decoupled_ppo", clip_high=0.28).loss_hparams == {
      "clip_low": 0.2, "clip_high": 0.28, "dual_clip": None, "is_cap": 5.0}
  assert config_lib.AlgoConfig(policy_loss="tis_token", loss_kwargs="is_cap=inf").loss_hparams == {
      "is_cap": float("inf")}
  with pytest.raises(ValueError, match="registered"):
    registry.register_policy_loss("cispo")(lambda *a, **k: None)
