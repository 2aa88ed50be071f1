"""TrainState (params, optimizer state, policy version), the optimizer, and their shardings."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from rl_fusion_jax.config import OptimConfig
from rl_fusion_jax.sharding.mesh import replicated
from rl_fusion_jax.sharding.reshard import optimizer_shardings
from rl_fusion_jax.shared_programs import shared


@flax.struct.dataclass
class TrainState:
  step: jax.Array               # int32: update steps taken (a guarded, skipped update counts too)
  params: dict
  opt_state: optax.OptState
  policy_version: jax.Array     # int32: the version stamped on tokens generated with these params
  # Mixed precision, generation phase only: the master weights while ``params`` holds their generation
  # copy (``reshard.to_phase``); None whenever the state is in the training phase.
  master_params: Any = None


@shared
def make_optimizer(cfg: OptimConfig, learning_rate: float | None = None) -> optax.GradientTransformation:
  """Global-norm clipping then AdamW with a linear warm-up."""
  lr = cfg.learning_rate if learning_rate is None else learning_rate
  schedule = (optax.linear_schedule(0.0, lr, cfg.warmup_steps) if cfg.warmup_steps
              else optax.constant_schedule(lr))
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip else adamw


def state_shardings(tx: optax.GradientTransformation, abstract_params, param_shardings, mesh: Mesh):
  """Shardings of a TrainState: optimizer moments follow their parameters, counters replicate
  (``reshard.optimizer_shardings``, the one derivation the phase switch uses too)."""
  rep = replicated(mesh)
  return TrainState(step=rep, params=param_shardings,
                    opt_state=optimizer_shardings(tx, abstract_params, param_shardings, mesh), policy_version=rep)


def create_train_state(params, tx: optax.GradientTransformation, shardings: TrainState,
                       policy_version: int = 0) -> TrainState:
  """Builds the state on device with the given shardings (the optimizer state is created in place)."""
  return _make_init(tx, shardings, int(policy_version))(params)


@shared
def _make_init(tx: optax.GradientTransformation, shardings: TrainState, policy_version: int):
  def init(params):
    return TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                      policy_version=jnp.int32(policy_version))
  return jax.jit(init, in_shardings=(shardings.params,), out_shardings=shardings)
