"""Per-token policy and value losses, KL estimators, entropy and loss aggregation (pure array functions).

Everything here takes log-probabilities, logits, advantages and masks and returns arrays; nothing calls
a model or reads a config object. All functions are safe inside `jit` and `grad`: hyper-parameters
(clip ranges, estimator kind, aggregation mode) are static Python values validated before tracing, and
array values never drive Python control flow.

Every policy loss returns `(loss_bt, stats)` with the same stats keys, `POLICY_LOSS_STATS`, each a float
[B, T] array (0/1 flags where the name says "clipped"/"truncated"), so metrics and the train step never
branch on the loss name. A key that does not apply to a loss is filled with its neutral value: "is_weight"
1 and "is_truncated" 0 for a loss without importance weights, "clipped" and "dual_clipped" 0 for a loss
without a PPO clip. Off-policy corrections (decoupled PPO, truncated IS) live in `offpolicy.py`.

Aggregation is expressed as per-token weights (`token_weights`) so that `loss = sum(loss_bt * w_bt)`.
The weights are computed once on the full batch and then split with the batch into micro-batches;
summing the micro-batch losses then reproduces the full-batch loss exactly, whatever the mode.

`value_loss` is the critic's regression loss for PPO with a learned value (targets from `advantages.gae`).

Shapes: b = sequences, t = response tokens, v = vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

KL_KINDS = ("k1", "k2", "k3")
AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp: float32 exp overflows above
# ~88.7, and an inf ratio turns the gradient into NaN even where the loss selects a finite branch
# (0 * inf in the backward pass). e^20 ~ 4.9e8 is far beyond any clip or truncation cap.
LOG_RATIO_CLAMP = 20.0
# The stats contract: every registered policy loss returns exactly these keys, each a float [B, T] array.
POLICY_LOSS_STATS = ("ratio", "clipped", "dual_clipped", "is_weight", "is_truncated", "log_ratio_clamped")


def _as_float(x: ArrayLike) -> Array:
  """Casts to at least float32: ratios of bf16 log-probs lose too much precision."""
  x = jnp.asarray(x)
  return x.astype(jnp.result_type(x.dtype, jnp.float32))


def _safe_div(num: Array, den: Array) -> Array:
  """num / den where den != 0, else 0; the inner `where` keeps gradients finite too."""
  nonzero = den != 0
  return jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)


# ----------------------------------------------------------------------------------------------------
# Clipped surrogate (PPO / GRPO policy loss)
# ----------------------------------------------------------------------------------------------------


def _check_clip_params(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
  if not 0.0 <= clip_low < 1.0:
    raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
  if not clip_high >= 0.0:
    raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
  if dual_clip is not None and not dual_clip > 1.0:
    raise ValueError(f"dual_clip must be None or > 1, got {dual_clip!r}")


def _check_log_ratio_clamp(log_ratio_clamp: float) -> None:
  if not log_ratio_clamp > 0.0:
    raise ValueError(f"log_ratio_clamp must be > 0, got {log_ratio_clamp!r}")


def _check_pair(logp_bt: Array, other_bt: Array, other_name: str) -> None:
  if logp_bt.ndim != 2 or logp_bt.shape != other_bt.shape:
    raise ValueError(
        f"logp_bt and {other_name} must be [B, T] of equal shape, got {logp_bt.shape} and {other_bt.shape}"
    )


def _broadcast_adv(adv: ArrayLike, shape: tuple[int, ...]) -> Array:
  """Accepts per-sequence [B] or per-token [B, T] advantages and returns them as [B, T]."""
  adv = _as_float(adv)
  if adv.shape == shape[:1]:
    return jnp.broadcast_to(adv[:, None], shape)
  if adv.shape == shape:
    return adv
  raise ValueError(f"adv must have shape {shape[:1]} (adv_b) or {shape} (adv_bt), got {adv.shape}")


def clamped_exp(
    log_ratio: Float[Array, "*s"], log_ratio_clamp: float
) -> tuple[Float[Array, "*s"], Float[Array, "*s"]]:
  """exp(clip(log_ratio, -c, c)) and a float flag, 1.0 where the clamp was active (|log_ratio| > c).

  Where the clamp is active the result is a constant e^{+-c}: its gradient w.r.t. log_ratio is 0, so a
  clamped token neither overflows nor moves the parameters.
  """
  exp_s = jnp.exp(jnp.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp))
  return exp_s, (jnp.abs(log_ratio) > log_ratio_clamp).astype(exp_s.dtype)


def ppo_clip_term(
    ratio_bt: Float[Array, "b t"],
    adv_bt: Float[Array, "b t"],
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Float[Array, "b t"], Float[Array, "b t"], Float[Array, "b t"]]:
  """-min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A), capped at -dual_clip * A where A < 0.

  The shared core of `clipped_surrogate` and `offpolicy.decoupled_ppo_surrogate`; see the former for the
  formula and references. Returns (loss_bt, clipped_bt, dual_clipped_bt), the last two 0/1 float flags.
  """
  unclipped_bt = ratio_bt * adv_bt
  clipped_bt = jnp.clip(ratio_bt, 1.0 - clip_low, 1.0 + clip_high) * adv_bt
  loss_bt = -jnp.minimum(unclipped_bt, clipped_bt)
  dual_clipped_bt = jnp.zeros_like(loss_bt)
  if dual_clip is not None:
    cap_bt = -dual_clip * adv_bt
    capped = (adv_bt < 0) & (loss_bt > cap_bt)
    loss_bt = jnp.where(capped, cap_bt, loss_bt)
    dual_clipped_bt = capped.astype(loss_bt.dtype)
  return loss_bt, (clipped_bt < unclipped_bt).astype(loss_bt.dtype), dual_clipped_bt


@dataclasses.dataclass(frozen=True)
class ClipParams:
  """Hyperparameters of `clipped_surrogate` (the registry's "ppo_clip"): the PPO clip range and the
  optional dual clip."""
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float | None = None

  def __post_init__(self):
    _check_clip_params(self.clip_low, self.clip_high, self.dual_clip)


def clipped_surrogate(
    logp_bt: Float[ArrayLike, "b t"],
    old_logp_bt: Float[ArrayLike, "b t"],
    adv: Float[ArrayLike, "b"] | Float[ArrayLike, "b t"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    proximal_logp_bt: Float[ArrayLike, "b t"] | None = None,
    is_cap: float | None = None,
    mask_bt: ArrayLike | None = None,
) -> tuple[Float[Array, "b t"], dict[str, Float[Array, "b t"]]]:
  """Per-token clipped surrogate loss of PPO (Schulman et al. 2017), as used by GRPO.

  With ratio rho = exp(clamp(logp - old_logp, -c, c)), c = log_ratio_clamp, and advantage A:

      loss = -min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A)

  `clip_high > clip_low` is DAPO's clip-higher (Yu et al. 2025): more room for raising the probability
  of unlikely tokens, which counters entropy collapse. With `dual_clip = c > 1` (Ye et al. 2020,
  "Mastering Complex Control in MOBA Games with Deep RL") the loss of a negative-advantage token is
  also capped, so a huge ratio cannot produce an unbounded update:

      loss = min(loss, -c * A)    where A < 0

  Gradients: d loss / d logp = -A * rho where neither clip is active, and 0 where one is (and where the
  log-ratio clamp is active: there rho is the constant e^{+-c}, finite instead of an overflowing exp).

  This loss clips against the behaviour policy itself; for stale (off-policy) samples see
  `offpolicy.decoupled_ppo_surrogate`. `is_cap` and `mask_bt` are accepted so that every registered
  policy loss takes the same keywords, and are unused (no importance weight; aggregation applies the
  mask).

  Args:
    logp_bt: [B, T] log-probs of the sampled tokens under the policy being trained.
    old_logp_bt: [B, T] log-probs under the policy that produced the samples (treated as a constant).
    adv: [B] per-sequence advantages (broadcast over tokens) or [B, T] per-token advantages.
    clip_low: epsilon below 1, in [0, 1).
    clip_high: epsilon above 1, >= 0.
    dual_clip: None, or the cap c > 1 for negative advantages.
    log_ratio_clamp: c > 0, the bound on |logp - old_logp| before exp.
    proximal_logp_bt: must be None: PPO-clip has no separate proximal policy (use "decoupled_ppo").
    is_cap, mask_bt: unused, see above.

  Returns:
    loss_bt: [B, T] per-token loss (aggregate with `aggregate` / `token_weights`).
    stats: the `POLICY_LOSS_STATS` keys, per-token float arrays: "ratio"; "clipped" (1.0 where the PPO
      clip chose the clipped term); "dual_clipped" (1.0 where the dual-clip cap was applied; always 0
      when dual_clip is None); "log_ratio_clamped" (1.0 where |logp - old_logp| > c); "is_weight"
      (always 1) and "is_truncated" (always 0).
  """
  del is_cap, mask_bt  # Unused: see the docstring.
  if proximal_logp_bt is not None:
    raise ValueError("ppo_clip clips against the behaviour log-probs and takes no proximal_logp_bt; "
                     "use the 'decoupled_ppo' policy loss for a separate proximal policy")
  _check_clip_params(clip_low, clip_high, dual_clip)
  _check_log_ratio_clamp(log_ratio_clamp)
  logp_bt, old_logp_bt = _as_float(logp_bt), _as_float(old_logp_bt)
  _check_pair(logp_bt, old_logp_bt, "old_logp_bt")
  adv_bt = _broadcast_adv(adv, logp_bt.shape)
  log_ratio_bt = logp_bt - jax.lax.stop_gradient(old_logp_bt)
  ratio_bt, log_ratio_clamped_bt = clamped_exp(log_ratio_bt, log_ratio_clamp)
  loss_bt, clipped_bt, dual_clipped_bt = ppo_clip_term(
      ratio_bt, adv_bt, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
  )
  stats = {
      "ratio": ratio_bt,
      "clipped": clipped_bt,
      "dual_clipped": dual_clipped_bt,
      "is_weight": jnp.ones_like(loss_bt),
      "is_truncated": jnp.zeros_like(loss_bt),
      "log_ratio_clamped": log_ratio_clamped_bt,
  }
  return loss_bt, stats


# ----------------------------------------------------------------------------------------------------
# Value loss (critic)
# ----------------------------------------------------------------------------------------------------


def value_loss(
    values_bt: Float[ArrayLike, "b t"],
    old_values_bt: Float[ArrayLike, "b t"],
    returns_bt: Float[ArrayLike, "b t"],
    *,
    clip: float | None,
) -> tuple[Float[Array, "b t"], Float[Array, "b t"]]:
  """Per-token critic regression loss, optionally with PPO value clipping.

  With V the current values, V_old the values at rollout time and R the returns (e.g. from `gae`):

      clip = None:   loss = 0.5 * (V - R)^2
      clip = c > 0:  loss = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)

  The clipped form is PPO's value clipping (Schulman et al. 2017, as implemented in OpenAI baselines'
  ppo2; discussed in Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients"): a token
  whose value has moved more than c from V_old, in the direction that the clipped term penalises more,
  gets no gradient. d loss / d V = V - R where the unclipped term is the larger one, 0 where the clipped
  one is. V_old and R are targets, treated as constants. Aggregate with `aggregate` / `token_weights`.

  Returns:
    loss_bt: [B, T] per-token loss.
    clipped_bt: [B, T] 0/1 float flag, 1.0 where the clipped term was strictly larger (always 0 when
      clip is None).
  """
  if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
    raise ValueError(f"clip must be None or a float > 0, got {clip!r}")
  values_bt = _as_float(values_bt)
  old_values_bt = jax.lax.stop_gradient(_as_float(old_values_bt))
  returns_bt = jax.lax.stop_gradient(_as_float(returns_bt))
  if not values_bt.shape == old_values_bt.shape == returns_bt.shape:
    raise ValueError(f"values_bt, old_values_bt and returns_bt shapes differ: {values_bt.shape}, "
                     f"{old_values_bt.shape}, {returns_bt.shape}")
  unclipped_sq_bt = jnp.square(values_bt - returns_bt)
  if clip is None:
    return 0.5 * unclipped_sq_bt, jnp.zeros_like(unclipped_sq_bt)
  clipped_values_bt = old_values_bt + jnp.clip(values_bt - old_values_bt, -clip, clip)
  clipped_sq_bt = jnp.square(clipped_values_bt - returns_bt)
  clipped_bt = (clipped_sq_bt > unclipped_sq_bt).astype(unclipped_sq_bt.dtype)
  return 0.5 * jnp.maximum(unclipped_sq_bt, clipped_sq_bt), clipped_bt


# ----------------------------------------------------------------------------------------------------
# KL and entropy
# ----------------------------------------------------------------------------------------------------


def kl_estimate(
    logp_bt: Float[ArrayLike, "b t"], ref_logp_bt: Float[ArrayLike, "b t"], kind: str
) -> Float[Array, "b t"]:
  """Per-token sample estimate of KL(pi || pi_ref) for tokens sampled from pi (Schulman 2020,
  "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html).

  With log r = ref_logp - logp (so r = pi_ref / pi at the sampled token):

      k1 = -log r                  unbiased, high variance, can be negative per token
      k2 = 0.5 * (log r)^2         biased, low variance, >= 0
      k3 = (r - 1) - log r         unbiased, low variance, >= 0 (the GRPO paper's KL term)

  k3 is computed as expm1(log r) - log r, which keeps its non-negativity when r is close to 1. It
  grows like r when pi_ref >> pi, so it overflows to inf for log r above ~88 in float32.
  """
  if kind not in KL_KINDS:
    raise ValueError(f"unknown KL estimator kind {kind!r}; known: {', '.join(KL_KINDS)}")
  logp_bt, ref_logp_bt = _as_float(logp_bt), _as_float(ref_logp_bt)
  if logp_bt.shape != ref_logp_bt.shape:
    raise ValueError(f"logp_bt and ref_logp_bt shapes differ: {logp_bt.shape} vs {ref_logp_bt.shape}")
  log_r_bt = ref_logp_bt - logp_bt
  if kind == "k1":
    return -log_r_bt
  if kind == "k2":
    return 0.5 * jnp.square(log_r_bt)
  return jnp.expm1(log_r_bt) - log_r_bt


def entropy_from_logits(logits_btv: Float[ArrayLike, "b t v"]) -> Float[Array, "b t"]:
  """Entropy H = -sum_v p_v log p_v of softmax(logits) over the last axis, in float32.

  log p comes from `log_softmax` (shifted by the max, so large logits do not overflow). Entries with
  p == 0 (for instance -inf logits of masked vocabulary entries) contribute 0, the limit of p log p;
  they are masked before the product so neither the value nor its gradient sees 0 * -inf. A row whose
  logits are all -inf has no distribution and yields NaN.
  """
  logp_btv = jax.nn.log_softmax(jnp.asarray(logits_btv, jnp.float32), axis=-1)
  p_btv = jnp.exp(logp_btv)
  logp_btv = jnp.where(p_btv > 0, logp_btv, 0.0)
  return -jnp.sum(p_btv * logp_btv, axis=-1)


# ----------------------------------------------------------------------------------------------------
# Aggregation as per-token weights
# ----------------------------------------------------------------------------------------------------


def check_aggregation_mode(mode: str, norm_len: float | None = None) -> str:
  """Validates an aggregation mode (and norm_len for the Dr. GRPO mode) and returns the mode."""
  if mode not in AGGREGATION_MODES:
    raise ValueError(f"unknown aggregation mode {mode!r}; known: {', '.join(AGGREGATION_MODES)}")
  if mode == "seq-mean-token-sum-norm" and (norm_len is None or not norm_len > 0):
    raise ValueError(
        f"norm_len must be a positive constant (e.g. the max response length) for mode {mode!r}, "
        f"got {norm_len!r}"
    )
  return mode


def token_weights(mask_bt: ArrayLike, mode: str, *, norm_len: float | None = None) -> Float[Array, "b t"]:
  """Per-token weights w such that the aggregated loss is sum(loss_bt * w_bt).

  With m the 0/1 response mask, len_b = sum_t m_bt and S the number of sequences with len_b > 0:

      "token-mean"               w = m / sum(m)                  every token counts the same (DAPO,
                                                                 Yu et al. 2025)
      "seq-mean-token-mean"      w = m / (len_b * S)             mean over tokens, then over sequences
                                                                 (GRPO, Shao et al. 2024)
      "seq-mean-token-sum-norm"  w = m / (norm_len * S)          Dr. GRPO (Liu et al. 2025): a constant
                                                                 norm_len removes the length bias

  S counts only non-empty sequences, so all-padding rows (a batch topped up to a fixed shape) do not
  dilute the loss. Compute the weights once on the full batch and slice them with the batch into
  micro-batches: the sum of the micro-batch losses is then exactly the full-batch loss. Every
  division is guarded: an empty mask gives all-zero weights, never NaN. `norm_len` is ignored by the
  other two modes.
  """
  check_aggregation_mode(mode, norm_len)
  mask_bt = jnp.asarray(mask_bt).astype(jnp.float32)
  if mask_bt.ndim != 2:
    raise ValueError(f"mask_bt must be [B, T], got shape {mask_bt.shape}")
  if mode == "token-mean":
    return _safe_div(mask_bt, jnp.sum(mask_bt))
  len_b = jnp.sum(mask_bt, axis=1)
  num_seqs = jnp.sum(len_b > 0).astype(jnp.float32)
  if mode == "seq-mean-token-mean":
    return _safe_div(mask_bt, (len_b * num_seqs)[:, None])
  return _safe_div(mask_bt, jnp.float32(norm_len) * num_seqs)


def weighted_sum(loss_bt: Float[ArrayLike, "b t"], weights_bt: Float[ArrayLike, "b t"]) -> Float[Array, ""]:
  """sum(loss_bt * weights_bt), the micro-batch form of `aggregate` (weights sliced from the full batch).

  Zero-weight positions are dropped with `where` rather than multiplied by 0, so garbage (inf/NaN) in
  padded positions of loss_bt cannot leak into the value.
  """
  loss_bt, weights_bt = _as_float(loss_bt), jnp.asarray(weights_bt)
  if loss_bt.shape != weights_bt.shape:
    raise ValueError(f"loss_bt shape {loss_bt.shape} does not match weights_bt shape {weights_bt.shape}")
  return jnp.sum(jnp.where(weights_bt != 0, loss_bt * weights_bt, 0.0))


def aggregate(
    loss_bt: Float[ArrayLike, "b t"], mask_bt: ArrayLike, mode: str, *, norm_len: float | None = None
) -> Float[Array, ""]:
  """Scalar loss sum(loss_bt * token_weights(mask_bt, mode)); see `token_weights` for the modes."""
  return weighted_sum(loss_bt, token_weights(mask_bt, mode, norm_len=norm_len))
