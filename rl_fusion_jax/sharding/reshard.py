"""Every parameter move: ``to_phase`` (the phase switch) and ``move`` / ``release`` (everything else) are
the only places parameters change layout, memory kind or mesh.

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

Every other parameter move goes through ``move`` with the same buckets and the same statistics: weights
sent to a rollout mesh (``keep_source=True``: the training side keeps its copy and no whole-tree copy is
made), auxiliary models fetched to the devices and released, a checkpoint's host arrays placed straight
where they rest (host memory included, never first on the devices).

Each switch also reports, per device, the bytes the params' layout change must bring to it against a
naive all-gather of every moved leaf (``Traffic``): for expert weights whose training shard lies inside
their generation shard, a device receives only the experts it lacks.

This module never builds PartitionSpecs of its own: every sharding comes from the rule tables
(``rules.py``) and the optimizer's own structure (``optimizer_shardings``). It imports nothing from
``train/``: the training state is read through its ``params`` / ``opt_state`` / ``grads`` fields.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from rl_fusion_jax.distributed import crosses_processes, put
from rl_fusion_jax.sharding import memory
from rl_fusion_jax.sharding.mesh import replicated
from rl_fusion_jax.sharding.rules import GENERATE_RULES, TRAIN_RULES, Rules, param_shardings

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
  # dtype of the generation copy of the floating params (e.g. bfloat16 over float32 master weights);
  # None: generation uses the params themselves. With a dtype, ``to_phase`` keeps the master weights in
  # ``master_params`` (on the host with ``offload_optimizer``) while generating.
  generate_dtype: Any = None
  # Per param, whether it has an 'expert' logical axis (MoE expert weights): the switch reports their
  # traffic on its own (``Traffic``). None: no param counts as an expert leaf.
  expert_leaves: Any = None

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


def optimizer_shardings(tx: optax.GradientTransformation, abstract_params, param_shardings_, mesh: Mesh):
  """Shardings of ``tx``'s state: per-parameter leaves (moments) follow their parameter's sharding,
  the rest (step counters) is replicated over ``mesh``. Needs only the optimizer's structure."""
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  return optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_shardings_,
                               transform_non_params=lambda _: replicated(mesh))


def make_layouts(mesh: Mesh, abstract_params, logical_axes, tx: optax.GradientTransformation, *,
                 train_rules: Rules = TRAIN_RULES, generate_rules: Rules = GENERATE_RULES,
                 generate_dtype=None) -> Layouts:
  """Derives all shardings of both phases; raises naming the rule table and rule if one is bad.

  ``generate_dtype``: the dtype generation runs its weights in (``ModelConfig.generation_dtype``); when no
  floating param would change dtype it is dropped (``Layouts.generate_dtype`` None).
  """
  _check_rules(train_rules, mesh, "train_rules")
  _check_rules(generate_rules, mesh, "generate_rules")
  train = param_shardings(abstract_params, logical_axes, mesh, train_rules)
  generate = param_shardings(abstract_params, logical_axes, mesh, generate_rules)
  opt = optimizer_shardings(tx, abstract_params, train, mesh)
  if generate_dtype is not None:
    generate_dtype = jnp.dtype(generate_dtype)
    if all(_cast_dtype(x.dtype, generate_dtype) == x.dtype for x in jax.tree.leaves(abstract_params)):
      generate_dtype = None
  experts = jax.tree.map(lambda axes: "expert" in axes, logical_axes, is_leaf=lambda x: isinstance(x, tuple))
  return Layouts(params={Phase.TRAIN: train, Phase.GENERATE: generate}, opt_device=opt,
                 opt_host=_on_host(opt), grads_device=train, grads_host=_on_host(train),
                 generate_dtype=generate_dtype, expert_leaves=experts)


def _cast_dtype(dtype, generate_dtype):
  """The dtype of one param's generation copy: ``generate_dtype`` for floating params, else its own."""
  return generate_dtype if jnp.issubdtype(dtype, jnp.floating) else dtype


