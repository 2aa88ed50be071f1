"""Token sampling: pure functions on logits (temperature, top-k, top-p) with per-sample random streams.

The behaviour log-probability of a sampled token is ``log_softmax(logits / temperature)[token]``: the
policy the learner differentiates is the temperature-scaled model, and top-k / top-p are treated as
truncations of the sampler that the log-probs do not include (the common convention; the ratio in the
loss is then exactly 1 on-policy). With temperature 0, sampling is greedy and log-probs use temperature 1.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 1.0
  top_k: int = 0        # 0: off
  top_p: float = 1.0    # 1.0: off

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def logprob_temperature(self) -> float:
    return self.temperature if self.temperature > 0 else 1.0


def sample_keys(rng: jax.Array, sample_ids_b: jax.Array, token_index_b: jax.Array) -> jax.Array:
  """One key per row from (rng, sample id, token index): independent of slot and batch position."""
  per_sample = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, sample_ids_b)
  return jax.vmap(jax.random.fold_in)(per_sample, token_index_b)


def truncate_logits(logits_bv: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Sets logits outside the top-k / nucleus (top-p) set to -inf; always keeps the argmax."""
  neg_inf = jnp.finfo(logits_bv.dtype).min
  if top_k > 0 and top_k < logits_bv.shape[-1]:
    kth = jax.lax.top_k(logits_bv, top_k)[0][..., -1:]
    logits_bv = jnp.where(logits_bv < kth, neg_inf, logits_bv)
  if top_p < 1.0:
    sorted_bv = jnp.sort(logits_bv, axis=-1)[..., ::-1]
    probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
    # Keep a token while the mass strictly before it is < top_p (so the first token is always kept).
    mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
    keep_bv = mass_before_bv < top_p
    threshold_b1 = jnp.min(jnp.where(keep_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True)
    logits_bv = jnp.where(logits_bv < threshold_b1, neg_inf, logits_bv)
  return logits_bv


def first_argmax(x_bv: jax.Array) -> jax.Array:
  """``jnp.argmax(x_bv, axis=-1)`` (the first maximum; the first NaN where a row has one), as int32.

  Written as a max, then the smallest index that reaches it: XLA:CPU runs ``argmax``'s reduction over
  (value, index) pairs as one scalar loop, and fuses whatever computes ``x_bv`` into it; two plain
  reductions vectorize (``experiments/benchmark_sampling.py``; BENCHMARKS.md, "Sampling over a
  49,152-token vocabulary").
  """
  max_b1 = jnp.max(x_bv, axis=-1, keepdims=True)
  hit_bv = (x_bv == max_b1) | jnp.isnan(x_bv)
  index_v = jnp.arange(x_bv.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(hit_bv, index_v, x_bv.shape[-1]), axis=-1)


def categorical(keys_b: jax.Array, logits_bv: jax.Array) -> jax.Array:
  """One draw per row: the same tokens as ``jax.vmap(jax.random.categorical)(keys_b, logits_bv)``
  (the Gumbel-max draw with the same noise: ``jax.random.gumbel`` under each row's key), with its argmax
  taken by `first_argmax`."""
  gumbel_bv = jax.vmap(lambda key, row: jax.random.gumbel(key, row.shape, row.dtype))(keys_b, logits_bv)
  return first_argmax(gumbel_bv + logits_bv)


def sample(logits_bv: jax.Array, keys_b: jax.Array, params: SamplingParams):
  """Samples one token per row; returns (tokens_b int32, behaviour logp_b float32)."""
  logits_bv = logits_bv.astype(jnp.float32)
  scaled_bv = logits_bv / params.logprob_temperature
  if params.temperature == 0:
    tokens_b = first_argmax(logits_bv)
  else:
    tokens_b = categorical(keys_b, truncate_logits(scaled_bv, params.top_k, params.top_p))
  logp_bv = jax.nn.log_softmax(scaled_bv, axis=-1)
  logp_b = jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0]
  return tokens_b, logp_b
