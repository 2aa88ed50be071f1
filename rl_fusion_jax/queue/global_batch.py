"""Global device batches built shard by shard from host rows: each data-parallel group's rows read once.

``jax.make_array_from_callback`` asks for the data of every addressable device; devices that differ only
along non-batch axes (e.g. ``tensor``) ask for the same rows. ``global_batch`` caches per row slice, so a
row reader (a DistQueue batch being unpacked, a file, ...) serves each group's rows once, and only the
rows of this process's devices (hierarchical transfer). Token rows are padded here, per shard, from the
packed form: the host never builds the full padded [B, T] batch. ``queue_arrays`` goes one step further
for several processes: it reads from the queue only this process's rows, one read per local group.

``global_batch_once_per_group`` goes further inside a data-parallel group: devices that differ only along
non-batch axes are each sent a distinct part of the group's rows and gather the rest on the device, so
the host's bytes cross once per group rather than once per device (the packed update places its rows
this way).

This module must never replicate a host batch onto every device, read a row slice twice in one build, or
read rows no local device holds.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding

from rl_fusion_jax.queue.distqueue import Batch, Packed, unpack
from rl_fusion_jax.sharding.mesh import BATCH_AXES, batch_sharding, batch_shards

RowReader = Callable[[int, int], np.ndarray]  # (row_start, row_stop) -> rows [stop - start, ...]
BatchReader = Callable[[np.ndarray], Batch]   # sample indices -> their fields (e.g. DistQueue.read)


def global_batch(sharding: Sharding, shape: Sequence[int], dtype, read_rows: RowReader) -> jax.Array:
  """A global array of ``shape`` whose rows (dimension 0) come from ``read_rows``, once per row slice."""
  shape, dtype = tuple(shape), np.dtype(dtype)
  cache: dict[tuple[int, int], np.ndarray] = {}

  def shard(index: tuple[slice, ...]) -> np.ndarray:
    start, stop, _ = index[0].indices(shape[0])
    if (start, stop) not in cache:
      cache[start, stop] = _check_rows(read_rows(start, stop), (stop - start,) + shape[1:], dtype)
    return cache[start, stop][(slice(None),) + tuple(index[1:])]

  return jax.make_array_from_callback(shape, sharding, shard, dtype=dtype)


def group_split(sharding: NamedSharding, shape: Sequence[int]) -> NamedSharding | None:
  """``sharding`` (dimension 0 over the batch axes) with dimension 0 also split over the mesh axes the
  batch is replicated over (``tensor``, ``stage``): every device of a data-parallel group then holds a
  distinct part of its group's rows, and the group's rows are still one contiguous range. None when the
  group is one device or the rows do not divide over every device."""
  mesh = sharding.mesh
  others = tuple(a for a in mesh.axis_names if a not in BATCH_AXES and mesh.shape[a] > 1)
  devices = batch_shards(mesh) * math.prod(mesh.shape[a] for a in others)
  if not others or shape[0] % devices:
    return None
  return NamedSharding(mesh, P(BATCH_AXES + others, *([None] * (len(shape) - 1))))


def global_batch_once_per_group(sharding: NamedSharding, shape: Sequence[int], dtype, read_rows: RowReader
                                ) -> tuple[jax.Array, int]:
  """``global_batch`` whose rows cross from the host once per data-parallel group, not once per device:
  each device of a group is sent a distinct part of the group's rows (``group_split``) and the group's
  devices then gather them on the device (a jitted identity to ``sharding``: an all-gather over the
  group's axes). Returns (the array with ``sharding``, the most bytes sent to one device, the bytes this
  process sent: its devices' parts, so of several processes each counts its own groups only). Falls back
  to ``global_batch`` (each device of a group sent the group's rows) when the rows do not divide."""
  split = group_split(sharding, shape)
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  if split is None:
    out = global_batch(sharding, shape, dtype, read_rows)
    return out, nbytes // batch_shards(sharding.mesh), _host_bytes(out)
  parts = global_batch(split, shape, dtype, read_rows)
  return _gather_to(sharding)(parts), nbytes // split.num_devices, _host_bytes(parts)


def _host_bytes(x: jax.Array) -> int:
  """Bytes of the shards of ``x`` on this process's devices (each was filled from this host)."""
  return sum(s.data.nbytes for s in x.addressable_shards)


@functools.lru_cache(maxsize=64)
def _gather_to(sharding: NamedSharding):
  return jax.jit(lambda x: x, out_shardings=sharding)


def _check_rows(rows, want: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  rows = np.asarray(rows)
  if rows.shape != want:
    raise ValueError(f"read_rows returned shape {rows.shape}; the shard needs {want}")
  return rows.astype(dtype, copy=False)


def _check_divides(mesh: Mesh, rows: int) -> None:
  if rows % batch_shards(mesh):
    raise ValueError(f"a batch of {rows} samples does not split over data*fsdp={batch_shards(mesh)} "
                     "batch shards")


def padded_tokens(mesh: Mesh, packed: Packed, width: int, pad=0) -> jax.Array:
  """Packed rows -> [N, width] split over the batch axes, each shard padded from its own rows only."""
  _check_divides(mesh, len(packed))
  read = lambda start, stop: unpack(packed.rows(start, stop), width, pad)
  return global_batch(batch_sharding(mesh, 2), (len(packed), width), packed.flat.dtype, read)


def sample_values(mesh: Mesh, values_n: np.ndarray) -> jax.Array:
  """One value per sample -> [N] split over the batch axes."""
  values_n = np.asarray(values_n)
  _check_divides(mesh, len(values_n))
  return global_batch(batch_sharding(mesh, 1), values_n.shape, values_n.dtype, lambda a, b: values_n[a:b])


def batch_arrays(mesh: Mesh, batch: Batch, width: int,
                 pads: Mapping[str, float] | None = None) -> dict[str, jax.Array]:
  """Every field of a DistQueue read as global arrays: token fields [N, width] (padded with ``pads[name]``,
  default 0) and sample fields [N]."""
  pads = pads or {}
  out = {name: padded_tokens(mesh, p, width, pads.get(name, 0)) for name, p in batch.tokens.items()}
  out.update({name: sample_values(mesh, v) for name, v in batch.sample.items()})
  return out


def rows_by_process(sharding: Sharding, rows: int, processes: int) -> np.ndarray:
  """[processes, rows] bool: the rows of a batch under 1-D ``sharding`` that each process's devices hold."""
  need = np.zeros((processes, rows), bool)
  for device, index in sharding.devices_indices_map((rows,)).items():
    need[device.process_index, index[0]] = True
  return need


def local_row_slices(sharding: Sharding, rows: int) -> list[tuple[int, int]]:
  """The distinct row ranges [start, stop) of a 1-D ``sharding``'s devices in this process, ascending:
  one per local data-parallel group (devices that differ only along other axes share one)."""
  index_map = sharding.addressable_devices_indices_map((rows,))
  return sorted({index[0].indices(rows)[:2] for index in index_map.values()})


def queue_arrays(mesh: Mesh, read: BatchReader, indices_n, width: int,
                 pads: Mapping[str, float] | None = None) -> dict[str, jax.Array]:
  """Global arrays of the samples ``indices_n`` (row i holds sample ``indices_n[i]``) that read only this
  process's rows: one ``read`` per local data-parallel group, every field at once. Fields come out as in
  ``batch_arrays``. Each process of a multi-process run calls it; together they read each row once."""
  indices_n = np.asarray(indices_n, np.int64)
  _check_divides(mesh, len(indices_n))
  slices = local_row_slices(batch_sharding(mesh, 1), len(indices_n))
  if not slices:
    raise ValueError("queue_arrays: no device of this process is in the mesh")
  parts = {(a, b): _checked_read(read, indices_n[a:b]) for a, b in slices}
  return _assemble(mesh, parts, len(indices_n), width, pads or {})


def _checked_read(read: BatchReader, indices: np.ndarray) -> Batch:
  batch = read(indices)
  if not np.array_equal(batch.indices, indices):
    raise ValueError(f"read returned samples {batch.indices.tolist()}; asked for {indices.tolist()}")
  return batch


def _assemble(mesh: Mesh, parts: Mapping[tuple[int, int], Batch], rows: int, width: int,
              pads: Mapping[str, float]) -> dict[str, jax.Array]:
  """One global array per field from the per-slice reads (each device takes its slice's rows)."""
  some = next(iter(parts.values()))
  out = {}
  for name, packed in some.tokens.items():
    read = lambda a, b, name=name: unpack(parts[a, b].tokens[name], width, pads.get(name, 0))
    out[name] = global_batch(batch_sharding(mesh, 2), (rows, width), packed.flat.dtype, read)
  for name, values in some.sample.items():
    read = lambda a, b, name=name: parts[a, b].sample[name]
    out[name] = global_batch(batch_sharding(mesh, 1), (rows,), values.dtype, read)
  return out
