"""Deployment modes: which devices hold which model in which phase, and the moves between phases.

One small class per mode behind one interface (:class:`Deployment`); the loop calls the same methods in
every mode, so a step's arithmetic is the same everywhere and the modes give the same metrics for the
same seed (tested):

* :class:`Colocated` (``colocated``, RL Fusion): one mesh over all devices. Before generating,
  ``to_phase`` reshards the actor from the training layout to the generation layout and offloads the
  optimizer state to host memory; after generating it reverses both. Reference and reward models stay
  on the devices.
* :class:`FullyColocated` (``full``): colocated, and the reference and reward models rest in host memory
  (placed there directly, never first on the devices), copied to the devices bucket by bucket only for
  the forward pass that needs them and deleted right after.
* :class:`Hybrid` (``hybrid``): the actor colocated on most devices; the reference and reward models live
  on a small separate device group (``fusion.aux_devices``) and score there. Their programs are
  dispatched before the host verifies the responses, so the aux group computes while the host works;
  the update waits for both.
* :class:`Separated` (``separated``, the baseline): a rollout sub-mesh and a training sub-mesh. The actor
  trains on its mesh; after each update its weights are sent (bucketed) to the rollout mesh in the
  generation layout (``rollout_params``).

Auxiliary models (reference, reward) always run on ``aux_mesh``: the training mesh except in hybrid.
Every move of parameters here goes through ``sharding/reshard.py`` (``to_phase``, ``move``, ``release``)
and reports the same statistics (bytes, buckets, seconds; live-memory peaks on the switches that sample
memory, ``fusion.memory_every``).
"""
from __future__ import annotations

from typing import ClassVar

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


def _devices_of(mesh: Mesh) -> list[int]:
  return sorted(int(d.id) for d in mesh.devices.flat)


class Deployment:
  """Meshes, layouts and residency of one run. Build with :func:`make_deployment`.

  Attributes: ``train_mesh`` (the actor's update), ``rollout_mesh`` (generation), ``aux_mesh``
  (reference and reward models), ``layouts`` (the actor's shardings on the training mesh in both
  phases), ``rollout_param_shardings`` (where generation reads the actor's params), ``groups``
  (timeline lanes: group name -> device ids) and the group each kind of work is recorded under.
  """
  mode: ClassVar[str]

  def __init__(self, *, train_mesh: Mesh, rollout_mesh: Mesh, aux_mesh: Mesh, layouts: reshard.Layouts,
               rollout_param_shardings, bucket_bytes: int, offload_optimizer: bool,
               train_rules: Rules = TRAIN_RULES, generate_rules: Rules = GENERATE_RULES,
               memory_every: int = 1):
    self.train_mesh, self.rollout_mesh, self.aux_mesh = train_mesh, rollout_mesh, aux_mesh
    self.layouts, self.rollout_param_shardings = layouts, rollout_param_shardings
    self.bucket_bytes, self.offload_optimizer = bucket_bytes, offload_optimizer
    self.memory_every = memory_every
    self._moves: dict = {}   # move kind -> count so far (memory sampling schedule)
    self.train_rules, self.generate_rules = train_rules, generate_rules
    self.groups = self._groups()

  def _groups(self) -> dict[str, list[int]]:
    return {"all": _devices_of(self.train_mesh)}

  rollout_group = train_group = aux_group = "all"

  @property
  def train_param_shardings(self):
    return self.layouts.params[reshard.Phase.TRAIN]

  # --- actor ---------------------------------------------------------------------------------------

  def track_memory(self, kind) -> bool:
    """Whether this move of ``kind`` (a Phase, or a name like ``'publish'``) samples live memory: the
    first of each kind, then every ``memory_every``-th (``fusion.memory_every``; 0: never). Counts it."""
    count = self._moves.get(kind, 0)
    self._moves[kind] = count + 1
    return self.memory_every > 0 and count % self.memory_every == 0

  def to_generation(self, state):
    """-> (state, params to generate with, metrics)."""
    state, stats = reshard.to_phase(state, reshard.Phase.GENERATE, layouts=self.layouts,
                                    bucket_bytes=self.bucket_bytes,
                                    offload_optimizer=self.offload_optimizer,
                                    track_memory=self.track_memory(reshard.Phase.GENERATE))
    return state, state.params, stats.as_metrics("switch/to_generate/")

  def to_training(self, state):
    """-> (state in the training layout, metrics)."""
    state, stats = reshard.to_phase(state, reshard.Phase.TRAIN, layouts=self.layouts,
                                    bucket_bytes=self.bucket_bytes,
                                    offload_optimizer=self.offload_optimizer,
                                    track_memory=self.track_memory(reshard.Phase.TRAIN))
    return state, stats.as_metrics("switch/to_train/")

  def publish(self, params) -> dict[str, float]:
    """After an update: whatever the rollout side needs to see the new weights (nothing when fused)."""
    del params
    return {}

  # --- reference and reward models -----------------------------------------------------------------

  def aux_param_shardings(self, abstract_params, logical_axes):
    """Shardings of an auxiliary model's params on ``aux_mesh`` (training rule table)."""
    return param_shardings(abstract_params, logical_axes, self.aux_mesh, self.train_rules)

  def place_aux(self, params, shardings, *, keep_source: bool = False):
    """Moves an auxiliary model to where it rests between uses: ``shardings`` (on ``aux_mesh``, from
    ``aux_param_shardings``), in host memory for ``full`` -> the resting params.

    ``params``: device arrays, or host numpy arrays (a checkpoint), which go straight to the resting
    memory kind. Moved device sources are deleted unless ``keep_source`` (then the result is a copy,
    made bucket by bucket: e.g. the reference taken from the live policy)."""
    shardings = jax.tree.map(self._resting, shardings)
    return reshard.move(params, shardings, bucket_bytes=self.bucket_bytes, name="aux",
                        keep_source=keep_source)[0]

  def _resting(self, sharding):
    return sharding

  def fetch_aux(self, resting, name: str = "aux"):
    """Device params for one use -> (params, metrics): the resident params themselves and no metrics
    (``full`` copies them in and reports the move under ``aux/{name}/fetch/``)."""
    del name
    return resting, {}

  def release_aux(self, fetched, used_by=None, name: str = "aux") -> dict[str, float]:
    """Ends one use of ``fetch_aux``'s result -> metrics; ``full`` waits for ``used_by`` (the outputs
    computed from it), then deletes the device copy (reported under ``aux/{name}/release/``)."""
    del fetched, used_by, name
    return {}


