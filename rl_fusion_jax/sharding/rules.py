"""Logical axis -> mesh axis rule tables, one per phase, and the shardings derived from them.

Parameters carry logical axis names only (``rl_fusion_jax.models.param_logical_axes``). These tables are
the single place that decides how they map onto the (data, fsdp, tensor) mesh; nothing else in the code
spells a PartitionSpec for parameters.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

#                     TRAIN_RULES: FSDP x tensor          GENERATE_RULES: tensor-parallel replicas
TRAIN_RULES: Rules = (
    # Embedding / head: vocab over tensor, model dim over fsdp (ZeRO-3 style, gathered per layer).
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    # Attention: heads over tensor (Megatron column/row split), head_dim never split.
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    # MLP hidden over tensor.
    ("mlp", "tensor"),
    # Norm scales are tiny: replicated.
    ("norm", None),
)

GENERATE_RULES: Rules = (
    ("vocab", "tensor"),
    ("embed", None),          # no fsdp while generating: the fsdp axis becomes extra replicas
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
)


def logical_to_spec(axes: Sequence[str | None], rules: Rules, mesh: Mesh) -> P:
  """Maps one parameter's logical axes to a PartitionSpec; a mesh axis is used at most once."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name in axes:
    if name is not None and name not in table:
      raise ValueError(f"logical axis {name!r} has no rule; rules cover {sorted(table)}")
    mesh_axes = table.get(name) if name is not None else None
    if isinstance(mesh_axes, str):
      mesh_axes = (mesh_axes,)
    mesh_axes = tuple(a for a in (mesh_axes or ()) if a not in used)
    for a in mesh_axes:
      if a not in mesh.shape:
        raise ValueError(f"rule for logical axis {name!r} names mesh axis {a!r}; mesh axes are "
                         f"{tuple(mesh.shape)}")
    used.update(mesh_axes)
    spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
  return P(*spec)


def param_shardings(abstract_params, logical_axes, mesh: Mesh, rules: Rules):
  """NamedSharding per parameter; raises naming the parameter if a dimension does not divide."""
  def one(path, leaf, axes):
    spec = logical_to_spec(axes, rules, mesh)
    for dim, (size, part) in enumerate(zip(leaf.shape, tuple(spec) + (None,) * leaf.ndim)):
      parts = (part,) if isinstance(part, str) else (part or ())
      shards = 1
      for a in parts:
        shards *= mesh.shape[a]
      if size % shards:
        raise ValueError(f"parameter {jax.tree_util.keystr(path)} dimension {dim} (size {size}, logical "
                         f"{axes[dim]!r}) does not divide over mesh axes {parts} ({shards} shards)")
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(
      one, abstract_params, logical_axes, is_leaf=lambda x: isinstance(x, tuple))
