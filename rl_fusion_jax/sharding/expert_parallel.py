"""Expert parallelism: the routed experts of every sparse layer computed under `jax.shard_map`, each device
running only the experts it holds, on the tokens routed to them.

Which devices hold which experts is the rule tables' decision: the mesh axes that split the logical axis
'expert' are the expert-parallel (EP) axes, those that split 'moe_mlp' the tensor axes inside each expert
(`expert_layout`). Nothing here spells a PartitionSpec of its own for parameters: the shard_map in_specs
of the expert weights are the rule tables' specs of those weights (any split of their 'embed' dimension
dropped: GSPMD gathers it at the boundary). Tokens arrive split over `mesh.BATCH_AXES`, so the EP axes
must be among the batch axes (each EP group then owns a disjoint set of tokens).

The exchange, per sparse layer, on a device of an EP group of `ep` devices holding T_l tokens each:

1. all-gather the group's tokens x [ep * T_l, D] and their routing (expert ids and weights [ep * T_l, k]);
2. pick the assignments routed to the device's E / ep local experts, sorted by local expert, and run them
   through `moe.grouped_ffn` with the local group sizes (dropless, 'ragged_dot' or 'blocked'). The row
   buffer has the static worst case ep * T_l * min(k, E / ep) rows (a token picks k distinct experts, at
   most min(k, E / ep) of them local), whatever the routing. 'blocked' computes every row of it, so a
   device does ep * min(k, E / ep) / k times its balanced share T_l * k of expert rows (4x at ep = E = 8,
   k = 2); ragged kernels that skip rows past the group sizes need not;
3. weight and sum each token's local expert outputs into [ep * T_l, D] partial outputs, `psum_scatter`
   them back over the group (each device keeps the sums of its own T_l tokens), and `psum` over the
   tensor axes, where each device computed its experts' F / tp slice (partial down-projection sums).

Communication per sparse layer and device, forward (the backward pass is its transpose: the gather
becomes a reduce-scatter and the reduce-scatter a gather, the same volumes): the all-gather receives
(ep - 1) * T_l * (D * itemsize + k * (4 + itemsize)) bytes, the reduce-scatter moves (ep - 1) * T_l * D
* itemsize, the tensor all-reduce of [T_l, D] 2 * (tp - 1) / tp * T_l * D * itemsize. An `all_to_all`
with per-destination buffers sends each assignment rather than each token, and a dropless one must
size every destination's buffer for the worst case T_l * min(k, E / ep) rows: at least the all-gather's
volume (equal when k = 1 or E / ep = 1), so the gather is never worse here. (A ragged all-to-all would
send only the routed rows, about T_l * k * (ep - 1) / ep on balanced routing; its receive buffer still
needs the same static worst case.)

Exactness: every assignment meets exactly the expert weights it meets on one device (dropless, nothing
dropped or recomputed differently); only the summation order of a token's k outputs changes (local sums,
then the reduce-scatter), a rounding-level difference.

With `moe_capacity_factor` set the override is not installed: capacity is a property of the global token
order (top-1 choices first, then in token order, over all T tokens), which an EP group seeing its own
tokens would change, so the capacity path keeps its single-device semantics under GSPMD.

This module must never place parameters (that is `reshard.py`) or change what the model computes.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models import moe
from rl_fusion_jax.models.decoder import param_logical_axes
from rl_fusion_jax.sharding.mesh import BATCH_AXES
from rl_fusion_jax.sharding.rules import Rules, logical_to_spec

# The expert weights as moe.Experts stacks them; the routed override receives them in this order.
_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
  """Where one sparse layer's experts live on the mesh, from the rule tables."""
  expert_axes: tuple[str, ...]    # mesh axes splitting 'expert': the EP group
  mlp_axes: tuple[str, ...]       # mesh axes splitting 'moe_mlp': tensor parallelism inside each expert
  weight_specs: tuple[P, P, P]    # shard_map in_specs of one layer's gate [E, D, F], up, down [E, F, D]
  ep: int
  tp: int


