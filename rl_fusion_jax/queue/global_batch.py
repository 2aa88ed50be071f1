"""Global device batches built shard by shard from host rows: each data-parallel group's rows read once.

``jax.make_array_from_callback`` asks for the data of every addressable device; devices that differ only
along non-batch axes (e.g. ``tensor``) ask for the same rows. ``global_batch`` caches per row slice, so a
row reader (a DistQueue batch being unpacked, a file, ...) serves each group's rows once, and only the
rows of this process's devices (hierarchical transfer). Token rows are padded here, per shard, from the
packed form: the host never builds the full padded [B, T] batch.

This module must never replicate a host batch onto every device, read a row slice twice in one build, or
read rows no local device holds.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, Sharding

from rl_fusion_jax.queue.distqueue import Batch, Packed, unpack
from rl_fusion_jax.sharding.mesh import batch_sharding, batch_shards

RowReader = Callable[[int, int], np.ndarray]  # (row_start, row_stop) -> rows [stop - start, ...]


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
