"""The device mesh: built once per run from a MeshConfig, axes (stage, data, fsdp, tensor).

Axis types are ``Auto``: shardings are given explicitly at jit boundaries (in/out shardings) and XLA
propagates them inside, so model code needs no per-op ``out_sharding``. Nothing else builds a mesh.

``stage`` is the pipeline axis (``sharding/pipeline.py``): training splits the stacked layers over it and
sends activations from stage to stage, so a batch is split over (data, fsdp) and every stage sees all of
its rows. Generation has no stages (``GENERATE_RULES`` gives every device all layers) and runs the same
rows on each stage: with stage > 1 its work is repeated ``stage`` times (docs/moe_pipeline.md, "Pipeline parallelism").
With stage = 1 the axis has size 1 and no sharding names it.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from rl_fusion_jax.config import MeshConfig

AXES = ("stage", "data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")   # the axes a batch dimension is split over (replicated over stage)
STAGE_AXIS = "stage"


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (stage, data, fsdp, tensor) mesh over ``devices`` (default: all)."""
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


def num_stages(mesh: Mesh) -> int:
  """Pipeline stages of ``mesh``: its 'stage' axis size (1 for a mesh built without one)."""
  return dict(mesh.shape).get(STAGE_AXIS, 1)
