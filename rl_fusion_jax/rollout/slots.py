"""Device side of the generation engine: fixed-shape prefill into slots, chunked decode.

A fixed number of slots share one KV cache ``{'k','v'}: [L, S, K, T, H]`` with ``T = max_prompt_len +
max_new_tokens``. Both programs here are pure functions that take the cache and the slot state donated and
return them, so a refill never reallocates anything and shapes never change:

* ``prefill`` takes R rows (a fixed count; unused rows carry slot index S and are dropped by every
  scatter): it writes new samples' rows into the slot state, then recomputes the KV of each row's prefix
  (prompt + response so far, except its newest token) in a temporary R-row cache of width W and scatters
  that into the chosen slots' cache rows. W is one of a small fixed set of widths, one compile each.
* ``run_chunk`` advances every active slot by at most ``steps`` tokens in one ``lax.while_loop``
  (``steps`` is a traced scalar, so one compile serves every chunk size), refilling free slots from an
  uploaded slice of the queue inside the loop (a ``prefill`` of ``rows`` rows at the prompt width, or with
  ``narrow_refills`` at the narrowest prompt width that holds the admitted prompts, chosen at run time among
  the compiled ones: one forward per width in the program), moving finished samples to the outbox of
  their batch shard (a row never leaves the devices that generated it; ``pack_finished`` runs per shard), and
  ending once a target of complete groups or finished samples is met (``ChunkTarget``), when nothing
  is left, or when the upload is spent. Every token, the first included, is sampled in a decode step:
  prefill only fills the cache, so a sample's token t is always drawn from the logits of one decode
  step with key (rng, sample id, t), whichever slot, chunk or call it lands in.

The per-slot state (``SlotState``) and the decode step are ``decode.py``'s, shared with the tests'
reference generator. ``SlotPrograms`` jits the programs with explicit shardings (slot dimension over the
mesh batch axes; the KV cache as ``GENERATE_RULES`` maps its logical axes, ``rules.cache_sharding``) and
donation. This module never touches the host: the engine (``engine.py``) decides what goes where.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rl_fusion_jax import models, shared_programs
from rl_fusion_jax.rollout import decode as decode_lib
# SlotState and empty_slots are part of this module's interface (the engine reads slots.SlotState).
from rl_fusion_jax.rollout.decode import GenerateSpec, SlotState, empty_slots
from rl_fusion_jax.sharding.mesh import BATCH_AXES, batch_sharding, batch_shards, replicated
from rl_fusion_jax.sharding.expert_parallel import with_expert_parallel
from rl_fusion_jax.sharding.rules import GENERATE_RULES, Rules, cache_sharding

# The narrowest prefill: below it a forward saves little, and every width is one more compile.
MIN_PREFILL_WIDTH = 8


def _admit(state: SlotState, dest_r, prompt_rp, prompt_len_r, sample_id_r, forced_len_r) -> SlotState:
  """Writes fresh samples into slots ``dest_r``; an index of S (out of range) drops that row.

  With the rows and ``dest_r`` replicated, each device writes the rows that land in its own slots; rows
  split over the batch axes instead make a batch-sharded program gather every row and index onto every
  device first (one all-gather per field)."""
  rows = decode_lib.new_rows(state.tokens_st.shape[1], prompt_rp, prompt_len_r, sample_id_r, forced_len_r)
  return jax.tree.map(lambda buf, new: buf.at[dest_r].set(new, mode="drop"), state, rows)


def prefill(spec: GenerateSpec, width: int, params, cache, state: SlotState, slot_r, is_new_r, prompt_rp,
            prompt_len_r, sample_id_r, forced_len_r, lead_u=None, from_r=None):
  """Admits the rows with ``is_new_r`` and rebuilds the KV of every row's prefix in slots ``slot_r``.

  A row's prefix is its prompt plus response so far; the KV of all but its newest token is needed (decode
  processes the newest one), and ``width`` must cover that. Positions past a row's prefix write pad KV,
  which is harmless: decode overwrites position p before any token attends to it.

  ``lead_u`` / ``from_r`` (a refill whose rows share prompts, ``shared_prompts``): the forward runs only on
  the U slots ``lead_u`` (S: an unused row) and row r's slot gets the KV of ``lead_u[from_r[r]]``, whose
  prefix equals its own.
  """
  num_slots = state.done_s.shape[0]
  params = models.decoding_params(spec.model, params)
  state = _admit(state, jnp.where(is_new_r, slot_r, num_slots), prompt_rp, prompt_len_r, sample_id_r,
                 forced_len_r)
  tokens_rw = state.tokens_st.at[slot_r if lead_u is None else lead_u, :width].get(mode="fill", fill_value=0)
  rows_cache = prefix_kv(spec, width, cache["k"].dtype, params, tokens_rw, from_r)
  return state, _write_kv(cache, slot_r, rows_cache)


def prefix_kv(spec: GenerateSpec, width: int, dtype, params, tokens_rw, from_r=None, pad_to: int | None = None):
  """The KV ``{'k', 'v'}: [L, R, K, W, H]`` (in ``dtype``, the cache's) of rows of prefix tokens (their
  first ``width`` columns), the rows ``from_r`` of it when given (rows sharing a prompt's forward);
  ``pad_to``: zero columns appended up to that width (pad KV past every prefix, harmless as in ``prefill``)."""
  tokens_rw = tokens_rw[:, :width]
  positions_rw = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens_rw.shape)
  rows_cache = models.init_cache(spec.model, tokens_rw.shape[0], width, dtype=dtype)
  # The logits are unused, so XLA drops the LM head from this program.
  _, rows_cache = models.forward_with_cache(spec.model, params, tokens_rw, positions_rw, rows_cache)
  if from_r is not None:
    rows_cache = {name: kv[:, from_r] for name, kv in rows_cache.items()}
  if pad_to is not None and pad_to > width:
    pad = [(0, 0)] * 3 + [(0, pad_to - width), (0, 0)]
    rows_cache = {name: jnp.pad(kv, pad) for name, kv in rows_cache.items()}
  return rows_cache


def _write_kv(cache, slot_r, rows_cache):
  """``rows_cache`` ([L, R, K, W, H]) into the first W positions of slots ``slot_r`` (S: dropped)."""
  width = rows_cache["k"].shape[3]
  return {name: cache[name].at[:, slot_r, :, :width].set(rows_cache[name], mode="drop") for name in cache}


def shared_prompt_rows(rows: int, group_size: int, shards: int) -> int:
  """Rows a refill's forward runs on when the samples of a group share their prompt's KV: ``rows``
  consecutive queued requests of groups of ``group_size`` (queued whole, one after the other) hold at most
  ``ceil((rows - 1) / group_size) + 1`` distinct prompts; rounded up to the batch shards. ``rows`` (no
  sharing) when that saves nothing."""
  if group_size <= 1:
    return rows
  unique = -(-(rows - 1) // group_size) + 1
  return min(rows, -(-unique // shards) * shards)


def shared_prompts(source_r, k, unique: int):
  """Which rows of a refill share a forward: ``source_r`` (each window row's first request with the same
  prompt, ``Pending.source_q``), ``k`` rows admitted at most, ``unique`` forward rows -> (rows admitted:
  the longest prefix of the ``k`` whose distinct prompts fit in ``unique``, each distinct prompt's first
  row as its leader; ``lead_r``: the row is a leader; ``from_r``: the index among the leaders of the row's
  leader)."""
  rows = source_r.shape[0]
  in_r = jnp.arange(rows) < k
  same_rr = (source_r[:, None] == source_r[None, :]) & in_r[None, :]
  first_r = jnp.argmax(same_rr, axis=1)                  # the first row in the window with this prompt
  lead_r = in_r & (first_r == jnp.arange(rows))
  rank_r = jnp.cumsum(lead_r, dtype=jnp.int32) - 1       # leaders up to row r, minus one
  admitted = jnp.sum(in_r & (rank_r < unique), dtype=jnp.int32)
  return admitted, lead_r, rank_r[first_r]


def pack_rows(state: SlotState):
  """Every slot's row as one int32 [S, 3T + 4] array (one transfer): tokens, log-prob bits, versions,
  then finished, prompt length, response length, sample id (``pack_finished`` reads it)."""
  scalars_s4 = jnp.stack([state.finished_s.astype(jnp.int32), state.prompt_len_s, state.response_len_s,
                          state.sample_id_s], axis=1)
  return jnp.concatenate([state.tokens_st, jax.lax.bitcast_convert_type(state.logp_st, jnp.int32),
                          state.version_st, scalars_s4], axis=1)


@flax.struct.dataclass
class Pending:
  """The head of the engine's queue, uploaded for one chunk: ``count`` requests in queue order (rows past
  it are padding). ``group_q``: each request's group as an index into the chunk's group table.
  ``source_q``: the index of the first request of the upload with the same group and prompt (itself if
  none), so a refill computes a shared prompt's KV once (``shared_prompts``)."""
  prompt_qp: jax.Array
  prompt_len_q: jax.Array
  sample_id_q: jax.Array
  forced_len_q: jax.Array
  group_q: jax.Array
  source_q: jax.Array
  count: jax.Array


