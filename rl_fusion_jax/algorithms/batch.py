"""The advantage stage: rollout + rewards (+ reference log-probs, + critic values) -> the TrainBatch an
update consumes.

Pure array functions (jit-safe; names resolve through the registry before tracing): the sequence KL
against the reference policy, KL-in-reward shaping (``kl_mode='reward'``: r_b - kl_coef * sum_t KL_bt,
as in InstructGPT-style PPO), and the group advantages (``train_batch``) or GAE over a critic's values
(``train_batch_gae``). Nothing here calls a model or reads a config
object; ``orchestration/programs.py`` binds the config values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rl_fusion_jax.algorithms import advantages as advantages_lib
from rl_fusion_jax.algorithms import registry
from rl_fusion_jax.types import Rollout, TrainBatch


def sequence_kl(logp_bt: Float[Array, "b t"], ref_logp_bt: Float[Array, "b t"], mask_bt: Float[Array, "b t"],
                estimator: str) -> Float[Array, "b"]:
  """sum_t KL_bt over each sequence's response tokens, with the named per-token estimator."""
  return jnp.sum(registry.get_kl_estimator(estimator)(logp_bt, ref_logp_bt) * mask_bt, axis=1)


def train_batch(rollout: Rollout, rewards_b: Float[Array, "b"], ref_logp_bt: Float[Array, "b t"], *,
                advantage: str, group_size: int, kl_coef: float, kl_estimator: str, kl_mode: str,
                advantage_hparams=None, advantages_b: Float[Array, "b"] | None = None
                ) -> tuple[TrainBatch, dict[str, Array]]:
  """(TrainBatch, stats): advantages from the (KL-shaped, when kl_mode == 'reward') rewards, or
  ``advantages_b`` as given (computed before, e.g. by the host's advantage stage; not with KL in the
  reward, which needs this batch's reference log-probs)."""
  mask_bt, stats = rollout.response_mask(), {}
  kl_b = None
  if kl_coef > 0:
    kl_b = sequence_kl(rollout.logp_bt, ref_logp_bt, mask_bt, kl_estimator)
    stats["kl_seq"] = jnp.mean(kl_b)
  adv_b = _sample_advantages(rewards_b, kl_b, advantages_b, advantage=advantage, group_size=group_size,
                             kl_coef=kl_coef, kl_mode=kl_mode, advantage_hparams=advantage_hparams)
  stats["advantage_abs_mean"] = jnp.mean(jnp.abs(adv_b))
  batch = TrainBatch(tokens_bt=rollout.tokens_bt, mask_bt=mask_bt, advantages_bt=adv_b[:, None] * mask_bt,
                     behaviour_logp_bt=rollout.logp_bt, ref_logp_bt=ref_logp_bt, version_bt=rollout.version_bt)
  return batch, stats


def _sample_advantages(rewards_b, kl_b, advantages_b, *, advantage: str, group_size: int, kl_coef: float,
                       kl_mode: str, advantage_hparams):
  """The per-sample advantages: ``advantages_b`` when given, else the estimator on the rewards (minus
  ``kl_coef * kl_b`` with ``kl_mode == 'reward'``)."""
  if advantages_b is not None:
    if kl_b is not None and kl_mode == "reward":
      raise ValueError("advantages given beside kl_mode='reward': the KL-shaped reward needs the batch's "
                       "reference log-probs, so the advantages are computed here")
    return advantages_b.astype(jnp.float32)
  if kl_b is not None and kl_mode == "reward":
    rewards_b = rewards_b - kl_coef * kl_b
  return registry.get_advantage_fn(advantage)(rewards_b, group_size, **(advantage_hparams or {}))


def masked_whiten(x_bt: Float[Array, "b t"], mask_bt: Float[Array, "b t"], eps: float = 1e-8) -> Float[Array, "b t"]:
  """(x - mean) / (std + eps) over the masked entries (population std), 0 elsewhere."""
  n = jnp.maximum(jnp.sum(mask_bt), 1.0)
  mean = jnp.sum(x_bt * mask_bt) / n
  var = jnp.sum(jnp.square(x_bt - mean) * mask_bt) / n
  return jnp.where(mask_bt > 0, (x_bt - mean) / (jnp.sqrt(var) + eps), 0.0)


def train_batch_gae(rollout: Rollout, rewards_b: Float[Array, "b"], ref_logp_bt: Float[Array, "b t"],
                    values_bt: Float[Array, "b t"], *, advantage: str, kl_coef: float, kl_estimator: str,
                    kl_mode: str, advantage_hparams=None
                    ) -> tuple[TrainBatch, dict[str, Array], Float[Array, "b t"]]:
  """(TrainBatch, stats, returns_bt) for PPO with a critic: per-token advantages from a token-level
  estimator (GAE) over the critic's rollout-time ``values_bt``.

  ``advantage_hparams``: the estimator's (GAE: gamma, lam). Token rewards: the sequence reward on each
  response's last token; with ``kl_mode == 'reward'`` minus
  ``kl_coef * KL_t`` on every response token (InstructGPT-style PPO). The advantages are whitened over
  the batch's response tokens (masked mean 0, std 1); the returns (advantages + values, before
  whitening) are the critic's regression targets.
  """
  mask_bt, stats = rollout.response_mask(), {}
  token_rewards_bt = advantages_lib.outcome_token_rewards(rewards_b, mask_bt)
  if kl_coef > 0:
    kl_bt = registry.get_kl_estimator(kl_estimator)(rollout.logp_bt, ref_logp_bt) * mask_bt
    stats["kl_seq"] = jnp.mean(jnp.sum(kl_bt, axis=1))
    if kl_mode == "reward":
      token_rewards_bt = token_rewards_bt - kl_coef * kl_bt
  adv_bt, returns_bt = registry.get_token_advantage_fn(advantage)(token_rewards_bt, values_bt, mask_bt,
                                                                  **(advantage_hparams or {}))
  n = jnp.maximum(jnp.sum(mask_bt), 1.0)
  stats["advantage_abs_mean"] = jnp.sum(jnp.abs(adv_bt) * mask_bt) / n     # before whitening
  stats["return_mean"] = jnp.sum(returns_bt * mask_bt) / n
  stats["value_old_mean"] = jnp.sum(values_bt * mask_bt) / n
  batch = TrainBatch(tokens_bt=rollout.tokens_bt, mask_bt=mask_bt, advantages_bt=masked_whiten(adv_bt, mask_bt),
                     behaviour_logp_bt=rollout.logp_bt, ref_logp_bt=ref_logp_bt, version_bt=rollout.version_bt)
  return batch, stats, returns_bt


