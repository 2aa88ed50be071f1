"""The PPO critic's jitted update ``critic_step(state, batch) -> (state, metrics)`` and its value function.

The critic is a `models.value_model` (the policy's body plus a per-token scalar head) with its own
TrainState and optimizer. Its update is `train.step.update` (micro-batch accumulation in a ``lax.scan``,
the non-finite guard) with the value-regression loss; the token-mean weights are computed on the whole
batch first, so accumulation gives exactly the full-batch gradient. Each step is compiled once per batch
shape with explicit in/out shardings and the state donated. The critic never bumps the policy version.

A batch is ``(tokens_bt, mask_bt, old_values_bt, returns_bt)``, all [B, T] and aligned like token
log-probs: position t holds the value of the state before token t, and the mask marks response tokens; or
a ``PackedCriticBatch``, the same on packed rows with their positions and segment ids.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from rl_fusion_jax import algorithms
from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models import value_model
from rl_fusion_jax.sharding.mesh import batch_sharding, batch_shards, replicated
from rl_fusion_jax.shared_programs import shared
from rl_fusion_jax.train.state import TrainState
from rl_fusion_jax.train.step import MicroBatching, as_micro_batching, update


class CriticBatch(NamedTuple):
  """What one critic update consumes (a plain 4-tuple in this order works as well)."""
  tokens_bt: Int[Array, "B T"]          # int32
  mask_bt: Float[Array, "B T"]          # float32 0/1: the tokens whose values are regressed
  old_values_bt: Float[Array, "B T"]    # float32: the critic's values at rollout time
  returns_bt: Float[Array, "B T"]       # float32: regression targets (e.g. GAE returns)


class PackedCriticBatch(NamedTuple):
  """``CriticBatch`` on packed rows ([R, W], ``train/packing.py``), with the rows' positions and segment ids."""
  tokens_rw: Int[Array, "R W"]
  mask_rw: Float[Array, "R W"]
  old_values_rw: Float[Array, "R W"]
  returns_rw: Float[Array, "R W"]
  positions_rw: Int[Array, "R W"]
  segment_ids_rw: Int[Array, "R W"]


def _check_clip(clip) -> None:
  if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
    raise ValueError(f"clip: must be None or a number > 0, got {clip!r}")


# ----------------------------------------------------------------------------------------------------
# Loss and metrics. Metric sums are token means under the batch-global weights, so they add over
# micro-batches; `explained_variance` is derived from the accumulated sums.
# ----------------------------------------------------------------------------------------------------

def value_loss_from_values(clip: float | None, values_bt, batch, weights_bt) -> tuple[jax.Array, dict]:
  """The critic loss after the forward pass: sum_t w_t loss_t, and the metric sums (token means).

  Metric sums: value_loss, value_clip_frac (tokens whose clipped term won), value_mean, return_mean,
  value_error_mean / value_error_sq_mean (R - V and its square) and return_sq_mean (for
  `explained_variance`), value_abs_change (|V - V_old|: how far the critic moved since the rollout).
  """
  old_values_bt, returns_bt = batch[2], batch[3]
  loss_bt, clipped_bt = algorithms.value_loss(values_bt, old_values_bt, returns_bt, clip=clip)
  loss = algorithms.weighted_sum(loss_bt, weights_bt)
  v_bt = jax.lax.stop_gradient(values_bt)
  error_bt = returns_bt - v_bt
  metrics_bt = {"value_clip_frac": clipped_bt, "value_mean": v_bt, "return_mean": returns_bt,
                "return_sq_mean": jnp.square(returns_bt), "value_error_mean": error_bt,
                "value_error_sq_mean": jnp.square(error_bt), "value_abs_change": jnp.abs(v_bt - old_values_bt)}
  sums = {"value_loss": loss}
  for name, value_bt in metrics_bt.items():
    sums[name] = algorithms.weighted_sum(value_bt, weights_bt)
  return loss, sums


def critic_loss(cfg: ModelConfig, clip: float | None, params, batch, weights_bt) -> tuple[jax.Array, dict]:
  """Value-regression loss of ``batch = (tokens_bt, mask_bt, old_values_bt, returns_bt)`` with the
  precomputed token weights ``weights_bt`` (token-mean over the whole batch's mask); see
  `value_loss_from_values` for the metric sums."""
  values_bt = value_model.values(cfg, params, batch[0])
  return value_loss_from_values(clip, values_bt, batch, weights_bt)


