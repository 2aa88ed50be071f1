"""Batched generation: a jitted prefill and a jitted decode loop over a donated, fixed-shape KV cache.

``prefill`` writes the prompts' keys and values and samples each row's first token; ``decode`` is one
``lax.while_loop`` that advances every active row one token per step and exits early once every row has
sampled EOS or reached ``max_new_tokens`` (no host round-trip per token). Both take the cache donated and
return it, so the cache is updated in place and never copied. Each row's random stream depends only on
(rng, sample id, token index), so a sample's tokens do not depend on which row or batch it landed in.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_fusion_jax import models
from rl_fusion_jax.rollout.sampling import SamplingParams, sample, sample_keys
from rl_fusion_jax.sharding.mesh import BATCH_AXES, batch_sharding, replicated
from rl_fusion_jax.types import Rollout


@flax.struct.dataclass
class DecodeState:
  """Per-row progress; token buffers hold prompt + response back to back (see types.Rollout)."""
  tokens_bt: jax.Array
  logp_bt: jax.Array
  version_bt: jax.Array
  prompt_len_b: jax.Array
  response_len_b: jax.Array
  finished_b: jax.Array      # sampled EOS
  done_b: jax.Array          # finished or at max_new_tokens
  sample_id_b: jax.Array

  def to_rollout(self) -> Rollout:
    return Rollout(tokens_bt=self.tokens_bt, prompt_len_b=self.prompt_len_b,
                   response_len_b=self.response_len_b, logp_bt=self.logp_bt, version_bt=self.version_bt,
                   finished_b=self.finished_b, sample_id_b=self.sample_id_b)


@dataclasses.dataclass(frozen=True)
class GenerateSpec:
  """Everything static about a generation program (hashable: part of the jit cache key)."""
  model: models.ModelConfig
  sampling: SamplingParams
  max_prompt_len: int
  max_new_tokens: int
  eos_id: int

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.max_prompt_len < 1:
      raise ValueError(f"max_prompt_len must be >= 1, got {self.max_prompt_len}")

  @property
  def seq_len(self) -> int:
    return self.max_prompt_len + self.max_new_tokens


def put_at(buf_bt, pos_b, value_b, active_b):
  """buf[b, pos_b] = value_b where active_b; positions outside [0, T) write nothing.

  A select over the whole [B, T] buffer rather than a scatter: the buffers are small, and a scatter
  whose row index is data makes a batch-sharded program gather every row's indices and values onto
  every device.
  """
  hit_bt = active_b[:, None] & (jnp.arange(buf_bt.shape[1]) == pos_b[:, None])
  return jnp.where(hit_bt, jnp.asarray(value_b, buf_bt.dtype)[:, None], buf_bt)


def take_at(buf_bt, pos_b):
  """buf[b, pos_b] per row, 0 where pos_b is outside [0, T) (a masked sum: no gather, as in `put_at`)."""
  hit_bt = jnp.arange(buf_bt.shape[1]) == pos_b[:, None]
  return jnp.sum(jnp.where(hit_bt, buf_bt, 0), axis=1, dtype=buf_bt.dtype)


def _append(spec: GenerateSpec, state: DecodeState, pos_b, token_b, logp_b, version) -> DecodeState:
  """Appends one sampled token at ``pos_b`` to every row that is not done yet."""
  active_b = ~state.done_b
  version_b = jnp.broadcast_to(version, token_b.shape)
  response_len_b = state.response_len_b + active_b.astype(jnp.int32)
  finished_b = state.finished_b | (active_b & (token_b == spec.eos_id))
  return state.replace(
      tokens_bt=put_at(state.tokens_bt, pos_b, token_b, active_b),
      logp_bt=put_at(state.logp_bt, pos_b, logp_b, active_b),
      version_bt=put_at(state.version_bt, pos_b, version_b, active_b),
      response_len_b=response_len_b, finished_b=finished_b,
      done_b=finished_b | (response_len_b >= spec.max_new_tokens))


def prefill(spec: GenerateSpec, params, cache, prompt_bp, prompt_len_b, sample_id_b, rng, version):
  """Runs the right-padded prompts through the model, samples token 0 of every row."""
  batch, width = prompt_bp.shape
  positions_bp = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  logits_bpv, cache = models.forward_with_cache(spec.model, params, prompt_bp, positions_bp, cache)
  last_bv = jnp.take_along_axis(logits_bpv, (prompt_len_b - 1)[:, None, None], axis=1)[:, 0]
  zeros_b = jnp.zeros((batch,), jnp.int32)
  token_b, logp_b = sample(last_bv, sample_keys(rng, sample_id_b, zeros_b), spec.sampling)
  state = DecodeState(
      tokens_bt=jnp.zeros((batch, spec.seq_len), jnp.int32).at[:, :width].set(prompt_bp),
      logp_bt=jnp.zeros((batch, spec.seq_len), jnp.float32),
      version_bt=jnp.full((batch, spec.seq_len), -1, jnp.int32),
      prompt_len_b=prompt_len_b, response_len_b=zeros_b, finished_b=jnp.zeros((batch,), bool),
      done_b=jnp.zeros((batch,), bool), sample_id_b=sample_id_b)
  return _append(spec, state, prompt_len_b, token_b, logp_b, version), cache


def decode(spec: GenerateSpec, params, cache, state: DecodeState, rng, version):
  """Decodes until every row is done (EOS or max_new_tokens), one token per row per step."""
  def body(carry):
    state, cache = carry
    pos_b = state.prompt_len_b + state.response_len_b - 1          # each row's newest token
    last_b = take_at(state.tokens_bt, pos_b)
    logits_b1v, cache = models.forward_with_cache(spec.model, params, last_b[:, None], pos_b[:, None],
                                                  cache)
    keys_b = sample_keys(rng, state.sample_id_b, state.response_len_b)
    token_b, logp_b = sample(logits_b1v[:, 0], keys_b, spec.sampling)
    return _append(spec, state, pos_b + 1, token_b, logp_b, version), cache

  return jax.lax.while_loop(lambda c: ~jnp.all(c[0].done_b), body, (state, cache))


class Generator:
  """Compiled prefill/decode for one GenerateSpec on one mesh; ``__call__`` returns a Rollout."""

  def __init__(self, spec: GenerateSpec, mesh: Mesh, param_shardings):
    self.spec = spec
    b1, b2 = batch_sharding(mesh, 1), batch_sharding(mesh, 2)
    rep = replicated(mesh)
    self.cache_sharding = NamedSharding(mesh, P(None, BATCH_AXES))
    state_sh = DecodeState(tokens_bt=b2, logp_bt=b2, version_bt=b2, prompt_len_b=b1, response_len_b=b1,
                           finished_b=b1, done_b=b1, sample_id_b=b1)
    cache_sh = self.cache_sharding
    self._prefill = jax.jit(functools.partial(prefill, spec), donate_argnums=(1,),
                            in_shardings=(param_shardings, cache_sh, b2, b1, b1, rep, rep),
                            out_shardings=(state_sh, cache_sh))
    self._decode = jax.jit(functools.partial(decode, spec), donate_argnums=(1, 2),
                           in_shardings=(param_shardings, cache_sh, state_sh, rep, rep),
                           out_shardings=(state_sh, cache_sh))
    self._init_cache = jax.jit(functools.partial(models.init_cache, spec.model), static_argnums=(0, 1),
                               out_shardings=cache_sh)

  def __call__(self, params, prompt_bp, prompt_len_b, sample_id_b, rng, version) -> Rollout:
    batch, width = prompt_bp.shape
    if width != self.spec.max_prompt_len:
      raise ValueError(f"prompt width {width} != max_prompt_len {self.spec.max_prompt_len}")
    cache = self._init_cache(batch, self.spec.seq_len)
    state, cache = self._prefill(params, cache, prompt_bp, prompt_len_b, sample_id_b, rng, version)
    state, cache = self._decode(params, cache, state, rng, version)
    del cache    # the cache lives only while generating
    return state.to_rollout()
