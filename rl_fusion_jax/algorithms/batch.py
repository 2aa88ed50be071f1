"""The advantage stage: rollout + rewards (+ reference log-probs) -> the TrainBatch an update consumes.

Pure array functions (jit-safe; names resolve through the registry before tracing): the sequence KL
against the reference policy, KL-in-reward shaping (``kl_mode='reward'``: r_b - kl_coef * sum_t KL_bt,
as in InstructGPT-style PPO), and the group advantages. Nothing here calls a model or reads a config
object; ``orchestration/programs.py`` binds the config values.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from rl_fusion_jax.algorithms import registry
from rl_fusion_jax.types import Rollout, TrainBatch


def sequence_kl(logp_bt: Float[Array, "b t"], ref_logp_bt: Float[Array, "b t"], mask_bt: Float[Array, "b t"],
                estimator: str) -> Float[Array, "b"]:
  """sum_t KL_bt over each sequence's response tokens, with the named per-token estimator."""
  return jnp.sum(registry.get_kl_estimator(estimator)(logp_bt, ref_logp_bt) * mask_bt, axis=1)


def train_batch(rollout: Rollout, rewards_b: Float[Array, "b"], ref_logp_bt: Float[Array, "b t"], *,
                advantage: str, group_size: int, kl_coef: float, kl_estimator: str, kl_mode: str
                ) -> tuple[TrainBatch, dict[str, Array]]:
  """(TrainBatch, stats): advantages from the (KL-shaped, when kl_mode == 'reward') rewards."""
  mask_bt, stats = rollout.response_mask(), {}
  if kl_coef > 0:
    kl_b = sequence_kl(rollout.logp_bt, ref_logp_bt, mask_bt, kl_estimator)
    stats["kl_seq"] = jnp.mean(kl_b)
    if kl_mode == "reward":
      rewards_b = rewards_b - kl_coef * kl_b
  adv_b = registry.get_advantage_fn(advantage)(rewards_b, group_size)
  stats["advantage_abs_mean"] = jnp.mean(jnp.abs(adv_b))
  batch = TrainBatch(tokens_bt=rollout.tokens_bt, mask_bt=mask_bt, advantages_b=adv_b,
                     behaviour_logp_bt=rollout.logp_bt, ref_logp_bt=ref_logp_bt, version_bt=rollout.version_bt)
  return batch, stats
