"""The run across processes: host work split by sample, one metric record per step, a timeline lane each.

Every process runs the same loop (``orchestration/loop.py``); these are the places where processes differ
or meet (through ``distributed.exchange``, the coordination service's key-value store: host bytes, no
device work; ``fill_rows`` through one all-to-all over one device per process), each a no-op in a
one-process run:
  * ``Share`` / ``gather_rows``: each process decodes and scores the samples it owns, then all exchange
    the results;
  * ``fill_rows`` / ``version_range``: where each process holds only the rows it read
    (``Engine.local_rows``), each process receives from their holders the rows its devices train on, and
    no other, and the batch's version range comes from every process;
  * ``reduce_metrics``: the step's metrics of every process -> the run's (queue transfer counters summed,
    own shares averaged, times the slowest process's);
  * ``run_queue_counters`` / ``local_queue_counters``: the queue counters a checkpoint saves are the run's;
  * ``ProcessTimeline``: process 0 writes the timeline, with a lane per process.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import time
from typing import Any

import numpy as np

from rl_fusion_jax.distributed import (client, exchange, is_writer, padded_bytes, process_count, process_index,
                                       send_bytes)
from rl_fusion_jax.timeline import Timeline


@dataclasses.dataclass(frozen=True)
class Share:
  """Which samples this process owns for host work: the process holding the sample's row where
  ``readers`` (sample id -> process; the engine's ``readers`` under ``Engine.local_rows``) knows it, else
  ``sample_id % count == index`` (every sample exactly one owner; a group's consecutive ids spread over
  the processes). ``Share()`` (one process) owns all."""
  index: int = 0
  count: int = 1
  readers: dict | None = dataclasses.field(default=None, compare=False, hash=False)

  def owner(self, sample_ids) -> np.ndarray:
    """The process that owns each of ``sample_ids``."""
    ids = np.asarray(sample_ids, np.int64)
    out = ids % self.count
    if self.readers:
      known = [i for i, s in enumerate(ids.tolist()) if s in self.readers]
      out[known] = [self.readers[int(ids[i])] for i in known]
    return out

  def owns(self, sample_ids) -> np.ndarray:
    return self.owner(sample_ids) == self.index

  @classmethod
  def of_run(cls) -> "Share":
    return cls(process_index(), process_count())


def _encode(arrays) -> str:
  return json.dumps([[a.dtype.str, list(a.shape), base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()]
                     for a in arrays])   # exact: dtype, shape and bytes


def _decode(text: str) -> list[np.ndarray]:
  return [np.frombuffer(base64.b64decode(b), np.dtype(d)).reshape(s) for d, s, b in json.loads(text)]


def gather_rows(name: str, share: Share, sample_ids, arrays, timeout_s: int = 600) -> list[np.ndarray]:
  """Rows (one per sample of ``sample_ids``) computed by their owners -> the whole arrays on every process.

  Each process passes ``arrays`` with the rows of the samples it owns filled in (the other rows anything);
  it gets back the arrays with every process's rows in place, the same on every process. Travels through
  the coordination service's key-value store (host bytes, no device work); every process calls it with
  the same ``name`` in the same order.
  """
  arrays = [np.asarray(a) for a in arrays]
  if share.count == 1:
    return arrays
  owner = share.owner(sample_ids)
  texts = exchange(f"rows/{name}", _encode([a[owner == share.index] for a in arrays]), timeout_s)
  out = [np.array(a) for a in arrays]
  for p, text in enumerate(texts):
    if p != share.index:
      for o, g in zip(out, _decode(text)):
        o[owner == p] = g
  return out


# The per-token fields of a host Rollout that ``fill_rows`` moves: the token id (as many bytes as the
# vocabulary needs, ``token_bytes``), the log-prob (its float32 bits) and the version (2 bytes above the
# payload's lowest, which heads the payload as an int32).
ROW_FIELDS = ("tokens_bt", "logp_bt", "version_bt")


def _field_bytes(field: str, token_bytes: int) -> int:
  return {"tokens_bt": token_bytes, "logp_bt": 4, "version_bt": 2}[field]


def _to_wire(values: np.ndarray, field: str, token_bytes: int, base: int) -> np.ndarray:
  if field == "tokens_bt":
    return np.ascontiguousarray(values.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :token_bytes]).reshape(-1)
  if field == "logp_bt":
    return values.astype("<f4").view(np.uint8)
  above = values.astype(np.int64) - base
  if above.size and above.max() >= 1 << 16:
    raise ValueError(f"fill_rows: versions span {int(above.max()) + 1} (> 65536) in one payload")
  return above.astype("<u2").view(np.uint8)


def _from_wire(data: np.ndarray, field: str, token_bytes: int, base: int) -> np.ndarray:
  if field == "tokens_bt":
    wide = np.zeros((data.size // token_bytes, 4), np.uint8)
    wide[:, :token_bytes] = data.reshape(-1, token_bytes)
    return wide.reshape(-1).view("<u4").astype(np.int32)
  if field == "logp_bt":
    return data.view("<f4")
  return data.view("<u2").astype(np.int32) + base


def fill_rows(share: Share, rollout, need, fields=ROW_FIELDS, vocab_size: int | None = None) -> tuple:
  """A host Rollout whose responses are held by their owners (``share.owner``; the other rows carry prompt
  and lengths only) -> (the same rollout with the responses of the rows ``need[share.index]`` marks filled
  in from their owners, the bytes that crossed to this process). ``need[p]``: bool [B], the rows process p
  needs; every process passes the same ``need``. Each owner sends each process exactly the rows it needs
  (``distributed.send_bytes``), so no process receives a row it does not need. ``fields``: which of
  ``ROW_FIELDS`` move (e.g. ``("tokens_bt",)`` for a model that reads the tokens only). A response token
  crosses in ``value_bytes(vocab_size)`` bytes for its id (4 without ``vocab_size``), 4 for its log-prob
  and 2 for its version (each payload headed by its lowest version): 7 bytes at a vocabulary of 256."""
  if share.count == 1:
    return rollout, 0
  from rl_fusion_jax.train.packing import value_bytes  # pylint: disable=g-import-not-at-top
  token_bytes = 4 if vocab_size is None else value_bytes(vocab_size)
  need = np.asarray(need, bool)
  owner = share.owner(rollout.sample_id_b)
  start_b = np.asarray(rollout.prompt_len_b, np.int64)
  len_b = np.asarray(rollout.response_len_b, np.int64)
  per_token = sum(_field_bytes(f, token_bytes) for f in fields)
  header = 4 if "version_bt" in fields else 0
  rows = lambda p, q: np.flatnonzero((owner == p) & need[q] & (len_b > 0)) if p != q else np.zeros((0,), np.int64)
  size_of = lambda r: per_token * int(len_b[r].sum()) + header * bool(len(r))
  sizes = np.asarray([[size_of(rows(p, q)) for q in range(share.count)] for p in range(share.count)], np.int64)
  cut = lambda x, r: (np.concatenate([x[b, start_b[b]:start_b[b] + len_b[b]] for b in r]) if len(r)
                      else np.zeros((0,), np.asarray(x).dtype))

  def payload(r):
    if not len(r):
      return np.zeros((0,), np.uint8)
    base = int(cut(rollout.version_bt, r).min()) if header else 0
    parts = [np.asarray([base], "<i4").view(np.uint8)] if header else []
    return np.concatenate(parts + [_to_wire(cut(getattr(rollout, f), r), f, token_bytes, base) for f in fields])

  received = send_bytes([payload(rows(share.index, q)) for q in range(share.count)], sizes)
  out = {f: np.array(getattr(rollout, f)) for f in fields}
  for p, data in enumerate(received):
    r = rows(p, share.index)
    if not len(r):
      continue
    base = int(data[:4].view("<i4")[0]) if header else 0
    offset, total = header, int(len_b[r].sum())
    for f in fields:
      size = _field_bytes(f, token_bytes) * total
      values, at = _from_wire(data[offset:offset + size], f, token_bytes, base), 0
      for b in r:
        out[f][b, start_b[b]:start_b[b] + len_b[b]] = values[at:at + len_b[b]]
        at += int(len_b[b])
      offset += size
  crossed = (share.count - 1) * padded_bytes(sizes.max()) if sizes.any() else 0
  return rollout.replace(**out), crossed


def fill_rows_padded(share: Share, rollout, need, fields=ROW_FIELDS) -> int:
  """What the rows ``fill_rows(share, rollout, need, fields)`` brings this process would take padded: each
  as one int32 / float32 row of the rollout's width per field (the link's padded equivalent)."""
  if share.count == 1:
    return 0
  received = ((share.owner(rollout.sample_id_b) != share.index) & np.asarray(need, bool)[share.index]
              & (np.asarray(rollout.response_len_b) > 0))
  return 4 * len(fields) * int(np.shape(rollout.tokens_bt)[1]) * int(received.sum())


def sum_over(name: str, numbers, share: Share) -> list[float]:
  """``numbers`` (a list of floats) summed element by element over the processes of ``share`` (the
  key-value store; every process calls it with the same ``name`` at the same point)."""
  numbers = [float(x) for x in numbers]
  if share.count == 1:
    return numbers
  return [float(sum(col)) for col in zip(*(json.loads(t) for t in exchange(f"sum/{name}", json.dumps(numbers))))]


def version_range(share: Share, rollout) -> tuple[int, int] | None:
  """The lowest and highest response-token version of ``rollout``'s samples, over every process (each
  reads those of the samples it owns: ``share.owner``); None when no sample has a response token."""
  owned = share.owns(rollout.sample_id_b)
  versions = [rollout.version_bt[b, rollout.prompt_len_b[b]:rollout.prompt_len_b[b] + rollout.response_len_b[b]]
              for b in np.flatnonzero(owned)]
  versions = np.concatenate(versions) if versions else np.zeros((0,), np.int32)
  mine = [int(versions.min()), int(versions.max())] if versions.size else None
  ranges = [json.loads(t) for t in exchange("version_range", json.dumps(mine))] if share.count > 1 else [mine]
  ranges = [r for r in ranges if r is not None]
  return (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None


# ----------------------------------------------------------------------------------------------------
# Metrics: one record per step for the whole run.
# ----------------------------------------------------------------------------------------------------

# What each process counts for itself and the run sums: the queue's transfer counters (each process's
# replica counts the rows it fed to its devices).
QUEUE_COUNTERS = ("bytes_", "token_rows_bytes")
SUMMED = tuple(f"queue/{c}" for c in QUEUE_COUNTERS)
# What one process moved itself (e.g. the bytes it put on its devices): the busiest host's and the sum.
PER_HOST = "_this_host"
# Each process's own share of its host work (mean over processes).
AVERAGED = ("verify/early_frac",)


def is_timing(key: str) -> bool:
  """Whether a metric measures time (and so differs between runs and processes): ``*_s``, ``*seconds``,
  ``*_per_s``. Every other metric of a run is a function of its config and seed."""
  return key.endswith(("_s", "seconds")) or "_per_s" in key


def reduce_metrics(step: int, scalars: dict[str, float]) -> dict[str, float]:
  """One step's metrics of every process -> the run's (``combine``). Every process calls it once per
  recorded step, and every process gets the run's metrics."""
  if process_count() == 1:
    return dict(scalars)
  records = [json.loads(t) for t in exchange("metrics", json.dumps({k: float(v) for k, v in scalars.items()}))]
  out, differing = combine(records)
  if differing:
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning("metrics differ between processes at step %d (taken from process 0): %s", step,
                    {k: [r.get(k) for r in records] for k in differing})
  return out


