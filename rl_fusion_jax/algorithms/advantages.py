"""Advantage estimators: group-relative ones for outcome rewards (GRPO, Dr. GRPO, RLOO) and GAE.

The group-relative functions map per-sample scalar rewards to per-sample advantages. The batch is laid
out as consecutive groups of `group_size` samples drawn for the same prompt:

    rewards_b = [r(p0,s0), ..., r(p0,s{G-1}), r(p1,s0), ..., r(p1,s{G-1}), ...]

so a group is a reshape to `(B // G, G)`: no gather and no Python branching on values, which keeps the
functions safe inside `jit` and `grad`. They never call a model and never read a config object;
`group_size` is a static Python int because it fixes a shape, and must be >= 2: a group of one sample
has no other sample to compare with. A group whose rewards are all equal carries no signal and gets
advantages of exactly 0 (not a rounding residue amplified by the std division).

`gae` is the token-level estimator for a learned critic (PPO): it maps per-token rewards and values over
rows laid out as `types.Rollout` (prompt then response, `mask_bt` 1.0 on the response) to per-token
advantages and returns; `outcome_token_rewards` turns a sequence reward into such per-token rewards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

ADVANTAGE_SCALES = ("std", "none")


def check_group_layout(shape: tuple[int, ...], group_size: int) -> int:
  """Validates a [B] rewards shape split into groups of `group_size` >= 2; returns B // G.

  Host-side (no array is touched), so `dapo.select_informative` shares it with the jitted estimators.
  """
  if len(shape) != 1:
    raise ValueError(f"rewards_b must be 1-D (one reward per sample), got shape {tuple(shape)}")
  if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
    raise ValueError(f"group_size must be an int >= 2 (a group needs samples to compare), got {group_size!r}")
  if shape[0] % group_size != 0:
    raise ValueError(
        f"batch size {shape[0]} is not divisible by group_size={group_size}; "
        "the batch must hold whole groups of samples of the same prompt"
    )
  return shape[0] // group_size


def _as_groups(rewards_b: ArrayLike, group_size: int) -> Array:
  """Checks the group layout and returns the rewards as a float [B // G, G] array."""
  rewards_b = jnp.asarray(rewards_b)
  rewards_b = rewards_b.astype(jnp.result_type(rewards_b.dtype, jnp.float32))
  check_group_layout(rewards_b.shape, group_size)
  return rewards_b.reshape(-1, group_size)


def _zero_equal_groups(adv_ng: Array, rewards_ng: Array) -> Array:
  """adv_ng, with exact zeros in groups whose rewards are all equal (max == min).

  There r - mean(r) should be 0 but is a rounding residue (float32 sums of [0.7] * 8 leave ~6e-8), and
  GRPO's division by std + eps (std ~ the same residue) would blow it up to ~0.06 (0.19 for [1.73] * 8).
  """
  equal_n1 = rewards_ng.max(axis=1, keepdims=True) == rewards_ng.min(axis=1, keepdims=True)
  return jnp.where(equal_n1, 0.0, adv_ng)


def group_advantages(
    rewards_b: Float[ArrayLike, "b"], group_size: int, *, scale: str = "std", eps: float = 1e-6
) -> Float[Array, "b"]:
  """Group-normalised advantages: GRPO (scale="std") and Dr. GRPO (scale="none").

  For sample i of a group g with rewards r_1..r_G:

      GRPO     (Shao et al. 2024, DeepSeekMath, sec. 4.1.2):   A_i = (r_i - mean_g(r)) / (std_g(r) + eps)
      Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
                Training"):                                     A_i =  r_i - mean_g(r)

  std is the population standard deviation (ddof=0, divide by G), as `np.std` and
  `torch.std(unbiased=False)`. Dr. GRPO drops the division because it up-weights groups whose rewards
  barely vary (prompts that are too easy or too hard). A group whose rewards are all equal (max == min)
  gets advantages of exactly 0 in both modes, whatever the float rounding of its mean; `eps` keeps the
  "std" mode finite for groups that differ by very little.

  Args:
    rewards_b: [B] scalar reward per sample, B a multiple of `group_size`.
    group_size: G >= 2, the number of consecutive samples per prompt (static).
    scale: "std" (GRPO) or "none" (Dr. GRPO).
    eps: added to the group std before dividing ("std" only).

  Returns:
    [B] float advantages, one per sample.
  """
  if scale not in ADVANTAGE_SCALES:
    raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
  rewards_ng = _as_groups(rewards_b, group_size)
  adv_ng = rewards_ng - rewards_ng.mean(axis=1, keepdims=True)
  if scale == "std":
    adv_ng = adv_ng / (rewards_ng.std(axis=1, keepdims=True) + eps)
  return _zero_equal_groups(adv_ng, rewards_ng).reshape(-1)


def rloo_advantages(rewards_b: Float[ArrayLike, "b"], group_size: int) -> Float[Array, "b"]:
  """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

  Each sample's baseline is the mean reward of the other G - 1 samples of its group:

      A_i = r_i - (sum_g(r) - r_i) / (G - 1)        (equivalently G / (G - 1) * (r_i - mean_g(r)))

  The baseline does not depend on r_i, so the policy-gradient estimate stays unbiased. Needs G >= 2. A
  group whose rewards are all equal gets advantages of exactly 0.

  Args:
    rewards_b: [B] scalar reward per sample, B a multiple of `group_size`.
    group_size: G >= 2, the number of consecutive samples per prompt (static).

  Returns:
    [B] float advantages, one per sample.
  """
  rewards_ng = _as_groups(rewards_b, group_size)
  others_mean_ng = (rewards_ng.sum(axis=1, keepdims=True) - rewards_ng) / (group_size - 1)
  return _zero_equal_groups(rewards_ng - others_mean_ng, rewards_ng).reshape(-1)


# ----------------------------------------------------------------------------------------------------
# Token-level: GAE for a learned critic
# ----------------------------------------------------------------------------------------------------


def _check_unit_interval(name: str, value: float) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
    raise ValueError(f"{name} must be a Python float in [0, 1], got {value!r}")


def _shift_left(x_bt: Array, fill) -> Array:
  """x_bt[:, t + 1] at position t, `fill` in the last column: what the state after token t holds."""
  return jnp.concatenate([x_bt[:, 1:], jnp.full_like(x_bt[:, :1], fill)], axis=1)


def _response_rows(*arrays_bt: ArrayLike, mask_bt: ArrayLike) -> tuple[list[Array], Array]:
  """Casts [B, T] arrays to float32 and the mask to bool, checking that every shape matches the mask's."""
  mask_bt = jnp.asarray(mask_bt) != 0
  if mask_bt.ndim != 2:
    raise ValueError(f"mask_bt must be [B, T], got shape {mask_bt.shape}")
  out = [jnp.asarray(x).astype(jnp.float32) for x in arrays_bt]
  for x in out:
    if x.shape != mask_bt.shape:
      raise ValueError(f"every [B, T] input must match mask_bt's shape {mask_bt.shape}, got {x.shape}")
  return out, mask_bt


def outcome_token_rewards(rewards_b: Float[ArrayLike, "b"], mask_bt: Float[ArrayLike, "b t"]) -> Float[Array, "b t"]:
  """Places each sequence's scalar reward on its last response token: the usual outcome-reward PPO setup.

      token_rewards[b, t] = rewards_b[b]   where t is the last t with mask_bt[b, t] = 1
                          = 0              elsewhere (so all zero for an empty response)

  `mask_bt` is one contiguous run of response tokens per row (`types.Rollout.response_mask`); the last
  token is the one whose successor is outside the mask (or past the end of the row).

  Returns:
    [B, T] float32 per-token rewards for `gae`.
  """
  rewards_b, mask_bt = jnp.asarray(rewards_b).astype(jnp.float32), jnp.asarray(mask_bt) != 0
  if mask_bt.ndim != 2 or rewards_b.shape != mask_bt.shape[:1]:
    raise ValueError(f"rewards_b must be [B] for mask_bt [B, T], got {rewards_b.shape} and {mask_bt.shape}")
  last_bt = mask_bt & ~_shift_left(mask_bt, False)
  return jnp.where(last_bt, rewards_b[:, None], 0.0)


@dataclasses.dataclass(frozen=True)
class GAEParams:
  """Hyperparameters of `gae`: the discount and the trace decay, each in [0, 1]."""
  gamma: float = 1.0
  lam: float = 1.0

  def __post_init__(self):
    for name in ("gamma", "lam"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def gae(
    token_rewards_bt: Float[ArrayLike, "b t"],
    values_bt: Float[ArrayLike, "b t"],
    mask_bt: Float[ArrayLike, "b t"],
    *,
    gamma: float,
    lam: float,
) -> tuple[Float[Array, "b t"], Float[Array, "b t"]]:
  """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
  Generalized Advantage Estimation", eq. 16) over the response tokens of each row.

  values_bt[b, t] is the critic's value of the state before token t (aligned like logp_bt) and m the 0/1
  response mask. For a response position t, with V_{T} = m_{T} = A_{T} = 0 past the end of the row:

      delta_t = r_t + gamma * m_{t+1} * V_{t+1} - V_t
      A_t     = delta_t + gamma * lam * m_{t+1} * A_{t+1}
      R_t     = A_t + V_t                           (the critic's regression target)

  The state after the last response token is terminal: neither its value nor anything after it is
  bootstrapped. lam = 1 gives A_t = sum_{k>=t} gamma^{k-t} r_k - V_t (Monte Carlo), lam = 0 the one-step
  TD error delta_t. Both outputs are exactly 0 outside the mask, and prompt or padding positions are
  read through `where`, so whatever they hold (even inf/NaN) cannot leak into a response token.

  Args:
    token_rewards_bt: [B, T] per-token rewards (see `outcome_token_rewards`); read on the response only.
    values_bt: [B, T] critic values; read on the response only.
    mask_bt: [B, T] 1 on response tokens (one contiguous run per row, possibly empty), 0 elsewhere.
    gamma: discount in [0, 1] (static).
    lam: GAE lambda in [0, 1] (static).

  Returns:
    (advantages_bt, returns_bt), float32 [B, T].
  """
  _check_unit_interval("gamma", gamma)
  _check_unit_interval("lam", lam)
  (rewards_bt, values_bt), mask_bt = _response_rows(token_rewards_bt, values_bt, mask_bt=mask_bt)
  values_bt = jnp.where(mask_bt, values_bt, 0.0)
  next_mask_bt = _shift_left(mask_bt, False)
  next_values_bt = _shift_left(values_bt, 0.0)  # Already 0 where t + 1 is not a response token.
  delta_bt = jnp.where(mask_bt, rewards_bt, 0.0) + gamma * next_values_bt - values_bt
  decay_bt = jnp.where(next_mask_bt, gamma * lam, 0.0)

  def step(next_adv_b, xs):
    delta_b, decay_b, mask_b = xs
    adv_b = jnp.where(mask_b, delta_b + decay_b * next_adv_b, 0.0)
    return adv_b, adv_b

  _, adv_tb = jax.lax.scan(step, jnp.zeros_like(delta_bt[:, 0]), (delta_bt.T, decay_bt.T, mask_bt.T),
                           reverse=True)
  adv_bt = adv_tb.T
  return adv_bt, jnp.where(mask_bt, adv_bt + values_bt, 0.0)