# ---------------------------------------------------------------------------------------------------
# Traffic of a layout change: what each device must receive, against an all-gather of every leaf.


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes per destination device id of the params' layout change in one switch (pure bookkeeping from
  the shardings' ``devices_indices_map``; nothing is measured on the wire).

  ``received``: per device, the bytes of its destination shards that it does not already hold of the
  source arrays (destination shard minus its overlap with the source shard on that same device), in the
  destination dtype: the least any transfer must bring to it. ``allgather``: the naive baseline where
  every device gathers each moved leaf whole and then slices its shard: per device, the leaf's full bytes
  minus the source shard it holds. Both count only leaves whose per-device layout changes (a change of
  memory kind alone, like the optimizer's offload or the master weights' return, moves no bytes between
  devices and counts 0); ``expert_*`` are the same figures over the expert leaves only
  (``Layouts.expert_leaves``).
  """
  received: Mapping[int, int] = dataclasses.field(default_factory=dict)
  allgather: Mapping[int, int] = dataclasses.field(default_factory=dict)
  expert_received: Mapping[int, int] = dataclasses.field(default_factory=dict)
  expert_allgather: Mapping[int, int] = dataclasses.field(default_factory=dict)

  def maxima(self) -> dict[str, int]:
    """Each figure on its fullest device: ``received_bytes_max``, ``allgather_bytes_max``, ``expert_*``."""
    return {f"{name}_bytes_max": max(getattr(self, name).values(), default=0)
            for name in ("received", "allgather", "expert_received", "expert_allgather")}


def _elements(index: tuple, shape: tuple[int, ...]) -> int:
  return math.prod(len(range(*part.indices(size))) for part, size in zip(index, shape))


def _overlap(a: tuple, b: tuple, shape: tuple[int, ...]) -> int:
  """Elements two shard indices (tuples of unit-step slices) have in common."""
  n = 1
  for pa, pb, size in zip(a, b, shape):
    (a0, a1, _), (b0, b1, _) = pa.indices(size), pb.indices(size)
    n *= max(0, min(a1, b1) - max(a0, b0))
  return n


@functools.lru_cache(maxsize=4096)
def leaf_traffic(shape: tuple[int, ...], itemsize: int, src, dst) -> tuple[tuple[int, int, int], ...]:
  """(device id, received bytes, all-gather bytes) per device of ``dst`` for one leaf of ``shape`` moved
  from sharding ``src`` (None: a host array, held by no device) to ``dst`` (see ``Traffic``); () when the
  per-device layout does not change."""
  dst_map = dst.devices_indices_map(shape)
  src_map = {} if src is None else src.devices_indices_map(shape)
  if src_map == dst_map:
    return ()
  full = math.prod(shape)
  out = []
  for device, index in dst_map.items():
    held = src_map.get(device)
    overlap = 0 if held is None else _overlap(index, held, shape)
    mine = 0 if held is None else _elements(held, shape)
    out.append((device.id, (_elements(index, shape) - overlap) * itemsize, (full - mine) * itemsize))
  return tuple(out)


def _traffic(leaves: list, dsts: list, dtypes: list | None, expert_flags: list) -> Traffic:
  """``Traffic`` of moving ``leaves`` to ``dsts`` (in ``dtypes[i]`` where given)."""
  names = ("received", "allgather", "expert_received", "expert_allgather")
  sums = {name: collections.Counter() for name in names}
  for i, (x, dst) in enumerate(zip(leaves, dsts)):
    itemsize = jnp.dtype(dtypes[i] if dtypes else x.dtype).itemsize
    src = x.sharding if isinstance(x, jax.Array) else None
    for device, received, gathered in leaf_traffic(tuple(x.shape), itemsize, src, dst):
      for prefix in ("", "expert_") if expert_flags[i] else ("",):
        sums[prefix + "received"][device] += received
        sums[prefix + "allgather"][device] += gathered
  return Traffic(**{name: dict(c) for name, c in sums.items()})


def _params_traffic(steps: list, params_flat, layouts: Layouts) -> Traffic:
  """``Traffic`` of the params in one ``to_phase``: their move in ``steps``, or with ``params_flat``
  (mixed precision, train -> generate) the generation copy made from them."""
  if params_flat is not None:
    leaves, _, treedef = params_flat
    dsts = treedef.flatten_up_to(layouts.params[Phase.GENERATE])
    dtypes = _cast_dtypes(leaves, layouts.generate_dtype)
  else:
    (leaves, dsts, treedef), dtypes = dict(steps)["params"], None
  flags = ([False] * len(leaves) if layouts.expert_leaves is None
           else treedef.flatten_up_to(layouts.expert_leaves))
  return _traffic(leaves, dsts, dtypes, flags)


# ---------------------------------------------------------------------------------------------------
# Statistics of one move or switch.


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoveStats:
  """What one bucketed move (or release) did and cost; memory fields are empty when tracking was off."""
  moved_bytes: int              # bytes of the arrays moved (one logical copy); for a release, freed
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

  def counts(self) -> dict[str, float]:
    """The figures reported whether or not memory was tracked."""
    return {"bytes": self.moved_bytes, "buckets": self.buckets,
            "largest_bucket_bytes": self.largest_bucket_bytes, "seconds": self.seconds}

  def as_metrics(self, prefix: str) -> dict[str, float]:
    """``counts()`` and, when memory was tracked, the peak and per-kind figures; keys start with ``prefix``."""
    out = self.counts()
    if self.peak_per_device:
      out |= {"peak_bytes_max": max(self.peak_per_device.values()),
              "peak_extra_bytes_max": self.peak_extra_bytes(),
              "transient_bytes_max": self.transient_bytes(),
              "device_kind_bytes_before_max": _max_of(self.before, "device"),
              "device_kind_bytes_after_max": _max_of(self.after, "device"),
              "host_kind_bytes_after_max": _max_of(self.after, HOST)}
    return {prefix + k: float(v) for k, v in out.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchStats(MoveStats):
  """One ``to_phase``: ``moved_bytes`` split into the params' layout change and the offloaded fields."""
  phase: Phase
  params_bytes: int             # bytes of the param arrays that changed layout (one logical copy)
  offload_bytes: int            # bytes of optimizer state / gradients that changed memory kind
  traffic: Traffic = dataclasses.field(default_factory=Traffic)   # per device: received vs all-gather

  def counts(self) -> dict[str, float]:
    return {"params_bytes": self.params_bytes, "offload_bytes": self.offload_bytes, "buckets": self.buckets,
            "largest_bucket_bytes": self.largest_bucket_bytes, "seconds": self.seconds,
            **self.traffic.maxima()}

  def as_metrics(self, prefix: str = "switch/") -> dict[str, float]:
    return super().as_metrics(prefix)