def run_queue_counters(counters: dict[str, float]) -> dict[str, float]:
  """A queue replica's counters with its transfer counters replaced by the run's (summed over the
  processes; every process calls it at the same point). What a checkpoint saves; on restore only process
  0 keeps them (``local_queue_counters``), so the sums stay the run's."""
  if process_count() == 1:
    return dict(counters)
  mine = {k: float(v) for k, v in counters.items() if k.startswith(QUEUE_COUNTERS)}
  records = [json.loads(t) for t in exchange("queue_counters", json.dumps(mine))]
  return {**counters, **{k: float(sum(r.get(k, 0.0) for r in records)) for k in mine}}


def local_queue_counters(counters: dict[str, float]) -> dict[str, float]:
  """Restored run counters -> this process's share: all of them on process 0, no transfers elsewhere."""
  if process_index() == 0:
    return dict(counters)
  return {k: (0.0 if k.startswith(QUEUE_COUNTERS) else v) for k, v in counters.items()}


def combine(records: list[dict[str, float]]) -> tuple[dict[str, float], list[str]]:
  """Per-process metric records -> (the run's record, keys that should agree but differ).

  The queue's transfer counters are summed (each process counts the rows it fed), own shares of host
  work averaged, times are the slowest process's (max), and what each process moved itself
  (``*_this_host``) is the busiest host's (max) with the sum over the hosts beside it (``*_hosts_sum``);
  every other metric is computed from the same data on every process and taken from process 0 (a
  difference means the processes diverged).
  """
  out, differing = {}, []
  for key, value in records[0].items():
    values = [r.get(key, value) for r in records]
    if key.endswith(PER_HOST):
      out[key] = float(max(values))
      out[key[:-len(PER_HOST)] + "_hosts_sum"] = float(sum(values))
    elif key.startswith(SUMMED):
      out[key] = float(sum(values))
    elif key.startswith(AVERAGED):
      out[key] = float(np.mean(values))
    elif is_timing(key):
      out[key] = float(max(values))
    else:
      out[key] = value
      if any(v != value and not (math.isnan(v) and math.isnan(value)) for v in values):
        differing.append(key)
  return out, differing


