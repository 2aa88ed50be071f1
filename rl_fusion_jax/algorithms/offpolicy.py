"""Policy losses for stale (off-policy) tokens: decoupled PPO, truncated importance sampling, and none.

Under StaleSync a token may have been sampled by an older policy version than the one being trained.
Three policies then meet in the loss:

    mu        behaviour policy, produced the token       behaviour_logp_bt (from the rollout)
    pi_prox   proximal policy, the anchor of the update   proximal_logp_bt, or stop_gradient(logp_bt)
    pi_theta  the policy being trained                    logp_bt (differentiated)

The behaviour importance weight w = pi_prox / mu (a constant of the objective) corrects the expectation
for sampling from mu; it is truncated at `is_cap` (a bias traded for bounded variance, Ionides 2008,
"Truncated Importance Sampling"). When `proximal_logp_bt` is None the proximal policy is the parameters
before this update, stop_gradient(logp_bt): exact when each batch gets one optimizer update, as in
`train.step.rl_step`. With mu == pi_prox every loss here reduces exactly to its on-policy counterpart.

Every function has the registry's call convention `fn(logp_bt, behaviour_logp_bt, adv, **hparams)`, takes
the same keywords as `losses.clipped_surrogate` and returns the `losses.POLICY_LOSS_STATS` keys. Pure
array functions: nothing here calls a model or reads a config object.

Shapes: b = sequences, t = response tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from rl_fusion_jax.algorithms.losses import (
    LOG_RATIO_CLAMP,
    _as_float,
    _broadcast_adv,
    _check_clip_params,
    _check_log_ratio_clamp,
    _check_pair,
    clamped_exp,
    ppo_clip_term,
)

# Default truncation of the behaviour importance weight (AReaL's usual behav_imp_weight_cap).
IS_CAP = 5.0

Stats = dict[str, Float[Array, "b t"]]


def _check_is_cap(is_cap: float) -> None:
  # A cap below 1 would truncate on-policy tokens (w = 1) too, so mu == pi_prox would no longer reduce to
  # the on-policy loss. float("inf") disables truncation.
  if is_cap is None or not is_cap >= 1.0:
    raise ValueError(f"is_cap must be >= 1 (float('inf') disables truncation), got {is_cap!r}")


def _prepare(logp_bt, behaviour_logp_bt, adv, proximal_logp_bt, log_ratio_clamp, is_cap):
  """Validates and returns (logp_bt, behaviour_bt, prox_bt, adv_bt), float; behaviour and prox constant."""
  _check_log_ratio_clamp(log_ratio_clamp)
  _check_is_cap(is_cap)
  logp_bt, behaviour_bt = _as_float(logp_bt), _as_float(behaviour_logp_bt)
  _check_pair(logp_bt, behaviour_bt, "behaviour_logp_bt")
  prox_bt = logp_bt if proximal_logp_bt is None else _as_float(proximal_logp_bt)
  _check_pair(logp_bt, prox_bt, "proximal_logp_bt")
  adv_bt = _broadcast_adv(adv, logp_bt.shape)
  return logp_bt, jax.lax.stop_gradient(behaviour_bt), jax.lax.stop_gradient(prox_bt), adv_bt


@dataclasses.dataclass(frozen=True)
class OffPolicyParams:
  """Hyperparameters of `decoupled_ppo_surrogate` and `uncorrected_surrogate`: the PPO clip around the
  proximal policy and the truncation of the behaviour weight."""
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float | None = None
  is_cap: float = IS_CAP

  def __post_init__(self):
    _check_clip_params(self.clip_low, self.clip_high, self.dual_clip)
    _check_is_cap(self.is_cap)


@dataclasses.dataclass(frozen=True)
class TISParams:
  """Hyperparameters of `tis_token_loss` and `tis_seq_loss`: the truncation of the behaviour weight."""
  is_cap: float = IS_CAP

  def __post_init__(self):
    _check_is_cap(self.is_cap)


def _truncate(w: Float[Array, "*s"], is_cap: float) -> tuple[Float[Array, "*s"], Float[Array, "*s"]]:
  """min(w, is_cap) and a float flag, 1.0 where the truncation was active."""
  return jnp.minimum(w, is_cap), (w > is_cap).astype(w.dtype)


def _check_no_dual_clip(dual_clip: float | None, name: str) -> None:
  # clip_low / clip_high are ignored by the TIS losses (the train step passes them to every loss), but
  # a dual clip that silently did nothing would hide a config mistake.
  if dual_clip is not None:
    raise ValueError(f"dual_clip does not apply to {name} (no PPO ratio to cap); set it to None")


def _score(logp_bt: Float[Array, "b t"]) -> Float[Array, "b t"]:
  """exp(logp - stop_gradient(logp)): 1 in value, grad logp in gradient (the score-function trick)."""
  return jnp.exp(logp_bt - jax.lax.stop_gradient(logp_bt))


def _proximal_ppo(logp_bt, behaviour_logp_bt, adv, *, clip_low, clip_high, dual_clip, is_cap, proximal_logp_bt,
                  log_ratio_clamp) -> tuple[Float[Array, "b t"], Float[Array, "b t"], Stats]:
  """PPO's clipped term around the proximal policy and the truncated behaviour weight, apart:
  (ppo_bt, min(w, is_cap), stats), shared by `decoupled_ppo_surrogate` and `uncorrected_surrogate`."""
  _check_clip_params(clip_low, clip_high, dual_clip)
  logp_bt, behaviour_bt, prox_bt, adv_bt = _prepare(
      logp_bt, behaviour_logp_bt, adv, proximal_logp_bt, log_ratio_clamp, is_cap
  )
  ratio_bt, ratio_clamped_bt = clamped_exp(logp_bt - prox_bt, log_ratio_clamp)
  ppo_bt, clipped_bt, dual_clipped_bt = ppo_clip_term(
      ratio_bt, adv_bt, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
  )
  w_bt, w_clamped_bt = clamped_exp(prox_bt - behaviour_bt, log_ratio_clamp)
  w_trunc_bt, truncated_bt = _truncate(w_bt, is_cap)
  stats = {
      "ratio": ratio_bt,
      "clipped": clipped_bt,
      "dual_clipped": dual_clipped_bt,
      "is_weight": w_bt,
      "is_truncated": truncated_bt,
      "log_ratio_clamped": jnp.maximum(ratio_clamped_bt, w_clamped_bt),
  }
  return ppo_bt, w_trunc_bt, stats


def decoupled_ppo_surrogate(
    logp_bt: Float[ArrayLike, "b t"],
    behaviour_logp_bt: Float[ArrayLike, "b t"],
    adv: Float[ArrayLike, "b"] | Float[ArrayLike, "b t"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_cap: float = IS_CAP,
    proximal_logp_bt: Float[ArrayLike, "b t"] | None = None,
    mask_bt: ArrayLike | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> tuple[Float[Array, "b t"], Stats]:
  """Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"), as in AReaL
  (Fu et al. 2025): clip against the proximal policy, reweight by the truncated behaviour weight.

      r = exp(clamp(logp - prox))              trust region around pi_prox, not around mu
      w = exp(clamp(prox - behaviour))         behaviour importance weight (constant)
      loss = -min(w, is_cap) * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

  with the dual clip (see `losses.clipped_surrogate`) applied to the PPO term before the weight, and
  clamp(x) = clip(x, -log_ratio_clamp, log_ratio_clamp). d loss / d logp = -min(w, is_cap) * A * r where
  no clip is active, else 0. With behaviour == prox, w = 1 and this is exactly `clipped_surrogate`.
  With the default prox = stop_gradient(logp), r = 1 in value, no clip is ever active, and the gradient
  equals `tis_token_loss`'s: the clip only matters when a proximal log-prob from before several updates
  is passed. AReaL drops tokens with w > cap (weight 0); here they are truncated to the cap.

  Args:
    logp_bt, behaviour_logp_bt, adv: as `losses.clipped_surrogate` (behaviour = its old_logp_bt).
    clip_low, clip_high, dual_clip: the PPO clip of r, as `losses.clipped_surrogate`.
    is_cap: truncation of w, >= 1 (float("inf") disables it).
    proximal_logp_bt: [B, T] log-probs under pi_prox (constant); None -> stop_gradient(logp_bt).
    mask_bt: unused (aggregation applies the mask); accepted for the common call convention.
    log_ratio_clamp: bound on |log r| and |log w| before exp.

  Returns:
    loss_bt and the `losses.POLICY_LOSS_STATS` keys: "ratio" r; "clipped", "dual_clipped" of the PPO
    term; "is_weight" w (untruncated); "is_truncated" (w > is_cap); "log_ratio_clamped" (either clamp).
  """
  del mask_bt  # Unused: see the docstring.
  ppo_bt, w_trunc_bt, stats = _proximal_ppo(
      logp_bt, behaviour_logp_bt, adv, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
      is_cap=is_cap, proximal_logp_bt=proximal_logp_bt, log_ratio_clamp=log_ratio_clamp)
  return w_trunc_bt * ppo_bt, stats


def uncorrected_surrogate(
    logp_bt: Float[ArrayLike, "b t"],
    behaviour_logp_bt: Float[ArrayLike, "b t"],
    adv: Float[ArrayLike, "b"] | Float[ArrayLike, "b t"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_cap: float = IS_CAP,
    proximal_logp_bt: Float[ArrayLike, "b t"] | None = None,
    mask_bt: ArrayLike | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> tuple[Float[Array, "b t"], Stats]:
  """No off-policy correction: PPO's clipped surrogate around the proximal policy, with the behaviour
  weight fixed at 1, so tokens of older policies are trained on as if the current policy had sampled
  them (the uncorrected arm of the staleness ablation; ``experiments/staleness_main.py``).

      r = exp(clamp(logp - prox))
      loss = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

  With the default prox = stop_gradient(logp) (one optimizer update per batch): r = 1 in value, no
  clip is active and the gradient is -A * grad log pi, REINFORCE with the advantage, whatever policy
  sampled the token. The behaviour log-probs only feed the reported "is_weight" (what the correction
  would have weighted the token by), never the loss.

  Args: as `decoupled_ppo_surrogate`; is_cap is checked but only labels "is_truncated".
  Returns: loss_bt and the `losses.POLICY_LOSS_STATS` keys, "is_weight" w = exp(clamp(prox - behaviour)).
  """
  del mask_bt  # Unused: aggregation applies the mask.
  ppo_bt, _, stats = _proximal_ppo(
      logp_bt, behaviour_logp_bt, adv, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
      is_cap=is_cap, proximal_logp_bt=proximal_logp_bt, log_ratio_clamp=log_ratio_clamp)
  return ppo_bt, stats


def _tis_stats(ratio_bt, ratio_clamped_bt, w_bt, truncated_bt, w_clamped_bt) -> Stats:
  zeros_bt = jnp.zeros_like(ratio_bt)
  return {
      "ratio": ratio_bt,
      "clipped": zeros_bt,
      "dual_clipped": zeros_bt,
      "is_weight": w_bt,
      "is_truncated": truncated_bt,
      "log_ratio_clamped": jnp.maximum(ratio_clamped_bt, w_clamped_bt),
  }


def tis_token_loss(
    logp_bt: Float[ArrayLike, "b t"],
    behaviour_logp_bt: Float[ArrayLike, "b t"],
    adv: Float[ArrayLike, "b"] | Float[ArrayLike, "b t"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_cap: float = IS_CAP,
    proximal_logp_bt: Float[ArrayLike, "b t"] | None = None,
    mask_bt: ArrayLike | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> tuple[Float[Array, "b t"], Stats]:
  """Token-level truncated importance sampling: the vanilla policy gradient with a per-token weight
  min(w_t, C) (IMPALA's truncated rho, Espeholt et al. 2018; the TIS fix of Yao et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training").

      w = exp(clamp(prox - behaviour))             constant; prox = stop_gradient(logp) by default
      loss = -min(w, is_cap) * A * exp(logp - stop_gradient(logp))

  In value loss = -min(w, is_cap) * A; its gradient is d loss / d logp = -min(w, is_cap) * A, i.e.
  -min(w, C) * A * grad log pi. With behaviour == prox (w = 1) it is exactly REINFORCE, -A * grad log pi.

  Args:
    logp_bt, behaviour_logp_bt, adv: as `decoupled_ppo_surrogate`.
    clip_low, clip_high: ignored (no PPO clip); accepted for the common call convention.
    dual_clip: must be None.
    is_cap, proximal_logp_bt, log_ratio_clamp: as `decoupled_ppo_surrogate`.
    mask_bt: unused (aggregation applies the mask).

  Returns:
    loss_bt and the `losses.POLICY_LOSS_STATS` keys: "ratio" exp(clamp(logp - prox)) (1 by default);
    "clipped" and "dual_clipped" 0; "is_weight" w; "is_truncated"; "log_ratio_clamped".
  """
  del clip_low, clip_high, mask_bt  # Unused: see the docstring.
  _check_no_dual_clip(dual_clip, "tis_token")
  logp_bt, behaviour_bt, prox_bt, adv_bt = _prepare(
      logp_bt, behaviour_logp_bt, adv, proximal_logp_bt, log_ratio_clamp, is_cap
  )
  w_bt, w_clamped_bt = clamped_exp(prox_bt - behaviour_bt, log_ratio_clamp)
  w_trunc_bt, truncated_bt = _truncate(w_bt, is_cap)
  ratio_bt, ratio_clamped_bt = clamped_exp(jax.lax.stop_gradient(logp_bt) - prox_bt, log_ratio_clamp)
  loss_bt = -w_trunc_bt * adv_bt * _score(logp_bt)
  return loss_bt, _tis_stats(ratio_bt, ratio_clamped_bt, w_bt, truncated_bt, w_clamped_bt)


def tis_seq_loss(
    logp_bt: Float[ArrayLike, "b t"],
    behaviour_logp_bt: Float[ArrayLike, "b t"],
    adv: Float[ArrayLike, "b"] | Float[ArrayLike, "b t"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_cap: float = IS_CAP,
    proximal_logp_bt: Float[ArrayLike, "b t"] | None = None,
    mask_bt: ArrayLike | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> tuple[Float[Array, "b t"], Stats]:
  """Sequence-level truncated importance sampling: one weight per sequence, the likelihood ratio of the
  whole response (unbiased for the sequence-level objective before truncation; token-level TIS is its
  lower-variance, biased approximation; compared by Liu, Yao et al. 2025, "When Speed Kills Stability").

      w_b = exp(clamp(sum_t m_bt * (prox_bt - behaviour_bt)))      over response tokens only
      loss_bt = -min(w_b, is_cap) * A_bt * exp(logp_bt - stop_gradient(logp_bt))

  The sum runs over the masked tokens with `where`, so padding (even inf/NaN log-probs) cannot reach
  w_b; an empty row gets w_b = 1. Gradient: d loss_bt / d logp_bt = -min(w_b, is_cap) * A_bt. With
  behaviour == prox on the response this is exactly REINFORCE. The log-ratio clamp bounds the summed
  log-weight, so long responses with a small per-token drift do not overflow.

  Args:
    mask_bt: [B, T] response mask (1 on response tokens), required.
    Otherwise as `tis_token_loss` (dual_clip must be None; clip_low, clip_high ignored).

  Returns:
    loss_bt and the `losses.POLICY_LOSS_STATS` keys, the sequence-level ones ("is_weight" w_b,
    "is_truncated", and the clamp of the summed log-weight in "log_ratio_clamped") broadcast over t.
  """
  del clip_low, clip_high  # Unused: see the docstring.
  _check_no_dual_clip(dual_clip, "tis_seq")
  if mask_bt is None:
    raise ValueError("tis_seq needs mask_bt (the [B, T] response mask) to sum log-weights per sequence")
  logp_bt, behaviour_bt, prox_bt, adv_bt = _prepare(
      logp_bt, behaviour_logp_bt, adv, proximal_logp_bt, log_ratio_clamp, is_cap
  )
  mask_bt = jnp.asarray(mask_bt)
  _check_pair(logp_bt, mask_bt, "mask_bt")
  log_w_b = jnp.sum(jnp.where(mask_bt != 0, prox_bt - behaviour_bt, 0.0), axis=1)
  w_b, w_clamped_b = clamped_exp(log_w_b, log_ratio_clamp)
  w_trunc_b, truncated_b = _truncate(w_b, is_cap)
  ratio_bt, ratio_clamped_bt = clamped_exp(jax.lax.stop_gradient(logp_bt) - prox_bt, log_ratio_clamp)
  loss_bt = -w_trunc_b[:, None] * adv_bt * _score(logp_bt)
  per_token = lambda x_b: jnp.broadcast_to(x_b[:, None], logp_bt.shape)
  return loss_bt, _tis_stats(
      ratio_bt, ratio_clamped_bt, per_token(w_b), per_token(truncated_b), per_token(w_clamped_b)
  )
