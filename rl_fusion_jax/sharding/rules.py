"""Logical axis -> mesh axis rule tables, one per phase, and the shardings derived from them.

Parameters carry logical axis names only (``rl_fusion_jax.models.param_logical_axes``), and so does the
KV cache (``rl_fusion_jax.models.cache_logical_axes``). These tables are the single place that decides
how they map onto the (stage, data, fsdp, tensor) mesh; nothing else in the code spells a PartitionSpec for
parameters or for the cache.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models.kv_cache import cache_logical_axes

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
    # The stacked layer axis of scanned blocks: over the pipeline stages (num_layers / stage consecutive
    # layers per stage, sharding/pipeline.py). With stage = 1 this names nothing (OPTIONAL_AXES).
    ("layers", "stage"),
    # MoE: experts over the batch axes (EP = fsdp x data; tokens travel to their experts' devices, see
    # sharding/expert_parallel.py), each expert's hidden dim over tensor; the router is tiny: replicated.
    # fsdp before data: device (d, f) then holds expert shard f * data + d, which lies inside the shard f
    # GENERATE_RULES gives it, so the switch moves E / (data * fsdp) experts into each device (and none
    # back); in (data, fsdp) order most devices would need their whole generation shard.
    ("expert", ("fsdp", "data")),
    ("moe_mlp", "tensor"),
    ("router", None),
    # KV cache [layers, cache_batch, kv_heads, cache_seq, head_dim] (the names above serve it too): rows
    # over the batch axes like every batch (sharding.mesh.BATCH_AXES), positions never split.
    ("cache_batch", ("data", "fsdp")),
    ("cache_seq", None),
)

GENERATE_RULES: Rules = (
    ("vocab", "tensor"),
    ("embed", None),          # no fsdp while generating: the fsdp axis becomes extra replicas
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),         # no stages while generating: every device holds every layer
    ("expert", "fsdp"),       # EP = fsdp inside each data replica: fewer experts per device move in
    ("moe_mlp", "tensor"),
    ("router", None),
    ("cache_batch", ("data", "fsdp")),   # fsdp holds no params here, so its devices take their own rows
    ("cache_seq", None),
)


# Mesh axes a rule may name although a mesh lacks them or holds them once: on a mesh without pipeline
# stages (no 'stage' axis, or stage = 1) they map to nothing, so every spec is what it was before the axis
# existed (e.g. the (data, fsdp, tensor) meshes of testing/aot_memory.py).
OPTIONAL_AXES = ("stage",)


def _absent(axis: str, mesh: Mesh) -> bool:
  return axis in OPTIONAL_AXES and dict(mesh.shape).get(axis, 1) == 1


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
    mesh_axes = tuple(a for a in (mesh_axes or ()) if a not in used and not _absent(a, mesh))
    for a in mesh_axes:
      if a not in mesh.shape:
        raise ValueError(f"rule for logical axis {name!r} names mesh axis {a!r}; mesh axes are "
                         f"{tuple(mesh.shape)}")
    used.update(mesh_axes)
    spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
  return P(*spec)


def _shards(part, mesh: Mesh) -> tuple[tuple[str, ...], int]:
  """The mesh axes of one PartitionSpec entry and how many pieces they split a dimension into."""
  axes = (part,) if isinstance(part, str) else tuple(part or ())
  shards = 1
  for a in axes:
    shards *= mesh.shape[a]
  return axes, shards


def cache_sharding(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> NamedSharding:
  """The one sharding of ``cache['k']`` and ``cache['v']``: ``models.cache_logical_axes()`` under ``rules``.

  Raises, naming ``model.num_kv_heads`` and the mesh axes, when the axes that split 'kv_heads' do not
  divide the model's KV heads. Whether the batch axes divide the rows is the caller's check (the engine
  validates ``num_slots``), since the row count is not part of the model.
  """
  spec = logical_to_spec(cache_logical_axes(), rules, mesh)
  axes, shards = _shards(spec[cache_logical_axes().index("kv_heads")], mesh)
  if cfg.num_kv_heads % shards:
    sizes = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in axes)
    raise ValueError(f"model.num_kv_heads={cfg.num_kv_heads} does not divide over {sizes} (rule "
                     f"'kv_heads'): the KV cache splits its heads like the k/v projections")
  return NamedSharding(mesh, spec)


# The ModelConfig field behind a logical axis' size, named when that size does not divide its mesh axes
# (e.g. num_experts over the expert-parallel degree). Axes whose size has several sources ('mlp': dense or
# shared-expert hidden; 'layers': one of two stacks) are left unnamed.
_MODEL_FIELDS = {"expert": "num_experts", "moe_mlp": "moe_intermediate_size", "q_heads": "num_heads",
                 "kv_heads": "num_kv_heads", "vocab": "vocab_size", "embed": "hidden_size"}


def param_shardings(abstract_params, logical_axes, mesh: Mesh, rules: Rules):
  """NamedSharding per parameter; raises naming the parameter if a dimension does not divide."""
  def one(path, leaf, axes):
    spec = logical_to_spec(axes, rules, mesh)
    for dim, (size, part) in enumerate(zip(leaf.shape, tuple(spec) + (None,) * leaf.ndim)):
      parts, shards = _shards(part, mesh)
      if size % shards:
        field = _MODEL_FIELDS.get(axes[dim])
        hint = f" (model.{field}={size}: the degree of the rule's mesh axes must divide it)" if field else ""
        raise ValueError(f"parameter {jax.tree_util.keystr(path)} dimension {dim} (size {size}, logical "
                         f"{axes[dim]!r}) does not divide over mesh axes {parts} ({shards} shards){hint}")
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(
      one, abstract_params, logical_axes, is_leaf=lambda x: isinstance(x, tuple))