def _max_of(live: memory.LiveBytes, kind: str) -> int:
  return max(memory.per_device(live, kind).values(), default=0)


def _memory_fields(tracker) -> dict[str, Any]:
  """The memory fields of a stats record: empty without a tracker, else before / after / peaks."""
  if tracker is None:
    return {}
  return dict(before=tracker.before, after=tracker.sample(), peak_per_device=dict(tracker.peak_per_device))


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


def _leaves(tree, shardings, field: str, *, allow_host: bool = False) -> tuple[list, list, Any]:
  """Flattens the state field and its shardings together; raises naming the field on any mismatch.

  Leaves must be jax.Arrays, or also numpy arrays with ``allow_host``.
  """
  leaves, treedef = jax.tree.flatten(tree)
  try:
    dsts = treedef.flatten_up_to(shardings)
  except (ValueError, TypeError) as e:
    raise ValueError(f"state.{field}: structure does not match its layout: {e}") from None
  allowed = (jax.Array, np.ndarray) if allow_host else jax.Array
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not isinstance(leaf, allowed):
      raise ValueError(f"state.{field}{jax.tree_util.keystr(path)}: expected a jax.Array"
                       f"{' or a numpy array' if allow_host else ''}, got {type(leaf).__name__}")
  return leaves, dsts, treedef


def _differs(x, sharding: NamedSharding) -> bool:
  """Whether leaf ``x`` (a host array, or a device array) is not already at ``sharding``."""
  return (not isinstance(x, jax.Array) or x.sharding.memory_kind != sharding.memory_kind
          or not x.sharding.is_equivalent_to(sharding, x.ndim))


def _pending(leaves: list, dsts: list, field: str, keep_source: bool) -> list[int]:
  """Indices of the leaves to put: all of them with ``keep_source`` (the result must own every buffer),
  else those (host arrays, or device arrays whose layout or memory kind differs) not at the destination."""
  if keep_source:
    return list(range(len(leaves)))
  todo = [i for i, (x, s) in enumerate(zip(leaves, dsts)) if _differs(x, s)]
  if len({id(leaves[i]) for i in todo}) != len(todo):
    raise ValueError(f"state.{field}: the same array appears twice; to_phase deletes each moved "
                     "source, so every leaf must be its own array")
  return todo


def _move_bucket(leaves: list, out: list, dsts: list, bucket: Sequence[int], tracker, keep_source: bool,
                 dtypes: list | None = None) -> None:
  """Puts one bucket to its destinations (into ``out``; cast to ``dtypes[i]`` first where given), waits,
  samples the peak, then frees the device sources unless ``keep_source``."""
  def source(i):
    x = leaves[i]
    return x if dtypes is None or x.dtype == dtypes[i] else x.astype(dtypes[i])

  moved = []
  for start in range(0, len(bucket), _MAX_IN_FLIGHT):
    chunk = bucket[start:start + _MAX_IN_FLIGHT]
    if any(crosses_processes(leaves[i], dsts[i]) for i in chunk):   # through host memory, leaf by leaf
      moved += [jax.block_until_ready(put(source(i), dsts[i])) for i in chunk]
      continue
    moved += jax.block_until_ready(jax.device_put([source(i) for i in chunk], [dsts[i] for i in chunk],
                                                  may_alias=False if keep_source else None))
  if tracker is not None:
    tracker.sample()    # sources and destinations are both alive: the bucket's peak
  for i, new in zip(bucket, moved):
    if not keep_source and isinstance(leaves[i], jax.Array):
      leaves[i].delete()
    out[i] = new