@flax.struct.dataclass
class ChunkTarget:
  """When a chunk may stop early, decided on the device.

  ``remaining_g``: samples each tracked group still needs before it is complete (untracked entries hold a
  value no count reaches). The target is met once ``need_groups`` tracked groups are complete, every
  ``awaited_g`` group is complete (never while ``blocked``: an awaited group has samples beyond the
  chunk's reach) and ``need_samples`` samples finished in the chunk. ``armed`` False: no target, the
  chunk runs until its step budget or until nothing is left. ``more_queued``: the host holds requests
  beyond ``Pending``; the chunk ends when it could refill but its upload is spent.
  """
  remaining_g: jax.Array
  awaited_g: jax.Array
  need_groups: jax.Array
  need_samples: jax.Array
  blocked: jax.Array
  armed: jax.Array
  more_queued: jax.Array


@flax.struct.dataclass
class _Carry:
  step: jax.Array
  tokens: jax.Array
  refills: jax.Array
  refill_tokens: jax.Array
  state: SlotState
  cache: dict
  ptr: jax.Array          # requests of ``Pending`` taken so far
  outbox: jax.Array       # [R, O, 3T + 4]: each batch shard's rows of the samples that finished there
  out_order: jax.Array    # [R, O]: each outbox row's place in the chunk's completion order (every shard)
  out_n: jax.Array        # [R]: outbox rows per batch shard
  live_s: jax.Array       # the slot holds a sample not yet moved to the outbox
  group_s: jax.Array      # its group's index in the chunk's group table (G: none)
  remaining_g: jax.Array
  filling: jax.Array      # a static refill is under way
  free: jax.Array         # slots done (free or holding a finished sample): sum(state.done_s)
  finished: jax.Array     # samples that finished in this chunk: sum(out_n) + sum(state.done_s & live_s)


