"""The generation engine's scheduling, replayed without a model: which sample sits in which slot, how
many decode steps, chunks and prefill calls a rollout phase takes.

``SimEngine`` follows ``rollout/engine.py::Engine`` decision for decision (continuous refill from a FIFO
queue into the lowest free slots, prefill calls of ``prefill_rows`` rows, chunks of at most
``chunk_steps`` decode steps that end early once ``min(prefill_rows, queued)`` slots finished or the
target can be met, re-prefill of every in-flight sample at the start of a run, targets of complete
groups with ``finish_groups``), with each sample's response length known up front instead of sampled.
As in the real engine every slot advances in lockstep (one SPMD program over all generation replicas).
It counts what a phase's time is made of (``PhaseCounts``); ``costs.py`` turns counts into seconds.
Slot state is numpy arrays, so a cluster-scale phase (thousands of slots, thousands of steps) takes
well under a second. Nothing here imports JAX.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import math

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
  prefill_calls: int = 0
  prefill_rows: int = 0
  reprefill_rows: int = 0
  prefill_tokens: int = 0      # prompt (+ response so far) tokens the prefill calls processed
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
  """Slots, a FIFO queue and a finished list, as ``Engine`` keeps them (no KV cache across runs)."""

  def __init__(self, num_slots: int, group_size: int, chunk_steps: int = 16, prefill_rows: int = 0,
               batch_shards: int = 1):
    if num_slots < 1 or chunk_steps < 1 or group_size < 1 or num_slots % group_size:
      raise ValueError(f"SimEngine: need num_slots >= 1 divisible by group_size, chunk_steps >= 1; got "
                       f"num_slots={num_slots}, group_size={group_size}, chunk_steps={chunk_steps}")
    self.num_slots, self.group_size, self.chunk_steps = num_slots, group_size, chunk_steps
    # Engine: prefill_rows or a quarter of the slots rounded up to the batch shards.
    self.rows = prefill_rows or -(-max(1, num_slots // 4) // batch_shards) * batch_shards
    self.queue: collections.deque[SimRequest] = collections.deque()
    self.chunks = 0
    # Slots: -1 = free; per slot the sample's fields.
    self.slot_id = np.full(num_slots, -1, np.int64)
    self.slot_group = np.zeros(num_slots, np.int64)
    self.slot_prompt = np.zeros(num_slots, np.int64)
    self.slot_len = np.zeros(num_slots, np.int64)
    self.slot_gen = np.zeros(num_slots, np.int64)
    self.slot_ver = np.full(num_slots, -1, np.int64)       # -1: no token yet
    # Finished, unreturned samples: sample id -> (order, Taken); per group counts, for targets.
    self.finished: dict[int, tuple[tuple[int, int], Taken]] = {}
    self.fin_count: collections.Counter = collections.Counter()
    self.fin_last: dict[int, tuple[int, int]] = {}
    self.fly_count: collections.Counter = collections.Counter()
    self.queued_count: collections.Counter = collections.Counter()
    self.complete: set[int] = set()     # groups whose samples have all finished (unreturned)
    self.left: set[int] = set()         # groups in flight with nothing queued: can complete in a chunk

  # -- host state ------------------------------------------------------------------------------------

  def add(self, requests) -> None:
    for r in requests:
      self.queue.append(r)
      self.queued_count[r.group_id] += 1

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
    counts, kv_valid = PhaseCounts(), False
    while True:
      self._collect()
      if self._target_met(target_groups, finish) or not (self.queue or self.num_in_flight):
        break
      if not kv_valid:
        self._reprefill(counts)
        kv_valid = True
      self._refill(counts)
      self._decode(version, target_groups, finish, counts)
    return self._take(target_groups, finish), counts

  def _collect(self) -> None:
    occupied = self.slot_id >= 0
    done = np.flatnonzero(occupied & (self.slot_gen >= self.slot_len))
    for s in done[np.argsort(self.slot_id[done], kind="stable")]:
      sid, g = int(self.slot_id[s]), int(self.slot_group[s])
      order = (self.chunks, sid)
      self.finished[sid] = (order, Taken(sid, g, int(self.slot_prompt[s]), int(self.slot_len[s]),
                                         int(self.slot_ver[s])))
      self.fin_count[g] += 1
      if self.fin_count[g] == self.group_size:
        self.complete.add(g)
      self.fin_last[g] = max(self.fin_last.get(g, order), order)
      self.fly_count[g] -= 1
      if not self.fly_count[g]:
        del self.fly_count[g]
        self.left.discard(g)
      self.slot_id[s] = -1

  def _complete_groups(self) -> list[int]:
    return sorted(self.complete, key=lambda g: (self.fin_last[g], g))

  def _target_met(self, n: int | None, finish) -> bool:
    if n is None:
      return False
    return len(self.complete) >= n and (finish is None or finish <= self.complete)

  def _take(self, n: int | None, finish) -> list[Taken]:
    if n is None:
      groups = set(self.fin_count)
    else:
      complete = self._complete_groups()
      groups = set(complete if finish is not None else complete[:n])
    taken = sorted((v for v in self.finished.values() if v[1].group_id in groups), key=lambda v: v[0])
    for _, t in taken:
      del self.finished[t.sample_id]
    for g in groups:
      del self.fin_count[g], self.fin_last[g]
      self.complete.discard(g)
    return [t for _, t in taken]

  def _reprefill(self, counts: PhaseCounts) -> None:
    flying = np.flatnonzero(self.slot_id >= 0)
    counts.prefill_calls += math.ceil(len(flying) / self.rows)
    counts.prefill_tokens += int((self.slot_prompt[flying] + self.slot_gen[flying]).sum())
    counts.reprefill_rows += len(flying)

  def _refill(self, counts: PhaseCounts) -> None:
    free = np.flatnonzero(self.slot_id < 0)
    k = min(len(free), len(self.queue))
    if not k:
      return
    for s in free[:k]:
      r = self.queue.popleft()
      self.slot_id[s], self.slot_group[s], self.slot_prompt[s], self.slot_len[s] = (
          r.sample_id, r.group_id, r.prompt_len, r.length)
      self.slot_gen[s], self.slot_ver[s] = 0, -1
      self.fly_count[r.group_id] += 1
      self.queued_count[r.group_id] -= 1
      if not self.queued_count[r.group_id]:
        del self.queued_count[r.group_id]
        self.left.add(r.group_id)
    counts.prefill_calls += math.ceil(k / self.rows)
    counts.prefill_tokens += int(self.slot_prompt[free[:k]].sum())
    counts.prefill_rows += k

  def _groups_bound(self, n: int, finish) -> int | None:
    """``Engine._groups_bound``: the fewest in-flight samples that must finish before the target can be
    met (None: not within this chunk)."""
    # ``left``: in flight with nothing queued (groups are returned whole, so every other sample of it
    # has finished): the groups that can complete within this chunk.
    awaited = finish - self.complete
    if not awaited <= self.left:
      return None
    short = max(0, n - len(self.complete) - len(awaited))
    if short > len(self.left) - len(awaited):
      return None
    others = heapq.nsmallest(short, (self.fly_count[g] for g in self.left if g not in awaited)) if short else []
    return sum(self.fly_count[g] for g in awaited) + sum(others)

  def _decode(self, version: int, n: int | None, finish, counts: PhaseCounts) -> None:
    min_done = self.num_slots + 1
    if self.queue:
      min_done = min(self.rows, len(self.queue))
    if n is not None and finish is not None:
      bound = self._groups_bound(n, finish)
      if bound is not None:
        min_done = min(min_done, bound)
    self.chunks += 1
    counts.decode_chunks += 1
    active = np.flatnonzero((self.slot_id >= 0) & (self.slot_gen < self.slot_len))
    if not len(active):
      return
    rem = self.slot_len[active] - self.slot_gen[active]
    ordered = np.sort(rem)
    steps = min(self.chunk_steps, int(ordered[-1]))
    if min_done <= len(ordered):   # the chunk ends at the step that finishes the min_done-th slot
      steps = min(steps, int(ordered[max(min_done, 1) - 1]))
    m = np.minimum(rem, steps)
    context = self.slot_prompt[active] + self.slot_gen[active]
    counts.decode_steps += steps
    counts.generated_tokens += int(m.sum())
    counts.kv_token_steps += int((m * context + m * (m - 1) // 2).sum())
    self.slot_gen[active] += m
    first = active[(self.slot_ver[active] < 0) & (m > 0)]
    self.slot_ver[first] = version      # versions only grow: the first is the oldest