def _cast_dtypes(leaves: list, dtype) -> list | None:
  """Per leaf, the dtype it is moved in (``_cast_dtype``); None without ``dtype``."""
  return None if dtype is None else [_cast_dtype(x.dtype, jnp.dtype(dtype)) for x in leaves]


def _move_tree(flat: tuple[list, list, Any], field: str, bucket_bytes: int, tracker,
               keep_source: bool = False, dtype=None) -> tuple[Any, int, list[int]]:
  """Moves one flattened field bucket by bucket (floating leaves cast to ``dtype`` if given); returns
  the new tree, bytes moved (of the sources) and bucket costs (destination bytes per device)."""
  leaves, dsts, treedef = flat
  dtypes = _cast_dtypes(leaves, dtype)
  todo = _pending(leaves, dsts, field, keep_source)
  if dtypes is not None:
    todo = sorted(set(todo) | {i for i, x in enumerate(leaves) if x.dtype != dtypes[i]})
  costs = [math.prod(dsts[i].shard_shape(leaves[i].shape)) * (dtypes[i] if dtypes else leaves[i].dtype).itemsize
           for i in todo]
  plan = plan_buckets(costs, bucket_bytes)
  moved_bytes = sum(leaves[i].nbytes for i in todo)
  out = list(leaves)
  for bucket in plan:
    _move_bucket(leaves, out, dsts, [todo[j] for j in bucket], tracker, keep_source, dtypes)
  return treedef.unflatten(out), moved_bytes, [sum(costs[j] for j in bucket) for bucket in plan]


def move(tree, shardings, *, bucket_bytes: int, name: str = "tree", keep_source: bool = False,
         track_memory: bool = False, dtype=None) -> tuple[Any, MoveStats]:
  """Bucketed copy of ``tree`` to ``shardings`` (another layout, memory kind or mesh) -> (tree, stats).

  Leaves may be device arrays or host numpy arrays (a checkpoint read into host memory, which goes
  straight to its destination memory kind). Without ``keep_source`` the moved device leaves are deleted,
  as in ``to_phase``, and leaves already at their destination are returned as they are. With
  ``keep_source`` nothing is deleted and every leaf is copied (also those already in place), so the
  result shares no buffer with ``tree``: the extra memory is the destination itself, built one bucket at
  a time, with no intermediate copy. With ``track_memory`` live bytes are sampled after every bucket
  (time excluded from ``seconds``). With ``dtype`` the floating leaves arrive in that dtype (each cast
  on its source's devices right before its bucket moves). Used for the weights sent to a rollout mesh,
  auxiliary models moving between host and device, checkpoints placed leaf by leaf, and the critic's
  parking.
  """
  _check_args(Phase.TRAIN, bucket_bytes)
  flat = _leaves(tree, shardings, name, allow_host=True)
  tracker = memory.MemoryTracker() if track_memory else None
  sampled = tracker.seconds if tracker else 0.0
  start = time.perf_counter()
  moved, nbytes, costs = _move_tree(flat, name, bucket_bytes, tracker, keep_source, dtype)
  seconds = time.perf_counter() - start - ((tracker.seconds - sampled) if tracker else 0.0)
  return moved, MoveStats(moved_bytes=nbytes, buckets=len(costs), largest_bucket_bytes=max(costs, default=0),
                          seconds=seconds, **_memory_fields(tracker))


