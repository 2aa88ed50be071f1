"""Device side of the generation engine: fixed-shape prefill into slots, chunked decode.

A fixed number of slots share one KV cache ``{'k','v'}: [L, S, K, T, H]`` with ``T = max_prompt_len +
max_new_tokens``. Both programs here are pure functions that take the cache and the slot state donated and
return them, so a refill never reallocates anything and shapes never change:

* ``prefill`` takes R rows (a fixed count; unused rows carry slot index S and are dropped by every
  scatter): it writes new samples' rows into the slot state, then recomputes the KV of each row's prefix
  (prompt + response so far, except its newest token) in a temporary R-row cache of width W and scatters
  that into the chosen slots' cache rows. W is one of a small fixed set of widths, one compile each.
* ``decode_chunk`` advances every active slot by at most ``steps`` tokens in one ``lax.while_loop``
  (``steps`` is a traced scalar, so one compile serves every chunk size) and exits early once no slot is
  active, or once enough slots finished to be worth a refill (``min_done``, also traced). Every token,
  the first included, is sampled here: prefill only fills the cache, so a sample's token t is always
  drawn from the logits of one decode step with key (rng, sample id, t), whichever slot, chunk or call
  it lands in.

The per-slot state (``SlotState``) and the decode step are ``decode.py``'s, shared with the tests'
reference generator. ``SlotPrograms`` jits the programs with explicit shardings (slot dimension over the
mesh batch axes; the KV cache as ``GENERATE_RULES`` maps its logical axes, ``rules.cache_sharding``) and
donation. This module never touches the host: the engine (``engine.py``) decides what goes where.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rl_fusion_jax import models
from rl_fusion_jax.rollout import decode as decode_lib
# SlotState and empty_slots are part of this module's interface (the engine reads slots.SlotState).
from rl_fusion_jax.rollout.decode import GenerateSpec, SlotState, empty_slots
from rl_fusion_jax.sharding.mesh import batch_sharding, replicated
from rl_fusion_jax.sharding.expert_parallel import with_expert_parallel
from rl_fusion_jax.sharding.rules import GENERATE_RULES, Rules, cache_sharding

# The narrowest prefill: below it a forward saves little, and every width is one more compile.
MIN_PREFILL_WIDTH = 8


def _admit(state: SlotState, dest_r, prompt_rp, prompt_len_r, sample_id_r, forced_len_r) -> SlotState:
  """Writes fresh samples into slots ``dest_r``; an index of S (out of range) drops that row."""
  rows = decode_lib.new_rows(state.tokens_st.shape[1], prompt_rp, prompt_len_r, sample_id_r, forced_len_r)
  return jax.tree.map(lambda buf, new: buf.at[dest_r].set(new, mode="drop"), state, rows)


def prefill(spec: GenerateSpec, width: int, params, cache, state: SlotState, slot_r, is_new_r, prompt_rp,
            prompt_len_r, sample_id_r, forced_len_r):
  """Admits the rows with ``is_new_r`` and rebuilds the KV of every row's prefix in slots ``slot_r``.

  A row's prefix is its prompt plus response so far; the KV of all but its newest token is needed (decode
  processes the newest one), and ``width`` must cover that. Positions past a row's prefix write pad KV,
  which is harmless: decode overwrites position p before any token attends to it.
  """
  num_slots = state.done_s.shape[0]
  state = _admit(state, jnp.where(is_new_r, slot_r, num_slots), prompt_rp, prompt_len_r, sample_id_r,
                 forced_len_r)
  tokens_rw = state.tokens_st.at[slot_r, :width].get(mode="fill", fill_value=0)
  positions_rw = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens_rw.shape)
  rows_cache = models.init_cache(spec.model, tokens_rw.shape[0], width, dtype=cache["k"].dtype)
  # The logits are unused, so XLA drops the LM head from this program.
  _, rows_cache = models.forward_with_cache(spec.model, params, tokens_rw, positions_rw, rows_cache)
  cache = {name: cache[name].at[:, slot_r, :, :width].set(rows_cache[name], mode="drop") for name in cache}
  return state, cache


def decode_chunk(spec: GenerateSpec, params, cache, state: SlotState, steps, min_done, rng, version):
  """At most ``steps`` decode steps over all slots; returns (state, cache, steps taken, tokens sampled).

  Exits early when no slot is active, or once ``min_done`` slots finished during this chunk (the host
  then has that many slots to refill; pass more than S to run the full ``steps``).
  """
  done_at_start_s, response_len_at_start_s = state.done_s, state.response_len_s

  def body(carry):
    step, state, cache = carry
    state, cache = decode_lib.decode_step(spec, params, state, cache, rng, version)
    return step + 1, state, cache

  def cond(carry):
    step, state, _ = carry
    # Both counts in one reduction: one cross-device sum per step when the slots are sharded.
    active, newly_done = jnp.sum(jnp.stack([~state.done_s, state.done_s & ~done_at_start_s]), axis=1,
                                 dtype=jnp.int32)
    return (step < steps) & (active > 0) & (newly_done < min_done)

  step, state, cache = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state, cache))
  # Every step appends one token to each active slot, so the tokens sampled are the length increments.
  tokens = jnp.sum(state.response_len_s - response_len_at_start_s, dtype=jnp.int32)
  return state, cache, step, tokens


def prefill_widths(max_prompt_len: int, seq_len: int) -> tuple[int, ...]:
  """Prefill widths, one compile each (on first use), ascending: powers of two from ``MIN_PREFILL_WIDTH``
  below the prompt width, the prompt width, then doubling up to the full row.

  A prefill call uses the smallest width that holds its longest prefix, so a batch of short prompts
  does not pay for a forward over ``max_prompt_len`` positions, nor a short partial response for a
  full-row one.
  """
  widths = [w for w in (MIN_PREFILL_WIDTH << i for i in range(max_prompt_len.bit_length()))
            if w < max_prompt_len]
  widths.append(max_prompt_len)
  while widths[-1] * 2 < seq_len:
    widths.append(widths[-1] * 2)
  return tuple(widths) + (seq_len,)


def prefill_width(widths: tuple[int, ...], need: int) -> int:
  """The smallest of ``widths`` (ascending) that holds ``need`` prefix positions."""
  return next(w for w in widths if w >= need)


class SlotPrograms:
  """The jitted programs of one (spec, slots, rows, mesh, param layout), with explicit shardings.

  ``rows`` (the prefill row count) is fixed here so that each jitted prefill has exactly one compiled
  shape; callers pass that many rows.
  """

  def __init__(self, spec: GenerateSpec, num_slots: int, rows: int, mesh: Mesh, param_shardings,
               rules: Rules = GENERATE_RULES):
    self.rows = rows
    b1, b2, rep = batch_sharding(mesh, 1), batch_sharding(mesh, 2), replicated(mesh)
    self.cache_sharding = cache_sharding(spec.model, mesh, rules)
    # An MoE policy's routed experts run expert-parallel in the generation layout (sharding/expert_parallel).
    ep = lambda fn: with_expert_parallel(fn, spec.model, mesh, rules)
    self.row_shardings = (b1, b1, b2, b1, b1, b1)
    self.replicated = rep
    self.state_shardings = state_sh = decode_lib.state_shardings(mesh)
    cache_sh = self.cache_sharding
    self.widths = prefill_widths(spec.max_prompt_len, spec.seq_len)
    self.prefill = {
        w: jax.jit(ep(functools.partial(prefill, spec, w)), donate_argnums=(1, 2),
                   in_shardings=(param_shardings, cache_sh, state_sh) + self.row_shardings,
                   out_shardings=(state_sh, cache_sh))
        for w in self.widths}
    self.decode = jax.jit(ep(functools.partial(decode_chunk, spec)), donate_argnums=(1, 2),
                          in_shardings=(param_shardings, cache_sh, state_sh, rep, rep, rep, rep),
                          out_shardings=(state_sh, cache_sh, rep, rep))
    self.init_cache = jax.jit(functools.partial(models.init_cache, spec.model, num_slots, spec.seq_len),
                              out_shardings=cache_sh)
    self.empty = jax.jit(functools.partial(empty_slots, num_slots, spec.seq_len),
                         out_shardings=state_sh)


@functools.lru_cache(maxsize=16)
def programs(spec, num_slots, rows, mesh, treedef, sharding_leaves, rules: Rules = GENERATE_RULES
             ) -> SlotPrograms:
  """Shared by every engine with equal arguments (all hashable), so a new engine compiles nothing."""
  return SlotPrograms(spec, num_slots, rows, mesh, jax.tree.unflatten(treedef, sharding_leaves), rules)