def _move_local(outbox, out_order, out_n, rows_sc, order_s, move_s):
  """``_move_done`` on one batch shard (under ``shard_map``): its outbox [1, O, C], orders [1, O] and count
  [1]; its slots' rows [S/R, C], completion orders and move flags [S/R]."""
  pos_s = jnp.where(move_s, out_n[0] + jnp.cumsum(move_s, dtype=jnp.int32) - 1, outbox.shape[1])
  return (outbox.at[0, pos_s].set(rows_sc, mode="drop"), out_order.at[0, pos_s].set(order_s, mode="drop"),
          out_n + jnp.sum(move_s, dtype=jnp.int32))


def _move_done(move_local, c: _Carry) -> _Carry:
  """Moves every finished sample still in its slot to its batch shard's outbox, freeing the slot. Rows
  never leave their shard; their places in the completion order (slot order within one move) do."""
  move_s = c.state.done_s & c.live_s
  order_s = jnp.sum(c.out_n) + jnp.cumsum(move_s, dtype=jnp.int32) - 1
  outbox, out_order, out_n = move_local(c.outbox, c.out_order, c.out_n, pack_rows(c.state), order_s, move_s)
  return c.replace(outbox=outbox, out_order=out_order, out_n=out_n, live_s=c.live_s & ~move_s)


def _pack_local(max_new_tokens: int, vocab_size: int, outbox, out_n, version):
  """``pack_finished`` on one batch shard's outbox (under ``shard_map``) -> ([1, W, C] bytes, [1] columns)."""
  flat, columns = pack_finished(outbox[0], out_n[0], max_new_tokens, version, vocab_size)
  return flat[None], columns[None]


