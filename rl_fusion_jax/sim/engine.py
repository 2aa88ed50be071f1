"""The generation engine's scheduling, replayed without a model: which sample sits in which slot, how
many decode steps, chunks, refills and prefill calls a rollout phase takes.

``SimEngine`` follows ``rollout/engine.py::Engine`` (``slots.run_chunk``) decision for decision: at the
start of a run one host prefill call per ``prefill_rows`` in-flight samples recomputes their prefixes
(unless the cache is kept); then chunks of at most ``chunk_steps`` decode steps, each with the queue's
first ``num_slots`` requests uploaded, where before every step, while the free slots reach
``min(prefill_rows, requests left)``, the finished samples move out (slot order) and the next
``prefill_rows`` requests fill the lowest free slots (with ``group_size > 1`` as many of them as have at
most ``unique_rows`` distinct groups: a group's samples share one prompt forward, as the engine's refill
shares one per distinct prompt); a chunk ends once the target is met (complete
groups, every group in ``finish_groups``), when nothing is left, or when the upload is spent and a refill
is due. Each sample's response length is known up front instead of sampled. As in the real engine every
slot advances in lockstep (one SPMD program over all generation replicas). It counts what a phase's
time is made of (``PhaseCounts``); ``costs.py`` turns counts into seconds. Slot state is numpy arrays;
a cluster-scale phase (thousands of slots, thousands of steps) takes about a second. Nothing here
imports JAX.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np


@dataclasses.dataclass(frozen=True)
class SimRequest:
  sample_id: int
  group_id: int
  prompt_len: int
  length: int      # response tokens the sample generates before it finishes


@dataclasses.dataclass
class PhaseCounts:
  """What one ``SimEngine.run`` did (the fields of the engine's run stats of the same names)."""
  decode_steps: int = 0
  decode_chunks: int = 0
  generated_tokens: int = 0
  prefill_calls: int = 0       # host calls: re-prefill of the samples carried in flight
  refill_prefills: int = 0     # refills inside chunks (admitting new samples)
  prefill_rows: int = 0
  reprefill_rows: int = 0
  prefill_tokens: int = 0      # rows x width every prefill processed (``widths`` given), else real tokens
  kv_token_steps: int = 0      # sum over decode steps of the active samples' context lengths


@dataclasses.dataclass(frozen=True)
class Taken:
  """A finished sample returned by a run."""
  sample_id: int
  group_id: int
  prompt_len: int
  length: int
  min_version: int             # the oldest policy version among its tokens


class SimEngine:
  """Slots, a FIFO queue and a finished list, as ``Engine`` keeps them.

  ``widths``: the engine's prefill widths (``slots.prefill_widths``) and ``max_prompt_len``, so that
  ``prefill_tokens`` counts rows x width as the engine does; without them it counts real prefix tokens.
  ``keep_cache``: in-flight samples keep their KV across runs (no re-prefill). ``narrow_refills``: as the
  engine's (``EngineConfig.narrow_refills``)."""

  def __init__(self, num_slots: int, group_size: int, chunk_steps: int = 16, prefill_rows: int = 0,
               batch_shards: int = 1, *, widths: tuple[int, ...] | None = None, max_prompt_len: int = 0,
               keep_cache: bool = False, narrow_refills: bool = False):
    if num_slots < 1 or chunk_steps < 1 or group_size < 1 or num_slots % group_size:
      raise ValueError(f"SimEngine: need num_slots >= 1 divisible by group_size, chunk_steps >= 1; got "
                       f"num_slots={num_slots}, group_size={group_size}, chunk_steps={chunk_steps}")
    self.num_slots, self.group_size, self.chunk_steps = num_slots, group_size, chunk_steps
    # Engine: prefill_rows or a quarter of the slots rounded up to the batch shards.
    self.rows = prefill_rows or -(-max(1, num_slots // 4) // batch_shards) * batch_shards
    # slots.shared_prompt_rows: a refill's forward runs on this many rows, one per distinct prompt (a
    # group's samples share theirs).
    unique = -(-(self.rows - 1) // group_size) + 1 if group_size > 1 else self.rows
    self.unique_rows = min(self.rows, -(-unique // batch_shards) * batch_shards)
    self.widths, self.keep_cache = widths, keep_cache
    if widths is not None:   # slots.refill_widths
      last = _width(widths, max_prompt_len - 1)
      self.new_widths = (tuple(w for w in widths if w < last) if narrow_refills else ()) + (last,)
    self.kv_valid = False
    self.queue: collections.deque[SimRequest] = collections.deque()
    self.chunks = 0
    # Slots: -1 = free; per slot the sample's fields.
    self.slot_id = np.full(num_slots, -1, np.int64)
    self.slot_group = np.zeros(num_slots, np.int64)
    self.slot_prompt = np.zeros(num_slots, np.int64)
    self.slot_len = np.zeros(num_slots, np.int64)
    self.slot_gen = np.zeros(num_slots, np.int64)
    self.slot_ver = np.full(num_slots, -1, np.int64)       # -1: no token yet
    # Finished, unreturned samples: sample id -> (order, Taken); per group counts of done samples
    # (moved out of their slot or not), for targets.
    self.finished: dict[int, tuple[tuple[int, int], Taken]] = {}
    self.done_count: collections.Counter = collections.Counter()
    self.fin_last: dict[int, tuple[int, int]] = {}
    self.complete: set[int] = set()     # groups whose samples have all finished (unreturned)
    self.complete_order: dict[int, tuple[int, int]] = {}

  # -- host state ------------------------------------------------------------------------------------

  def add(self, requests) -> None:
    self.queue.extend(requests)

  @property
  def num_in_flight(self) -> int:
    return int((self.slot_id >= 0).sum())

  def group_min_versions(self) -> dict[int, int | None]:
    """Per held group (queued, in flight, finished unreturned): the oldest version of its tokens."""
    out: dict[int, int | None] = {}

    def put(g, v):
      old = out.get(g)
      out[g] = v if old is None else old if v is None else min(old, v)
    for r in self.queue:
      put(r.group_id, None)
    for s in np.flatnonzero(self.slot_id >= 0):
      put(int(self.slot_group[s]), int(self.slot_ver[s]) if self.slot_ver[s] >= 0 else None)
    for _, t in self.finished.values():
      put(t.group_id, t.min_version)
    return out

  # -- one run ---------------------------------------------------------------------------------------

  def run(self, version: int, *, target_groups: int | None = None,
          finish_groups=None) -> tuple[list[Taken], PhaseCounts]:
    """Generates until ``target_groups`` complete groups (and every group in ``finish_groups``) have
    finished, or, with no target, until nothing is left; returns the samples taken and the counts."""
    finish = frozenset(finish_groups) if finish_groups is not None else None
    counts = PhaseCounts()
    while not self._target_met(target_groups, finish) and (self.queue or self.num_in_flight):
      if not self.kv_valid:
        self._reprefill(counts)
        self.kv_valid = True
      self._chunk(version, target_groups, finish, counts)
    self.kv_valid = self.kv_valid and self.keep_cache
    return self._take(target_groups, finish), counts

  def _target_met(self, n: int | None, finish) -> bool:
    if n is None:
      return False
    return len(self.complete) >= n and (finish is None or finish <= self.complete)

  def _take(self, n: int | None, finish) -> list[Taken]:
    if n is None:
      groups = {t.group_id for _, t in self.finished.values()}
    else:
      complete = sorted(self.complete, key=lambda g: (self.fin_last[g], g))
      groups = set(complete if finish is not None else complete[:n])
    taken = sorted((v for v in self.finished.values() if v[1].group_id in groups), key=lambda v: v[0])
    for _, t in taken:
      del self.finished[t.sample_id]
    for g in groups:
      self.done_count.pop(g, None)
      self.fin_last.pop(g, None)
      self.complete.discard(g)
    return [t for _, t in taken]

  def _reprefill(self, counts: PhaseCounts) -> None:
    flying = np.flatnonzero(self.slot_id >= 0)
    need = np.sort(self.slot_prompt[flying] + self.slot_gen[flying] - 1)
    for start in range(0, len(need), self.rows):
      counts.prefill_calls += 1
      part = need[start:start + self.rows]
      counts.prefill_tokens += (self.rows * _width(self.widths, int(part[-1])) if self.widths is not None
                                else int((part + 1).sum()))
    counts.reprefill_rows += len(flying)

  # -- one chunk: slots.run_chunk ----------------------------------------------------------------------

  def _chunk(self, version: int, n: int | None, finish, counts: PhaseCounts) -> None:
    pending = list(itertools.islice(self.queue, self.num_slots))
    more = len(self.queue) > len(pending)
    tracked = {int(g) for g in self.slot_group[self.slot_id >= 0]} | {r.group_id for r in pending}
    complete_at_start = set(self.complete)
    need_groups = 0 if n is None else n - len(complete_at_start)
    awaited = (finish or frozenset()) - complete_at_start
    blocked = not awaited <= tracked
    self.ptr, self.out_pos = 0, 0
    left = lambda: len(pending) - self.ptr

    def free() -> int:
      return int(np.count_nonzero((self.slot_id < 0) | (self.slot_gen >= self.slot_len)))

    def met() -> bool:
      return (n is not None and not blocked and len(self.complete) - len(complete_at_start) >= need_groups
              and awaited <= self.complete)

    def stops(n_free: int) -> bool:   # the chunk's end conditions, but for its step limit (n_free: free())
      if met():
        return True
      n_left = left()
      can_refill = n_left > 0 and n_free > 0 and n_free >= min(self.rows, n_left)
      active = n_free < self.num_slots
      return not (active or can_refill) or (more and n_left <= 0 and n_free >= self.rows)

    step = 0
    while step < self.chunk_steps and not stops(n_free := free()):
      while left() > 0 and n_free > 0 and n_free >= min(self.rows, left()):
        self._refill(pending, counts)
        n_free = free()
      active = np.flatnonzero((self.slot_id >= 0) & (self.slot_gen < self.slot_len))
      if len(active):
        # Until a sample finishes, nothing the loop tests changes: no slot frees, no group completes, and
        # the refill just done cannot repeat. So the steps up to the next finish run as one, unless the
        # chunk ends after the first (``stops`` already true after the refill).
        to_finish = int((self.slot_len[active] - self.slot_gen[active]).min())
        steps = 1 if stops(n_free) else min(self.chunk_steps - step, to_finish)
        self._decode_steps(active, version, counts, steps)
        step += steps
    self._move_done()
    for _ in range(self.ptr):
      self.queue.popleft()
    self.chunks += 1
    counts.decode_chunks += 1

  def _move_done(self) -> None:
    """Finished samples leave their slots, in slot order (their completion order)."""
    for s in np.flatnonzero((self.slot_id >= 0) & (self.slot_gen >= self.slot_len)):
      sid, g = int(self.slot_id[s]), int(self.slot_group[s])
      order = (self.chunks, self.out_pos)
      self.out_pos += 1
      self.finished[sid] = (order, Taken(sid, g, int(self.slot_prompt[s]), int(self.slot_len[s]),
                                         int(self.slot_ver[s])))
      self.fin_last[g] = max(self.fin_last.get(g, order), order)
      self.slot_id[s] = -1

  def _refill(self, pending: list[SimRequest], counts: PhaseCounts) -> None:
    self._move_done()
    free = np.flatnonzero(self.slot_id < 0)
    k = min(self.rows, len(free), len(pending) - self.ptr)
    if self.unique_rows < self.rows:   # slots.shared_prompts: the longest run whose groups fit
      groups = list(dict.fromkeys(r.group_id for r in pending[self.ptr:self.ptr + k]))[:self.unique_rows]
      k = next((i for i, r in enumerate(pending[self.ptr:self.ptr + k]) if r.group_id not in groups), k)
    admitted = pending[self.ptr:self.ptr + k]
    for s, r in zip(free[:k], admitted):
      self.slot_id[s], self.slot_group[s], self.slot_prompt[s], self.slot_len[s] = (
          r.sample_id, r.group_id, r.prompt_len, r.length)
      self.slot_gen[s], self.slot_ver[s] = 0, -1
    self.ptr += k
    counts.refill_prefills += 1
    counts.prefill_rows += k
    need = max(r.prompt_len for r in admitted) - 1
    if self.widths is not None:
      counts.prefill_tokens += self.unique_rows * _width(self.new_widths, need)
    elif self.unique_rows < self.rows:   # one forward per distinct prompt
      counts.prefill_tokens += sum({r.group_id: r.prompt_len for r in admitted}.values())
    else:
      counts.prefill_tokens += sum(r.prompt_len for r in admitted)

  def _decode_steps(self, active: np.ndarray, version: int, counts: PhaseCounts, steps: int) -> None:
    """``steps`` decode steps of the ``active`` slots, in which no sample finishes before the last."""
    counts.decode_steps += steps
    counts.generated_tokens += len(active) * steps
    # Context lengths grow by one a step: sum over the steps of (prompt + generated so far).
    counts.kv_token_steps += (steps * int((self.slot_prompt[active] + self.slot_gen[active]).sum())
                              + len(active) * steps * (steps - 1) // 2)
    first = active[self.slot_ver[active] < 0]
    self.slot_ver[first] = version      # versions only grow: the first is the oldest
    self.slot_gen[active] += steps
    for s in active[self.slot_gen[active] >= self.slot_len[active]]:
      g = int(self.slot_group[s])
      self.done_count[g] += 1
      if self.done_count[g] == self.group_size:
        self.complete.add(g)


def _width(widths, need: int) -> int:
  """``slots.prefill_width``: the smallest width that holds ``need`` prefix positions."""
  return next(w for w in widths if w >= need)
