"""The aux models as a stage that consumes finished samples: in ``hybrid`` the reference model and the
learned reward model score them on their own devices while the actor's devices are still generating.

The engine reports each batch of newly finished samples after a decode chunk (``Engine.on_finished``,
beside the verify stage). :class:`AuxStage` sends them to the aux mesh as a packed byte stream
(``packed_step.place_rows``, once for both models) and computes there the reference's log-probs of the
packed rows and the reward model's score of each sample (``reward_model.packed_score``), scattering each
sample's log-probs into a row of a per-sample buffer (``[capacity, seq_len]``, float32) and its score into
a per-sample vector (``[capacity]``), all dispatched without waiting: the aux devices work while the
rollout devices decode the next chunk. The train phase then asks for its batch (``take``): samples not
scored yet (none were finished in this run: a resume, or evicted from a full buffer) are scored on the
spot, and one gather builds the update's reference log-probs in the update's own layout (packed rows or
padded rows) and another the batch's scores, on the aux mesh. Under StaleSync (``stalesync.StaleSync._aux``)
``fetch`` instead takes a rollout phase's results to the host, for the queue's ``ref_logp`` and
``rm_score`` fields: the responses' log-probs laid end to end in blocks of ``FETCH_BLOCKS`` values, and
the scores.

Every call has one shape: a chunk's samples are packed first-fit into rows of ``seq_len`` and scored
``block_rows`` rows at a time (``BLOCK_ROWS_PER_SHARD`` per batch shard of the aux mesh, the last block's
spare rows empty), each block's samples padded to ``block_samples`` entries (``seq_len / 2``: every sample
takes two columns at least, and a block ends at fewer rows rather than hold more; zero-length entries take
no row), its token stream crossing as pages into one buffer (``packed_step.StreamPages``). So the stage
compiles each of its programs once, on its first call, whatever a chunk finished. Only the samples' token
ids cross (``tokens_only``: the models read nothing else), with a table of 6 numbers per sample entry;
``take`` and ``fetch`` report the bytes put since the last report as ``queue/link_bytes/host_to_aux``
beside its padded equivalent (the samples' tokens as int32 rows of ``seq_len``). The buffers hold
``capacity`` samples; when they are full the oldest entries are evicted (scored again if asked for), so a
result never depends on what was kept. Samples that will never be trained (StaleSync's stale groups)
are released by ``forget``.

Active in ``fusion.mode=hybrid`` with a reference model or a reward model, in one process or several:
the engine reports the same finished samples in the same order on every process (its host state is
replicated), so every process dispatches the stage's programs in the same order, as SPMD programs need.
Host values reach the aux devices by ``distributed.put`` (each process fills its own devices, no hidden
collective). Each sample the engine reports is scored by the aux group of the engine shard that generated
it (``submit``), so where the two meshes split over the processes alike (``fusion/deployment.py``) it is
scored on the process that holds its row. Where each process holds only the responses it generated
(``Engine.local_rows``: ``share``), a call first fills in, from their holders, the tokens of the samples
its process's aux devices score and it does not hold (``processes.fill_rows``, tokens only:
``link_bytes/aux_rows_between_hosts_this_host``; none when the meshes align and the engine reported them).
The stage blocks on its buffers every ``BLOCK_EVERY`` calls: XLA:CPU deadlocked with more than about 32
multi-device programs in flight (DESIGN.md), and each call dispatches up to about ten (a write per stream
page, the rows, their layout, each model and its scatter).
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rl_fusion_jax import distributed, shared_programs
from rl_fusion_jax.orchestration import processes
from rl_fusion_jax.queue import global_batch
from rl_fusion_jax.sharding import mesh as mesh_lib
from rl_fusion_jax.timeline import Timeline
from rl_fusion_jax.train import packed_step, packing
from rl_fusion_jax.types import Rollout

BLOCK_EVERY = 2
# A call of the stage scores this many packed rows per batch shard of the aux mesh (``AuxStage.block_rows``),
# its stream crossing in at most this many pages (``packed_step.StreamPages``).
BLOCK_ROWS_PER_SHARD = 4
STREAM_PAGES = 4
# Values a call of the reference log-probs' fetch (``AuxStage.fetch``) returns: large blocks while the rest
# fills one, then small ones, so a fetch is at most one small block longer than the log-probs it holds
# (two program shapes).
FETCH_BLOCKS = (4096, 128)


def fetch_starts(total: int) -> list[tuple[int, int]]:
  """(start, size) of the blocks that fetch ``total`` values laid end to end."""
  big, small = FETCH_BLOCKS
  starts = [(start, big) for start in range(0, total - total % big, big)]
  return starts + [(start, small) for start in range(total - total % big, total, small)]


def _scatter(buffer_ct, logp_rw, row_k, start_k, length_k, dest_k):
  """Sample k's log-probs (packed at ``row_k`` / ``start_k``, ``length_k`` tokens) into ``buffer_ct[dest_k]``
  at positions 0 .. length - 1, position by position of the packed rows (the rest of the buffer row keeps
  what it held: readers stop at the sample's length). ``dest_k`` = capacity drops the sample."""
  k_rw, pos_rw, inside = packed_step.covering(*logp_rw.shape, row_k, start_k, length_k)
  target_rw = jnp.where(inside, dest_k[k_rw], buffer_ct.shape[0])
  return buffer_ct.at[target_rw, jnp.clip(pos_rw, 0, buffer_ct.shape[1] - 1)].set(logp_rw, mode="drop")


def _scatter_scores(scores_c, score_k, dest_k):
  return scores_c.at[dest_k].set(score_k, mode="drop")


def _take_flat(buffer_ct, slot_k, column_k, offset_k, length_k, start, *, size: int):
  """``size`` values, from position ``start``, of the samples' response log-probs laid end to end:
  value j is ``buffer_ct[slot_k, column_k + j - offset_k]`` for the sample k with ``offset_k <= j <
  offset_k + length_k`` (offsets ascending; entries of length 0 after the samples), 0 past the last."""
  j = start + jnp.arange(size, dtype=jnp.int32)
  k = jnp.clip(jnp.searchsorted(offset_k, j, side="right") - 1, 0, offset_k.shape[0] - 1)
  inside = (j >= offset_k[k]) & (j < offset_k[k] + length_k[k])
  col = jnp.clip(column_k[k] + j - offset_k[k], 0, buffer_ct.shape[1] - 1)
  return jnp.where(inside, buffer_ct[slot_k[k], col], 0.0)


def _gather_packed(buffer_ct, slot_b, row_b, start_b, length_b, *, num_rows: int, width: int):
  """The buffer rows of samples ``slot_b`` laid out as packed rows [num_rows, width] (0 outside them)."""
  k_rw, pos_rw, inside = packed_step.covering(num_rows, width, row_b, start_b, length_b)
  return jnp.where(inside, buffer_ct[slot_b[k_rw], jnp.clip(pos_rw, 0, buffer_ct.shape[1] - 1)], 0.0)


def _gather_padded(buffer_ct, slot_b, length_b, *, width: int):
  """The buffer rows of samples ``slot_b`` as padded rows [B, width], 0 from each sample's length on."""
  inside = jnp.arange(width, dtype=jnp.int32)[None, :] < length_b[:, None]
  return jnp.where(inside, buffer_ct[slot_b, :width], 0.0)


class AuxStage:
  """Reference log-probs and reward-model scores of finished samples, computed on the aux mesh as they
  finish. ``reference`` / ``reward``: which of the two it computes (``programs.packed_ref_logprobs`` and
  ``programs.packed_reward_score`` are their programs). ``engine_shards``: the engine's batch shards (the
  samples ``submit`` gets are scored by their shard's aux group; None: packed over every group)."""

  def __init__(self, cfg, programs, timeline_group: str, capacity: int, *, reference: bool = True,
               reward: bool = False, engine_shards: int | None = None):
    if not (reference or reward):
      raise ValueError("AuxStage: give it the reference, the reward model or both")
    r = cfg.rollout
    self.reference, self.reward = reference, reward
    self.mesh, self.seq_len, self.capacity = programs.aux_mesh, r.seq_len, capacity
    self.vocab_size = cfg.model.config.vocab_size
    self.logprobs = programs.packed_ref_logprobs if reference else None
    self.score_fn = programs.packed_reward_score if reward else None
    self.row_layout = packed_step.make_row_layout(self.mesh)
    self.shards = mesh_lib.batch_shards(self.mesh)
    # The engine's batch shards: a sample generated by shard r is scored in the aux group r x shards /
    # engine_shards (``submit``), on the same process when both meshes split over the processes alike.
    self.engine_shards = engine_shards
    self.group = timeline_group
    rep = self._rep = mesh_lib.replicated(self.mesh)
    self._scatter = shared_programs.jit(_scatter, out_shardings=rep, donate_argnums=(0,))
    self._scatter_scores = shared_programs.jit(_scatter_scores, out_shardings=rep, donate_argnums=(0,))
    self._take_flat = {size: shared_programs.jit(functools.partial(_take_flat, size=size), out_shardings=rep)
                       for size in FETCH_BLOCKS}
    # Every call scores one block of at most ``block_rows`` packed rows holding at most ``block_samples``
    # samples (a row's worth of two-token samples: any one row fits, as ``_score`` packs every sample in
    # two columns at least), its stream crossing as pages into one buffer: one shape for each of the
    # stage's programs, whatever a chunk finished.
    self.block_rows = BLOCK_ROWS_PER_SHARD * self.shards
    self.block_samples = max(1, self.seq_len // 2)
    self.pages = packed_step.StreamPages(self.mesh, self.block_rows, self.seq_len,
                                         packing.value_bytes(self.vocab_size), max_pages=STREAM_PAGES,
                                         tokens_only=True, unit=16)
    # Bytes the calls put on the aux devices since they were last reported (``take`` / ``fetch``).
    self.link = collections.Counter()
    # Where each process holds only the responses it generated (``Engine.local_rows``): the run's
    # ``processes.Share`` (following the engine's ``readers``); each call then fills in, from their holders,
    # the tokens of its samples that its process's aux devices score and it does not hold. None: every
    # process holds every row.
    self.share: processes.Share | None = None
    self.buffer = distributed.put(np.zeros((capacity, self.seq_len), np.float32), rep) if reference else None
    self.scores = distributed.put(np.zeros((capacity,), np.float32), rep) if reward else None
    self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()   # sample id -> row, oldest first
    self.free = list(range(capacity))[::-1]
    self.params = self.rm_params = None
    self.timeline: Timeline | None = None
    self.step = 0
    self.scored = self._dispatched = 0
    self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aux-ready")

  def begin(self, params, timeline: Timeline, step: int, rm_params=None) -> None:
    """The reference params and the reward model's (on the aux mesh; each None where the stage does not
    compute it) and where to record the stage's intervals, for this step."""
    self.params, self.rm_params, self.timeline, self.step = params, rm_params, timeline, step

  # -- producer side (the engine's listener) --------------------------------------------------------

  def submit(self, rollout: Rollout, group_id_b=None, shard_b=None) -> None:
    """Dispatches the stage's models on finished samples (host arrays); a no-op before ``begin``.
    ``shard_b``: the engine's batch shard that generated each (``Engine.on_finished``): each sample is then
    scored by the aux group of that shard (``_score``), else packed over all of them."""
    del group_id_b
    if (self.reference and self.params is None) or (self.reward and self.rm_params is None):
      return
    new = np.asarray([i for i, s in enumerate(np.asarray(rollout.sample_id_b)) if int(s) not in self.slot_of])
    if len(new):
      group_k = (None if shard_b is None or self.engine_shards is None
                 else np.asarray(shard_b, np.int64)[new] * self.shards // self.engine_shards)
      self._score(rollout, new, group_k=group_k)

  def _score(self, rollout: Rollout, rows, keep=frozenset(), group_k=None) -> None:
    """Scores samples ``rows`` of ``rollout`` into buffer rows (evicting the oldest entries not in ``keep``
    when the buffer is full): packed first-fit into rows of ``seq_len``, then scored ``block_rows`` rows
    at a time. ``group_k``: the aux group (batch shard of the aux mesh) each sample is scored by: each
    group's samples packed into rows of its own, every call taking up to ``block_rows / shards`` of each
    group's rows; None: the rows dealt over the groups in turn."""
    rows = np.asarray(rows)
    prompt = np.asarray(rollout.prompt_len_b, np.int64)[rows]
    # Each sample takes two columns at least (a one-token sample leaves one empty), so a row holds at most
    # block_samples samples.
    lengths = np.minimum(np.maximum(prompt + np.asarray(rollout.response_len_b, np.int64)[rows], 2), self.seq_len)
    dest = np.asarray([self._slot(int(rollout.sample_id_b[i]), keep) for i in rows], np.int32)
    per_group = self.block_rows // self.shards
    if group_k is None:
      row_k, start_k, used = packing.first_fit_decreasing(lengths, self.seq_len)
      group_k, row_k = row_k % self.shards, row_k // self.shards    # dealt over the groups as packing.plan does
      used = -(-used // self.shards)
    else:
      row_k, start_k = np.zeros(len(rows), np.int64), np.zeros(len(rows), np.int64)
      used = 0
      for g in range(self.shards):
        mine = np.flatnonzero(group_k == g)
        row_k[mine], start_k[mine], n = packing.first_fit_decreasing(lengths[mine], self.seq_len)
        used = max(used, n)
    # Calls over the groups' rows in step: up to per_group rows of each group, block_samples samples in all.
    per_row = np.zeros((self.shards, used), np.int64)        # samples in each group's rows
    np.add.at(per_row, (group_k, row_k), 1)
    first = np.zeros(self.shards, np.int64)
    while (first < used).any():
      last = first.copy()
      count = 0
      for g in range(self.shards):
        while (last[g] < used and last[g] - first[g] < per_group
               and count + per_row[g, last[g]] <= self.block_samples):
          count += per_row[g, last[g]]
          last[g] += 1
      if (last == first).all():   # one row alone holds more samples than a call takes: cannot happen
        raise AssertionError("aux stage: a packed row holds more samples than one call takes")
      mine = np.flatnonzero((row_k >= first[group_k]) & (row_k < last[group_k]))
      self._score_block(rollout, rows[mine], group_k[mine] * per_group + row_k[mine] - first[group_k[mine]],
                        start_k[mine], dest[mine])
      first = last
    self.scored += len(rows)

  def _score_block(self, rollout: Rollout, rows, row_k, start_k, dest_k) -> None:
    """One call: samples ``rows`` of ``rollout`` at rows ``row_k`` (< ``block_rows``; group g holds rows
    g x block_rows / shards onwards) / ``start_k`` of the block, into buffer rows ``dest_k``; padded to
    ``block_samples`` samples of length 0."""
    k, kmax, num_rows = len(rows), self.block_samples, self.block_rows
    if k > kmax:
      raise ValueError(f"aux stage: {k} samples in one call; it takes at most {kmax}")
    pad = lambda x, fill=0: np.concatenate([np.asarray(x)[rows], np.full((kmax - k,) + np.shape(x)[1:], fill,
                                                                          np.asarray(x).dtype)])
    prompt = pad(rollout.prompt_len_b)
    lengths = prompt + pad(rollout.response_len_b)          # padding samples: length 0, no row
    row_b = np.full((kmax,), -1, np.int64)
    row_b[:k] = row_k
    start_b = np.zeros((kmax,), np.int64)
    start_b[:k] = start_k
    layout = packing.Layout(row_b, start_b, np.asarray(lengths, np.int64), num_rows, self.seq_len,
                            int(row_b.max(initial=-1)) + 1)
    tokens_bt = pad(rollout.tokens_bt)
    if self.share is not None and self.share.count > 1:   # the tokens of this process's groups' rows
      need = global_batch.rows_by_process(mesh_lib.batch_sharding(self.mesh, 1), num_rows, self.share.count)
      need = need[:, np.maximum(row_b, 0)] & (row_b >= 0)
      block = Rollout(tokens_bt=tokens_bt, prompt_len_b=prompt, response_len_b=lengths - prompt,
                      logp_bt=None, version_bt=None, finished_b=None, sample_id_b=pad(rollout.sample_id_b))
      block, crossed = processes.fill_rows(self.share, block, need, fields=("tokens_bt",),
                                           vocab_size=self.vocab_size)
      tokens_bt = block.tokens_bt
      self.link["aux_rows_between_hosts_this_host"] += crossed
      self.link["aux_rows_between_hosts_padded_this_host"] += processes.fill_rows_padded(
          self.share, block, need, fields=("tokens_bt",))
    # The models read the tokens only: nothing else crosses (``tokens_only``).
    placed, put = packed_step.place_rows(self.mesh, layout, tokens_bt=tokens_bt, behaviour_logp_bt=None,
                                         version_bt=None, prompt_len_b=prompt, vocab_size=self.vocab_size,
                                         pages=self.pages, tokens_only=True)
    for key in ("host_to_device", "host_to_device_per_device", "host_to_device_this_host"):
      self.link[key.replace("device", "aux", 1)] += put[key]
    self.link["host_to_aux_padded"] += 4 * k * self.seq_len     # the samples' tokens as int32 rows of seq_len
    start = self.timeline.now() if self.timeline is not None else 0.0
    positions, segments, _, _ = self.row_layout(placed)
    dest = np.full((kmax,), self.capacity, np.int32)
    dest[:k] = dest_k
    dest = distributed.put(dest, self._rep)
    outputs = []      # the models' results (the buffers are donated to the next call's scatter)
    if self.reference:
      logp_rw = self.logprobs(self.params, placed.tokens_rw, positions, segments)
      self.buffer = self._scatter(self.buffer, logp_rw, placed.row_b, placed.start_b, placed.length_b, dest)
      outputs.append(logp_rw)
    if self.reward:
      score_k = self.score_fn(self.rm_params, placed.tokens_rw, positions, segments, placed.row_b,
                              placed.start_b, placed.length_b)
      self.scores = self._scatter_scores(self.scores, score_k, dest)
      outputs.append(score_k)
    self._dispatched += 1
    if self._dispatched % BLOCK_EVERY == 0:
      jax.block_until_ready((self.buffer, self.scores))
    if self.timeline is not None:
      timeline, step, group = self.timeline, self.step, self.group
      names = [n for n, on in (("reference", self.reference), ("reward_model", self.reward)) if on]
      done = self._waiter.submit(lambda out: (jax.block_until_ready(out), timeline.now())[1], outputs)
      done.add_done_callback(lambda f: [timeline.record(n, start, f.result(), group=group, step=step)
                                        for n in names])

  def _slot(self, sample_id: int, keep) -> int:
    if not self.free:                      # full: evict the oldest (asked for later, it is scored again)
      oldest = next(s for s in self.slot_of if s not in keep)
      self.free.append(self.slot_of.pop(oldest))
    slot = self.free.pop()
    self.slot_of[sample_id] = slot
    return slot

  def forget(self, sample_ids) -> None:
    """Releases samples that will never be asked for (e.g. discarded stale samples)."""
    for s in sample_ids:
      slot = self.slot_of.pop(int(s), None)
      if slot is not None:
        self.free.append(slot)

  # -- consumer side ----------------------------------------------------------------------------------

  def take(self, rollout: Rollout, layout: packing.Layout | None, width: int, *, reference: bool = True,
           reward: bool = True):
    """(reference log-probs, reward-model scores, metrics) of ``rollout``'s samples (host, in batch order)
    on the aux mesh, each None where the stage does not compute it (or where ``reference`` / ``reward``
    is False: the caller has them already, read from the queue). The log-probs as packed rows laid out as
    ``layout`` ([R, W], batch-sharded), or with ``layout`` None padded rows [B, width]; the scores [B],
    replicated. Samples not scored yet are scored first; every sample's buffer row is released after."""
    reference, reward = reference and self.reference, reward and self.reward
    if not (reference or reward):
      return None, None, {}
    ids = [int(s) for s in np.asarray(rollout.sample_id_b)]
    missing = np.asarray([i for i, s in enumerate(ids) if s not in self.slot_of])
    found = len(ids) - len(missing)
    if len(ids) > self.capacity:
      raise ValueError(f"aux stage: a batch of {len(ids)} samples; the buffer holds {self.capacity}")
    if len(missing):
      self._score(rollout, missing, keep=frozenset(ids))
    slot_b = distributed.put(np.asarray([self.slot_of[s] for s in ids], np.int32), self._rep)
    ref = scores = None
    if reference and layout is None:
      length_b = np.asarray(rollout.prompt_len_b, np.int32) + np.asarray(rollout.response_len_b, np.int32)
      ref = _padded_fn(self.mesh, width)(self.buffer, slot_b, distributed.put(length_b, self._rep))
    elif reference:
      per_sample = distributed.put(tuple(np.asarray(x, np.int32) for x in (layout.row_b, layout.start_b,
                                                                         layout.length_b)), self._rep)
      ref = _packed_fn(self.mesh, layout.num_rows, layout.width)(self.buffer, slot_b, *per_sample)
    if reward:
      scores = _take_fn(self.mesh)(self.scores, slot_b)
    self.forget(ids)
    return ref, scores, {"aux_stage/early_frac": found / max(1, len(ids))} | {
        f"queue/{k}": v for k, v in self.link_bytes().items()}

  def link_bytes(self) -> dict[str, float]:
    """Bytes put on the aux devices since the last call (``link_bytes/host_to_aux``: each call's token
    stream and its per-sample table; ``..._padded``: the same samples' tokens as int32 rows of ``seq_len``,
    what a padded placement would send; ``..._per_device``, ``..._this_host`` as ``place_rows`` counts
    them)."""
    out = {f"link_bytes/{k}": float(v) for k, v in self.link.items()}
    self.link.clear()
    return out

  def fetch(self, rollout: Rollout) -> tuple[list[np.ndarray] | None, np.ndarray | None, dict[str, float]]:
    """What the stage computed for ``rollout``'s samples, on the host, for the queue's fields: (the
    reference's log-probs, ``ref_logp``: one float32 array per sample, as long as its prompt + response, the
    response positions the reference's log-probs and the prompt positions 0, as a ``Rollout``'s; the reward
    model's scores, ``rm_score``: float32 [B]; each None where the stage does not compute it) and the
    bytes fetched (``link_bytes/aux_to_host``; ``..._padded``: the same samples as float32 rows of
    ``seq_len`` and a score each). Samples not scored yet are scored first. Of the log-probs
    only the responses' cross, laid end to end in blocks (``fetch_starts``: two program shapes). The
    samples' buffer rows are released after: the queue holds their values now. More samples than the
    buffer holds are fetched in parts (scoring a part may evict a later part's entries, scored again)."""
    n = len(np.asarray(rollout.sample_id_b))
    if n > self.capacity:
      parts = [self.fetch(jax.tree.map(lambda x, a=a: np.asarray(x)[a:a + self.capacity], rollout))
               for a in range(0, n, self.capacity)]
      rows = None if not self.reference else [r for part in parts for r in part[0]]
      scores = None if not self.reward else np.concatenate([part[1] for part in parts])
      keys = dict.fromkeys(k for part in parts for k in part[2])
      return rows, scores, {k: float(sum(part[2].get(k, 0.0) for part in parts)) for k in keys}
    ids = [int(s) for s in np.asarray(rollout.sample_id_b)]
    missing = np.asarray([i for i, s in enumerate(ids) if s not in self.slot_of])
    if len(missing):
      self._score(rollout, missing, keep=frozenset(ids))
    slots = np.asarray([self.slot_of[s] for s in ids], np.int32)
    rows = scores = None
    fetched = 0
    if self.reference:
      prompt = np.asarray(rollout.prompt_len_b, np.int32)
      length = np.asarray(rollout.response_len_b, np.int32)
      offset = np.cumsum(length, dtype=np.int32) - length
      total = int(length.sum())
      table = np.zeros((4, self.capacity), np.int32)
      table[2, len(ids):] = total                      # unused entries: length 0, after every sample
      table[:, :len(ids)] = [slots, prompt, offset, length]
      slot, column, offsets, lengths = distributed.put(tuple(table), self._rep)
      blocks = distributed.fetch([self._take_flat[size](self.buffer, slot, column, offsets, lengths, np.int32(start))
                                  for start, size in fetch_starts(total)])
      fetched += sum(np.asarray(b).nbytes for b in blocks)
      flat = np.concatenate([np.zeros((0,), np.float32)] + [np.asarray(b) for b in blocks])[:total]
      rows = [np.concatenate([np.zeros((p,), np.float32), flat[o:o + n]]) for p, o, n in zip(prompt, offset, length)]
    if self.reward:
      padded = np.full((self.capacity,), self.capacity, np.int32)     # one program shape; extra entries dropped
      padded[:len(ids)] = slots
      all_scores = np.asarray(distributed.fetch(_take_fn(self.mesh)(self.scores, distributed.put(padded, self._rep))))
      fetched += all_scores.nbytes
      scores = all_scores[:len(ids)].astype(np.float32)
    self.forget(ids)
    padded = len(ids) * 4 * ((self.seq_len if self.reference else 0) + (1 if self.reward else 0))
    return rows, scores, {"link_bytes/aux_to_host": float(fetched), "link_bytes/aux_to_host_padded": float(padded),
                          **self.link_bytes()}

  def close(self) -> None:
    self._waiter.shutdown(wait=True)


@functools.lru_cache(maxsize=32)
def _take_fn(mesh):
  return jax.jit(lambda scores_c, slot_b: scores_c[slot_b], out_shardings=mesh_lib.replicated(mesh))


@functools.lru_cache(maxsize=32)
def _packed_fn(mesh, num_rows: int, width: int):
  return jax.jit(functools.partial(_gather_packed, num_rows=num_rows, width=width),
                 out_shardings=mesh_lib.batch_sharding(mesh, 2))


@functools.lru_cache(maxsize=32)
def _padded_fn(mesh, width: int):
  return jax.jit(functools.partial(_gather_padded, width=width), out_shardings=mesh_lib.batch_sharding(mesh, 2))