def run_chunk(spec: GenerateSpec, new_widths: tuple[int, ...], rows: int, unique: int, static: bool, row_shardings,
              params, cache, state: SlotState, group_s, pending: Pending, target: ChunkTarget, steps, rng, version):
  """At most ``steps`` decode steps with refill on the device -> (state, cache, finished rows, counters).

  Before every step, while the free slots (done ones) reach ``min(rows, requests left)`` (``static``:
  every slot free), the finished samples still in slots move to the outbox and the next ``rows``
  requests of ``pending`` are admitted to the lowest free slots and prefilled at the narrowest of
  ``new_widths`` that holds their prompts but the last token (every width in the one program, picked at
  run time: one compile). With ``unique < rows``, requests that share a prompt (a group's samples) share
  its forward: a refill runs it on ``unique`` rows and admits the longest run of requests whose distinct
  prompts fit (``shared_prompts``). The chunk ends after ``steps`` steps, once ``target`` is
  met, when nothing is left to decode or admit, or when the host must upload more requests. Finished
  samples are then all in the outbox, so every done slot is free.

  The outbox is one per batch shard (R = data x fsdp shards of the slots): a finished row stays on the
  devices of the shard that generated it, and each shard packs its own (``pack_finished``), so no device
  gathers another shard's rows (a host reads the shards it holds). What every host learns of every row is
  its sample id and its place in the chunk's completion order.

  Returns (state, cache, each shard's outbox packed by ``pack_finished`` ([R, W, C] bytes, split over the
  batch axes), the finished samples' ids, shards and 2 x response length + finished flag in completion
  order ([S + pending] each; the first ``sum(rows)`` are set), outbox rows per shard [R], the columns of
  each shard's packed buffer they fill
  [R], requests taken from ``pending``, decode steps, tokens sampled, refill prefills, and the rows x width
  they processed).
  """
  num_slots = state.done_s.shape[0]
  num_pending = pending.sample_id_q.shape[0]
  num_groups = target.remaining_g.shape[0]
  mesh = row_shardings[0].mesh
  shards = batch_shards(mesh)
  b1, b2, b3 = (P(BATCH_AXES, *[None] * (n - 1)) for n in (1, 2, 3))
  move_done = functools.partial(_move_done, jax.shard_map(
      _move_local, mesh=mesh, in_specs=(b3, b2, b1, b2, b1, b1), out_specs=(b3, b2, b1), check_vma=False))
  # Each layer's kernels cast to the matmul dtype once for the chunk, not in every step and refill.
  params = models.decoding_params(spec.model, params)
  left = lambda c: pending.count - c.ptr

  # The loop's conditions read the counts the carry keeps (``free``, ``finished``), the same on every device,
  # rather than summing the batch-split slot flags: no collective of their own in each decode step.
  def can_refill(c):
    free = c.free
    # Static: a refill starts once every slot is free and goes on until the slots are full.
    enough = (free == num_slots) | c.filling if static else free >= jnp.minimum(rows, left(c))
    return (left(c) > 0) & (free > 0) & enough

  def refill_once(c):
    c = move_done(c)
    # The requests' window and what is computed from it stay replicated, as ``pending`` is (every device
    # reads it whole): left unconstrained, the rows' split over the batch axes for the forward below
    # propagates back into them and each read becomes a gather between devices. The slots' free flags are
    # gathered once, so the refill's bookkeeping is computed alike on every device.
    everywhere = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))
    free_s = everywhere(c.state.done_s)
    k = jnp.minimum(jnp.minimum(rows, c.free), left(c))
    index_r = c.ptr + jnp.arange(rows, dtype=jnp.int32)
    take = lambda x: everywhere(x.at[index_r].get(mode="fill", fill_value=0))
    if unique < rows:
      k, lead_r, from_r = map(everywhere, shared_prompts(take(pending.source_q), k, unique))
    rank_s = jnp.cumsum(free_s, dtype=jnp.int32) - 1
    # The k lowest free slots take rows 0 .. k - 1 (dest_r: each row's slot, S for none).
    slot_row_s = jnp.where(free_s & (rank_s < k), rank_s, rows)
    dest_r = everywhere(jnp.full((rows,), num_slots, jnp.int32).at[slot_row_s].set(
        jnp.arange(num_slots, dtype=jnp.int32), mode="drop"))
    valid_r = jnp.arange(rows) < k
    prompt_len_r = take(pending.prompt_len_q)
    # The narrowest of ``new_widths`` that holds every admitted prompt but its last token.
    need = jnp.max(jnp.where(valid_r, prompt_len_r - 1, 0))
    branch = jnp.minimum(jnp.sum(jnp.asarray(new_widths) < need, dtype=jnp.int32), len(new_widths) - 1)
    # The refill's rows split over the batch axes like the host's prefill rows (else every device would
    # prefill all of them).
    b1, b2 = row_shardings
    rows_1 = lambda x: jax.lax.with_sharding_constraint(x, b1)
    # The requests' fields and dest_r are replicated: each device writes the rows its own slots take.
    prompt_rp = take(pending.prompt_qp)
    state = _admit(c.state, dest_r, prompt_rp, prompt_len_r, take(pending.sample_id_q), take(pending.forced_len_q))
    # The forward's rows: the admitted rows' prefixes, which are their prompts (nothing sampled yet), read
    # from the replicated requests rather than gathered back from the slots; zero rows past the admitted.
    source_r, from_arg, forward_rows = jnp.where(valid_r, jnp.arange(rows, dtype=jnp.int32), rows), (), rows
    if unique < rows:   # each distinct prompt's first row leads; U rows split like the others
      source_r = jnp.full((unique,), rows, jnp.int32).at[jnp.where(lead_r & valid_r, from_r, unique)].set(
          jnp.arange(rows, dtype=jnp.int32), mode="drop")
      from_arg, forward_rows = (rows_1(from_r),), unique
    widest = new_widths[-1]
    prompt_rw = prompt_rp[:, :widest]
    if prompt_rw.shape[1] < widest:   # a slot's row is its prompt then zeros
      prompt_rw = jnp.pad(prompt_rw, ((0, 0), (0, widest - prompt_rw.shape[1])))
    tokens_rw = jax.lax.with_sharding_constraint(prompt_rw.at[source_r].get(mode="fill", fill_value=0), b2)
    # Only the forward depends on the width: the switch neither takes nor returns the cache, so XLA
    # updates it in place (a cache passing through a conditional is copied in and out of it).
    kv_dtype = c.cache["k"].dtype
    rows_cache = jax.lax.switch(
        branch, [functools.partial(prefix_kv, spec, w, kv_dtype, pad_to=widest) for w in new_widths],
        params, tokens_rw, *from_arg)
    new_state, new_cache = state, _write_kv(c.cache, rows_1(dest_r), rows_cache)
    width = jnp.asarray(new_widths, jnp.int32)[branch]
    return c.replace(state=new_state, cache=new_cache, ptr=c.ptr + k, refills=c.refills + 1, filling=True,
                     free=c.free - k,
                     refill_tokens=c.refill_tokens + forward_rows * width,
                     group_s=c.group_s.at[dest_r].set(take(pending.group_q), mode="drop"),
                     live_s=c.live_s.at[dest_r].set(True, mode="drop"))

  def met(c):
    complete_g = c.remaining_g <= 0
    return (target.armed & ~target.blocked & (jnp.sum(complete_g, dtype=jnp.int32) >= target.need_groups)
            & jnp.all(complete_g | ~target.awaited_g) & (c.finished >= target.need_samples))

  def needs_host(c):   # a refill is due but the uploaded requests are spent
    free = c.free
    return target.more_queued & (left(c) <= 0) & (free == num_slots if static else free >= rows)

  def cond(c):
    active = c.free < num_slots
    return (c.step < steps) & ~met(c) & (active | can_refill(c)) & ~needs_host(c)

  def decode(c):
    active_s = ~c.state.done_s
    new_state, new_cache = decode_lib.decode_step(spec, params, c.state, c.cache, rng, version)
    newly_s = new_state.done_s & active_s
    finished_g = jax.ops.segment_sum(newly_s.astype(jnp.int32), c.group_s, num_groups)
    # Every active slot is live (only done slots move to the outbox), so each newly done slot is a sample
    # finished in this chunk.
    newly = jnp.sum(newly_s, dtype=jnp.int32)
    return c.replace(state=new_state, cache=new_cache, step=c.step + 1, tokens=c.tokens + num_slots - c.free,
                     remaining_g=c.remaining_g - finished_g, free=c.free + newly, finished=c.finished + newly)

  def body(c):
    # ``cond`` holds: a slot is active, or a refill is due and admits at least one; either way the
    # decode step has an active slot.
    return decode(jax.lax.while_loop(can_refill, refill_once, c).replace(filling=False))

  zero = jnp.zeros((), jnp.int32)
  # A shard's outbox holds its slots' samples and every request the chunk could admit to them.
  per_shard = num_slots // shards + num_pending
  on_shards = lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  outbox = on_shards(jnp.zeros((shards, per_shard, 3 * state.tokens_st.shape[1] + 4), jnp.int32), b3)
  out_order = on_shards(jnp.zeros((shards, per_shard), jnp.int32), b2)
  c = _Carry(step=zero, tokens=zero, refills=zero, refill_tokens=zero, state=state, cache=cache, ptr=zero, outbox=outbox,
             out_order=out_order, out_n=on_shards(jnp.zeros((shards,), jnp.int32), b1), live_s=~state.done_s,
             group_s=group_s, remaining_g=target.remaining_g, filling=jnp.zeros((), bool),
             free=jnp.sum(state.done_s, dtype=jnp.int32), finished=zero)
  c = move_done(jax.lax.while_loop(cond, body, c))
  # What every host reads of the outboxes: each finished sample's id (pack_rows' last column) and shard,
  # in the chunk's completion order [S + pending].
  order_ro = jnp.where(jnp.arange(per_shard) < c.out_n[:, None], c.out_order, num_slots + num_pending)
  put_o = lambda x, dtype: jnp.zeros((num_slots + num_pending,), dtype).at[order_ro].set(x.astype(dtype), mode="drop")
  t = state.tokens_st.shape[1]
  out_ids = put_o(c.outbox[:, :, -1], jnp.int32)
  out_shard = put_o(jnp.broadcast_to(jnp.arange(shards)[:, None], order_ro.shape), shard_dtype(shards))
  # Each finished sample's response length and finished flag (2 x length + flag): what a host that does not
  # read the sample's shard keeps of it (``Engine.local_rows``).
  out_len = put_o(2 * c.outbox[:, :, 3 * t + 2] + c.outbox[:, :, 3 * t], jnp.int32)
  pack = jax.shard_map(functools.partial(_pack_local, spec.max_new_tokens, spec.model.vocab_size), mesh=mesh,
                       in_specs=(b3, b1, P()), out_specs=(b3, b1), check_vma=False)
  flat, columns = pack(c.outbox, c.out_n, version)
  return (c.state, c.cache, flat, out_ids, out_shard, out_len, c.out_n, columns, c.ptr, c.step, c.tokens,
          c.refills, c.refill_tokens)


