"""Memory accounting: which bytes live on which device and memory kind, and their peak over a window.

Pure bookkeeping over ``jax.live_arrays()``: nothing here allocates, copies or waits on a device. Each
addressable shard counts on its own device under its sharding's memory kind, so a replicated array counts
once on every device holding it. On CPU every memory kind is host RAM: these numbers say where bytes are
booked, not what the machine saves; ``device_memory_stats`` gives the allocator's view where the backend
has one (GPU, TPU).

Buffers are counted once each. JAX keeps per-device views of a sharded array (created when the array is
resharded, or when its shards are read) and ``jax.live_arrays()`` lists those views next to the array
they belong to; they share its buffers, so buffers are identified by (device, memory kind, pointer).
"""
from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Iterator, Mapping

import jax

Key = tuple[int, str]   # (device id, memory kind)
LiveBytes = dict[Key, int]


def _memory_kind(buf: jax.Array, device: jax.Device) -> str:
  kind = buf.sharding.memory_kind
  return kind if kind is not None else device.default_memory().kind


def _buffers(arrays: Iterable[jax.Array]) -> Iterator[tuple[Key, int, int]]:
  """(key, buffer id, nbytes) per addressable shard of every array that is not deleted."""
  for array in arrays:
    if array.is_deleted():
      continue
    for shard in array.addressable_shards:
      buf = shard.data
      try:
        buffer_id = buf.unsafe_buffer_pointer()
      except (RuntimeError, ValueError):  # backends without raw pointers: count the shard as its own
        buffer_id = id(buf)
      yield (shard.device.id, _memory_kind(buf, shard.device)), buffer_id, buf.nbytes


def _distinct(arrays: Iterable[jax.Array] | None) -> dict[tuple[Key, int], int]:
  arrays = jax.live_arrays() if arrays is None else arrays
  return {(key, buffer_id): nbytes for key, buffer_id, nbytes in _buffers(arrays)}


def live_bytes(arrays: Iterable[jax.Array] | None = None) -> LiveBytes:
  """Bytes per (device id, memory kind) of ``arrays`` (default: every live array), each buffer once."""
  totals: LiveBytes = collections.defaultdict(int)
  for (key, _), nbytes in _distinct(arrays).items():
    totals[key] += nbytes
  return dict(totals)


def live_buffer_count(arrays: Iterable[jax.Array] | None = None) -> int:
  """Number of distinct device buffers behind ``arrays`` (default: every live array)."""
  return len(_distinct(arrays))


def per_device(live: Mapping[Key, int], kind: str | None = None) -> dict[int, int]:
  """Bytes per device id, summed over memory kinds (or only ``kind``)."""
  totals: dict[int, int] = collections.defaultdict(int)
  for (device_id, memory_kind), nbytes in live.items():
    if kind is None or memory_kind == kind:
      totals[device_id] += nbytes
  return dict(totals)


def device_memory_stats() -> dict[int, dict[str, int]] | None:
  """The allocator's statistics per local device id, or None where the backend keeps none (CPU)."""
  stats = {d.id: d.memory_stats() for d in jax.local_devices()}
  if any(s is None for s in stats.values()):
    return None
  return stats


class MemoryTracker:
  """Samples live bytes at chosen points and keeps the peak per device and per (device, memory kind).

  The first sample is taken at construction (``before``). Peaks are the largest value seen at any
  sample: a transient between two samples is invisible, so callers sample where the peak occurs (for a
  transfer: destination ready, source not yet freed). ``seconds`` is the time spent sampling, which a
  caller timing its own work can subtract.
  """

  def __init__(self):
    self.seconds = 0.0
    self.samples = 0
    self.peak: LiveBytes = {}
    self.peak_per_device: dict[int, int] = {}
    self.before = self.sample()

  def sample(self) -> LiveBytes:
    """Records the current live bytes and returns them."""
    start = time.perf_counter()
    live = live_bytes()
    for key, nbytes in live.items():
      self.peak[key] = max(self.peak.get(key, 0), nbytes)
    for device_id, nbytes in per_device(live).items():
      self.peak_per_device[device_id] = max(self.peak_per_device.get(device_id, 0), nbytes)
    self.samples += 1
    self.seconds += time.perf_counter() - start
    return live