# ----------------------------------------------------------------------------------------------------
# The timeline.
# ----------------------------------------------------------------------------------------------------

class ProcessTimeline(Timeline):
  """The run's timeline with a lane per process: process 0 appends to the run's file; every other
  process records in memory and sends what it recorded to process 0 at each ``gather()`` (called by
  every process at the same points: once per step), where it lands as group ``<group>@p<N>`` with that
  process's devices of the group. Times are aligned on the wall clock (each process sends the Unix time
  of its timeline's zero once), so lanes of processes on one machine line up exactly.
  """

  def __init__(self, path: str, groups: dict[str, Any]):
    super().__init__(path if is_writer() else None)
    for name, ids in groups.items():
      self.add_group(name, ids)
    self._groups, self._sent, self._rounds = dict(groups), 0, 0
    self._shift = [0.0]
    if process_count() > 1:
      zeros = exchange("timeline/zero", repr(time.time() - self.now()))
      self._shift = [float(z) - float(zeros[0]) for z in zeros]

  def _lane(self, group: str, process: int) -> str:
    import jax  # pylint: disable=g-import-not-at-top
    name = f"{group}@p{process}"
    if name not in self.groups:
      ids = list(self._groups.get(group, ()))
      on_device = {d.id: d.process_index for d in jax.devices()}
      local = [i for i in ids if on_device.get(i) == process]
      self.add_group(name, local or ids)
    return name

  def gather(self) -> None:
    """Moves the phases other processes recorded since the last call into process 0's file."""
    if process_count() == 1:
      return
    kv, me, key = client(), process_index(), f"rlfj/timeline/{self._rounds}"
    self._rounds += 1
    if me:
      with self._lock:
        new, self._sent = self.intervals[self._sent:], len(self.intervals)
      kv.key_value_set(f"{key}/{me}", json.dumps([dataclasses.astuple(i) for i in new]))
      return
    for p in range(1, process_count()):
      text = kv.blocking_key_value_get(f"{key}/{p}", 600_000)
      kv.key_value_delete(f"{key}/{p}")
      for name, group, step, start, end in json.loads(text):
        self.record(name, start + self._shift[p], end + self._shift[p], group=self._lane(group, p), step=step)