def _axes(part) -> tuple[str, ...]:
  return (part,) if isinstance(part, str) else tuple(part or ())


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _sizes(mesh: Mesh, axes: tuple[str, ...]) -> str:
  return " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in axes)


def _layer_spec(leaf_axes: tuple, rules: Rules, mesh: Mesh) -> tuple[P, dict[str, tuple[str, ...]]]:
  """One layer's slice of a stacked expert weight: its spec (only 'expert' / 'moe_mlp' kept) and the mesh
  axes of those two logical axes."""
  spec = tuple(logical_to_spec(leaf_axes, rules, mesh))[1:]   # drop the stacked 'layers' dimension
  names = leaf_axes[1:]
  kept = {n: _axes(s) for n, s in zip(names, spec) if n in ("expert", "moe_mlp")}
  return P(*(s if n in kept else None for n, s in zip(names, spec))), kept


def expert_layout(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> ExpertLayout:
  """The EP and tensor axes of ``cfg``'s experts under ``rules``; raises naming the field and mesh axes
  when the experts or their hidden size do not divide, or the EP axes are not batch axes."""
  experts = param_logical_axes(cfg)["layers"]["moe"]["experts"]
  specs, axes = zip(*(_layer_spec(experts[name], rules, mesh) for name in _WEIGHTS))
  expert_axes, mlp_axes = axes[0]["expert"], axes[0]["moe_mlp"]
  ep, tp = _size(mesh, expert_axes), _size(mesh, mlp_axes)
  if cfg.num_experts % ep:
    raise ValueError(f"model.num_experts={cfg.num_experts} does not divide over {_sizes(mesh, expert_axes)} "
                     f"(rule 'expert', {ep} expert-parallel shards)")
  if cfg.moe_intermediate_size % tp:
    raise ValueError(f"model.moe_intermediate_size={cfg.moe_intermediate_size} does not divide over "
                     f"{_sizes(mesh, mlp_axes)} (rule 'moe_mlp', {tp} tensor shards)")
  if not set(expert_axes) <= set(BATCH_AXES):
    raise ValueError(f"rule 'expert' splits experts over mesh axes {expert_axes}: expert parallelism needs "
                     f"them among the batch axes {BATCH_AXES} (tokens travel inside the EP group)")
  if set(mlp_axes) & set(BATCH_AXES):
    raise ValueError(f"rule 'moe_mlp' splits the experts' hidden size over mesh axes {mlp_axes}: these must "
                     f"not be batch axes {BATCH_AXES} (devices summing partial outputs need the same tokens)")
  return ExpertLayout(expert_axes=expert_axes, mlp_axes=mlp_axes, weight_specs=specs, ep=ep, tp=tp)


# ---------------------------------------------------------------------------------------------------
# The routed computation on one device of the shard_map.


def local_assignments(idx_gk: jax.Array, first_expert, num_local: int) -> tuple[jax.Array, ...]:
  """The assignments (token g, choice j) whose expert is in [first_expert, first_expert + num_local).

  Returns (flat assignment index [M], local expert id [M] sorted ascending, valid [M], group sizes
  [num_local]) with M = G * min(k, num_local): every local assignment fits, the remaining rows are
  padding (valid False, id clipped to the last expert so the ids stay sorted and in range).
  """
  g, k = idx_gk.shape
  local_n = idx_gk.reshape(-1) - first_expert
  key_n = jnp.where((local_n >= 0) & (local_n < num_local), local_n, num_local)
  rows = g * min(k, num_local)
  order_m = jnp.argsort(key_n, stable=True)[:rows]
  key_m = jnp.take(key_n, order_m)
  sizes_e = jnp.bincount(key_n, length=num_local + 1)[:num_local].astype(jnp.int32)
  return order_m, jnp.minimum(key_m, num_local - 1), key_m < num_local, sizes_e


def _local_experts(x_gd, idx_gk, weights_gk, gate_edf, up_edf, down_efd, first_expert, cfg):
  """Partial outputs [G, D]: each token's weighted sum over its local experts (F-slice partial sums)."""
  k = idx_gk.shape[1]
  order_m, experts_m, valid_m, sizes_e = local_assignments(idx_gk, first_expert, gate_edf.shape[0])
  rows_md = jnp.take(x_gd, order_m // k, axis=0)
  y_md, _ = moe.grouped_ffn(rows_md, experts_m, gate_edf, up_edf, down_efd, cfg, group_sizes_e=sizes_e)
  w_m = jnp.where(valid_m, jnp.take(weights_gk.reshape(-1), order_m), 0).astype(y_md.dtype)
  y_md = jnp.where(valid_m[:, None], y_md, 0) * w_m[:, None]
  return jnp.zeros_like(x_gd, dtype=y_md.dtype).at[order_m // k].add(y_md)


def _shard_body(x_ld, idx_lk, weights_lk, gate_edf, up_edf, down_efd, *, cfg, layout: ExpertLayout):
  ep_axes = layout.expert_axes
  if ep_axes:
    gather = functools.partial(jax.lax.all_gather, axis_name=ep_axes, tiled=True)
    x_ld, idx_lk, weights_lk = gather(x_ld), gather(idx_lk), gather(weights_lk)
    first = jax.lax.axis_index(ep_axes) * gate_edf.shape[0]
  else:
    first = 0
  y_gd = _local_experts(x_ld, idx_lk, weights_lk, gate_edf, up_edf, down_efd, first, cfg)
  y_ld = jax.lax.psum_scatter(y_gd, ep_axes, scatter_dimension=0, tiled=True) if ep_axes else y_gd
  return jax.lax.psum(y_ld, layout.mlp_axes) if layout.mlp_axes else y_ld


def _trace_mesh(mesh: Mesh, used: frozenset[str]):
  """(mesh, manual axes) of the shard_map: manual over every axis of ``mesh`` at top level; inside a
  program already manual over some axes (a pipeline over 'stage'), the context's mesh and only ``used``."""
  context = jax.sharding.get_abstract_mesh()
  if context.empty or not context.manual_axes:
    return mesh, frozenset(mesh.axis_names)
  return context, used - frozenset(context.manual_axes)


def routed_expert_parallel(mesh: Mesh, layout: ExpertLayout) -> moe.RoutedFn:
  """A `moe.routed_override` function: the routed experts under shard_map over ``mesh`` (dropless)."""
  tokens = P(BATCH_AXES, None)
  shards = _size(mesh, BATCH_AXES)
  used = frozenset(BATCH_AXES) | frozenset(layout.expert_axes) | frozenset(layout.mlp_axes)

  def routed(x_td, idx_tk, weights_tk, gate_edf, up_edf, down_efd, cfg):
    if x_td.shape[0] % shards:
      raise ValueError(f"expert parallelism: {x_td.shape[0]} token rows do not divide over the batch axes "
                       f"{_sizes(mesh, BATCH_AXES)}")
    body = functools.partial(_shard_body, cfg=cfg, layout=layout)
    target, manual = _trace_mesh(mesh, used)
    fn = jax.shard_map(body, mesh=target, in_specs=(tokens, tokens, tokens) + layout.weight_specs,
                       out_specs=tokens, axis_names=manual)
    return fn(x_td, idx_tk, weights_tk, gate_edf, up_edf, down_efd), None

  return routed


def with_expert_parallel(fn: Callable[..., Any], cfg: ModelConfig, mesh: Mesh, rules: Rules) -> Callable[..., Any]:
  """``fn`` with every sparse layer it traces computing its routed experts expert-parallel over ``mesh``.

  Validates the layout now (before any compile). Returns ``fn`` itself for a dense model, for the
  capacity-factor path (module docstring), and when neither 'expert' nor 'moe_mlp' is split (one device
  holds every expert whole: the model's own computation is already local).
  """
  if not cfg.is_moe:
    return fn
  layout = expert_layout(cfg, mesh, rules)
  if cfg.moe_capacity_factor is not None or (layout.ep == 1 and layout.tp == 1):
    return fn
  routed = routed_expert_parallel(mesh, layout)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with moe.routed_override(routed):
      return fn(*args, **kwargs)

  return wrapped
