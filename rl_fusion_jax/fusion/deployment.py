"""Deployment modes: which devices hold which model in which phase, and the moves between phases.

* ``colocated`` (RL Fusion): one mesh over all devices. Before generating, ``to_phase`` reshards the
  actor from the training layout to the generation layout and offloads the optimizer state to host
  memory; after generating it reverses both. Reference and reward models stay on device.
* ``full``: colocated, and the reference and reward models live in host memory, copied to the devices
  only for the forward pass that needs them and deleted right after.
* ``separated`` (the baseline): a rollout sub-mesh and a training sub-mesh. The actor trains on its
  mesh; after each update its weights are sent (bucketed) to the rollout mesh in the generation layout.

The loop calls the same four methods in every mode, so a step's arithmetic is the same everywhere and
the modes give the same metrics for the same seed (tested).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rl_fusion_jax import models
from rl_fusion_jax.config import ExperimentConfig, MeshConfig
from rl_fusion_jax.sharding import mesh as mesh_lib
from rl_fusion_jax.sharding import reshard
from rl_fusion_jax.sharding.rules import GENERATE_RULES, TRAIN_RULES, Rules, param_shardings


def merge_rules(base: Rules, overrides) -> Rules:
  """``base`` with single entries replaced (or added) by ``overrides`` [(logical, mesh_axes), ...]."""
  table = dict(base)
  for logical, mesh_axes in overrides:
    table[logical] = tuple(mesh_axes) if isinstance(mesh_axes, (list, tuple)) else mesh_axes
  return tuple(table.items())


@dataclasses.dataclass
class Deployment:
  """Meshes, layouts and residency of one run. Build with :func:`make_deployment`."""
  mode: str
  train_mesh: Mesh
  rollout_mesh: Mesh
  layouts: reshard.Layouts              # actor shardings on the training mesh, both phases
  rollout_param_shardings: Any          # where generation reads the actor's params
  bucket_bytes: int
  offload_optimizer: bool
  groups: dict[str, list[int]]          # timeline lanes: group name -> device ids
  rollout_group: str
  train_group: str
  train_rules: Rules = TRAIN_RULES      # the merged tables (defaults + config overrides)
  generate_rules: Rules = GENERATE_RULES
  _rollout_params: Any = None           # separated: the rollout mesh's copy of the weights

  @property
  def train_param_shardings(self):
    return self.layouts.params[reshard.Phase.TRAIN]

  # --- actor ---------------------------------------------------------------------------------------

  def to_generation(self, state):
    """-> (state, params to generate with, metrics)."""
    if self.mode == "separated":
      return state, self._rollout_params, {}
    state, stats = reshard.to_phase(state, reshard.Phase.GENERATE, layouts=self.layouts,
                                    bucket_bytes=self.bucket_bytes,
                                    offload_optimizer=self.offload_optimizer)
    return state, state.params, stats.as_metrics("switch/to_generate/")

  def to_training(self, state):
    """-> (state in the training layout, metrics)."""
    if self.mode == "separated":
      return state, {}
    state, stats = reshard.to_phase(state, reshard.Phase.TRAIN, layouts=self.layouts,
                                    bucket_bytes=self.bucket_bytes,
                                    offload_optimizer=self.offload_optimizer)
    return state, stats.as_metrics("switch/to_train/")

  def publish(self, params) -> dict[str, float]:
    """After an update: separated mode sends the new weights to the rollout mesh."""
    if self.mode != "separated":
      return {}
    start = time.perf_counter()
    copy = jax.tree.map(lambda x: x.copy(), params)   # the training side keeps its own
    old = self._rollout_params
    self._rollout_params, nbytes = reshard.move(copy, self.rollout_param_shardings,
                                                bucket_bytes=self.bucket_bytes, name="params")
    if old is not None:
      jax.tree.map(lambda x: x.delete(), old)
    return {"sync/seconds": time.perf_counter() - start, "sync/bytes": float(nbytes)}

  # --- reference and reward models -----------------------------------------------------------------

  def place_aux(self, params):
    """Where an auxiliary model (reference, reward) rests between uses: host in ``full``, else device."""
    shardings = self.aux_shardings(params)
    if self.mode == "full":
      shardings = jax.tree.map(lambda s: s.with_memory_kind(reshard.HOST), shardings)
    return reshard.move(params, shardings, bucket_bytes=self.bucket_bytes, name="aux")[0]

  def aux_shardings(self, params):
    """Training-layout shardings on the training mesh for an aux model's params (same logical axes)."""
    return jax.tree.map(lambda x: x.sharding.with_memory_kind("device")
                        if x.sharding.memory_kind != "device" else x.sharding, params)

  def fetch_aux(self, resting):
    """Device copy for one use (``full``), or the resident params themselves."""
    if self.mode != "full":
      return resting
    on_device = jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), resting)
    return jax.tree.map(jax.device_put, resting, on_device)

  def release_aux(self, fetched) -> None:
    if self.mode == "full":
      jax.tree.map(lambda x: x.delete(), fetched)


def _devices_of(mesh: Mesh) -> list[int]:
  return sorted(int(d.id) for d in mesh.devices.flat)


def make_deployment(cfg: ExperimentConfig, abstract_params, logical_axes, tx,
                    devices=None) -> Deployment:
  """Builds meshes and layouts for ``cfg.fusion.mode``; raises naming the config field on bad input."""
  devices = list(jax.devices() if devices is None else devices)
  f = cfg.fusion
  train_rules = merge_rules(TRAIN_RULES, f.train_rules)
  generate_rules = merge_rules(GENERATE_RULES, f.generate_rules)
  if f.mode == "separated":
    n_rollout, _ = f.split(len(devices))
    rollout_mesh = mesh_lib.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=cfg.mesh.tensor),
                                      devices[:n_rollout])
    train_mesh = mesh_lib.make_mesh(cfg.mesh, devices[n_rollout:])
  else:
    train_mesh = rollout_mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  try:
    layouts = reshard.make_layouts(train_mesh, abstract_params, logical_axes, tx,
                                   train_rules=train_rules, generate_rules=generate_rules)
    rollout_shardings = (param_shardings(abstract_params, logical_axes, rollout_mesh, generate_rules)
                         if f.mode == "separated" else layouts.params[reshard.Phase.GENERATE])
  except ValueError as e:
    raise ValueError(f"config.fusion (rule tables): {e}") from e
  if f.mode == "separated":
    groups = {"rollout": _devices_of(rollout_mesh), "train": _devices_of(train_mesh)}
    rollout_group, train_group = "rollout", "train"
  else:
    groups = {"all": _devices_of(train_mesh)}
    rollout_group = train_group = "all"
  return Deployment(mode=f.mode, train_mesh=train_mesh, rollout_mesh=rollout_mesh, layouts=layouts,
                    rollout_param_shardings=rollout_shardings, bucket_bytes=f.bucket_bytes,
                    offload_optimizer=f.offload_optimizer, groups=groups, rollout_group=rollout_group,
                    train_group=train_group, train_rules=train_rules, generate_rules=generate_rules)


def check_rules(cfg: ExperimentConfig, num_devices: int) -> None:
  """Start-up validation of the rule tables against the mesh and the model (nothing is allocated)."""
  abstract = models.abstract_params(cfg.model.config)
  axes = models.param_logical_axes(cfg.model.config)
  devices = np.asarray(jax.devices()[:num_devices])
  import optax  # pylint: disable=g-import-not-at-top
  make_deployment(cfg, abstract, axes, optax.identity(), list(devices))