def _packed_kl(sample_rw, mask_rw, behaviour_logp_rw, ref_logp_rw, num_samples: int, kl_estimator: str):
  """(per-token KL on the response tokens [R, W], each sample's sequence KL [B]: a segment sum over
  ``sample_rw``, -1 on padding)."""
  kl_rw = registry.get_kl_estimator(kl_estimator)(behaviour_logp_rw, ref_logp_rw) * mask_rw
  kl_b = jax.ops.segment_sum(kl_rw.reshape(-1), jnp.where(sample_rw < 0, num_samples, sample_rw).reshape(-1),
                             num_segments=num_samples + 1)[:num_samples]
  return kl_rw, kl_b


def packed_train_batch(sample_rw: Int[Array, "r w"], mask_rw: Float[Array, "r w"],
                       behaviour_logp_rw: Float[Array, "r w"], ref_logp_rw: Float[Array, "r w"],
                       rewards_b: Float[Array, "b"], *, advantage: str, group_size: int, kl_coef: float,
                       kl_estimator: str, kl_mode: str, advantage_hparams=None,
                       advantages_b: Float[Array, "b"] | None = None
                       ) -> tuple[Float[Array, "r w"], dict[str, Array]]:
  """``train_batch``'s advantage stage on packed rows -> (advantages_rw, stats).

  ``sample_rw``: the index of the sample each position belongs to (-1: padding). The sequence KL of
  sample b sums its response tokens (a segment sum over sample_rw), the advantages come from the
  per-sample rewards as in ``train_batch`` (or are ``advantages_b`` as given) and are broadcast over each
  sample's response tokens.
  """
  num_samples = rewards_b.shape[0]
  stats, kl_b = {}, None
  if kl_coef > 0:
    _, kl_b = _packed_kl(sample_rw, mask_rw, behaviour_logp_rw, ref_logp_rw, num_samples, kl_estimator)
    stats["kl_seq"] = jnp.mean(kl_b)
  adv_b = _sample_advantages(rewards_b, kl_b, advantages_b, advantage=advantage, group_size=group_size,
                             kl_coef=kl_coef, kl_mode=kl_mode, advantage_hparams=advantage_hparams)
  stats["advantage_abs_mean"] = jnp.mean(jnp.abs(adv_b))
  return adv_b[jnp.maximum(sample_rw, 0)] * mask_rw, stats


def packed_train_batch_gae(sample_rw: Int[Array, "r w"], mask_rw: Float[Array, "r w"],
                           behaviour_logp_rw: Float[Array, "r w"], ref_logp_rw: Float[Array, "r w"],
                           rewards_b: Float[Array, "b"], values_rw: Float[Array, "r w"], *, advantage: str,
                           kl_coef: float, kl_estimator: str, kl_mode: str, advantage_hparams=None
                           ) -> tuple[Float[Array, "r w"], dict[str, Array], Float[Array, "r w"]]:
  """``train_batch_gae``'s advantage stage on packed rows -> (advantages_rw whitened, stats, returns_rw).

  Each sample's reward goes on its last response token (``rewards_b[sample_rw]`` where the next position
  is outside the mask). The token estimator runs on the rows as they are: a row holds several responses,
  each followed by the next sample's prompt or padding (mask 0), and an estimator that stops its
  recursion where the mask ends (GAE: ``m_{t+1}``) treats each as its own episode, as on padded rows.
  """
  num_samples = rewards_b.shape[0]
  stats = {}
  mask = mask_rw != 0
  last_rw = mask & ~jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)
  token_rewards_rw = jnp.where(last_rw, rewards_b.astype(jnp.float32)[jnp.maximum(sample_rw, 0)], 0.0)
  if kl_coef > 0:
    kl_rw, kl_b = _packed_kl(sample_rw, mask_rw, behaviour_logp_rw, ref_logp_rw, num_samples, kl_estimator)
    stats["kl_seq"] = jnp.mean(kl_b)
    if kl_mode == "reward":
      token_rewards_rw = token_rewards_rw - kl_coef * kl_rw
  adv_rw, returns_rw = registry.get_token_advantage_fn(advantage)(token_rewards_rw, values_rw, mask_rw,
                                                                  **(advantage_hparams or {}))
  n = jnp.maximum(jnp.sum(mask_rw), 1.0)
  stats["advantage_abs_mean"] = jnp.sum(jnp.abs(adv_rw) * mask_rw) / n
  stats["return_mean"] = jnp.sum(returns_rw * mask_rw) / n
  stats["value_old_mean"] = jnp.sum(values_rw * mask_rw) / n
  return masked_whiten(adv_rw, mask_rw), stats, returns_rw
