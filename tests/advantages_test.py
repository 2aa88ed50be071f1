"""Group advantages (GRPO, Dr. GRPO), RLOO and GAE against hand-computed values."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax.algorithms import advantages

REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_grpo_hand_values_and_equal_group_is_zero():
  # Group 1 [1,0,0,1]: mean 0.5, deviations +-0.5, population std sqrt(mean(0.25)) = 0.5
  #   -> +-0.5 / (0.5 + 1e-6) = +-0.999998.
  # Group 2 [1,1,1,1]: deviations 0, std 0 -> 0 / (0 + 1e-6) = 0, not NaN.
  adv_b = np.asarray(advantages.group_advantages(REWARDS, 4))
  np.testing.assert_allclose(adv_b, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5)
  assert np.all(np.isfinite(adv_b))
  assert np.all(adv_b[4:] == 0.0)


def test_grpo_uses_population_std():
  # [0,0,0,3]: mean 0.75, deviations [-0.75]*3 + [2.25]; variance (3*0.5625 + 5.0625) / 4 = 1.6875,
  # std sqrt(1.6875) = 1.299038 -> [-1/sqrt(3)]*3 + [sqrt(3)] = [-0.577350]*3 + [1.732051].
  # (ddof=1 would give std 1.5 -> [-0.5]*3 + [1.5].)
  adv_b = advantages.group_advantages([0.0, 0.0, 0.0, 3.0], 4, eps=0.0)
  np.testing.assert_allclose(adv_b, [-0.577350, -0.577350, -0.577350, 1.732051], rtol=1e-5)


def test_dr_grpo_does_not_divide_by_std():
  # Group 1: r - 0.5 = [0.5,-0.5,-0.5,0.5]; group 2: r - 1 = 0.
  adv_b = advantages.group_advantages(REWARDS, 4, scale="none")
  np.testing.assert_allclose(adv_b, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], atol=1e-7)


def test_rloo_hand_values():
  # Group [1,0,0,1]: sum 2. A = r - (2 - r) / 3: r=1 -> 1 - 1/3 = 2/3; r=0 -> 0 - 2/3 = -2/3.
  # Group [1,1,1,2]: sum 5. r=1 -> 1 - 4/3 = -1/3; r=2 -> 2 - 3/3 = 1.
  adv_b = advantages.rloo_advantages([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0], 4)
  np.testing.assert_allclose(adv_b, [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1 / 3, -1 / 3, -1 / 3, 1.0], rtol=1e-6)


@pytest.mark.parametrize("fn", [
    functools.partial(advantages.group_advantages, scale="std"),
    functools.partial(advantages.group_advantages, scale="none"),
    advantages.rloo_advantages,
])
def test_group_size_one_is_an_error(fn):
  # A group of one sample has nothing to be compared with: an error, not silent zero advantages.
  with pytest.raises(ValueError, match="group_size must be an int >= 2"):
    fn([3.0, -1.0], 1)


EQUAL_GROUPS_G8 = [0.1] * 8 + [0.7] * 8 + [1.73] * 8 + [0.1, 0.3] * 4


@pytest.mark.parametrize("jit", [False, True])
def test_equal_non_binary_groups_get_exact_zeros(jit):
  # Groups [0.1]*8, [0.7]*8, [1.73]*8: every reward equal -> advantages exactly 0 in all three estimators.
  # Group 4 [0.1, 0.3]*4: mean 0.2, deviations +-0.1, population std 0.1:
  #   grpo    +-0.1 / (0.1 + 1e-6) = +-0.99999
  #   dr_grpo +-0.1
  #   rloo    G / (G - 1) * (r - mean) = 8/7 * +-0.1 = +-0.1142857
  signs = np.array([-1.0, 1.0] * 4)
  want = {"std": signs * 0.1 / (0.1 + 1e-6), "none": signs * 0.1, "rloo": signs * 0.8 / 7}
  for name, fn in [("std", functools.partial(advantages.group_advantages, scale="std")),
                   ("none", functools.partial(advantages.group_advantages, scale="none")),
                   ("rloo", advantages.rloo_advantages)]:
    fn = functools.partial(fn, group_size=8)
    adv_b = np.asarray((jax.jit(fn) if jit else fn)(np.array(EQUAL_GROUPS_G8, np.float32)))
    assert adv_b.dtype == np.float32
    np.testing.assert_array_equal(adv_b[:24], np.zeros(24), err_msg=name)
    np.testing.assert_allclose(adv_b[24:], want[name], rtol=1e-5, err_msg=name)
  # G = 4: [0.3]*4 and [0.1]*4 are equal groups -> exact zeros.
  for fn in (advantages.group_advantages, functools.partial(advantages.group_advantages, scale="none"),
             advantages.rloo_advantages):
    np.testing.assert_array_equal(fn([0.3] * 4 + [0.1] * 4, 4), np.zeros(8))


def test_naive_grpo_failure_value_is_gone():
  # The naive formula on [0.7]*8 in float32: XLA:CPU's mean lands 1 ulp (2^-24 = 5.96e-8 in [0.5, 1))
  # away from float32(0.7), so r - mean = 5.96e-8 for every sample, std = 5.96e-8 too, and
  #   (r - mean) / (std + 1e-6) = 5.96e-8 / 1.0596e-6 = 0.05625     (not 0: the failure being fixed).
  rewards = jnp.full((8,), 0.7, jnp.float32)
  naive = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
  ulp = 2.0**-24
  np.testing.assert_allclose(np.abs(np.asarray(naive)), ulp / (ulp + 1e-6), rtol=1e-4)
  np.testing.assert_array_equal(advantages.group_advantages(rewards, 8), np.zeros(8))


def test_jit_matches_eager_and_groups_are_independent():
  # Group 2 is group 1 shifted by +10 and scaled by 2: GRPO advantages are shift/scale invariant
  # (up to eps), so both halves must agree; a layout bug that mixed groups would break this.
  fn = jax.jit(functools.partial(advantages.group_advantages, group_size=3))
  adv_b = np.asarray(fn(np.array([0.0, 1.0, 5.0, 10.0, 12.0, 20.0], np.float32)))
  np.testing.assert_allclose(adv_b[:3], adv_b[3:], atol=1e-5)
  np.testing.assert_allclose(
      adv_b, advantages.group_advantages([0.0, 1.0, 5.0, 10.0, 12.0, 20.0], 3), atol=1e-6
  )


@pytest.mark.parametrize("group_size", [4, 0, -2, 2.0, True])
def test_bad_group_size_raises(group_size):
  # 6 samples do not split into groups of 4; 0, negatives, floats and bools are not group sizes.
  with pytest.raises(ValueError, match="group_size"):
    advantages.group_advantages([0.0] * 6, group_size)


def test_rloo_needs_two_samples_per_group():
  with pytest.raises(ValueError, match="group_size"):
    advantages.rloo_advantages([1.0, 2.0], 1)
  with pytest.raises(ValueError, match="group_size=4"):
    advantages.rloo_advantages([1.0] * 6, 4)


def test_bad_scale_and_rank_raise():
  with pytest.raises(ValueError, match="scale"):
    advantages.group_advantages(REWARDS, 4, scale="max")
  with pytest.raises(ValueError, match="rewards_b"):
    advantages.group_advantages(np.zeros((2, 4)), 4)


# ----------------------------------------------------------------------------------------------------
# Token level: outcome_token_rewards and GAE
# ----------------------------------------------------------------------------------------------------


def test_outcome_token_rewards_on_the_last_response_token():
  # Row 0: response at t=1,2 -> reward 0.5 at t=2.   Row 1: response fills the row -> -1 at t=3.
  # Row 2: empty response -> all zeros.               Row 3: response only at t=3 -> 2.5 at t=3.
  mask_bt = np.array([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]], np.float32)
  token_rewards_bt = advantages.outcome_token_rewards([0.5, -1.0, 3.0, 2.5], mask_bt)
  assert token_rewards_bt.dtype == jnp.float32
  np.testing.assert_array_equal(
      token_rewards_bt, [[0, 0, 0.5, 0], [0, 0, 0, -1.0], [0, 0, 0, 0], [0, 0, 0, 2.5]]
  )
  with pytest.raises(ValueError, match="rewards_b"):
    advantages.outcome_token_rewards([1.0, 2.0], mask_bt)


def test_gae_gamma_one_lam_one_is_return_minus_value():
  # Prompt t=0,1 (values there are ignored), response t=2,3,4 ending at the row's end; outcome reward 1
  # on t=4; V = [0.5, 0.25, 0.75] on the response.
  #   delta_4 = 1 + 0 - 0.75 = 0.25       (terminal: no bootstrap)
  #   delta_3 = 0 + 0.75 - 0.25 = 0.5
  #   delta_2 = 0 + 0.25 - 0.5 = -0.25
  #   A_4 = 0.25, A_3 = 0.5 + 0.25 = 0.75, A_2 = -0.25 + 0.75 = 0.5   (= return 1 - V)
  #   returns = A + V = 1 at every response token.
  mask_bt = np.array([[0, 0, 1, 1, 1]], np.float32)
  rewards_bt = advantages.outcome_token_rewards([1.0], mask_bt)
  values_bt = np.array([[3.0, -2.0, 0.5, 0.25, 0.75]], np.float32)
  adv_bt, ret_bt = advantages.gae(rewards_bt, values_bt, mask_bt, gamma=1.0, lam=1.0)
  assert adv_bt.dtype == ret_bt.dtype == jnp.float32
  np.testing.assert_array_equal(adv_bt, [[0, 0, 0.5, 0.75, 0.25]])
  np.testing.assert_array_equal(ret_bt, [[0, 0, 1.0, 1.0, 1.0]])


# One row: prompt t=0,1; response t=2,3,4 with rewards [0.5, -0.2, 1.0] and values [0.4, 0.6, 0.3].
GAE_REWARDS = [[0.0, 0.0, 0.5, -0.2, 1.0]]
GAE_VALUES = [[0.0, 0.0, 0.4, 0.6, 0.3]]
GAE_MASK = [[0.0, 0.0, 1.0, 1.0, 1.0]]


def test_gae_discounted_with_intermediate_rewards():
  # gamma = 0.9, lam = 0.5, gamma * lam = 0.45:
  #   delta_4 = 1.0 + 0           - 0.3 = 0.7
  #   delta_3 = -0.2 + 0.9 * 0.3 - 0.6 = -0.53
  #   delta_2 = 0.5 + 0.9 * 0.6  - 0.4 = 0.64
  #   A_4 = 0.7
  #   A_3 = -0.53 + 0.45 * 0.7    = -0.215
  #   A_2 = 0.64 + 0.45 * -0.215  = 0.54325
  #   returns = A + V = [0.94325, 0.385, 1.0]
  adv_bt, ret_bt = advantages.gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.5)
  np.testing.assert_allclose(adv_bt, [[0, 0, 0.54325, -0.215, 0.7]], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(ret_bt, [[0, 0, 0.94325, 0.385, 1.0]], rtol=1e-6, atol=1e-7)


def test_gae_lam_zero_is_one_step_td():
  # lam = 0: A_t = delta_t = [0.64, -0.53, 0.7] (deltas above); returns = r_t + gamma * V_{t+1} =
  # [0.5 + 0.54, -0.2 + 0.27, 1.0] = [1.04, 0.07, 1.0].
  adv_bt, ret_bt = advantages.gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.0)
  np.testing.assert_allclose(adv_bt, [[0, 0, 0.64, -0.53, 0.7]], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(ret_bt, [[0, 0, 1.04, 0.07, 1.0]], rtol=1e-6, atol=1e-7)


def test_gae_empty_row_is_zero_and_padding_does_not_leak():
  # Row 0: prompt t=0 (value NaN, reward 7), response t=1,2 (r = [0, 1], V = [0.5, 0.8]), padding t=3,4
  # holding V = [100, inf], r = [NaN, 5]. With gamma = 0.9, lam = 0.5:
  #   delta_2 = 1 - 0.8 = 0.2                 (t=3 is padding: no bootstrap from V = 100)
  #   delta_1 = 0 + 0.9 * 0.8 - 0.5 = 0.22
  #   A_2 = 0.2, A_1 = 0.22 + 0.45 * 0.2 = 0.31; returns = [0.81, 1.0]
  # Row 1: empty response, arbitrary rewards and values -> all zeros.
  nan, inf = float("nan"), float("inf")
  rewards_bt = np.array([[7.0, 0.0, 1.0, nan, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0]], np.float32)
  values_bt = np.array([[nan, 0.5, 0.8, 100.0, inf], [1.0, -1.0, 2.0, -2.0, 3.0]], np.float32)
  mask_bt = np.array([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]], np.float32)
  adv_bt, ret_bt = advantages.gae(rewards_bt, values_bt, mask_bt, gamma=0.9, lam=0.5)
  np.testing.assert_allclose(adv_bt, [[0, 0.31, 0.2, 0, 0], [0, 0, 0, 0, 0]], rtol=1e-6, atol=0)
  np.testing.assert_allclose(ret_bt, [[0, 0.81, 1.0, 0, 0], [0, 0, 0, 0, 0]], rtol=1e-6, atol=0)


def test_gae_jit_matches_eager():
  rng = np.random.default_rng(0)
  prompt_b, response_b, width = np.array([2, 0, 3, 1]), np.array([4, 5, 0, 2]), 6
  t = np.arange(width)[None, :]
  mask_bt = ((t >= prompt_b[:, None]) & (t < (prompt_b + response_b)[:, None])).astype(np.float32)
  rewards_bt = rng.normal(size=(4, width)).astype(np.float32)
  values_bt = rng.normal(size=(4, width)).astype(np.float32)
  fn = functools.partial(advantages.gae, gamma=0.99, lam=0.95)
  eager, jitted = fn(rewards_bt, values_bt, mask_bt), jax.jit(fn)(rewards_bt, values_bt, mask_bt)
  for e, j in zip(eager, jitted):
    np.testing.assert_allclose(j, e, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(e)[mask_bt == 0], 0.0)


@pytest.mark.parametrize("kwargs, name", [
    (dict(gamma=-0.1, lam=0.9), "gamma"),
    (dict(gamma=1.5, lam=0.9), "gamma"),
    (dict(gamma=float("nan"), lam=0.9), "gamma"),
    (dict(gamma=True, lam=0.9), "gamma"),
    (dict(gamma=0.9, lam=-1e-3), "lam"),
    (dict(gamma=0.9, lam=2.0), "lam"),
    (dict(gamma=0.9, lam=None), "lam"),
])
def test_gae_invalid_gamma_lam_raise(kwargs, name):
  with pytest.raises(ValueError, match=name):
    advantages.gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, **kwargs)


def test_gae_shape_mismatch_raises():
  with pytest.raises(ValueError, match="mask_bt"):
    advantages.gae(GAE_REWARDS, [[0.0, 0.0, 0.4, 0.6]], GAE_MASK, gamma=1.0, lam=1.0)
