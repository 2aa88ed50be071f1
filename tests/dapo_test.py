"""DAPO's soft overlong penalty and dynamic-sampling filters against hand-computed values."""

import functools

import jax
import numpy as np
import pytest

from rl_fusion_jax import algorithms
from rl_fusion_jax.algorithms import dapo


def test_overlong_penalty_at_the_boundaries():
  # max_len 20, buffer 4 -> soft interval (16, 20]:
  #   L = 0, 16       -> 0                        (at or below max_len - buffer)
  #   L = 17          -> (16 - 17) / 4 = -0.25
  #   L = 18          -> (16 - 18) / 4 = -0.5
  #   L = 20          -> (16 - 20) / 4 = -1       (continuous with the hard penalty)
  #   L = 21, 100     -> -1
  lengths = np.array([0, 16, 17, 18, 20, 21, 100], np.int32)
  penalty_b = dapo.overlong_penalty(lengths, max_len=20, buffer=4)
  assert penalty_b.dtype == np.float32
  np.testing.assert_array_equal(penalty_b, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
  # factor 0.5 halves every value: [0, 0, -0.125, -0.25, -0.5, -0.5, -0.5].
  np.testing.assert_array_equal(dapo.overlong_penalty(lengths, max_len=20, buffer=4, factor=0.5),
                                [0.0, 0.0, -0.125, -0.25, -0.5, -0.5, -0.5])


def test_overlong_penalty_buffer_equal_to_max_len_and_jit():
  # max_len = buffer = 4: the soft interval is (0, 4]: L=0 -> 0, L=1 -> -1/4, L=3 -> -3/4, L=4 -> -1,
  # L=5 -> -1.
  fn = functools.partial(dapo.overlong_penalty, max_len=4, buffer=4)
  lengths = np.array([0, 1, 3, 4, 5])
  np.testing.assert_array_equal(fn(lengths), [0.0, -0.25, -0.75, -1.0, -1.0])
  np.testing.assert_array_equal(jax.jit(fn)(lengths), fn(lengths))


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_len=0, buffer=1), "max_len"),
    (dict(max_len=20.0, buffer=4), "max_len"),
    (dict(max_len=True, buffer=1), "max_len"),
    (dict(max_len=20, buffer=0), "buffer"),
    (dict(max_len=20, buffer=21), "buffer"),
    (dict(max_len=20, buffer=4, factor=-0.5), "factor"),
    (dict(max_len=20, buffer=4, factor=float("nan")), "factor"),
])
def test_overlong_penalty_bad_params_raise(kwargs, name):
  with pytest.raises(ValueError, match=name):
    dapo.overlong_penalty(np.array([3]), **kwargs)


ULP_ABOVE_07 = float(np.nextafter(np.float32(0.7), np.float32(1.0)))
# G = 4. Group 0 all 0.1 (equal); group 1 [0.1, 0.1, 0.1, 0.3] (differs); group 2 all 1.1 (equal);
# group 3 [-0.5, 0.5, 0, 0] (differs); group 4 three 0.7 and one float32 ulp above (differs: exact
# comparison, no tolerance); group 5 all 0.7 (equal).
REWARDS = np.array(
    [0.1] * 4 + [0.1, 0.1, 0.1, 0.3] + [1.1] * 4 + [-0.5, 0.5, 0.0, 0.0] + [0.7] * 3 + [ULP_ABOVE_07] + [0.7] * 4,
    np.float32,
)
INFORMATIVE = [False, True, False, True, True, False]


def test_informative_groups_and_sample_mask():
  groups_n = dapo.informative_groups(REWARDS, 4)
  assert groups_n.dtype == np.bool_
  np.testing.assert_array_equal(groups_n, INFORMATIVE)
  mask_b = dapo.informative_sample_mask(REWARDS, 4)
  np.testing.assert_array_equal(mask_b, np.repeat(INFORMATIVE, 4))
  np.testing.assert_array_equal(jax.jit(functools.partial(dapo.informative_sample_mask, group_size=4))(REWARDS),
                                mask_b)


def test_select_informative_on_the_host():
  indices = dapo.select_informative(REWARDS, 4)
  assert isinstance(indices, np.ndarray)
  np.testing.assert_array_equal(indices, [1, 3, 4])
  # G = 2 over the same rewards: pairs (0.1, 0.1), (0.1, 0.1), (0.1, 0.1), (0.1, 0.3), (1.1, 1.1), (1.1, 1.1),
  # (-0.5, 0.5), (0, 0), (0.7, 0.7), (0.7, 0.7+ulp), (0.7, 0.7), (0.7, 0.7) -> groups 3, 6 and 9.
  np.testing.assert_array_equal(dapo.select_informative(REWARDS, 2), [3, 6, 9])
  assert dapo.select_informative([0.5] * 4, 2).size == 0


@pytest.mark.parametrize("fn", [dapo.informative_groups, dapo.informative_sample_mask, dapo.select_informative])
def test_bad_group_layout_raises(fn):
  with pytest.raises(ValueError, match="group_size"):
    fn([0.0, 1.0], 1)
  with pytest.raises(ValueError, match="group_size=4"):
    fn([0.0] * 6, 4)


def test_package_exports():
  assert algorithms.overlong_penalty is dapo.overlong_penalty
  assert algorithms.informative_groups is dapo.informative_groups
  assert algorithms.informative_sample_mask is dapo.informative_sample_mask