def shard_dtype(shards: int):
  """The narrowest integer type that numbers ``shards`` batch shards (what a chunk's ``out_shard`` is)."""
  return jnp.int8 if shards <= 127 else jnp.int16 if shards <= 32767 else jnp.int32


# The host fetches ``pack_finished``'s buffer in blocks of these sizes (columns): as many large blocks as
# fit in what it needs, then small ones, so at most SMALL - 1 columns beyond it cross, and one compiled
# slice per size serves every block.
PACK_BLOCKS = (1024, 64)


# Bytes a token's version takes on the wire: its distance below the chunk's version (what a sample can
# carry from earlier runs is bounded by the staleness bound, far below 2**16).
VERSION_BYTES = 2


def _value_bytes(num_values: int) -> int:
  return next((n for n in (1, 2, 3) if num_values <= 2 ** (8 * n)), 4)


@functools.lru_cache(maxsize=None)
def wire_format(vocab_size: int, seq_len: int) -> tuple[int, int, int]:
  """(token bytes, length bytes, bytes per column) of ``pack_finished``'s buffer: a response token's
  column holds its id, its log-prob's float32 bits and its version's distance below the chunk's version
  (``VERSION_BYTES``); a row's column holds its finished flag, prompt and response lengths."""
  token, length = _value_bytes(vocab_size), _value_bytes(seq_len + 1)
  return token, length, max(token + 4 + VERSION_BYTES, 1 + 2 * length)


