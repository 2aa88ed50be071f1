"""The phase switch: ``to_phase`` is the only place parameters change layout or memory kind.

Training keeps the parameters in the TRAIN_RULES layout (FSDP x tensor) and the optimizer state on the
device; generation wants the GENERATE_RULES layout (tensor-parallel replicas) and the device memory for
the KV cache, so the optimizer state (and any held gradients) waits in pinned host memory.

Moves go in buckets of consecutive leaves. Each bucket is put to its destination, waited on, and its
source arrays are deleted before the next bucket starts, so the extra memory at any time is about one
bucket, never a second full copy. Sources are deleted explicitly because donation does not free them when
the per-device shard shape or the memory kind changes. ``to_phase`` therefore consumes its input: the
moved leaves of the state passed in are deleted, like donated buffers.

``bucket_bytes`` bounds what one bucket adds on any single device (the destination shards it creates
there), not the arrays' global size. Per device, the live bytes during a switch stay within
max(live before, live after) + one bucket: the generation layout is itself larger than the training one
(no fsdp split), so after train -> generate the device legitimately holds more than before.

This module never builds PartitionSpecs of its own: every sharding comes from the rule tables
(``rules.py``) and the optimizer's own structure (``train/state.py``).
"""
from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from rl_fusion_jax.sharding import memory
from rl_fusion_jax.sharding.rules import GENERATE_RULES, TRAIN_RULES, Rules, param_shardings
from rl_fusion_jax.train import state as state_lib

HOST = "pinned_host"
# Transfers dispatched before waiting: more than ~32 multi-device programs in flight deadlock on CPU.
_MAX_IN_FLIGHT = 16
# State fields that leave the device while generating (gradients only where a caller holds them).
_OFFLOADED = ("opt_state", "grads")


class Phase(enum.Enum):
  TRAIN = "train"
  GENERATE = "generate"


# ---------------------------------------------------------------------------------------------------
# Layouts: where every leaf lives in each phase, built once from the rule tables.


@dataclasses.dataclass(frozen=True)
class Layouts:
  """Param shardings per phase, and device / host shardings of the optimizer state and gradients."""
  params: Mapping[Phase, Any]   # Phase -> pytree of NamedSharding (same structure as the params)
  opt_device: Any
  opt_host: Any
  grads_device: Any
  grads_host: Any

  def offloaded(self, field: str, on_host: bool):
    """Shardings of an offloadable field (``opt_state`` or ``grads``) on the host or the device."""
    prefix = "opt" if field == "opt_state" else "grads"
    return getattr(self, f"{prefix}_{'host' if on_host else 'device'}")


def _check_rules(rules: Rules, mesh: Mesh, name: str) -> None:
  """Every mesh axis a rule names must exist, whether or not a parameter uses that rule today."""
  for rule in rules:
    if len(rule) != 2:
      raise ValueError(f"{name}: rule {rule!r} is not a (logical axis, mesh axes) pair")
    targets = rule[1] if isinstance(rule[1], (tuple, list)) else (rule[1],)
    for axis in targets:
      if axis is not None and axis not in mesh.shape:
        raise ValueError(f"{name}: rule {rule!r} names mesh axis {axis!r}; mesh axes are "
                         f"{tuple(mesh.shape)}")


def _on_host(shardings):
  return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


def make_layouts(mesh: Mesh, abstract_params, logical_axes, tx: optax.GradientTransformation, *,
                 train_rules: Rules = TRAIN_RULES, generate_rules: Rules = GENERATE_RULES) -> Layouts:
  """Derives all shardings of both phases; raises naming the rule table and rule if one is bad."""
  _check_rules(train_rules, mesh, "train_rules")
  _check_rules(generate_rules, mesh, "generate_rules")
  train = param_shardings(abstract_params, logical_axes, mesh, train_rules)
  generate = param_shardings(abstract_params, logical_axes, mesh, generate_rules)
  opt = state_lib.state_shardings(tx, abstract_params, train, mesh).opt_state
  return Layouts(params={Phase.TRAIN: train, Phase.GENERATE: generate}, opt_device=opt,
                 opt_host=_on_host(opt), grads_device=train, grads_host=_on_host(train))


# ---------------------------------------------------------------------------------------------------
# Statistics of one switch.


