"""The advantage stage (algorithms/batch.py) by hand: sequence KL, KL-in-reward shaping, advantages."""
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax.algorithms import batch as algo_batch
from rl_fusion_jax.types import Rollout


def first_response_token(batch):
  """The per-token advantages are the sample's advantage on its response tokens and 0 elsewhere; column 1
  is every row's first response token (prompts of 1 token)."""
  adv_bt = np.asarray(batch.advantages_bt)
  mask_bt = np.asarray(batch.mask_bt)
  np.testing.assert_array_equal(adv_bt * (1 - mask_bt), 0.0)
  np.testing.assert_allclose(adv_bt * mask_bt, adv_bt[:, 1:2] * mask_bt)
  return adv_bt[:, 1]


def rollout():
  # 4 samples (2 groups of 2), prompt of 1 token, responses of 2, 1, 3, 2 tokens in rows of width 5.
  resp = np.array([2, 1, 3, 2], np.int32)
  t = np.arange(5)[None, :]
  mask = (t >= 1) & (t < 1 + resp[:, None])
  logp = np.where(mask, -1.0, 0.0).astype(np.float32)
  return Rollout(tokens_bt=jnp.ones((4, 5), jnp.int32), prompt_len_b=jnp.ones((4,), jnp.int32),
                 response_len_b=jnp.asarray(resp), logp_bt=jnp.asarray(logp),
                 version_bt=jnp.zeros((4, 5), jnp.int32), finished_b=jnp.ones((4,), bool),
                 sample_id_b=jnp.arange(4, dtype=jnp.int32))


REF = jnp.full((4, 5), -1.5)          # k1 = logp - ref_logp = 0.5 per response token
REWARDS = jnp.array([1.0, 0.0, 0.5, 0.5])


def test_kl_in_reward_shapes_the_rewards_before_the_advantages():
  batch, stats = algo_batch.train_batch(rollout(), REWARDS, REF, advantage="grpo", group_size=2,
                                        kl_coef=0.2, kl_estimator="k1", kl_mode="reward")
  # kl_b = 0.5 * [2, 1, 3, 2] = [1.0, 0.5, 1.5, 1.0]; shaped r = r - 0.2 kl_b = [0.8, -0.1, 0.2, 0.3].
  # Group 0: mean 0.35, std 0.45 -> [+1, -1]; group 1: mean 0.25, std 0.05 -> [-1, +1] (eps 1e-6).
  assert float(stats["kl_seq"]) == pytest.approx(1.0)
  np.testing.assert_allclose(first_response_token(batch), [0.45 / 0.450001, -0.45 / 0.450001, -0.05 / 0.050001,
                                                  0.05 / 0.050001], rtol=1e-5)
  np.testing.assert_array_equal(batch.mask_bt.sum(axis=1), [2, 1, 3, 2])


def test_kl_as_a_loss_term_leaves_the_rewards_alone():
  batch, stats = algo_batch.train_batch(rollout(), REWARDS, REF, advantage="grpo", group_size=2,
                                        kl_coef=0.2, kl_estimator="k1", kl_mode="loss")
  # Group 0: [1, 0] -> mean 0.5, std 0.5 -> [+1, -1]; group 1: equal rewards -> [0, 0].
  np.testing.assert_allclose(first_response_token(batch), [0.5 / 0.500001, -0.5 / 0.500001, 0.0, 0.0], rtol=1e-5)
  assert float(stats["kl_seq"]) == pytest.approx(1.0)


def test_no_reference_no_kl_stat():
  batch, stats = algo_batch.train_batch(rollout(), REWARDS, jnp.zeros((4, 5)), advantage="dr_grpo",
                                        group_size=2, kl_coef=0.0, kl_estimator="k3", kl_mode="loss")
  assert "kl_seq" not in stats
  np.testing.assert_allclose(first_response_token(batch), [0.5, -0.5, 0.0, 0.0])
  assert float(stats["advantage_abs_mean"]) == pytest.approx(0.25)