def packed_critic_loss(cfg: ModelConfig, clip: float | None, params, batch: PackedCriticBatch, weights_rw
                       ) -> tuple[jax.Array, dict]:
  """``critic_loss`` of a ``PackedCriticBatch``: the values of packed rows (``value_model.packed_values``)."""
  values_rw = value_model.packed_values(cfg, params, batch.tokens_rw, batch.positions_rw, batch.segment_ids_rw)
  return value_loss_from_values(clip, values_rw, batch, weights_rw)


def explained_variance(sums: dict[str, jax.Array]) -> jax.Array:
  """1 - Var(R - V) / Var(R) over the masked tokens, from the token-mean sums of `value_loss_from_values`.

  1: perfect predictions; 0: no better than predicting the mean return; negative: worse. When the
  returns have no variance the ratio is undefined and this gives 0.
  """
  var_error = jnp.maximum(sums["value_error_sq_mean"] - jnp.square(sums["value_error_mean"]), 0.0)
  var_return = jnp.maximum(sums["return_sq_mean"] - jnp.square(sums["return_mean"]), 0.0)
  return jnp.where(var_return > 0, 1.0 - var_error / jnp.where(var_return > 0, var_return, 1.0), 0.0)


# ----------------------------------------------------------------------------------------------------
# Jitted programs
# ----------------------------------------------------------------------------------------------------

def critic_step(cfg: ModelConfig, clip: float | None, tx: optax.GradientTransformation, micro: MicroBatching,
                mesh: Mesh, state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
  """One guarded critic update; metrics are the loss sums plus value_explained_var, grad_norm, nonfinite."""
  tokens_bt, mask_bt = batch[0], batch[1]
  weights_bt = algorithms.token_weights(mask_bt, "token-mean")
  loss_fn = functools.partial(packed_critic_loss if isinstance(batch, PackedCriticBatch) else critic_loss, cfg, clip)
  num_micro = micro.num_micro(*tokens_bt.shape, batch_shards(mesh))
  state, metrics = update(loss_fn, tx, num_micro, mesh, state, batch, weights_bt, bump_version=False)
  metrics["value_explained_var"] = explained_variance(metrics)
  return state, metrics


@shared
def make_critic_step(cfg: ModelConfig, clip: float | None, tx: optax.GradientTransformation,
                     micro: MicroBatching | int, mesh: Mesh, shardings: TrainState):
  """``critic_step(state, batch) -> (state, metrics)``, compiled once per batch shape, state donated.
  ``batch``: a ``CriticBatch`` (or 4-tuple) of padded rows or a ``PackedCriticBatch`` of packed rows.

  ``shardings``: the critic's `train.state.state_shardings` (over `value_model.abstract_value_params`).
  ``micro``: a ``MicroBatching`` (the count follows the batch's shape) or a fixed micro-batch count.
  ``clip``: PPO's value-clipping range, or None for plain regression. Metrics are replicated scalars.
  """
  _check_clip(clip)
  fn = functools.partial(critic_step, cfg, None if clip is None else float(clip), tx, as_micro_batching(micro),
                         mesh)
  # One batch sharding for the whole batch pytree: every leaf is [B, T], split over the batch axes.
  return jax.jit(fn, in_shardings=(shardings, batch_sharding(mesh, 2)),
                 out_shardings=(shardings, replicated(mesh)), donate_argnums=(0,))


@shared
def make_value_fn(cfg: ModelConfig, mesh: Mesh, param_shardings):
  """``fn(params, tokens_bt) -> values_bt`` (float32 [B, T], batch-sharded), compiled once per shape."""
  b2 = batch_sharding(mesh, 2)
  return jax.jit(functools.partial(value_model.values, cfg), in_shardings=(param_shardings, b2), out_shardings=b2)


@shared
def make_packed_value_fn(cfg: ModelConfig, mesh: Mesh, param_shardings):
  """``fn(params, tokens_rw, positions_rw, segment_ids_rw) -> values_rw`` of packed rows (float32,
  batch-sharded), compiled once per row count."""
  b2 = batch_sharding(mesh, 2)
  return jax.jit(functools.partial(value_model.packed_values, cfg), in_shardings=(param_shardings, b2, b2, b2),
                 out_shardings=b2)