@dataclasses.dataclass(frozen=True)
class SwitchStats:
  """What one switch moved and what it cost; memory fields are empty when tracking was off."""
  phase: Phase
  params_bytes: int             # bytes of the param arrays that changed layout (one logical copy)
  offload_bytes: int            # bytes of optimizer state / gradients that changed memory kind
  buckets: int
  largest_bucket_bytes: int     # destination bytes the fullest device received in the largest bucket
  seconds: float                # wall time of the moves, sampling excluded
  before: memory.LiveBytes = dataclasses.field(default_factory=dict)
  after: memory.LiveBytes = dataclasses.field(default_factory=dict)
  peak_per_device: Mapping[int, int] = dataclasses.field(default_factory=dict)   # all memory kinds

  def peak_extra_bytes(self) -> int:
    """Largest rise over the start, on any device, of the live bytes (all memory kinds)."""
    before = memory.per_device(self.before)
    return max((peak - before.get(d, 0) for d, peak in self.peak_per_device.items()), default=0)

  def transient_bytes(self) -> int:
    """Largest rise of the peak over max(live before, live after) on any device: what bucketing bounds."""
    before, after = memory.per_device(self.before), memory.per_device(self.after)
    return max((peak - max(before.get(d, 0), after.get(d, 0)) for d, peak in self.peak_per_device.items()),
               default=0)

  def as_metrics(self, prefix: str = "switch/") -> dict[str, float]:
    out = {"params_bytes": self.params_bytes, "offload_bytes": self.offload_bytes,
           "buckets": self.buckets, "largest_bucket_bytes": self.largest_bucket_bytes,
           "seconds": self.seconds}
    if self.peak_per_device:
      out |= {"peak_bytes_max": max(self.peak_per_device.values()),
              "peak_extra_bytes_max": self.peak_extra_bytes(),
              "transient_bytes_max": self.transient_bytes(),
              "device_kind_bytes_before_max": _max_of(self.before, "device"),
              "device_kind_bytes_after_max": _max_of(self.after, "device"),
              "host_kind_bytes_after_max": _max_of(self.after, HOST)}
    return {prefix + k: float(v) for k, v in out.items()}


def _max_of(live: memory.LiveBytes, kind: str) -> int:
  return max(memory.per_device(live, kind).values(), default=0)


# ---------------------------------------------------------------------------------------------------
# Bucketed moves.


def plan_buckets(costs: Sequence[int], bucket_bytes: int) -> list[list[int]]:
  """Groups consecutive indices of ``costs`` into buckets of total cost <= ``bucket_bytes``.

  A single item costing more than ``bucket_bytes`` gets a bucket of its own.
  """
  buckets: list[list[int]] = []
  total = bucket_bytes + 1
  for index, cost in enumerate(costs):
    if total + cost > bucket_bytes:
      buckets.append([])
      total = 0
    buckets[-1].append(index)
    total += cost
  return buckets


def _shard_bytes(array: jax.Array, sharding: NamedSharding) -> int:
  return math.prod(sharding.shard_shape(array.shape)) * array.dtype.itemsize


def _leaves(tree, shardings, field: str) -> tuple[list, list, Any]:
  """Flattens the state field and its shardings together; raises naming the field on any mismatch."""
  leaves, treedef = jax.tree.flatten(tree)
  try:
    dsts = treedef.flatten_up_to(shardings)
  except (ValueError, TypeError) as e:
    raise ValueError(f"state.{field}: structure does not match its layout: {e}") from None
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not isinstance(leaf, jax.Array):
      raise ValueError(f"state.{field}{jax.tree_util.keystr(path)}: expected a jax.Array, got "
                       f"{type(leaf).__name__}")
  return leaves, dsts, treedef


def _pending(leaves: list, dsts: list, field: str) -> list[int]:
  """Indices of the leaves whose layout or memory kind differs from the destination."""
  todo = [i for i, (x, s) in enumerate(zip(leaves, dsts))
          if x.sharding.memory_kind != s.memory_kind or not x.sharding.is_equivalent_to(s, x.ndim)]
  if len({id(leaves[i]) for i in todo}) != len(todo):
    raise ValueError(f"state.{field}: the same array appears twice; to_phase deletes each moved "
                     "source, so every leaf must be its own array")
  return todo


def _move_bucket(leaves: list, dsts: list, bucket: Sequence[int], tracker) -> None:
  """Puts one bucket to its destinations, waits, samples the peak, then frees the sources."""
  moved = []
  for start in range(0, len(bucket), _MAX_IN_FLIGHT):
    chunk = bucket[start:start + _MAX_IN_FLIGHT]
    moved += jax.block_until_ready(jax.device_put([leaves[i] for i in chunk], [dsts[i] for i in chunk]))
  if tracker is not None:
    tracker.sample()    # sources and destinations are both alive: the bucket's peak
  for i, new in zip(bucket, moved):
    leaves[i].delete()
    leaves[i] = new