def _le_bytes(x, nbytes: int) -> list:
  """``x`` (int32) as ``nbytes`` uint8 values, least significant first (two's complement bits)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)
  return [((bits >> (8 * i)) & 0xFF).astype(jnp.uint8) for i in range(nbytes)]


def pack_finished(outbox, out_n, max_new_tokens: int, version, vocab_size: int):
  """The outbox's first ``out_n`` rows as the host needs them, without padding -> (bytes [W, C] uint8, n).

  Columns ``[0, out_n)`` hold each row's finished flag, prompt length and response length; columns
  ``[out_n, n)`` the rows' response tokens, sample after sample (row k's ``response_len`` tokens from its
  ``prompt_len``), each as its id, its log-prob's float32 bits and ``version`` minus its version; the rest
  is 0. Every value is little-endian in ``wire_format``'s widths (W bytes a column). ``C`` is a multiple
  of the largest block that holds every row at ``max_new_tokens``. The prompts are not sent back: the
  host uploaded them.
  """
  num_rows = outbox.shape[0]
  t = (outbox.shape[1] - 4) // 3
  token_bytes, length_bytes, width = wire_format(vocab_size, t)
  prompt_o = outbox[:, 3 * t + 1]
  resp_o = jnp.where(jnp.arange(num_rows) < out_n, outbox[:, 3 * t + 2], 0)
  end_o = jnp.cumsum(resp_o, dtype=jnp.int32)
  big = PACK_BLOCKS[0]
  cap = -(-num_rows * (max_new_tokens + 1) // big) * big
  i_c = jnp.arange(cap, dtype=jnp.int32)
  meta_c = i_c < out_n
  r_c = i_c - out_n                                  # index into the response stream
  k_c = jnp.clip(jnp.searchsorted(end_o, r_c, side="right"), 0, num_rows - 1)
  real_c = (r_c >= 0) & (r_c < end_o[-1])
  col_c = jnp.where(real_c, prompt_o[k_c] + r_c - (end_o[k_c] - resp_o[k_c]), 0)
  row_c = jnp.minimum(i_c, num_rows - 1)
  token = lambda offset: outbox[k_c, offset + col_c]
  record = (_le_bytes(token(0), token_bytes) + _le_bytes(token(t), 4)
            + _le_bytes(version - token(2 * t), VERSION_BYTES))
  meta = lambda m, nbytes: _le_bytes(outbox[row_c, 3 * t + m], nbytes)
  row = meta(0, 1) + meta(1, length_bytes) + meta(2, length_bytes)
  zero = jnp.zeros_like(i_c, jnp.uint8)
  pad = lambda parts: parts + [zero] * (width - len(parts))
  return (jnp.stack([jnp.where(meta_c, m, jnp.where(real_c, r, zero)) for m, r in zip(pad(row), pad(record))]),
          out_n + end_o[-1])


def unpack_finished(bytes_wn: np.ndarray, num_rows: int, version: int, vocab_size: int, seq_len: int):
  """``pack_finished``'s buffer (its first columns, on the host) -> (meta [K, 3] int32: finished, prompt
  length, response length; tokens [N] int32, log-probs [N] float32, versions [N] int32 of the responses)."""
  token_bytes, length_bytes, width = wire_format(vocab_size, seq_len)
  if bytes_wn.shape[0] != width:
    raise ValueError(f"engine buffer of {bytes_wn.shape[0]} bytes a column; the wire format has {width}")
  b = bytes_wn.astype(np.uint32)
  value = lambda rows, cols: sum(b[r, cols] << np.uint32(8 * i) for i, r in enumerate(rows))
  meta, resp = slice(0, num_rows), slice(num_rows, None)
  meta_k3 = np.stack([value([0], meta), value(range(1, 1 + length_bytes), meta),
                      value(range(1 + length_bytes, 1 + 2 * length_bytes), meta)], axis=1).astype(np.int32)
  tokens = value(range(token_bytes), resp).astype(np.int32)
  logp = np.ascontiguousarray(value(range(token_bytes, token_bytes + 4), resp).astype(np.uint32)).view(np.float32)
  distance = value(range(token_bytes + 4, token_bytes + 4 + VERSION_BYTES), resp).astype(np.int64)
  return meta_k3, tokens, logp, (version - distance).astype(np.int32)


def block_starts(n: int) -> list[tuple[int, int]]:
  """(start, size) of the blocks that cover columns [0, n): large ones first, then small ones."""
  big, small = PACK_BLOCKS
  whole = n // big * big
  return [(s, big) for s in range(0, whole, big)] + [(s, small) for s in range(whole, n, small)]


def take_block(flat, start, size: int):
  """Columns [start, start + size) of every shard's ``pack_finished`` buffer: [R, W, size]."""
  return jax.lax.dynamic_slice_in_dim(flat, start, size, axis=2)


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


