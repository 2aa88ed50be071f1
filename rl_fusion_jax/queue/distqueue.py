"""DistQueue: the host-side data plane between stages, a column store keyed by integer sample index.

Each stage (generate, reward, reference log-probs, advantages, train) writes the fields it produces for
some samples and reads, as a registered consumer, the fields it needs once they are written. Token fields
(``per_token=True``) are variable-length and stored packed: each ``put`` keeps one flat buffer per field
for the samples it wrote (a chunk), each sample holds a view of its slice, and no padding is ever stored;
consumers get ``Packed(flat, lengths, offsets)`` and pad only where they must (``unpack``). A sample's
storage is freed once every registered consumer has read it, or when it is dropped (counted by reason).
Memory is bounded by ``capacity`` samples: a producer opening samples in a full queue waits (back-pressure).

This module never imports jax, never pads what it stores, never overwrites a written field, and never
drops a sample silently: a drop is an explicit call and lands in ``stats()``.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np

# Cumulative counters (wait_s/... and dropped/<reason> are added as they first occur). token_rows_bytes
# sums rows * itemsize over token-field reads: times a width it is what padding to that width would move.
_COUNTERS = ("evicted", "bytes_read_tokens", "bytes_read_samples", "token_rows_bytes",
             "bytes_read_tokens_batchmax")
_RESERVED = frozenset({"indices", "block", "timeout", "producer"})  # keyword arguments of put
# The clock that wait_s/... counters read, once as a wait starts (holding the lock, just before it is
# released to wait) and once as it ends. Tests put a clock of their own here to know that a caller is
# waiting and to measure its wait without depending on the machine's load.
_clock = time.monotonic


class QueueFull(RuntimeError):
  """A producer found no room for new samples (block=False, or its timeout ran out)."""


class NotReady(RuntimeError):
  """A consumer asked for samples that are not (or not yet) ready for it."""


@dataclasses.dataclass(frozen=True)
class FieldSpec:
  """One column: ``per_token`` fields hold a 1-D array per sample, the others one scalar per sample."""
  name: str
  dtype: np.dtype
  per_token: bool

  def __post_init__(self):
    if not self.name.isidentifier() or self.name in _RESERVED:
      raise ValueError(f"field name {self.name!r} must be an identifier other than {sorted(_RESERVED)}")
    object.__setattr__(self, "dtype", np.dtype(self.dtype))


@dataclasses.dataclass(frozen=True)
class Packed:
  """Rows of different lengths back to back: row i is ``flat[offsets[i]:offsets[i] + lengths[i]]``."""
  flat: np.ndarray
  lengths: np.ndarray
  offsets: np.ndarray = dataclasses.field(init=False)

  def __post_init__(self):
    flat, lengths = np.asarray(self.flat), np.asarray(self.lengths, np.int64)
    if lengths.ndim != 1 or (lengths < 0).any():
      raise ValueError(f"Packed lengths must be a 1-D array >= 0, got {lengths}")
    if flat.ndim != 1 or len(flat) != lengths.sum():
      raise ValueError(f"Packed flat has shape {flat.shape}; lengths sum to {lengths.sum()}")
    object.__setattr__(self, "flat", flat)
    object.__setattr__(self, "lengths", lengths)
    object.__setattr__(self, "offsets", np.cumsum(lengths) - lengths)

  def __len__(self) -> int:
    return len(self.lengths)

  def row(self, i: int) -> np.ndarray:
    return self.flat[self.offsets[i]:self.offsets[i] + self.lengths[i]]

  def rows(self, start: int, stop: int) -> Packed:
    """Rows [start, stop) as their own Packed (the flat part is a view, not a copy)."""
    lo = int(self.offsets[start]) if start < len(self) else len(self.flat)
    lengths = self.lengths[start:stop]
    return Packed(self.flat[lo:lo + int(lengths.sum())], lengths)


def pack(rows: Sequence[np.ndarray], dtype=None) -> Packed:
  """1-D arrays -> one flat buffer plus lengths."""
  rows = [np.asarray(r, dtype) for r in rows]
  for i, r in enumerate(rows):
    if r.ndim != 1:
      raise ValueError(f"pack: row {i} has shape {r.shape}; rows must be 1-D")
  flat = np.concatenate(rows) if rows else np.zeros((0,), dtype or np.float32)
  return Packed(flat, np.array([len(r) for r in rows], np.int64))


def unpack(packed: Packed, width: int, pad=0) -> np.ndarray:
  """Packed rows -> [N, width], row i left-aligned with its ``lengths[i]`` values, ``pad`` after."""
  if len(packed) and packed.lengths.max() > width:
    raise ValueError(f"unpack: a row of {packed.lengths.max()} values does not fit width={width}")
  out_nw = np.full((len(packed), width), pad, packed.flat.dtype)
  out_nw[np.arange(width)[None, :] < packed.lengths[:, None]] = packed.flat  # row-major = packed order
  return out_nw


def check_capacity(capacity: int, batch: int) -> None:
  """A queue smaller than one consumer batch would block that consumer forever."""
  if capacity < batch:
    raise ValueError(f"capacity={capacity} is smaller than one consumer batch ({batch} samples); "
                     "raise capacity to at least the batch")


@dataclasses.dataclass(frozen=True)
class Batch:
  """What one ``read`` returns: sample indices, scalar fields [N] and packed token fields."""
  indices: np.ndarray
  sample: dict[str, np.ndarray]
  tokens: dict[str, Packed]

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, name: str):
    return self.tokens[name] if name in self.tokens else self.sample[name]


class DistQueue:
  """Column store with per-consumer consumption, eviction, back-pressure, metrics and checkpoints."""

  def __init__(self, fields: Iterable[FieldSpec], capacity: int):
    if capacity < 1:
      raise ValueError(f"capacity={capacity} must be >= 1")
    self.fields = {f.name: f for f in fields}
    self.capacity = int(capacity)
    self._cond = threading.Condition(threading.RLock())
    self._cols: dict[str, dict[int, object]] = {name: {} for name in self.fields}
    self._length: dict[int, int] = {}         # token count of each live sample (set by its first token field)
    self._live: set[int] = set()
    self._needs: dict[str, tuple[str, ...]] = {}
    self._consumed: dict[str, set[int]] = {}
    self._retired_floor = 0                   # every index below it is retired; the set holds the rest
    self._retired: set[int] = set()
    self._counters: dict[str, float] = dict.fromkeys(_COUNTERS, 0.0)

  # ---- Producers -------------------------------------------------------------------------------------

  def put(self, indices, *, block: bool = True, timeout: float | None = None, producer: str = "producer",
          **fields) -> None:
    """Writes ``fields`` for ``indices``, opening the samples not yet live (waiting for room if full)."""
    if not fields:
      raise ValueError("put needs at least one field")
    with self._cond:
      indices = self._check_indices(indices)
      values = {name: self._coerce(name, indices, v) for name, v in fields.items()}
      self._check_writes(indices, values)  # fails before waiting ...
      self._wait_for_room(indices, block, timeout, producer)
      self._check_writes(indices, values)  # ... and again: the lock was released while waiting
      for name, v in values.items():
        self._store(name, indices, v)
      self._cond.notify_all()

  def write(self, field: str, indices, values, **kwargs) -> None:
    self.put(indices, **kwargs, **{field: values})

  def drop(self, indices, reason: str) -> None:
    """Frees live samples before every consumer read them; counted under ``dropped/<reason>``."""
    with self._cond:
      indices = self._check_indices(indices)
      for i in indices:
        if i not in self._live:
          raise KeyError(f"drop: sample {i} is not live (never written, consumed or dropped already)")
      for i in indices:
        self._evict(i)
      key = f"dropped/{reason}"
      self._counters[key] = self._counters.get(key, 0.0) + len(indices)
      self._cond.notify_all()

  def _check_indices(self, indices) -> list[int]:
    indices = [int(i) for i in np.asarray(indices, np.int64).reshape(-1)]
    if any(i < 0 for i in indices):
      raise ValueError(f"sample indices must be >= 0, got {sorted(indices)}")
    if len(set(indices)) != len(indices):
      raise ValueError(f"indices repeat a sample: {sorted(indices)}")
    return indices

  def _coerce(self, name: str, indices: list[int], value):
    if name not in self.fields:
      raise KeyError(f"field {name!r} is not declared (declared: {sorted(self.fields)})")
    spec = self.fields[name]
    if spec.per_token:
      value = value if isinstance(value, Packed) else pack(value)
    else:
      value = np.asarray(value)
      if value.ndim != 1:
        raise ValueError(f"field {name!r}: expected one scalar per sample, got shape {value.shape}")
    flat = value.flat if spec.per_token else value
    if not np.can_cast(flat.dtype, spec.dtype, casting="same_kind"):
      raise TypeError(f"field {name!r}: {flat.dtype} values do not fit declared {spec.dtype}")
    if len(value) != len(indices):
      raise ValueError(f"field {name!r}: {len(value)} values for {len(indices)} indices")
    return Packed(flat.astype(spec.dtype), value.lengths) if spec.per_token else value.astype(spec.dtype)

  def _check_writes(self, indices: list[int], values: dict) -> None:
    for name in values:
      for i in indices:
        if self._is_retired(i):
          raise KeyError(f"field {name!r}: sample {i} was already consumed or dropped")
        if i in self._cols[name]:
          raise ValueError(f"field {name!r} was already written for sample {i} (no overwrite)")
    token = {name: v.lengths for name, v in values.items() if isinstance(v, Packed)}
    for k, i in enumerate(indices):
      first = self._length.get(i)
      for name, lengths in token.items():
        first = int(lengths[k]) if first is None else first
        if lengths[k] != first:
          raise ValueError(f"field {name!r}: sample {i} has {lengths[k]} tokens, its other token fields "
                           f"have {first}")

  def _wait_for_room(self, indices: list[int], block: bool, timeout, producer: str) -> None:
    new = lambda: sum(i not in self._live for i in indices)
    if new() > self.capacity:
      raise ValueError(f"put opens {new()} samples at once; capacity={self.capacity}")
    self._wait(lambda: len(self._live) + new() <= self.capacity, block, timeout, f"producer/{producer}",
               lambda: QueueFull(f"{new()} new samples do not fit: {len(self._live)} of capacity="
                                 f"{self.capacity} live (producer {producer!r})"))

  def _wait(self, ok, block: bool, timeout, who: str, error) -> None:
    if ok():
      return
    if not block:
      raise error()
    start = _clock()
    done = self._cond.wait_for(ok, timeout)
    key = f"wait_s/{who}"
    self._counters[key] = self._counters.get(key, 0.0) + _clock() - start
    if not done:
      raise error()

  def _store(self, name: str, indices: list[int], value) -> None:
    column = self._cols[name]
    for k, i in enumerate(indices):
      self._live.add(i)
      if isinstance(value, Packed):
        column[i] = value.row(k)  # a view: the chunk is freed with the last of its samples
        self._length.setdefault(i, len(column[i]))
      else:
        column[i] = value[k]

  # ---- Consumers -------------------------------------------------------------------------------------

  def register_consumer(self, name: str, needs: Sequence[str]) -> None:
    """A consumer reads ``needs`` once per sample; samples leave the queue when every consumer read them."""
    with self._cond:
      if name in self._needs:
        raise ValueError(f"consumer {name!r} is already registered")
      for field in needs:
        if field not in self.fields:
          raise KeyError(f"consumer {name!r} needs field {field!r}, which no one declared "
                         f"(declared: {sorted(self.fields)})")
      self._needs[name] = tuple(needs)
      self._consumed[name] = set()

  def ready(self, consumer: str) -> np.ndarray:
    """Ascending indices whose needed fields are all written and that ``consumer`` has not read."""
    with self._cond:
      return np.array(sorted(self._ready(consumer)), np.int64)

  def read(self, consumer: str, indices=None, *, n: int | None = None, block: bool = False,
           timeout: float | None = None, counted: bool = True) -> Batch:
    """Reads ``indices`` (all ready), or the ``n`` lowest ready indices (waiting for them if ``block``).

    ``counted=False``: kept out of the byte counters. For a replica of the queue in one process of several
    reading, for its host bookkeeping, rows another process fed to its devices (each process's counters
    then hold what it fed, and the counters summed over processes what the run fed)."""
    with self._cond:
      self._check_consumer(consumer)
      if (indices is None) == (n is None):
        raise ValueError("read takes indices or n, not both")
      if indices is None:
        indices = self._wait_for_ready(consumer, n, block, timeout)
      indices = self._check_indices(indices)
      self._check_ready(consumer, indices)
      saved = dict(self._counters)
      batch = self._gather(consumer, indices)
      if not counted:
        self._counters = saved
      self._consume(consumer, indices)
      return batch

  def live(self) -> np.ndarray:
    """Ascending indices of the samples held now (put and neither read by every consumer nor dropped)."""
    with self._cond:
      return np.array(sorted(self._live), np.int64)

  def peek(self, indices, fields: Sequence[str]) -> dict[str, np.ndarray]:
    """Sample (scalar) fields of live samples, for scheduling decisions; consumes and counts nothing."""
    with self._cond:
      out = {}
      for name in fields:
        spec = self.fields.get(name)
        if spec is None or spec.per_token:
          raise ValueError(f"peek: {name!r} is not a declared sample field")
        column = self._cols[name]
        missing = [int(i) for i in indices if int(i) not in column]
        if missing:
          raise NotReady(f"peek: samples {missing[:5]} have no field {name!r}")
        out[name] = np.array([column[int(i)] for i in indices], spec.dtype)
      return out

  def _check_consumer(self, consumer: str) -> None:
    if consumer not in self._needs:
      raise KeyError(f"consumer {consumer!r} is not registered (registered: {sorted(self._needs)})")

  def _ready(self, consumer: str) -> list[int]:
    self._check_consumer(consumer)
    columns = [self._cols[f] for f in self._needs[consumer]]
    done = self._consumed[consumer]
    return [i for i in self._live if i not in done and all(i in c for c in columns)]

  def _wait_for_ready(self, consumer: str, n: int, block: bool, timeout) -> list[int]:
    check_capacity(self.capacity, n)
    self._wait(lambda: len(self._ready(consumer)) >= n, block, timeout, f"consumer/{consumer}",
               lambda: NotReady(f"consumer {consumer!r} asked for {n} samples; "
                                f"{len(self._ready(consumer))} are ready"))
    return sorted(self._ready(consumer))[:n]

  def _check_ready(self, consumer: str, indices: list[int]) -> None:
    for i in indices:
      if i in self._consumed[consumer] or self._is_retired(i):
        raise NotReady(f"consumer {consumer!r} already read sample {i} (or it was dropped)")
      missing = [f for f in self._needs[consumer] if i not in self._cols[f]]
      if missing:
        raise NotReady(f"consumer {consumer!r}: sample {i} lacks fields {missing}")

  def _gather(self, consumer: str, indices: list[int]) -> Batch:
    sample, tokens = {}, {}
    for name in self._needs[consumer]:
      spec, column = self.fields[name], self._cols[name]
      if spec.per_token:
        tokens[name] = pack([column[i] for i in indices], spec.dtype)
        self._count_token_bytes(tokens[name], spec.dtype.itemsize)
      else:
        sample[name] = np.array([column[i] for i in indices], spec.dtype)
        self._counters["bytes_read_samples"] += sample[name].nbytes
    return Batch(np.array(indices, np.int64), sample, tokens)

  def _count_token_bytes(self, packed: Packed, itemsize: int) -> None:
    self._counters["bytes_read_tokens"] += packed.flat.nbytes
    self._counters["token_rows_bytes"] += len(packed) * itemsize
    self._counters["bytes_read_tokens_batchmax"] += len(packed) * itemsize * int(packed.lengths.max(initial=0))

  def _consume(self, consumer: str, indices: list[int]) -> None:
    self._consumed[consumer].update(indices)
    for i in indices:
      if all(i in done for done in self._consumed.values()):
        self._evict(i)
        self._counters["evicted"] += 1
    self._cond.notify_all()

  # ---- Eviction --------------------------------------------------------------------------------------

  def _evict(self, i: int) -> None:
    for column in self._cols.values():
      column.pop(i, None)
    for done in self._consumed.values():
      done.discard(i)
    self._length.pop(i, None)
    self._live.discard(i)
    self._retired.add(i)
    while self._retired_floor in self._retired:  # keeps the set to the indices retired out of order
      self._retired.remove(self._retired_floor)
      self._retired_floor += 1

  def _is_retired(self, i: int) -> bool:
    return i < self._retired_floor or i in self._retired

  # ---- Metrics and checkpoints -----------------------------------------------------------------------

  def stats(self, width: int | None = None) -> dict[str, float]:
    """Counters plus depth. ``bytes_read_padded`` is what the same reads would move padded to ``width``
    tokens per row (default: each read padded to its own longest row, the least any padding needs)."""
    with self._cond:
      c = dict(self._counters)
      tokens_padded = (c["token_rows_bytes"] * width if width is not None
                       else c["bytes_read_tokens_batchmax"])
      c["bytes_read_packed"] = c["bytes_read_tokens"] + c["bytes_read_samples"]
      c["bytes_read_padded"] = tokens_padded + c["bytes_read_samples"]
      c["dropped"] = sum(v for k, v in c.items() if k.startswith("dropped/"))
      c["depth"] = float(len(self._live))
      c["capacity"] = float(self.capacity)
      return {k: float(v) for k, v in sorted(c.items())}

  def state_dict(self) -> dict:
    """Plain numpy arrays and JSON-able values: fields, live samples, consumption state and counters."""
    with self._cond:
      live = sorted(self._live)
      return {
          "fields": [[f.name, f.dtype.str, f.per_token] for f in self.fields.values()],
          "capacity": self.capacity,
          "columns": {name: self._column_state(name, live) for name in self.fields},
          "consumers": {name: {"needs": list(needs),
                               "consumed": np.array(sorted(self._consumed[name]), np.int64)}
                        for name, needs in self._needs.items()},
          "retired_floor": self._retired_floor,
          "retired": np.array(sorted(self._retired), np.int64),
          "counters": dict(self._counters),
      }

  def _column_state(self, name: str, live: list[int]) -> dict:
    column, spec = self._cols[name], self.fields[name]
    indices = [i for i in live if i in column]
    values = [column[i] for i in indices]
    if spec.per_token:
      packed = pack(values, spec.dtype)
      return {"indices": np.array(indices, np.int64), "flat": packed.flat, "lengths": packed.lengths}
    return {"indices": np.array(indices, np.int64), "values": np.array(values, spec.dtype)}

  @classmethod
  def from_state_dict(cls, state: dict) -> DistQueue:
    queue = cls([FieldSpec(n, np.dtype(d), bool(t)) for n, d, t in state["fields"]], state["capacity"])
    for name, col in state["columns"].items():
      value = Packed(col["flat"], col["lengths"]) if "flat" in col else col["values"]
      if len(col["indices"]):
        queue._store(name, [int(i) for i in col["indices"]], queue._coerce(name, col["indices"], value))
    for name, consumer in state["consumers"].items():
      queue.register_consumer(name, consumer["needs"])
      queue._consumed[name] = {int(i) for i in consumer["consumed"]}
    queue._retired_floor = int(state["retired_floor"])
    queue._retired = {int(i) for i in state["retired"]}
    queue._counters = {k: float(v) for k, v in state["counters"].items()}
    return queue
