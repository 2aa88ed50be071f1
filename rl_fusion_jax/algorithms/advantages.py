"""Group-relative advantage estimators for outcome rewards (GRPO, Dr. GRPO, RLOO).

Every function here maps per-sample scalar rewards to per-sample advantages. The batch is laid out as
consecutive groups of `group_size` samples drawn for the same prompt:

    rewards_b = [r(p0,s0), ..., r(p0,s{G-1}), r(p1,s0), ..., r(p1,s{G-1}), ...]

so a group is a reshape to `(B // G, G)`: no gather and no Python branching on values, which keeps the
functions safe inside `jit` and `grad`. They never call a model and never read a config object;
`group_size` is a static Python int because it fixes a shape.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

ADVANTAGE_SCALES = ("std", "none")


def _as_groups(rewards_b: ArrayLike, group_size: int, *, min_group: int = 1) -> Array:
  """Checks the group layout and returns the rewards as a float [B // G, G] array."""
  rewards_b = jnp.asarray(rewards_b)
  rewards_b = rewards_b.astype(jnp.result_type(rewards_b.dtype, jnp.float32))
  if rewards_b.ndim != 1:
    raise ValueError(f"rewards_b must be 1-D (one reward per sample), got shape {rewards_b.shape}")
  if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < min_group:
    raise ValueError(f"group_size must be an int >= {min_group}, got {group_size!r}")
  if rewards_b.shape[0] % group_size != 0:
    raise ValueError(
        f"batch size {rewards_b.shape[0]} is not divisible by group_size={group_size}; "
        "the batch must hold whole groups of samples of the same prompt"
    )
  return rewards_b.reshape(-1, group_size)


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
  barely vary (prompts that are too easy or too hard). A group whose rewards are all equal gets zero
  advantages in both modes; `eps` keeps the "std" mode finite there.

  Args:
    rewards_b: [B] scalar reward per sample, B a multiple of `group_size`.
    group_size: G, the number of consecutive samples per prompt (static).
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
  return adv_ng.reshape(-1)


def rloo_advantages(rewards_b: Float[ArrayLike, "b"], group_size: int) -> Float[Array, "b"]:
  """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

  Each sample's baseline is the mean reward of the other G - 1 samples of its group:

      A_i = r_i - (sum_g(r) - r_i) / (G - 1)        (equivalently G / (G - 1) * (r_i - mean_g(r)))

  The baseline does not depend on r_i, so the policy-gradient estimate stays unbiased. Needs G >= 2.

  Args:
    rewards_b: [B] scalar reward per sample, B a multiple of `group_size`.
    group_size: G >= 2, the number of consecutive samples per prompt (static).

  Returns:
    [B] float advantages, one per sample.
  """
  rewards_ng = _as_groups(rewards_b, group_size, min_group=2)
  others_mean_ng = (rewards_ng.sum(axis=1, keepdims=True) - rewards_ng) / (group_size - 1)
  return (rewards_ng - others_mean_ng).reshape(-1)
