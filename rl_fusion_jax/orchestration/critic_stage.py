"""The PPO critic of a run (``algo.advantage='gae'``): its state, where it rests, and its two programs.

The critic is a value model (``models/value_model.py``) with its own TrainState on the training mesh, in
the training layout (``sharding/rules.py`` TRAIN_RULES over ``value_model.value_logical_axes``). It is
used twice per RL step, both in the train phase: ``values`` / ``packed_values`` (the rollout-time values
GAE needs, of padded or packed rows) and
``update`` (one regression step on the GAE returns, ``train/critic.py``). Between train phases it rests
where the deployment says (``park`` before the generation phase, ``unpark`` after it):

* ``colocated`` / ``hybrid``: weights stay on the devices; the optimizer state moves to host memory
  (``pinned_host``) with ``fusion.offload_optimizer``, like the actor's.
* ``full``: weights and optimizer state both go to host memory for the generation phase (they are back
  on the devices for the train phase, and stay there through evaluation and checkpointing).
* ``separated``: the training side never generates, so nothing moves.

Moves are bucketed (``reshard.move``, ``fusion.bucket_bytes``): never two full copies of a tree. Each
park / unpark reports like a phase switch (``MoveStats.as_metrics``): ``critic/park/*`` and
``critic/unpark/*`` (bytes, buckets, seconds; live-memory peaks when ``fusion.memory_every`` samples).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rl_fusion_jax import distributed
from rl_fusion_jax.config import ExperimentConfig
from rl_fusion_jax.models import value_model
from rl_fusion_jax.sharding import reshard
from rl_fusion_jax.sharding.rules import param_shardings
from rl_fusion_jax.train import critic as critic_lib
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train.step import MicroBatching


@dataclasses.dataclass(frozen=True)
class CriticPlacement:
  """Optimizer and shardings of the critic: what a restore needs, built without compiling."""
  tx: optax.GradientTransformation
  param_shardings: object
  state_shardings: state_lib.TrainState


def make_critic_placement(cfg: ExperimentConfig, deployment) -> CriticPlacement:
  model_cfg = cfg.model.config
  abstract = value_model.abstract_value_params(model_cfg)
  shardings = param_shardings(abstract, value_model.value_logical_axes(model_cfg), deployment.train_mesh,
                              deployment.train_rules)
  tx = state_lib.make_optimizer(dataclasses.replace(cfg.optim, learning_rate=cfg.critic.learning_rate))
  return CriticPlacement(tx, shardings, state_lib.state_shardings(tx, abstract, shardings, deployment.train_mesh))


class CriticStage:
  """The critic's TrainState (``state``, None until ``start``/``restore``) and its compiled programs."""

  def __init__(self, cfg: ExperimentConfig, deployment, placement: CriticPlacement, micro: MicroBatching):
    model_cfg = cfg.model.config
    self.cfg, self.deployment, self.placement = cfg, deployment, placement
    clip = cfg.critic.value_clip or None
    self.step_fn = critic_lib.make_critic_step(model_cfg, clip, placement.tx, micro, deployment.train_mesh,
                                               placement.state_shardings)
    self.value_fn = critic_lib.make_value_fn(model_cfg, deployment.train_mesh, placement.param_shardings)
    self.packed_value_fn = critic_lib.make_packed_value_fn(model_cfg, deployment.train_mesh,
                                                           placement.param_shardings)
    self.state: state_lib.TrainState | None = None
    self.parked = False

  # --- state ----------------------------------------------------------------------------------------

  def start(self, policy_params, host_params=None) -> None:
    """A fresh critic: ``host_params`` (a loaded value model) or the policy's body with a zero head."""
    model_cfg = self.cfg.model.config
    if host_params is None:
      params = jax.jit(lambda p: value_model.value_params_from_policy(model_cfg, p),
                       out_shardings=self.placement.param_shardings)(policy_params)
    else:
      params = distributed.put(host_params, self.placement.param_shardings)
    self.state = state_lib.create_train_state(params, self.placement.tx, self.placement.state_shardings)
    self.parked = False

  def restore(self, params, opt_state, step) -> None:
    # The unused version counter goes where the update expects it (the update runs under a transfer guard).
    version = distributed.put(np.int32(0), self.placement.state_shardings.policy_version)
    self.state = state_lib.TrainState(step=step, params=params, opt_state=opt_state, policy_version=version)
    self.parked = False

  # --- residency ------------------------------------------------------------------------------------

  def _resting(self) -> dict[str, bool]:
    """Which fields rest in host memory between train phases in this deployment."""
    mode = self.deployment.mode
    if mode == "separated":
      return {"params": False, "opt_state": False}
    return {"params": mode == "full", "opt_state": self.deployment.offload_optimizer}

  def _move(self, memory_kind: str, kind: str) -> dict[str, float]:
    """Moves the resting fields to ``memory_kind`` in one bucketed ``reshard.move`` -> metrics under
    ``kind`` (e.g. ``critic/park/``)."""
    fields = {"params": self.placement.param_shardings, "opt_state": self.placement.state_shardings.opt_state}
    names = [name for name, on_host in self._resting().items() if on_host]
    dst = {name: jax.tree.map(lambda s: s.with_memory_kind(memory_kind), fields[name]) for name in names}
    moved, stats = reshard.move({name: getattr(self.state, name) for name in names}, dst,
                                bucket_bytes=self.deployment.bucket_bytes, name="critic",
                                track_memory=self.deployment.track_memory(kind))
    self.state = self.state.replace(**moved)
    return stats.as_metrics(kind)

  def park(self) -> dict[str, float]:
    """Before generating: the resting fields go to host memory -> ``critic/park/*`` metrics."""
    if self.parked:
      return {}
    m = self._move(reshard.HOST, "critic/park/")
    self.parked = True
    return m

  def unpark(self) -> dict[str, float]:
    """Before the train phase: everything back on the devices -> ``critic/unpark/*`` metrics."""
    if not self.parked:
      return {}
    m = self._move("device", "critic/unpark/")
    self.parked = False
    return m

  # --- programs -------------------------------------------------------------------------------------

  def values(self, tokens_bt):
    """float32 [B, T] rollout-time values (dispatched, not waited for)."""
    if self.parked:
      raise RuntimeError("critic: values() while parked; unpark() first")
    return self.value_fn(self.state.params, tokens_bt)

  def packed_values(self, tokens_rw, positions_rw, segment_ids_rw):
    """float32 [R, W] rollout-time values of packed rows (dispatched, not waited for)."""
    if self.parked:
      raise RuntimeError("critic: packed_values() while parked; unpark() first")
    return self.packed_value_fn(self.state.params, tokens_rw, positions_rw, segment_ids_rw)

  def update(self, batch: critic_lib.CriticBatch | critic_lib.PackedCriticBatch) -> dict:
    """One regression step; returns the metrics (device scalars), ``critic/``-prefixed."""
    if self.parked:
      raise RuntimeError("critic: update() while parked; unpark() first")
    self.state, metrics = self.step_fn(self.state, batch)
    return {f"critic/{k}": v for k, v in metrics.items()}