class Colocated(Deployment):
  mode = "colocated"


class FullyColocated(Colocated):
  mode = "full"

  def _resting(self, sharding):
    return sharding.with_memory_kind(reshard.HOST)

  def fetch_aux(self, resting, name: str = "aux"):
    """A device copy of the host-resting params, bucket by bucket (the host copy stays)."""
    on_device = jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), resting)
    kind = f"aux/{name}/fetch/"
    fetched, stats = reshard.move(resting, on_device, bucket_bytes=self.bucket_bytes, name=name,
                                  keep_source=True, track_memory=self.track_memory(kind))
    return fetched, stats.as_metrics(kind)

  def release_aux(self, fetched, used_by=None, name: str = "aux") -> dict[str, float]:
    kind = f"aux/{name}/release/"
    return reshard.release(fetched, used_by=used_by, track_memory=self.track_memory(kind)).as_metrics(kind)


class Hybrid(Colocated):
  mode = "hybrid"
  aux_group = "aux"

  def _groups(self):
    return {"all": _devices_of(self.train_mesh), "aux": _devices_of(self.aux_mesh)}


class Separated(Deployment):
  mode = "separated"
  rollout_group, train_group, aux_group = "rollout", "train", "train"

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.rollout_params = None   # the rollout mesh's copy of the weights, replaced by ``publish``

  def _groups(self):
    return {"rollout": _devices_of(self.rollout_mesh), "train": _devices_of(self.train_mesh)}

  def to_generation(self, state):
    return state, self.rollout_params, {}

  def to_training(self, state):
    return state, {}

  def publish(self, params) -> dict[str, float]:
    """Frees the rollout mesh's previous copy, then sends the new weights there bucket by bucket
    (``reshard.move`` with ``keep_source``: the training side keeps its own and no whole-tree copy is
    made, so the rollout devices hold at most one copy and the training devices nothing extra) ->
    ``sync/*`` metrics (``MoveStats.as_metrics``; seconds include freeing the old copy)."""
    old, self.rollout_params = self.rollout_params, None
    freed = reshard.release(old) if old is not None else None
    self.rollout_params, stats = reshard.move(params, self.rollout_param_shardings,
                                              bucket_bytes=self.bucket_bytes, name="params", keep_source=True,
                                              track_memory=self.track_memory("publish"),
                                              dtype=self.layouts.generate_dtype)
    metrics = stats.as_metrics("sync/")
    metrics["sync/seconds"] += freed.seconds if freed is not None else 0.0
    return metrics


