"""The batch generator the tests compare the engine with: one prefill and one decode loop over all rows.

``Generator`` runs B right-padded prompts at once: a jitted ``prefill`` writes the prompts' keys and
values and samples each row's first token from the prefill logits; a jitted ``decode`` is one
``lax.while_loop`` of ``rollout.decode.decode_step`` until every row sampled EOS or reached
``max_new_tokens``. Both take the cache donated. Each row's random stream depends only on (rng, sample id,
token index), so a sample's tokens do not depend on which row or batch it landed in, and an engine run
must reproduce them token for token.

It shares the decode step and the state with the engine (``rollout/decode.py``), but not the engine's
scheduling: no slots, refill, chunking, re-prefill or partial rollout, and token 0 comes from the prompt's
forward here rather than from a decode step. Production code never imports it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rl_fusion_jax import models
from rl_fusion_jax.rollout.decode import (GenerateSpec, SlotState, append, decode_step, new_rows,
                                          state_shardings)
from rl_fusion_jax.rollout.sampling import sample, sample_keys
from rl_fusion_jax.sharding.mesh import batch_sharding, replicated
from rl_fusion_jax.sharding.rules import GENERATE_RULES, cache_sharding
from rl_fusion_jax.types import Rollout


def prefill(spec: GenerateSpec, params, cache, prompt_bp, prompt_len_b, sample_id_b, rng, version):
  """Runs the right-padded prompts through the model, samples token 0 of every row."""
  batch, width = prompt_bp.shape
  positions_bp = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  logits_bpv, cache = models.forward_with_cache(spec.model, params, prompt_bp, positions_bp, cache)
  last_bv = jnp.take_along_axis(logits_bpv, (prompt_len_b - 1)[:, None, None], axis=1)[:, 0]
  zeros_b = jnp.zeros((batch,), jnp.int32)
  token_b, logp_b = sample(last_bv, sample_keys(rng, sample_id_b, zeros_b), spec.sampling)
  state = new_rows(spec.seq_len, prompt_bp, prompt_len_b, sample_id_b, zeros_b)
  return append(spec, state, prompt_len_b, token_b, logp_b, version), cache


def decode(spec: GenerateSpec, params, cache, state: SlotState, rng, version):
  """Decodes until every row is done (EOS or max_new_tokens), one token per row per step."""
  return jax.lax.while_loop(lambda c: ~jnp.all(c[0].done_s),
                            lambda c: decode_step(spec, params, *c, rng, version), (state, cache))


def to_rollout(state: SlotState) -> Rollout:
  return Rollout(tokens_bt=state.tokens_st, prompt_len_b=state.prompt_len_s,
                 response_len_b=state.response_len_s, logp_bt=state.logp_st, version_bt=state.version_st,
                 finished_b=state.finished_s, sample_id_b=state.sample_id_s)


class Generator:
  """Compiled prefill/decode for one GenerateSpec on one mesh; ``__call__`` returns a Rollout.

  Rows are split over the mesh batch axes; the cache is laid out by ``rules`` (``rules.cache_sharding``).
  """

  def __init__(self, spec: GenerateSpec, mesh: Mesh, param_shardings, rules=GENERATE_RULES):
    self.spec = spec
    b1, b2 = batch_sharding(mesh, 1), batch_sharding(mesh, 2)
    rep = replicated(mesh)
    self.cache_sharding = cache_sh = cache_sharding(spec.model, mesh, rules)
    state_sh = state_shardings(mesh)
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
    return to_rollout(state)
