"""Name -> function registry: every name resolves, unknown names list the known ones, forks can add."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax import algorithms
from rl_fusion_jax.algorithms import losses, offpolicy, registry

REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0]


def test_advantage_names_resolve_to_the_right_estimator():
  # Group 1 [1,0,0,1]: mean 0.5, population std 0.5. Group 2 [1,1,1,2]: mean 1.25,
  # deviations [-0.25]*3 + [0.75], variance (3*0.0625 + 0.5625)/4 = 0.1875, std 0.433013.
  #   grpo:    [1,-1,-1,1] and [-0.25, 0.75]/0.433013 = [-0.577350, 1.732051]
  #   dr_grpo: [0.5,-0.5,-0.5,0.5, -0.25,-0.25,-0.25,0.75]
  #   rloo:    r - (sum - r)/3: [2/3,-2/3,-2/3,2/3], group 2 sum 5: [1-4/3]*3 + [2-1] = [-1/3]*3 + [1]
  want = {
      "grpo": [1, -1, -1, 1, -0.577350, -0.577350, -0.577350, 1.732051],
      "dr_grpo": [0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75],
      "rloo": [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1 / 3, -1 / 3, -1 / 3, 1.0],
  }
  assert set(registry.ADVANTAGE_ESTIMATORS) == set(want)
  for name, adv in want.items():
    np.testing.assert_allclose(registry.get_advantage_fn(name)(REWARDS, 4), adv, rtol=1e-5, atol=1e-5)


def test_token_advantage_names_resolve():
  # One row: prompt t=0, response t=1,2 with rewards [0, 1] and values [0.5, 0.25]; gamma = lam = 1:
  #   delta_2 = 1 - 0.25 = 0.75, delta_1 = 0 + 0.25 - 0.5 = -0.25 -> A = [0.5, 0.75] (= 1 - V),
  #   returns = A + V = [1, 1].
  assert set(registry.TOKEN_ADVANTAGE_ESTIMATORS) == {"gae"}
  fn = registry.get_token_advantage_fn("gae")
  assert fn is algorithms.gae and algorithms.get_token_advantage_fn("gae") is fn
  adv_bt, ret_bt = fn([[0.0, 0.0, 1.0]], [[9.0, 0.5, 0.25]], [[0.0, 1.0, 1.0]], gamma=1.0, lam=1.0)
  np.testing.assert_array_equal(adv_bt, [[0.0, 0.5, 0.75]])
  np.testing.assert_array_equal(ret_bt, [[0.0, 1.0, 1.0]])


def test_policy_kl_and_aggregation_names_resolve():
  want_losses = {
      "ppo_clip": losses.clipped_surrogate,
      "decoupled_ppo": offpolicy.decoupled_ppo_surrogate,
      "tis_token": offpolicy.tis_token_loss,
      "tis_seq": offpolicy.tis_seq_loss,
      "uncorrected": offpolicy.uncorrected_surrogate,
  }
  assert set(want_losses) <= set(registry.POLICY_LOSSES)   # (a plugin loaded by another test may add one)
  for name, fn in want_losses.items():
    assert registry.get_policy_loss(name) is fn
  # pi = 0.5, pi_ref = 0.25: log r = -ln 2 -> k1 = 0.693147, k2 = 0.240227, k3 = -0.5 + 0.693147 = 0.193147
  logp, ref = jnp.log(jnp.array([[0.5]])), jnp.log(jnp.array([[0.25]]))
  for name, want in {"k1": 0.693147, "k2": 0.240227, "k3": 0.193147}.items():
    np.testing.assert_allclose(registry.get_kl_estimator(name)(logp, ref), [[want]], rtol=1e-5)
  # mask [[1,1],[1,0]]: token-mean 1/3 each; seq-mean-token-mean row 0 1/(2*2), row 1 1/(1*2);
  # seq-mean-token-sum-norm with norm_len 2: 1/(2*2) each.
  mask = np.array([[1, 1], [1, 0]], np.float32)
  want_w = {
      "token-mean": [[1 / 3, 1 / 3], [1 / 3, 0]],
      "seq-mean-token-mean": [[1 / 4, 1 / 4], [1 / 2, 0]],
      "seq-mean-token-sum-norm": [[1 / 4, 1 / 4], [1 / 4, 0]],
  }
  assert set(registry.AGGREGATIONS) == set(want_w)
  for name, w in want_w.items():
    assert registry.check_aggregation(name) == name
    np.testing.assert_allclose(registry.get_token_weights_fn(name)(mask, norm_len=2), w, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(registry.POLICY_LOSSES))
def test_every_policy_loss_takes_its_hyperparameters_and_returns_the_stats_contract(name):
  # The train step calls any registered loss the same way (its dataclass's fields, mask_bt and, with
  # several updates per batch, proximal_logp_bt); each must answer with the same stats keys, every one a
  # float32 [B, T] array, under jit. Row 1 is 0.3 nats stale on its response tokens.
  logp_bt = jnp.log(jnp.array([[0.5, 0.4, 0.3], [0.2, 0.6, 0.9]]))
  behaviour_bt = logp_bt - jnp.array([[0.0, 0.0, 0.0], [0.3, 0.3, 0.0]])
  mask_bt = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
  shared = dict(clip_low=0.2, clip_high=0.28, dual_clip=None, is_cap=2.0)
  params = registry.hyperparameters(registry.POLICY_LOSS_PARAMS, "policy loss", name, shared, "", "kwargs")
  kwargs = dict(registry.hparams_dict(params), mask_bt=mask_bt)
  if name != "ppo_clip":     # ppo_clip is handed the proximal log-probs as its old_logp_bt instead
    kwargs["proximal_logp_bt"] = logp_bt - 0.1
  assert set(registry.hparams_dict(params)) <= set(shared)
  fn = jax.jit(lambda lp, beh, adv: registry.get_policy_loss(name)(lp, beh, adv, **kwargs))
  loss_bt, stats = fn(logp_bt, behaviour_bt, jnp.array([1.0, -1.0]))
  assert loss_bt.shape == (2, 3) and np.all(np.isfinite(loss_bt))
  assert set(stats) == set(losses.POLICY_LOSS_STATS)
  for key, value in stats.items():
    assert value.shape == (2, 3) and value.dtype == jnp.float32, key
    assert np.all(np.isfinite(value)), key


@pytest.mark.parametrize(
    "getter, what, known",
    [
        (registry.get_advantage_fn, "advantage estimator", "dr_grpo, grpo, rloo"),
        (registry.get_token_advantage_fn, "token advantage estimator", "gae"),
        (registry.get_policy_loss, "policy loss", "decoupled_ppo, ppo_clip, tis_seq, tis_token"),
        (registry.get_kl_estimator, "KL estimator", "k1, k2, k3"),
        (
            registry.check_aggregation,
            "aggregation",
            "seq-mean-token-mean, seq-mean-token-sum-norm, token-mean",
        ),
        (registry.get_token_weights_fn, "aggregation", "token-mean"),
    ],
)
def test_unknown_names_list_the_known_ones(getter, what, known):
  with pytest.raises(ValueError, match=f"unknown {what} 'nope'; known: .*{known}"):
    getter("nope")


def test_registered_variants_are_retrievable_and_names_are_not_overwritten():
  try:

    @registry.register_advantage("test_sign")
    def sign_advantages(rewards_b, group_size):
      del group_size
      return jnp.sign(jnp.asarray(rewards_b) - 0.5)

    @registry.register_policy_loss("test_pg")
    def vanilla_pg(logp_bt, old_logp_bt, adv, **unused):
      return -logp_bt * adv[:, None], {}

    @registry.register_kl_estimator("test_zero")
    def zero_kl(logp_bt, ref_logp_bt):
      return jnp.zeros_like(logp_bt)

    @registry.register_token_advantage("test_mc")
    def monte_carlo(token_rewards_bt, values_bt, mask_bt, *, gamma, lam):
      del lam
      return algorithms.gae(token_rewards_bt, values_bt, mask_bt, gamma=gamma, lam=1.0)

    assert registry.get_advantage_fn("test_sign") is sign_advantages
    np.testing.assert_array_equal(registry.get_advantage_fn("test_sign")([1.0, 0.0], 2), [1.0, -1.0])
    assert registry.get_policy_loss("test_pg") is vanilla_pg
    assert registry.get_kl_estimator("test_zero") is zero_kl
    assert registry.get_token_advantage_fn("test_mc") is monte_carlo
    assert algorithms.get_token_advantage_fn("test_mc") is monte_carlo
    with pytest.raises(ValueError, match="token advantage estimator 'gae' is already registered"):
      registry.register_token_advantage("gae")(monte_carlo)
    assert registry.TOKEN_ADVANTAGE_ESTIMATORS["gae"] is algorithms.gae
    # The package-level re-exports are the same tables.
    assert algorithms.get_advantage_fn("test_sign") is sign_advantages
    with pytest.raises(ValueError, match="already registered"):
      registry.register_advantage("grpo")(sign_advantages)
    assert registry.ADVANTAGE_ESTIMATORS["grpo"] is not sign_advantages
  finally:
    registry.ADVANTAGE_ESTIMATORS.pop("test_sign", None)
    registry.POLICY_LOSSES.pop("test_pg", None)
    registry.KL_ESTIMATORS.pop("test_zero", None)
    registry.TOKEN_ADVANTAGE_ESTIMATORS.pop("test_mc", None)
  with pytest.raises(ValueError, match="name"):
    registry.register_policy_loss("")
  with pytest.raises(ValueError, match="name"):
    registry.register_token_advantage("")


def test_import_has_no_side_effects():
  # A fresh interpreter: importing the registry must not start a JAX backend (no device work at import).
  code = (
      "import rl_fusion_jax.algorithms.registry as r\n"
      "from jax._src import xla_bridge\n"
      "assert not xla_bridge.backends_are_initialized()\n"
      "assert sorted(r.POLICY_LOSSES) == ['decoupled_ppo', 'ppo_clip', 'tis_seq', 'tis_token', 'uncorrected']\n"
      "assert sorted(r.TOKEN_ADVANTAGE_ESTIMATORS) == ['gae']\n"
  )
  repo_root = pathlib.Path(__file__).resolve().parents[1]
  result = subprocess.run(
      [sys.executable, "-c", code],
      capture_output=True,
      text=True,
      timeout=60,
      cwd=repo_root,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert result.returncode == 0, result.stderr
