"""DAPO's reward shaping and dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale").

Two pieces of DAPO that act on rewards rather than on the loss (clip-higher and token-mean aggregation
live in `losses`):

  * soft overlong punishment (sec. 3.4, eq. 13): a length penalty added to the reward of responses that
    run into the last `buffer` tokens of the generation budget, so truncation stops being reward noise;
  * dynamic sampling (sec. 3.2): a group whose rewards are all equal has zero group-relative advantages
    and contributes no gradient, so the loop keeps sampling until the batch holds enough groups that do
    not. `informative_groups` / `informative_sample_mask` are the jit-safe flags; `select_informative`
    is the host-side (numpy) form the loop uses to pick groups.

Pure functions; nothing here calls a model or reads a config object. Hyper-parameters are static Python
values validated before tracing. Groups are laid out as in `advantages` (consecutive `group_size`
samples per prompt, group_size >= 2).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from rl_fusion_jax.algorithms.advantages import check_group_layout


def _check_overlong_params(max_len: int, buffer: int, factor: float) -> None:
  for name, value, low in (("max_len", max_len, 1), ("buffer", buffer, 1)):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
  if buffer > max_len:
    raise ValueError(f"buffer must be <= max_len={max_len}, got {buffer!r}")
  if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor >= 0):
    raise ValueError(f"factor must be a finite float >= 0, got {factor!r}")


def overlong_penalty(
    response_len_b: Int[ArrayLike, "b"], *, max_len: int, buffer: int, factor: float = 1.0
) -> Float[Array, "b"]:
  """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `factor`; add it to the reward.

  With L the response length, L_max = max_len and L_cache = buffer:

      penalty = 0                                            L <= L_max - L_cache
              = factor * ((L_max - L_cache) - L) / L_cache   L_max - L_cache < L <= L_max
              = -factor                                      L > L_max

  The middle piece falls linearly from 0 to -factor, so the penalty is continuous at both ends.

  Args:
    response_len_b: [B] response lengths in tokens.
    max_len: L_max >= 1, the generation budget (static).
    buffer: L_cache, 0 < buffer <= max_len, the length of the soft-penalty interval (static).
    factor: the penalty's magnitude, >= 0 (static).

  Returns:
    [B] float32 penalties, each in [-factor, 0].
  """
  _check_overlong_params(max_len, buffer, factor)
  len_b = jnp.asarray(response_len_b).astype(jnp.float32)
  soft_start = max_len - buffer
  soft_b = factor * (soft_start - len_b) / buffer
  return jnp.where(len_b <= soft_start, 0.0, jnp.where(len_b <= max_len, soft_b, -float(factor)))


def informative_groups(rewards_b: Float[ArrayLike, "b"], group_size: int) -> Bool[Array, "n"]:
  """[B // G] bool: True for groups whose rewards are not all equal (max != min, compared exactly).

  These are the groups DAPO's dynamic sampling keeps: an all-equal group (all correct, all wrong, or any
  repeated value) has zero advantages under GRPO, Dr. GRPO and RLOO.
  """
  rewards_b = jnp.asarray(rewards_b)
  check_group_layout(rewards_b.shape, group_size)
  rewards_ng = rewards_b.reshape(-1, group_size)
  return rewards_ng.max(axis=1) != rewards_ng.min(axis=1)


def informative_sample_mask(rewards_b: Float[ArrayLike, "b"], group_size: int) -> Bool[Array, "b"]:
  """[B] bool: each sample's `informative_groups` flag (the group flag repeated G times)."""
  groups_n = informative_groups(rewards_b, group_size)
  return jnp.repeat(groups_n, group_size, total_repeat_length=groups_n.shape[0] * group_size)


def select_informative(rewards_b: ArrayLike, group_size: int) -> np.ndarray:
  """Host-side (numpy) indices of the informative groups, ascending: what dynamic sampling keeps.

  Same rule as `informative_groups`; group n covers samples [n * G, (n + 1) * G) of rewards_b.
  """
  rewards_b = np.asarray(rewards_b)
  check_group_layout(rewards_b.shape, group_size)
  rewards_ng = rewards_b.reshape(-1, group_size)
  return np.flatnonzero(rewards_ng.max(axis=1) != rewards_ng.min(axis=1))