def refill_widths(widths: tuple[int, ...], max_prompt_len: int, narrow: bool = False) -> tuple[int, ...]:
  """The widths a chunk's refills prefill at: the one that holds every prompt but its last token, and with
  ``narrow`` every narrower one too (the chunk program then holds one forward per width: on XLA:CPU a
  30-layer model's decode chunk compiled in 18.5-19.1 s with 5 widths against 6.9-7.3 s with one, and
  generated no faster; BENCHMARKS.md, "One refill width")."""
  last = prefill_width(widths, max_prompt_len - 1)
  return (tuple(w for w in widths if w < last) if narrow else ()) + (last,)


def prefill_width(widths: tuple[int, ...], need: int) -> int:
  """The smallest of ``widths`` (ascending) that holds ``need`` prefix positions."""
  return next(w for w in widths if w >= need)


class SlotPrograms:
  """The jitted programs of one (spec, slots, rows, mesh, param layout), with explicit shardings.

  ``rows`` (the prefill row count) is fixed here so that each jitted prefill has exactly one compiled
  shape; callers pass that many rows.
  """

  def __init__(self, spec: GenerateSpec, num_slots: int, rows: int, mesh: Mesh, param_shardings,
               rules: Rules = GENERATE_RULES, static: bool = False, group_size: int = 1,
               narrow_refills: bool = False):
    self.rows = rows
    # Rows a refill's forward runs on: a group's samples share their prompt's KV.
    self.unique_rows = shared_prompt_rows(rows, group_size, batch_shards(mesh))
    b1, b2, rep = batch_sharding(mesh, 1), batch_sharding(mesh, 2), replicated(mesh)
    self.cache_sharding = cache_sharding(spec.model, mesh, rules)
    # An MoE policy's routed experts run expert-parallel in the generation layout (sharding/expert_parallel).
    ep = lambda fn: with_expert_parallel(fn, spec.model, mesh, rules)
    self.row_shardings = (b1, b1, b2, b1, b1, b1)
    self.replicated = rep
    self.shard_bytes = batch_sharding(mesh, 3)   # the chunk's packed finished rows: [R, W, C], a shard each
    self.state_shardings = state_sh = decode_lib.state_shardings(mesh)
    cache_sh = self.cache_sharding
    self.widths = prefill_widths(spec.max_prompt_len, spec.seq_len)
    self.prefill = {
        w: jax.jit(ep(functools.partial(prefill, spec, w)), donate_argnums=(1, 2),
                   in_shardings=(param_shardings, cache_sh, state_sh) + self.row_shardings,
                   out_shardings=(state_sh, cache_sh))
        for w in self.widths}
    self.new_widths = refill_widths(self.widths, spec.max_prompt_len, narrow_refills)
    self.pending_rows = num_slots
    self.num_groups = 2 * num_slots
    self.chunk = jax.jit(
        ep(functools.partial(run_chunk, spec, self.new_widths, rows, self.unique_rows, static, (b1, b2))),
        donate_argnums=(1, 2),
        in_shardings=(param_shardings, cache_sh, state_sh, b1, rep, rep, rep, rep, rep),
        out_shardings=(state_sh, cache_sh, self.shard_bytes) + (rep,) * 10)
    # A block of every shard's packed buffer, each shard's part left on its devices (hosts read the shards
    # they hold).
    self.take_block = {size: jax.jit(functools.partial(take_block, size=size), out_shardings=self.shard_bytes)
                       for size in PACK_BLOCKS}
    self.init_cache = jax.jit(functools.partial(models.init_cache, spec.model, num_slots, spec.seq_len),
                              out_shardings=cache_sh)
    self.empty = jax.jit(functools.partial(empty_slots, num_slots, spec.seq_len),
                         out_shardings=state_sh)


@shared_programs.shared
def programs(spec, num_slots, rows, mesh, param_shardings, rules: Rules = GENERATE_RULES,
             static: bool = False, group_size: int = 1, narrow_refills: bool = False) -> SlotPrograms:
  """Shared by every engine with equal arguments (``shared_programs``), so a new engine compiles nothing."""
  return SlotPrograms(spec, num_slots, rows, mesh, param_shardings, rules, static, group_size, narrow_refills)
