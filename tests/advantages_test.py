"""Group advantages (GRPO, Dr. GRPO) and RLOO against hand-computed values."""

import functools

import jax
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


def test_group_size_one_grpo_is_zero():
  # A group of one sample is its own mean: every advantage is 0.
  np.testing.assert_array_equal(advantages.group_advantages([3.0, -1.0], 1), [0.0, 0.0])


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