def release(tree, *, used_by=None, track_memory: bool = False) -> MoveStats:
  """Deletes every array of ``tree`` (e.g. a fetched device copy whose resting copy lives elsewhere)
  once ``used_by`` (the outputs computed from it) is ready -> stats with the freed bytes.

  The wait for ``used_by`` is not counted in ``seconds``. ``buckets`` is 0: a release moves nothing.
  """
  jax.block_until_ready(used_by)
  leaves = list({id(x): x for x in jax.tree.leaves(tree) if not x.is_deleted()}.values())
  tracker = memory.MemoryTracker() if track_memory else None
  start = time.perf_counter()
  freed = sum(x.nbytes for x in leaves)
  for x in leaves:
    x.delete()
  seconds = time.perf_counter() - start
  return MoveStats(moved_bytes=freed, buckets=0, largest_bucket_bytes=0, seconds=seconds,
                   **_memory_fields(tracker))


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

  With ``layouts.generate_dtype`` (mixed precision), going to generation makes ``params`` a copy in that
  dtype and the generation layout, bucket by bucket, while the master weights go to ``master_params``
  (pinned host memory with ``offload_optimizer``, else they stay where they are); going back deletes the
  copy and returns the masters, bit for bit, to ``params``.
  """
  _check_args(phase, bucket_bytes)
  masters = _get(state, "master_params")
  split = layouts.generate_dtype is not None and phase is Phase.GENERATE and masters is None
  join = masters is not None and phase is Phase.TRAIN     # params are the generation copy: masters return
  sources = {"params": masters} if join else {}
  # Every field is checked before the first byte moves, so a bad state fails with nothing deleted.
  steps = [(field, _leaves(sources.get(field, _get(state, field)), shardings, field))
           for field, shardings in _plan(state, phase, layouts, offload_optimizer)
           if not (split and field == "params")]
  params_flat = _leaves(_get(state, "params"), layouts.params[Phase.TRAIN], "params") if split else None
  traffic = _params_traffic(steps, params_flat, layouts)
  tracker = memory.MemoryTracker() if track_memory else None
  sampled = tracker.seconds if tracker else 0.0
  start = time.perf_counter()
  moved, costs = {}, []
  if join:    # the generation copy is derived from the masters: free it before they come back
    release(_get(state, "params"))
    state = _replace(state, "master_params", None)
  for field, flat in steps:
    tree, moved[field], field_costs = _move_tree(flat, field, bucket_bytes, tracker)
    state = _replace(state, field, tree)
    costs += field_costs
  if split:
    gen, master, moved["params"], moved["master_params"], field_costs = _split_params(
        params_flat, layouts, offload_optimizer, bucket_bytes, tracker)
    state = _replace(_replace(state, "params", gen), "master_params", master)
    costs += field_costs
  seconds = time.perf_counter() - start - ((tracker.seconds - sampled) if tracker else 0.0)
  return state, _stats(phase, moved, costs, seconds, tracker, traffic)


def _split_params(flat, layouts: Layouts, offload: bool, bucket_bytes: int, tracker):
  """Train -> generate under mixed precision, bucket by bucket: the bucket's copies in
  ``layouts.generate_dtype`` and the generation layout are made, then its masters go to the host
  (``offload``; their device sources deleted) -> (copies, masters, copy bytes, master bytes, costs)."""
  leaves, _, treedef = flat
  gen_dsts = treedef.flatten_up_to(layouts.params[Phase.GENERATE])
  master_dsts = treedef.flatten_up_to(_on_host(layouts.params[Phase.TRAIN]) if offload
                                      else layouts.params[Phase.TRAIN])
  dtypes = _cast_dtypes(leaves, layouts.generate_dtype)
  costs = [math.prod(s.shard_shape(x.shape)) * dt.itemsize for x, s, dt in zip(leaves, gen_dsts, dtypes)]
  plan = plan_buckets(costs, bucket_bytes)
  gen, master = list(leaves), list(leaves)
  for bucket in plan:
    bucket = list(bucket)
    _move_bucket(leaves, gen, gen_dsts, bucket, tracker, keep_source=True, dtypes=dtypes)
    _move_bucket(leaves, master, master_dsts, [i for i in bucket if _differs(leaves[i], master_dsts[i])],
                 None, keep_source=False)
  gen_bytes = sum(math.prod(x.shape) * dt.itemsize for x, dt in zip(leaves, dtypes))
  master_bytes = sum(x.nbytes for x, s in zip(leaves, master_dsts) if offload)
  return (treedef.unflatten(gen), treedef.unflatten(master), gen_bytes, master_bytes,
          [sum(costs[j] for j in bucket) for bucket in plan])


def _stats(phase: Phase, moved: Mapping[str, int], costs: list[int], seconds: float, tracker,
           traffic: Traffic) -> SwitchStats:
  return SwitchStats(phase=phase, moved_bytes=sum(moved.values()), params_bytes=moved.get("params", 0),
                     offload_bytes=sum(v for f, v in moved.items() if f != "params"),
                     buckets=len(costs), largest_bucket_bytes=max(costs, default=0), seconds=seconds,
                     traffic=traffic, **_memory_fields(tracker))
