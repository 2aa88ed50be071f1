"""StaleSync in separated mode with real overlap: one OS process per side, joined by ``jax.distributed``.

On CPU one process runs multi-device programs one after another, so the one-process ``separated`` mode
never overlaps rollout and training. Here process 0 owns its devices as the rollout mesh and process 1
owns its devices as the training mesh; each runs only its own side's programs.

Protocol (s = ``stalesync.max_staleness``; batch k is problems [k n, (k + 1) n), n = ``num_prompts``):
  rollout (process 0): load weights version 0, evaluate; for k = 0, 1, ...: load the weights the schedule
    names for boundary k, generate batch k to completion under them, score it on the host
    (``programs.verify``), ship it packed as chunk k; at the end load the last weights and evaluate.
  train (process 1): warm-up, publish version 0; for L = 0, 1, ...: receive chunk L into a DistQueue,
    drop (and count) groups beyond the bound, admit ``num_prompts`` groups (``queue.staleness.admit``),
    run ``phases.train_phase`` (the one-process arithmetic, fed the shipped scores), publish version L + 1.
  Batch k is trained at learner version k, so it is never generated with a version older than k - s:
  * reproducible (``Options.reproducible``): batch k uses version max(0, k - s) exactly (``weight_plan``),
    so a seed gives the same metrics every run, and s = 0 is the synchronous algorithm (both tested);
  * opportunistic: at each boundary the rollout adopts the newest published version, and waits only
    when that is older than k - s.

Transports. Rollouts: chunk k is one blob in the coordination service's bytes key-value store
(``encode``): token fields packed (one flat buffer + lengths), sample fields, scores, the rollout's
metrics. Weights (``Options.weight_transport``), both exact (reproducible runs agree across them, tested):
  * ``kv`` (default): the trainer copies each needed version to the host and a background thread writes
    it to the key-value store; nobody waits for a rendezvous, the rollout may lead by s batches, and CPU
    collectives stay in-process (``initialize``). Opportunistic mode needs it.
  * ``collective`` (reproducible only): a jitted ``ppermute`` over a 2-device 'side' mesh (one device per
    process) that both processes call where the plan says (``trainer_point``), after a key-value
    handshake that keeps the wait out of the measured transfer; the rollout then reshards locally.
    The trainer joins the transfer for boundary k just before reading chunk k - 1 (s >= 1), which the
    rollout ships right before boundary k: no wait beyond data it needs anyway, but a lead of one batch.
    It needs gloo CPU collectives, which then carry every collective of a multi-device training mesh over
    TCP too: a 40-step warm-up of the test model took 18.6 s instead of 1.7 s (2 devices per process).
  Measured (2-core CPU, busy machine), tiny_grpo (12.7 MB of float32 weights, 1 device per side): kv
  0.67-0.80 s to publish (off the trainer's critical path), 4-10 ms to load; collective 42 ms (trainer),
  49 ms (rollout). Test model (87 KB): kv ~10 ms / 4 ms, collective ~4 ms. Rollout chunks of tiny_grpo:
  61.5 KB packed vs 76.7 KB padded to seq_len; test model 1.06-1.25 KB vs 1.53 KB.

Overlap is measured, not assumed: each side records its busy phases on its own timeline
(``timeline_rollout.jsonl``, ``timeline_train.jsonl``; waits are not phases); the summary merges them on
wall-clock time (also ``timeline.jsonl``) and reports the share of the RL window in which both sides were
busy, each side's idle share and the share in which generation ran beside the training computation.

Checkpoint/resume is not supported in this mode: ``run`` refuses a workdir that holds a checkpoint or a
previous run's metrics. This module never trains a group beyond the bound, never drops one silently
(stale groups are counted), and never ``device_put``s between the two processes' meshes.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import distributed
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax import models
from rl_fusion_jax.config import ExperimentConfig
from rl_fusion_jax.errors import ConfigError
from rl_fusion_jax.fusion.deployment import make_deployment
from rl_fusion_jax.orchestration import advantage_stage, phases, resume, stalesync, workdir_lock
from rl_fusion_jax.orchestration.guard import DivergenceGuard
from rl_fusion_jax.orchestration.programs import Placement, Programs, make_placement
from rl_fusion_jax.orchestration.setup import Setup, validate, write_json_atomic
from rl_fusion_jax.queue.distqueue import DistQueue, Packed, pack
from rl_fusion_jax.queue.staleness import admit_groups, stale_groups, waiting_groups
from rl_fusion_jax.timeline import Timeline
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.types import Rollout

ROLLOUT, TRAIN = 0, 1                     # process index of each side
ROLES = ("rollout", "train")
TRANSPORTS = ("collective", "kv")
PREFIX = "separated"                      # key-value namespace of a run
SCORE_FIELDS = stalesync.SCORE_FIELDS


# ----------------------------------------------------------------------------------------------------
# 1. Options and start-up checks (nothing compiled or written before they pass).
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Options:
  """``reproducible``: batch k uses version max(0, k - s) exactly; else the newest published (>= k - s).
  ``weight_transport``: 'collective' (jitted transfer) or 'kv' (bytes in the key-value store)."""
  reproducible: bool = True
  weight_transport: str = "kv"
  timeout_s: float = 600.0                # longest wait for the other side

  def __post_init__(self):
    if self.weight_transport not in TRANSPORTS:
      raise ConfigError(f"weight_transport: must be one of {TRANSPORTS}, got {self.weight_transport!r}")
    if not self.reproducible and self.weight_transport != "kv":
      raise ConfigError("weight_transport='collective' needs reproducible=True (a rendezvous per push "
                        "cannot adopt whatever is newest); use weight_transport='kv'")
    if not self.timeout_s > 0:
      raise ConfigError(f"timeout_s: must be > 0, got {self.timeout_s}")


def check(cfg: ExperimentConfig, device_processes) -> None:
  """Raises a ConfigError naming the field unless ``cfg`` can run as the two-process async schedule.

  ``device_processes``: the process index of every global device, in ``jax.devices()`` order.
  """
  device_processes = [int(p) for p in device_processes]
  if cfg.fusion.mode != "separated":
    raise ConfigError(f"config.fusion.mode: the async separated schedule needs 'separated', got "
                      f"{cfg.fusion.mode!r}")
  if not cfg.stalesync.enabled:
    raise ConfigError("config.stalesync.enabled: the async separated schedule is StaleSync; set it to True")
  if cfg.stalesync.train_fraction != 1:
    raise ConfigError(f"config.stalesync.train_fraction: must be 1 in the async separated schedule "
                      f"(batches are generated whole), got {cfg.stalesync.train_fraction}")
  count = len(set(device_processes))
  if count != 2:
    raise ConfigError(f"jax.process_count() is {count}: the async separated schedule needs exactly 2 "
                      "processes (0: rollout, 1: training), joined by jax.distributed.initialize")
  n_rollout, _ = cfg.fusion.split(len(device_processes))
  if device_processes != [ROLLOUT] * n_rollout + [TRAIN] * (len(device_processes) - n_rollout):
    raise ConfigError(f"config.fusion.rollout_device_fraction={cfg.fusion.rollout_device_fraction}: the "
                      f"rollout sub-mesh ({n_rollout} of {len(device_processes)} devices) must be exactly "
                      "process 0's devices "
                      f"(devices per process: {[device_processes.count(p) for p in (0, 1)]})")


def initialize(settings: distributed.DistributedConfig, weight_transport: str) -> None:
  """``jax.distributed.initialize`` for one side (before anything starts the backend).

  With 'kv' weights nothing crosses the processes inside a program, so CPU collectives stay in-process:
  gloo would carry every collective of the training mesh over TCP (a warm-up 10x slower, measured).
  """
  if weight_transport == "kv":
    jax.config.update("jax_cpu_collectives_implementation", None)
  distributed.initialize(settings)


def check_workdir(workdir: str) -> None:
  """The workdir must be writable and hold no checkpoint or metrics (resume is not supported here)."""
  resume.check_workdir(workdir)
  for name in (resume.RL_DIR, resume.WARMUP_DIR, "metrics.jsonl"):
    path = os.path.join(workdir, name)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
      raise ConfigError(f"--workdir={workdir}: holds {name} of an earlier run; checkpoint/resume of the "
                        "async separated schedule is not supported, use a fresh workdir")


# ----------------------------------------------------------------------------------------------------
# 2. The reproducible weight plan (pure).
# ----------------------------------------------------------------------------------------------------

def weight_plan(steps: int, max_staleness: int) -> list[tuple[int, int]]:
  """(boundary k, version) of every weight transfer of the reproducible schedule, in order.

  Boundary k < steps comes before batch k, which is generated with version max(0, k - s); boundary
  ``steps`` comes after the last batch (the final evaluation's weights).
  """
  plan, have = [(0, 0)], 0
  for k in range(1, steps):
    if k - max_staleness > have:
      have = k - max_staleness
      plan.append((k, have))
  return plan + ([(steps, steps)] if steps else [])


def trainer_point(boundary: int, steps: int, max_staleness: int) -> int:
  """The chunk before whose reading the trainer joins the collective transfer of ``boundary``
  (``steps``: after the last update). With s >= 1 it is chunk k - 1, shipped just before boundary k."""
  if max_staleness == 0 or boundary in (0, steps):
    return boundary
  return boundary - 1


# ----------------------------------------------------------------------------------------------------
# 3. Wire format: named numpy arrays + a JSON header in one blob.
# ----------------------------------------------------------------------------------------------------

def encode(arrays: dict[str, np.ndarray], meta: dict | None = None) -> bytes:
  arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
  header = json.dumps({"meta": meta or {}, "arrays": [[k, v.dtype.name, list(v.shape)]
                                                       for k, v in arrays.items()]}).encode()
  return len(header).to_bytes(8, "little") + header + b"".join(v.tobytes() for v in arrays.values())


def decode(blob: bytes) -> tuple[dict[str, np.ndarray], dict]:
  n = int.from_bytes(blob[:8], "little")
  header, offset, arrays = json.loads(blob[8:8 + n]), 8 + n, {}
  for name, dtype, shape in header["arrays"]:
    dtype, count = np.dtype(dtype), int(np.prod(shape))
    arrays[name] = np.frombuffer(blob, dtype, count, offset).reshape(shape)
    offset += count * dtype.itemsize
  return arrays, header["meta"]


def pack_batch(rollout: Rollout, rewards, fmt, correct) -> tuple[dict[str, np.ndarray], int]:
  """Finished samples -> arrays with token fields cut to prompt + response and packed, and the bytes the
  same arrays would take with token fields padded to the rows' width."""
  lengths = (rollout.prompt_len_b + rollout.response_len_b).astype(np.int32)
  cut = lambda x_bt: pack([row[:n] for row, n in zip(x_bt, lengths)], x_bt.dtype).flat
  arrays = {"lengths": lengths, "tokens": cut(rollout.tokens_bt), "logp": cut(rollout.logp_bt),
            "version": cut(rollout.version_bt), "prompt_len": rollout.prompt_len_b,
            "response_len": rollout.response_len_b, "finished": rollout.finished_b,
            "sample_id": rollout.sample_id_b, "reward": rewards, "format_ok": fmt, "correct": correct}
  token_row_bytes = sum(x.nbytes for x in (rollout.tokens_bt, rollout.logp_bt, rollout.version_bt))
  padded = token_row_bytes + sum(v.nbytes for k, v in arrays.items() if k not in ("tokens", "logp", "version"))
  return arrays, padded


# ----------------------------------------------------------------------------------------------------
# 4. Transports: the key-value channel and the two ways weights travel.
# ----------------------------------------------------------------------------------------------------

class Channel:
  """The coordination service's key-value store under ``PREFIX``; every wait ends after ``timeout_s``."""

  def __init__(self, timeout_s: float):
    from jax._src import distributed  # pylint: disable=g-import-not-at-top  (the jax.distributed client)
    self.client = distributed.global_state.client
    if self.client is None:
      raise RuntimeError("jax.distributed.initialize(...) must run before the async separated schedule")
    self.timeout_ms = int(timeout_s * 1000)

  def put(self, key: str, blob: bytes) -> None:
    self.client.key_value_set_bytes(f"{PREFIX}/{key}", blob)

  def get(self, key: str) -> bytes:
    return self.client.blocking_key_value_get_bytes(f"{PREFIX}/{key}", self.timeout_ms)

  def delete(self, key: str) -> None:
    self.client.key_value_delete(f"{PREFIX}/{key}")

  def set_int(self, key: str, value: int) -> None:
    self.client.key_value_set(f"{PREFIX}/{key}", str(value), allow_overwrite=True)

  def try_int(self, key: str) -> int | None:
    try:
      return int(self.client.key_value_try_get(f"{PREFIX}/{key}"))
    except jax.errors.JaxRuntimeError:   # NOT_FOUND
      return None

  def meet(self, name: str, role: int) -> float:
    """Waits until the other side also reached ``name``; returns the seconds waited."""
    start = time.perf_counter()
    self.client.key_value_set(f"{PREFIX}/meet/{name}/{role}", "1")
    self.client.blocking_key_value_get(f"{PREFIX}/meet/{name}/{1 - role}", self.timeout_ms)
    return time.perf_counter() - start


class CollectiveWeights:
  """Weights from the trainer to the rollout as one jitted ``ppermute`` over a 2-device 'side' mesh.

  The leaves are concatenated into one flat buffer per dtype on one device of each side; each buffer
  travels as a [2, n] array sharded over 'side' (row 0 on the rollout device, row 1 on the training
  device), and both processes call ``_move``, which copies row 1 into row 0: one copy crosses over.
  """

  def __init__(self, abstract_params, rollout_shardings):
    ends = [next(d for d in jax.devices() if d.process_index == p) for p in (ROLLOUT, TRAIN)]
    self.mine = ends[jax.process_index()]
    self.sharding = NamedSharding(Mesh(np.array(ends), ("side",)), P("side"))
    self.abstract, self.treedef = jax.tree.flatten(abstract_params)
    self.rollout_shardings = rollout_shardings
    by_dtype: dict[str, list[int]] = {}
    for i, a in enumerate(self.abstract):
      by_dtype.setdefault(np.dtype(a.dtype).name, []).append(i)
    self.groups = list(by_dtype.values())
    self._flat = jax.jit(lambda xs: [jnp.concatenate([xs[i].reshape(-1) for i in g]) for g in self.groups])
    self._split = jax.jit(self._split_buffers)
    move = lambda xs: [jax.lax.ppermute(x, "side", [(TRAIN, ROLLOUT)]) for x in xs]
    self._move = jax.jit(jax.shard_map(move, mesh=self.sharding.mesh, in_specs=P("side"),
                                       out_specs=P("side")))

  def _split_buffers(self, buffers):
    leaves = [None] * len(self.abstract)
    for buffer, group in zip(buffers, self.groups, strict=True):
      offset = 0
      for i in group:
        shape = self.abstract[i].shape
        leaves[i] = buffer[offset:offset + math.prod(shape)].reshape(shape)
        offset += math.prod(shape)
    return leaves

  def _call(self, buffers):
    rows = [jax.make_array_from_single_device_arrays((2, b.shape[0]), self.sharding, [b[None]])
            for b in buffers]
    return jax.block_until_ready(self._move(rows))

  def send(self, params) -> int:
    buffers = self._flat(jax.device_put(jax.tree.leaves(params), self.mine))  # gathered on one device
    self._call(buffers)
    return sum(b.nbytes for b in buffers)

  def receive(self):
    sizes = [sum(math.prod(self.abstract[i].shape) for i in g) for g in self.groups]
    out = self._call([jnp.zeros((n,), self.abstract[g[0]].dtype, device=self.mine)
                      for n, g in zip(sizes, self.groups)])
    buffers = [o.addressable_shards[0].data[0] for o in out]
    params = jax.device_put(jax.tree.unflatten(self.treedef, self._split(buffers)), self.rollout_shardings)
    return params, sum(b.nbytes for b in buffers)


class KVPublisher:
  """Publishes weight versions as bytes in the key-value store from a background thread, in order.

  The trainer only copies the params to the host (its next update donates them) and goes on; encoding
  and the write, which the coordinator (in process 0, beside generation) serves slowly (0.7 s for 12.7 MB
  on 2 busy cores, measured), overlap its next steps. Each write is recorded as a 'push' phase.
  """

  def __init__(self, channel: Channel, timeline: Timeline, group: str):
    self.channel, self.timeline, self.group = channel, timeline, group
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="publish")
    self._futures: list[concurrent.futures.Future] = []

  def publish(self, version: int, params, step: int | None) -> None:
    leaves = jax.device_get(jax.tree.leaves(params))
    self._futures.append(self._pool.submit(self._write, version, leaves, step))

  def _write(self, version: int, leaves, step: int | None) -> dict[str, float]:
    start, t0 = self.timeline.now(), time.perf_counter()
    blob = encode({str(i): np.asarray(x) for i, x in enumerate(leaves)})
    self.channel.put(f"weights/{version}", blob)
    self.channel.set_int("weights/newest", version)
    self.timeline.record("push", start, self.timeline.now(), group=self.group, step=step)
    return {"push_s": time.perf_counter() - t0, "push_bytes": float(len(blob))}

  def finished(self, wait: bool = False) -> dict[str, float]:
    """The figures of the newest write completed so far (all of them with ``wait``); raises its errors."""
    done = [f for f in self._futures if wait or f.done()]
    self._futures = [f for f in self._futures if f not in done]
    results = [f.result() for f in done]
    return results[-1] if results else {}

  def close(self) -> None:
    self.finished(wait=True)
    self._pool.shutdown()