def _move_tree(flat: tuple[list, list, Any], field: str, bucket_bytes: int, tracker) -> tuple[Any, int, list[int]]:
  """Moves one flattened field bucket by bucket; returns the new tree, bytes moved and bucket costs."""
  leaves, dsts, treedef = flat
  todo = _pending(leaves, dsts, field)
  costs = [_shard_bytes(leaves[i], dsts[i]) for i in todo]
  plan = plan_buckets(costs, bucket_bytes)
  moved_bytes = sum(leaves[i].nbytes for i in todo)
  for bucket in plan:
    _move_bucket(leaves, dsts, [todo[j] for j in bucket], tracker)
  return treedef.unflatten(leaves), moved_bytes, [sum(costs[j] for j in bucket) for bucket in plan]


def move(tree, shardings, *, bucket_bytes: int, name: str = "tree") -> tuple[Any, int]:
  """Bucketed copy of ``tree`` to ``shardings`` (another layout, memory kind or mesh) -> (tree, bytes).

  The moved source leaves are deleted, as in ``to_phase``; used for the weights sent to a rollout mesh
  and for auxiliary models moving between host and device.
  """
  _check_args(Phase.TRAIN, bucket_bytes)
  moved, nbytes, _ = _move_tree(_leaves(tree, shardings, name), name, bucket_bytes, None)
  return moved, nbytes


# ---------------------------------------------------------------------------------------------------
# The switch.


def _get(state, field: str):
  return state.get(field) if isinstance(state, Mapping) else getattr(state, field, None)


def _replace(state, field: str, value):
  if isinstance(state, Mapping):
    return {**state, field: value}
  return dataclasses.replace(state, **{field: value})


def _plan(state, phase: Phase, layouts: Layouts, offload: bool) -> list[tuple[str, Any]]:
  """(field, destination shardings) in move order.

  Going to generation the optimizer leaves the device first, which frees room for the larger generation
  layout of the params; going back the params shrink to the training layout before the optimizer returns.
  """
  on_host = phase is Phase.GENERATE and offload
  steps = [(f, layouts.offloaded(f, on_host)) for f in _OFFLOADED if _get(state, f) is not None]
  steps.append(("params", layouts.params[phase]))
  return steps if phase is Phase.GENERATE else steps[::-1]


def _check_args(phase, bucket_bytes) -> None:
  if not isinstance(phase, Phase):
    raise ValueError(f"phase: expected a Phase, got {phase!r}")
  if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
    raise ValueError(f"bucket_bytes: must be a positive int, got {bucket_bytes!r}")


def to_phase(state, phase: Phase, *, layouts: Layouts, bucket_bytes: int, offload_optimizer: bool = True,
             track_memory: bool = True) -> tuple[Any, SwitchStats]:
  """Moves ``state`` (a TrainState, or a mapping with ``params`` / ``opt_state`` / ``grads``) to ``phase``.

  Leaves already where ``phase`` wants them are left alone (switching to the current phase moves
  nothing). The moved leaves of the input are deleted; use the returned state. With ``track_memory``
  the live bytes are sampled after every bucket (a few ms each; the time is excluded from ``seconds``).
  """
  _check_args(phase, bucket_bytes)
  # Every field is checked before the first byte moves, so a bad state fails with nothing deleted.
  steps = [(field, _leaves(_get(state, field), shardings, field))
           for field, shardings in _plan(state, phase, layouts, offload_optimizer)]
  tracker = memory.MemoryTracker() if track_memory else None
  sampled = tracker.seconds if tracker else 0.0
  start = time.perf_counter()
  moved, costs = {}, []
  for field, flat in steps:
    tree, moved[field], field_costs = _move_tree(flat, field, bucket_bytes, tracker)
    state = _replace(state, field, tree)
    costs += field_costs
  seconds = time.perf_counter() - start - ((tracker.seconds - sampled) if tracker else 0.0)
  return state, _stats(phase, moved, costs, seconds, tracker)


def _stats(phase: Phase, moved: Mapping[str, int], costs: list[int], seconds: float, tracker) -> SwitchStats:
  memory_fields = {}
  if tracker is not None:
    memory_fields = dict(before=tracker.before, after=tracker.sample(),
                         peak_per_device=dict(tracker.peak_per_device))
  return SwitchStats(phase=phase, params_bytes=moved.get("params", 0),
                     offload_bytes=sum(v for f, v in moved.items() if f != "params"),
                     buckets=len(costs), largest_bucket_bytes=max(costs, default=0), seconds=seconds,
                     **memory_fields)
