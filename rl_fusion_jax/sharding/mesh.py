"""The device mesh: built once per run from a MeshConfig, axes (data, fsdp, tensor).

Axis types are ``Auto``: shardings are given explicitly at jit boundaries (in/out shardings) and XLA
propagates them inside, so model code needs no per-op ``out_sharding``. Nothing else builds a mesh.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from rl_fusion_jax.config import MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")   # the axes a batch dimension is split over


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, tensor) mesh over ``devices`` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = cfg.resolve(len(devices))
  grid = np.asarray(devices, dtype=object).reshape([sizes[a] for a in AXES])
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def batch_sharding(mesh: Mesh, ndim: int, *, axis: int = 0) -> NamedSharding:
  """Splits dimension ``axis`` of an ``ndim`` array over the batch axes, replicating the rest."""
  spec = [None] * ndim
  spec[axis] = BATCH_AXES
  return NamedSharding(mesh, P(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_shards(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]