def params_from_blob(blob: bytes, treedef, shardings):
  arrays, _ = decode(blob)
  return jax.device_put(jax.tree.unflatten(treedef, [arrays[str(i)] for i in range(len(arrays))]), shardings)


# ----------------------------------------------------------------------------------------------------
# 5. The rollout side (process 0).
# ----------------------------------------------------------------------------------------------------

class RolloutSide:
  """Generates whole batches under the weights the schedule names and ships them packed."""

  def __init__(self, setup: Setup, programs: Programs, options: Options, channel: Channel, timeline: Timeline):
    self.setup, self.programs, self.options, self.channel, self.timeline = (
        setup, programs, options, channel, timeline)
    self.cfg, self.r = setup.cfg, setup.cfg.rollout
    self.s, self.steps = setup.cfg.stalesync.max_staleness, setup.cfg.run.steps
    self.group = programs.deployment.rollout_group
    d = programs.deployment
    abstract = models.abstract_params(self.cfg.model.config)
    self.treedef = jax.tree.structure(abstract)
    self.collective = (CollectiveWeights(abstract, d.rollout_param_shardings)
                       if options.weight_transport == "collective" else None)
    self.plan = dict(weight_plan(self.steps, self.s)) if options.reproducible else {}
    self.params, self.version, self.deleted = None, -1, -1
    self.shipped: list[int] = []

  def _load(self, version: int, boundary: int) -> dict[str, float]:
    """Replaces the weights with ``version`` (waiting for it); returns the wait and transfer figures."""
    start = time.perf_counter()
    if self.collective is not None:
      wait = self.channel.meet(f"weights/{boundary}", ROLLOUT)
      with self.timeline.phase("weights", group=self.group, step=self._step(boundary)):
        t0 = time.perf_counter()
        self.params, nbytes = self.collective.receive()
    else:
      blob = self.channel.get(f"weights/{version}")
      wait = time.perf_counter() - start
      with self.timeline.phase("weights", group=self.group, step=self._step(boundary)):
        t0 = time.perf_counter()
        self.params = params_from_blob(blob, self.treedef, self.programs.deployment.rollout_param_shardings)
        nbytes = len(blob)
      # Opportunistic: every version was published and the skipped ones are never needed again.
      for v in ([version] if self.options.reproducible else range(self.deleted + 1, version + 1)):
        self.channel.delete(f"weights/{v}")
      self.deleted = version
    self.version = version
    return {"weights_wait_s": wait, "weights_s": time.perf_counter() - t0, "weights_bytes": float(nbytes)}

  def _step(self, boundary: int) -> int | None:
    return boundary if boundary < self.steps else None

  def _weights_for(self, k: int) -> dict[str, float]:
    """Boundary k: the reproducible plan's version, or the newest published (never older than k - s)."""
    if self.options.reproducible:
      return self._load(self.plan[k], k) if k in self.plan else {}
    newest = max(self.channel.try_int("weights/newest") or 0, k - self.s, 0)
    return self._load(newest, k) if newest > self.version else {}

  def _batch(self, k: int, weight_metrics: dict) -> None:
    r, setup, programs = self.r, self.setup, self.programs
    first = k * r.num_prompts
    problems = [setup.train_task.problem(first + i) for i in range(r.num_prompts)]
    programs.engine.add(phases.requests(setup.tokenizer, problems, r.max_prompt_len, r.group_size,
                                        first * r.group_size, first, forced_len=phases.forced_lengths(self.cfg)))
    params, version = self.params, self.version
    _, result, metrics = phases.generation_phase(programs, None, k, self.timeline,
                                                 lambda _: programs.engine.run(params, version))
    rollout = phases.by_sample_id(result.rollout)
    if len(rollout.sample_id_b) != r.batch_size:
      raise RuntimeError(f"batch {k}: the engine returned {len(rollout.sample_id_b)} samples, expected "
                         f"{r.batch_size}")
    with self.timeline.phase("score", group=self.group, step=k):
      rewards, fmt, correct, m = programs.verify.scores(rollout, problems)
    with self.timeline.phase("ship", group=self.group, step=k):
      arrays, padded = pack_batch(rollout, rewards, fmt, correct)
      meta = {"step": k, "version": version, "padded_bytes": padded,
              "packed_bytes": sum(a.nbytes for a in arrays.values()),
              "metrics": metrics | m | {f"separated/{n}": v for n, v in weight_metrics.items()}}
      self.channel.put(f"chunk/{k}", encode(arrays, meta))
    self.shipped += sorted({int(i) // r.group_size for i in rollout.sample_id_b})

  def _evaluate(self, round_index: int) -> dict[str, float]:
    with self.timeline.phase("evaluate", group=self.group):
      return phases.evaluate(self.setup, self.programs, self.params, round_index)

  def run(self) -> dict[str, Any]:
    self._load(0, 0)
    before = self._evaluate(0)
    for k in range(self.steps):
      self._batch(k, self._weights_for(k) if k else {})
    after = before
    if self.steps:
      self._load(self.steps, self.steps)
      after = self._evaluate(1)
    return {"before": before, "after": after, "shipped_groups": self.shipped}


# ----------------------------------------------------------------------------------------------------
# 6. The training side (process 1).
# ----------------------------------------------------------------------------------------------------

class ShippedScores:
  """Stands in for ``programs.verify`` on the training side: the rollout side already scored the samples."""

  def __init__(self):
    self._by_id: dict[int, tuple[float, bool, bool]] = {}

  def add(self, sample_ids, rewards, fmt, correct) -> None:
    for s, r, f, c in zip(sample_ids, rewards, fmt, correct, strict=True):
      self._by_id[int(s)] = (float(r), bool(f), bool(c))

  def scores(self, rollout: Rollout, problems):
    del problems
    rows = [self._by_id.pop(int(s)) for s in rollout.sample_id_b]
    rewards, fmt, correct = (np.array(x) for x in zip(*rows))
    return rewards.astype(np.float32), fmt.astype(bool), correct.astype(bool), {}

  def forget(self, sample_ids) -> None:
    for s in sample_ids:
      self._by_id.pop(int(s), None)

  def close(self) -> None:
    pass


def make_queue(setup: Setup, programs: Programs) -> DistQueue:
  """The trainer's queue: StaleSync's fields plus the shipped scores (and the advantages, written by the
  advantage stage as a chunk arrives, where ``advantage_stage.in_queue`` holds), room for one batch."""
  sample_fields, _ = stalesync.queue_fields(setup.cfg, programs)   # no aux stage in this deployment
  return stalesync.make_queue(setup, sample_fields, capacity=setup.cfg.rollout.batch_size)


class TrainSide:
  """Receives chunks, admits within the bound, trains with ``phases.train_phase`` and pushes weights."""

  def __init__(self, setup: Setup, programs: Programs, options: Options, channel: Channel, timeline: Timeline,
               writer):
    self.setup, self.programs, self.options, self.channel, self.timeline, self.writer = (
        setup, programs, options, channel, timeline, writer)
    self.cfg, self.r = setup.cfg, setup.cfg.rollout
    self.s, self.steps = setup.cfg.stalesync.max_staleness, setup.cfg.run.steps
    self.group = programs.deployment.train_group
    self.queue = make_queue(setup, programs)
    self.advantages = (advantage_stage.AdvantageStage(setup.cfg, self.queue) if "advantage" in self.queue.fields
                       else None)
    self.shipped = programs.verify = ShippedScores()
    plan = weight_plan(self.steps, self.s)
    self.points = {trainer_point(k, self.steps, self.s): (k, v) for k, v in plan}
    self.plan_versions = {v for _, v in plan}
    self.collective = (CollectiveWeights(models.abstract_params(self.cfg.model.config), None)
                       if options.weight_transport == "collective" else None)
    self.publisher = None if self.collective else KVPublisher(channel, timeline, self.group)
    self.snapshots: dict[int, Any] = {}
    self.groups = {"trained": [], "discarded": []}

  # -- weights ------------------------------------------------------------------------------------------

  def _produced(self, version: int, params) -> None:
    """A new version exists: kv publishes it now if anyone reads it; collective keeps a copy if its
    transfer comes later than the next point."""
    if self.collective is not None:
      point = next((c for c, (_, v) in self.points.items() if v == version), None)
      if point is not None and point != version:
        self.snapshots[version] = jax.tree.map(jnp.copy, params)
    elif not self.options.reproducible or version in self.plan_versions:
      self.publisher.publish(version, params, self._step(version))

  def _before_chunk(self, c: int, params) -> dict[str, float]:
    """Joins the collective transfer the plan puts before reading chunk ``c`` (if any)."""
    if self.collective is None or c not in self.points:
      return {}
    boundary, version = self.points[c]
    wait = self.channel.meet(f"weights/{boundary}", TRAIN)
    with self.timeline.phase("push", group=self.group, step=self._step(c)):
      start = time.perf_counter()
      nbytes = self.collective.send(self.snapshots.pop(version, params))
    return {"push_wait_s": wait, "push_s": time.perf_counter() - start, "push_bytes": float(nbytes)}

  def _step(self, step: int) -> int | None:
    return step if step < self.steps else None

  # -- data ---------------------------------------------------------------------------------------------

  def _receive(self, step: int) -> tuple[dict, dict[str, float]]:
    """Chunk ``step`` -> the queue; returns its meta and the wait / size figures."""
    start = time.perf_counter()
    blob = self.channel.get(f"chunk/{step}")
    wait = time.perf_counter() - start
    with self.timeline.phase("receive", group=self.group, step=step):
      self.channel.delete(f"chunk/{step}")
      a, meta = decode(blob)
      if meta["step"] != step:
        raise RuntimeError(f"chunk {step} holds batch {meta['step']}")
      n = a["lengths"]
      self.queue.put(a["sample_id"].astype(np.int64), tokens=Packed(a["tokens"], n),
                     logp=Packed(a["logp"], n), version=Packed(a["version"], n),
                     prompt_len=a["prompt_len"], response_len=a["response_len"], finished=a["finished"],
                     sample_id=a["sample_id"], group_id=a["sample_id"] // self.r.group_size,
                     min_version=_min_versions(a), reward=a["reward"], format_ok=a["format_ok"],
                     correct=a["correct"], block=False)
    if self.advantages is not None:
      with self.timeline.phase("advantage", group=self.group, step=step):
        self.advantages.run()
    return meta, {"wait_rollout_s": wait, "rollout_bytes": meta["packed_bytes"],
                  "rollout_bytes_padded": meta["padded_bytes"], "rollout_blob_bytes": len(blob),
                  "generated_with_version": meta["version"]}

  def _admit(self, learner: int):
    """Drops groups beyond the bound (counted), admits ``num_prompts`` -> (groups, host Rollout, metrics,
    their advantages from the queue: None without that field)."""
    ready = self.queue.ready(stalesync.CONSUMER)
    peek = self.queue.peek(ready, ("group_id", "min_version", "response_len"))
    waiting = waiting_groups(ready, peek["group_id"], peek["min_version"], peek["response_len"])
    stale = stale_groups({g: w.min_token_version for g, w in waiting.items()}, learner, self.s)
    for g in stale:
      self.queue.drop(list(waiting.pop(g).indices), reason="stale")
    self.groups["discarded"] += stale
    adm = admit_groups(waiting, learner, self.s, limit=self.r.num_prompts)
    if len(adm.admitted) != self.r.num_prompts:
      raise RuntimeError(f"step {learner}: {len(adm.admitted)} admissible groups for an update of "
                         f"{self.r.num_prompts}")
    groups = sorted(adm.admitted)
    batch = self.queue.read(stalesync.CONSUMER, sorted(i for g in groups for i in waiting[g].indices))
    rollout = stalesync.host_rollout([batch], self.r.seq_len)
    self.shipped.add(batch["sample_id"], batch["reward"], batch["format_ok"], batch["correct"])
    metrics = {f"stalesync/{k}": v for k, v in adm.metrics().items()} | {"stalesync/discarded_now": len(stale)}
    return groups, rollout, metrics, batch.sample.get("advantage")

  # -- the loop -----------------------------------------------------------------------------------------

  def _warm_start(self):
    """Initial policy, warm-up and train state as ``loop.run`` builds them (+ the resting reference)."""
    setup, programs = self.setup, self.programs
    with self.timeline.phase("warmup", group=self.group):
      params = phases.init_policy(setup, programs)
      params = phases.warmup(setup, programs, params, guard=DivergenceGuard(self.cfg.run, "warm-up"))
    d = programs.deployment
    ref = (d.place_aux(params, programs.ref_param_shardings, keep_source=True) if self.cfg.algo.needs_reference
           else None)
    return state_lib.create_train_state(params, programs.tx, programs.state_shardings), ref

  def _step_once(self, state, ref_resting, step: int, guard: DivergenceGuard):
    t_start = time.perf_counter()
    metrics = self._before_chunk(step, state.params)
    meta, m = self._receive(step)
    metrics |= m
    groups, rollout, adm_metrics, advantages = self._admit(step)
    problems = [self.setup.train_task.problem(g) for g in groups]
    state, train_metrics = phases.train_phase(self.setup, self.programs, state, ref_resting, step,
                                              self.timeline, problems, rollout, advantages=advantages)
    self.groups["trained"] += groups
    self._produced(step + 1, state.params)
    metrics |= self.publisher.finished() if self.publisher else {}
    response_versions = np.concatenate([v[p:p + n] for v, p, n in zip(
        rollout.version_bt, rollout.prompt_len_b, rollout.response_len_b, strict=True)])
    scalars = {f"separated/{k}": float(v) for k, v in metrics.items()} | meta["metrics"] | train_metrics
    scalars |= adm_metrics | {
        "separated/token_staleness_max": float(step - response_versions.min()),
        "stalesync/trained_token_staleness_mean": float(np.mean(step - response_versions)),
        "separated/trained_groups_total": float(len(self.groups["trained"])),
        "separated/discarded_groups_total": float(len(self.groups["discarded"])),
        "step_s": time.perf_counter() - t_start}
    return state, scalars | guard.scalars(guard.check(step + 1, scalars))

  def run(self) -> dict[str, Any]:
    state, ref_resting = self._warm_start()
    self._produced(0, state.params)
    guard = DivergenceGuard(self.cfg.run, "RL")
    for step in range(self.steps):
      state, scalars = self._step_once(state, ref_resting, step, guard)
      self.writer.write(step + 1, scalars)
    self._before_chunk(self.steps, state.params)   # the final weights (version 0 when steps == 0)
    if self.publisher:
      self.publisher.close()
    waiting = self.queue.ready(stalesync.CONSUMER)
    return {"trained_groups": self.groups["trained"], "discarded_groups": self.groups["discarded"],
            "waiting_groups": sorted({int(i) // self.r.group_size for i in waiting}),
            "updates_skipped": guard.skipped}


def _min_versions(arrays: dict[str, np.ndarray]) -> np.ndarray:
  """Per sample, the oldest version among its response tokens (-1 when it has none)."""
  out, offset = [], 0
  for n, p, r in zip(arrays["lengths"], arrays["prompt_len"], arrays["response_len"], strict=True):
    out.append(int(arrays["version"][offset + p:offset + p + r].min()) if r else -1)
    offset += int(n)
  return np.asarray(out, np.int32)


# ----------------------------------------------------------------------------------------------------
# 7. Overlap: the two timelines on one clock.
# ----------------------------------------------------------------------------------------------------

def _union(spans) -> list[tuple[float, float]]:
  out: list[list[float]] = []
  for start, end in sorted(spans):
    if out and start <= out[-1][1]:
      out[-1][1] = max(out[-1][1], end)
    else:
      out.append([start, end])
  return [(a, b) for a, b in out]


def _intersection(a, b) -> float:
  """Seconds covered by both unions ``a`` and ``b`` (each sorted and disjoint)."""
  total, i, j = 0.0, 0, 0
  while i < len(a) and j < len(b):
    total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return total


def _clip(spans, start: float | None) -> list[tuple[float, float]]:
  return _union(spans if start is None else [(max(s, start), e) for s, e in spans if e > start])


def overlap(rollout_spans, train_spans, start: float | None = None) -> dict[str, float]:
  """Fraction of the window (``start``, default the first start of either side, to the last end) in which
  both sides were busy, and each side's idle fraction; spans are clipped to the window."""
  a, b = _clip(rollout_spans, start), _clip(train_spans, start)
  if not a or not b:
    return {}
  wall = max(a[-1][1], b[-1][1]) - min(a[0][0], b[0][0])
  busy_a, busy_b = sum(e - s for s, e in a), sum(e - s for s, e in b)
  return {"wall_s": wall, "both_busy_frac": _intersection(a, b) / wall, "rollout_busy_s": busy_a,
          "train_busy_s": busy_b, "rollout_idle_frac": 1 - busy_a / wall, "train_idle_frac": 1 - busy_b / wall}


def _own_intervals(timeline: Timeline, group: str, role: str, unix_offset: float) -> list[list]:
  """This side's phases (its own device group only) as [name, role, step, unix start, unix end]."""
  return [[i.name, role, i.step, i.start + unix_offset, i.end + unix_offset]
          for i in timeline.data().intervals if i.group == group]


def _overlap_summary(intervals: list[list], first_step: int) -> dict[str, float]:
  """``overlap`` over the RL steps >= ``first_step``, from the moment both sides reached them (so a first
  step's compile on one side does not count as the other's idle time), plus the share of that window in
  which the rollout generated while the trainer computed (reference, reward, update)."""
  steps = [i for i in intervals if i[2] is not None and i[2] >= first_step]
  spans = lambda role, names=None: [(s, e) for name, r, _, s, e in steps
                                    if r == role and (names is None or name in names)]
  if not spans("rollout") or not spans("train"):
    return {}
  start = max(min(s for s, _ in spans(role)) for role in ROLES)
  out = overlap(spans("rollout"), spans("train"), start)
  if not out:   # one side has nothing left after ``start`` (a run of very few steps)
    return {}
  busy = _intersection(_clip(spans("rollout", ("generate",)), start),
                       _clip(spans("train", ("reference", "reward", "reward_model", "train")), start))
  return out | {"generate_while_train_frac": busy / out["wall_s"]}


def _write_merged_timeline(path: str, intervals: list[list], groups: dict[str, list[int]]) -> None:
  origin = min(s for *_, s, _ in intervals)
  timeline = Timeline(path)
  for role in ROLES:
    timeline.add_group(role, groups[role])
  for name, role, step, start, end in sorted(intervals, key=lambda i: i[3]):
    timeline.record(name, start - origin, end - origin, group=role, step=step)


# ----------------------------------------------------------------------------------------------------
# 8. Entry point: one call per process.
# ----------------------------------------------------------------------------------------------------

def _trainer_placement(cfg: ExperimentConfig) -> Placement:
  """The training side's programs on this process's devices only: the colocated deployment of the same
  training mesh (its engines are built but never run, and its ``publish`` does nothing)."""
  local = dataclasses.replace(cfg, fusion=dataclasses.replace(cfg.fusion, mode="colocated"))
  abstract, tx = models.abstract_params(cfg.model.config), state_lib.make_optimizer(cfg.optim)
  d = make_deployment(local, abstract, models.param_logical_axes(cfg.model.config), tx, jax.local_devices())
  return Placement(tx, d, state_lib.state_shardings(tx, abstract, d.train_param_shardings, d.train_mesh))


def _setup(cfg: ExperimentConfig, workdir: str, options: Options) -> Setup:
  check(cfg, [d.process_index for d in jax.devices()])
  if (options.weight_transport == "collective" and jax.devices()[0].platform == "cpu"
      and jax.config.jax_cpu_collectives_implementation is None):
    raise ConfigError("weight_transport='collective' needs cross-process CPU collectives "
                      "(jax_cpu_collectives_implementation='gloo'); use weight_transport='kv'")
  check_workdir(workdir)
  try:
    return validate(cfg, jax.device_count(), per_process=False)   # process 0: rollout, 1: training
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError(str(e)) from e


def run(cfg: ExperimentConfig, workdir: str, options: Options = Options()) -> dict[str, Any]:
  """Runs this process's side of the async separated schedule; both processes return the same summary
  (process 0 writes summary.json, config.json and the merged timeline.jsonl; process 1 metrics.jsonl)."""
  setup = _setup(cfg, workdir, options)
  role = jax.process_index()
  channel = Channel(options.timeout_s)
  channel.meet("checked", role)   # both checked the workdir before either writes to it
  with workdir_lock.hold(workdir):   # one run per workdir (each process holds its own lock file)
    return _run_side(cfg, workdir, options, setup, role, channel)


def _run_side(cfg: ExperimentConfig, workdir: str, options: Options, setup, role: int, channel) -> dict[str, Any]:
  """``run`` once the workdir is held: this process's side, then the shared summary."""
  programs = (Programs(setup, make_placement(cfg, per_process=False)) if role == ROLLOUT
              else Programs(setup, _trainer_placement(cfg)))
  d = programs.deployment
  group = d.rollout_group if role == ROLLOUT else d.train_group
  timeline = Timeline(os.path.join(workdir, f"timeline_{ROLES[role]}.jsonl"))
  for name, ids in d.groups.items():
    timeline.add_group(name, ids)
  unix_offset = time.time() - timeline.now()
  logging.info("async separated: %s side on %s (%s, %s weights)", ROLES[role], dict(
      (d.rollout_mesh if role == ROLLOUT else d.train_mesh).shape),
      "reproducible" if options.reproducible else "opportunistic", options.weight_transport)
  if role == ROLLOUT:
    try:
      result = RolloutSide(setup, programs, options, channel, timeline).run()
    finally:
      programs.verify.close()
  else:
    programs.verify.close()
    writer = metrics_lib.make_writer(workdir)
    try:
      result = TrainSide(setup, programs, options, channel, timeline, writer).run()
    finally:
      writer.close()
  mine = {"result": result, "intervals": _own_intervals(timeline, group, ROLES[role], unix_offset),
          "devices": [int(x.id) for x in jax.local_devices()]}
  channel.put(f"final/{role}", json.dumps(mine).encode())
  other = json.loads(channel.get(f"final/{1 - role}"))
  sides = {ROLES[role]: mine, ROLES[1 - role]: other}
  summary = _summary(cfg, options, sides)
  if role == ROLLOUT:
    intervals = sides["rollout"]["intervals"] + sides["train"]["intervals"]
    _write_merged_timeline(os.path.join(workdir, "timeline.jsonl"), intervals,
                           {r: sides[r]["devices"] for r in ROLES})
    write_json_atomic(os.path.join(workdir, "config.json"),
                      config_lib.as_dict(cfg) | {"separated": dataclasses.asdict(options)})
    write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  return summary


def _summary(cfg: ExperimentConfig, options: Options, sides: dict) -> dict[str, Any]:
  rollout, train = sides["rollout"]["result"], sides["train"]["result"]
  intervals = sides["rollout"]["intervals"] + sides["train"]["intervals"]
  out = {"accuracy_before": rollout["before"]["accuracy"], "accuracy_after": rollout["after"]["accuracy"],
         "format_rate_before": rollout["before"]["format_rate"],
         "format_rate_after": rollout["after"]["format_rate"], "steps": cfg.run.steps,
         "mode": "separated_async", "max_staleness": cfg.stalesync.max_staleness,
         "reproducible": options.reproducible, "weight_transport": options.weight_transport,
         "updates_skipped": train["updates_skipped"],
         "groups": {"shipped": rollout["shipped_groups"], "trained": train["trained_groups"],
                    "discarded": train["discarded_groups"], "waiting": train["waiting_groups"]}}
  out |= {f"overlap/{k}": v for k, v in _overlap_summary(intervals, 0).items()}
  out |= {f"overlap_after_first/{k}": v for k, v in _overlap_summary(intervals, 1).items()}
  return out