MODES: dict[str, type[Deployment]] = {c.mode: c for c in (Colocated, FullyColocated, Hybrid, Separated)}


def split_devices(devices, n: int, field: str, per_process: bool = True) -> tuple[list, list]:
  """(the first ``n`` devices, the rest). Of devices on several processes (with ``per_process``), the
  same share of each process's devices, in process order: every sub-mesh then spans every process, so
  each process runs every program on its own devices (one program, many controllers) and the run needs
  no cross-process scheduling. Without ``per_process`` the first ``n`` in ``jax.devices()`` order: one
  process per side, for rollout and training overlapping (``orchestration/separated.py``)."""
  procs = sorted({d.process_index for d in devices})
  if len(procs) == 1 or not per_process:
    return devices[:n], devices[n:]
  local = [[d for d in devices if d.process_index == p] for p in procs]
  if n % len(procs) or len({len(ds) for ds in local}) > 1:
    raise ValueError(f"{field}: {n} of {len(devices)} devices do not split evenly over the {len(procs)} "
                     "processes (each process gives the same number of its devices to each sub-mesh)")
  k = n // len(procs)
  return [d for ds in local for d in ds[:k]], [d for ds in local for d in ds[k:]]


def make_deployment(cfg: ExperimentConfig, abstract_params, logical_axes, tx,
                    devices=None, *, per_process: bool = True) -> Deployment:
  """Builds meshes and layouts for ``cfg.fusion.mode``; raises naming the config field on bad input.
  ``per_process``: how sub-meshes split devices of several processes (``split_devices``)."""
  devices = list(jax.devices() if devices is None else devices)
  f = cfg.fusion
  train_rules = merge_rules(TRAIN_RULES, f.train_rules)
  generate_rules = merge_rules(GENERATE_RULES, f.generate_rules)
  if f.mode == "separated":
    n_rollout, _ = f.split(len(devices))
    first, rest = split_devices(devices, n_rollout, "config.fusion.rollout_device_fraction", per_process)
    rollout_mesh = mesh_lib.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=cfg.mesh.tensor), first)
    train_mesh = aux_mesh = mesh_lib.make_mesh(cfg.mesh, rest)
  elif f.mode == "hybrid":
    first, rest = split_devices(devices, f.aux_split(len(devices)), "config.fusion.aux_devices", per_process)
    aux_mesh = mesh_lib.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1), first)
    train_mesh = rollout_mesh = mesh_lib.make_mesh(cfg.mesh, rest)
  else:
    train_mesh = rollout_mesh = aux_mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  try:
    layouts = reshard.make_layouts(train_mesh, abstract_params, logical_axes, tx,
                                   train_rules=train_rules, generate_rules=generate_rules,
                                   generate_dtype=cfg.model.config.generation_dtype)
    rollout_shardings = (param_shardings(abstract_params, logical_axes, rollout_mesh, generate_rules)
                         if f.mode == "separated" else layouts.params[reshard.Phase.GENERATE])
  except ValueError as e:
    raise ValueError(f"config.fusion (rule tables): {e}") from e
  return MODES[f.mode](train_mesh=train_mesh, rollout_mesh=rollout_mesh, aux_mesh=aux_mesh,
                       layouts=layouts, rollout_param_shardings=rollout_shardings,
                       bucket_bytes=f.bucket_bytes, offload_optimizer=f.offload_optimizer,
                       train_rules=train_rules, generate_rules=generate_rules, memory_every=f.memory_every)


def check_rules(cfg: ExperimentConfig, num_devices: int, *, per_process: bool = True) -> None:
  """Start-up validation of the rule tables against the mesh and the model (nothing is allocated)."""
  abstract = models.abstract_params(cfg.model.config)
  axes = models.param_logical_axes(cfg.model.config)
  devices = np.asarray(jax.devices()[:num_devices])
  import optax  # pylint: disable=g-import-not-at-top
  make_deployment(cfg, abstract, axes, optax.identity(), list(devices), per_process=per_process)
