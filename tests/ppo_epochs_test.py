"""Several updates per rollout batch (algo.ppo_epochs, algo.mini_batches): the loss against the proximal
policy by hand, the loop's epochs and mini-batches on padded and packed rows, and the version count."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.orchestration import loop
from rl_fusion_jax.testing.experiments import tiny
from rl_fusion_jax.train import step as step_lib

MASK = jnp.ones((1, 2), jnp.float32)
WEIGHTS = (MASK / 2, MASK / 2)     # token-mean over the 2 tokens


def loss_and_grad(name: str, logp, behaviour, proximal, adv):
  algo = config_lib.AlgoConfig(policy_loss=name, clip_low=0.2, clip_high=0.2)
  fn = lambda lp: step_lib.rl_loss_from_logprobs(
      algo, lp, jnp.zeros_like(lp), behaviour_logp_bt=behaviour, advantages=adv, mask_bt=MASK,
      ref_logp_bt=jnp.zeros_like(lp), weights=WEIGHTS, proximal_logp_bt=proximal)
  (loss, sums), grad = jax.value_and_grad(fn, has_aux=True)(logp)
  return float(loss), sums, np.asarray(grad)


def test_the_clip_binds_against_the_proximal_policy_on_a_later_update():
  # Token 0: sampled with p = 0.5, p = 0.4 under the proximal policy (before the batch's first update), and
  # 0.6 now (after one update): ratio to the proximal policy 1.5 > 1 + 0.2, advantage +1, so the clip binds
  # (no gradient). Token 1: p = 0.5 throughout, ratio 1, not clipped.
  logp = jnp.log(jnp.array([[0.6, 0.5]]))
  behaviour, proximal = jnp.log(jnp.array([[0.5, 0.5]])), jnp.log(jnp.array([[0.4, 0.5]]))
  adv = jnp.ones((1, 2))
  # ppo_clip clips around the proximal policy: -(min(1.5, 1.2) + 1) / 2 = -1.1; the clipped token has no
  # gradient, the other -adv * d ratio / d logp / 2 = -0.5.
  loss, sums, grad = loss_and_grad("ppo_clip", logp, behaviour, proximal, adv)
  assert loss == pytest.approx(-1.1, abs=1e-6)
  np.testing.assert_allclose(grad, [[0.0, -0.5]], atol=1e-6)
  assert float(sums["clip_frac"]) == pytest.approx(0.5)
  # decoupled PPO: the same clipped terms, each times w = p_prox / p_behaviour (0.8 and 1): -(0.8 * 1.2 + 1) / 2.
  loss, sums, grad = loss_and_grad("decoupled_ppo", logp, behaviour, proximal, adv)
  assert loss == pytest.approx(-(0.8 * 1.2 + 1) / 2, abs=1e-6)
  np.testing.assert_allclose(grad, [[0.0, -0.5]], atol=1e-6)
  # uncorrected: the clipped terms without the weight.
  loss, _, _ = loss_and_grad("uncorrected", logp, behaviour, proximal, adv)
  assert loss == pytest.approx(-1.1, abs=1e-6)
  # KL to the proximal policy, k3 per token: r - 1 - log r with r = p_prox / p = 0.4 / 0.6, then 0.
  r = 0.4 / 0.6
  assert float(sums["kl_proximal"]) == pytest.approx((r - 1 - math.log(r)) / 2, rel=1e-5)
  # Without the proximal log-probs (one update per batch) decoupled PPO and TIS weight the same gradient.
  _, _, g_dec = loss_and_grad("decoupled_ppo", logp, behaviour, None, adv)
  _, _, g_tis = loss_and_grad("tis_token", logp, behaviour, None, adv)
  np.testing.assert_allclose(g_dec, g_tis, rtol=1e-6)
  # With them, on the clipped token decoupled PPO has no gradient and TIS does: they now differ.
  _, _, g_tis = loss_and_grad("tis_token", logp, behaviour, proximal, adv)
  assert abs(g_tis[0, 0]) > 0.1


@pytest.mark.parametrize("name", ["ppo_clip", "decoupled_ppo", "tis_token", "tis_seq", "uncorrected"])
def test_the_first_update_of_a_batch_is_the_one_update_loss(name):
  # Before the batch's first update the proximal log-probs are the current ones: each off-policy loss is
  # then its one-update form (proximal None). ppo_clip anchors at the behaviour log-probs with one update
  # and at the proximal ones with several; on-policy (s = 0) the two are the same log-probs.
  rng = np.random.default_rng(0)
  logp = jnp.asarray(np.log(rng.uniform(0.2, 0.9, (1, 2))), jnp.float32)
  behaviour = jnp.asarray(np.log(rng.uniform(0.2, 0.9, (1, 2))), jnp.float32)
  adv = jnp.asarray([[0.7, 0.7]])
  if name == "ppo_clip":
    behaviour = logp
  a = loss_and_grad(name, logp, behaviour, None, adv)
  b = loss_and_grad(name, logp, behaviour, logp, adv)
  assert b[0] == pytest.approx(a[0], rel=1e-6)
  np.testing.assert_allclose(b[2], a[2], rtol=1e-6)


def test_several_updates_per_batch_in_the_loop_padded_and_packed(tmp_path):
  """E = 2 epochs x M = 2 mini-batches: one policy version per batch, the clip acting on later updates, and
  the packed mini-batches give the padded ones' metrics (same samples, same shuffles)."""
  over = {"rollout.num_prompts": 8, "run.steps": 2, "rollout.max_prompt_len": 16, "rollout.max_new_tokens": 8,
          "model.max_position_embeddings": 32, "warmup.steps": 40, "warmup.learning_rate": 3e-3,
          "optim.learning_rate": 1e-2, "algo.ppo_epochs": 2, "algo.mini_batches": 2}
  runs = {}
  for name, extra in (("padded", {}), ("packed", {"optim.pack_rows": True})):
    loop.run(tiny(**over, **extra), str(tmp_path / name))
    runs[name] = [r for r in metrics_lib.read_metrics(str(tmp_path / name)) if "loss" in r]
  for rows in runs.values():
    assert [r["policy_version"] for r in rows] == [1.0, 2.0]
    assert rows[0]["ppo/epoch1/kl_proximal"] > 0 and rows[0]["ppo/epoch1/clip_frac"] > 0
  for key in ("loss", "grad_norm", "clip_frac", "kl_proximal", "ppo/epoch0/clip_frac", "ppo/epoch1/kl_proximal"):
    assert runs["packed"][0][key] == pytest.approx(runs["padded"][0][key], rel=1e-4, abs=1e-6), key


def test_mini_batches_must_divide_the_batch():
  with pytest.raises(ValueError, match="algo.mini_batches"):
    tiny(**{"algo.mini_batches": 3})
  with pytest.raises(ValueError, match="algo.ppo_epochs"):
    tiny(**{"algo.ppo_epochs": 0})


def test_several_updates_under_stalesync_keep_one_version_per_batch(tmp_path):
  over = {"rollout.num_prompts": 8, "run.steps": 3, "warmup.steps": 20, "warmup.learning_rate": 3e-3,
          "algo.ppo_epochs": 2, "algo.mini_batches": 2, "algo.policy_loss": "decoupled_ppo",
          "stalesync.enabled": True, "stalesync.max_staleness": 1, "stalesync.train_fraction": 0.5}
  loop.run(tiny(**over), str(tmp_path / "run"))
  rows = [r for r in metrics_lib.read_metrics(str(tmp_path / "run")) if "loss" in r]
  assert [r["policy_version"] for r in rows] == [1.0, 2.0, 3.0]
  assert all(r["stalesync/trained_token_staleness_mean"] <= 1 for r in rows)
  assert all("ppo/epoch1/kl_proximal" in r and r["mismatch/tokens_frac"] <= 1 for r in rows)
