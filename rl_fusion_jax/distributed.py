"""One run across several processes: start-up through JAX's own distributed runtime, and its checks.

``initialize`` joins this process to the others (``jax.distributed.initialize``: the coordination service
on process 0, gloo collectives between CPU processes) before anything touches a device. Every binary calls
it with the same settings; they differ only in the process id. ``check_same_config`` compares a hash of
the resolved config across processes through the coordination service's key-value store, so processes
started with different configs stop at start, on every process, before anything is compiled or written.

Settings, each a flag of the binaries or the environment variable beside it (flags win):
  coordinator address  --coordinator_address   JAX_COORDINATOR_ADDRESS  (host:port of process 0)
  process count        --num_processes         JAX_NUM_PROCESSES
  process id           --process_id            JAX_PROCESS_ID
Under SLURM (more than one task), Open MPI or on Cloud TPU, none needs setting: JAX reads them from the
scheduler (``jax.distributed.initialize()``'s own detection). With none set and no such scheduler, the
run is one process and nothing is initialised. One process with a coordinator address joins the runtime
too: its collectives are then the multi-process ones (gloo on CPU), the reference a short multi-process
run equals bit for bit (tests/multihost_run_test.py; long runs drift apart by float rounding).

Also here: the key-value ``exchange`` between processes, ``on_writer`` (what process 0
does alone, its failure raised everywhere), ``fetch`` / ``put`` (``device_get`` / ``device_put`` that
work where arrays span processes). What a run does with them (host work split by sample, metrics
reduced, the timeline's lanes): ``orchestration/processes.py``. This module never writes a file: the
run's outputs are written by process 0 (``is_writer``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import time
from typing import Any

import numpy as np

from rl_fusion_jax.errors import ConfigError, ProcessError, RunError

_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
        "process_id": "JAX_PROCESS_ID"}
# Environments in which jax.distributed.initialize() finds the unset settings itself.
_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins the run. All unset (the default) with no cluster detected: one process.

  ``timeout_s``: how long start-up waits for the coordinator and every other process before failing.
  ``heartbeat_timeout_s``: after this long without a heartbeat a process counts as dead and every other
  process fails (JAX's coordination service ends them with an error naming the dead task).
  """
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1
  timeout_s: int = 120
  heartbeat_timeout_s: int = 10

  def __post_init__(self):
    if self.num_processes < 0:
      raise ConfigError(f"--num_processes={self.num_processes}: must be >= 1 (0: not set)")
    if self.num_processes and self.process_id >= self.num_processes:
      raise ConfigError(f"--process_id={self.process_id} is not below --num_processes={self.num_processes}")
    if self.process_id < -1:
      raise ConfigError(f"--process_id={self.process_id}: must be >= 0")
    if self.coordinator_address and ":" not in self.coordinator_address:
      raise ConfigError(f"--coordinator_address={self.coordinator_address!r}: expected host:port")
    if self.timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
      raise ConfigError("--distributed_timeout_s and --heartbeat_timeout_s must be > 0")

  @classmethod
  def from_flags(cls, coordinator_address: str = "", num_processes: int = 0, process_id: int = -1,
                 **timeouts) -> "DistributedConfig":
    """Flags first, then the environment variables (``_ENV``); bad environment values name the variable."""
    values: dict[str, Any] = {"coordinator_address": coordinator_address or
                              os.environ.get(_ENV["coordinator_address"], "")}
    for name, flag_value, unset in (("num_processes", num_processes, 0), ("process_id", process_id, -1)):
      raw = os.environ.get(_ENV[name], "")
      if flag_value != unset or not raw:
        values[name] = flag_value
        continue
      try:
        values[name] = int(raw)
      except ValueError:
        raise ConfigError(f"{_ENV[name]}={raw!r} is not an integer") from None
    return cls(**values, **timeouts)

  @property
  def explicit(self) -> bool:
    return bool(self.coordinator_address or self.num_processes or self.process_id >= 0)

  @property
  def wanted(self) -> bool:
    """Whether this process is part of a multi-process run (settings given, or a cluster detected)."""
    if self.explicit:   # one process with a coordinator: the same runtime and collectives (gloo on CPU)
      return self.num_processes != 1 or bool(self.coordinator_address)
    return _on_cluster()


def _on_cluster() -> bool:
  """Whether a scheduler JAX reads the settings from runs this process (SLURM with more than one task)."""
  return any(k in os.environ for k in _CLUSTER_ENV) and int(os.environ.get("SLURM_NTASKS", "2")) > 1


def initialize(cfg: DistributedConfig) -> None:
  """``jax.distributed.initialize`` from ``cfg`` (nothing when it is one process); must run before any
  device is touched. A missing setting, or a coordinator that does not answer within ``timeout_s``,
  raises ConfigError naming the settings."""
  if not cfg.wanted:
    return
  if cfg.explicit and not _on_cluster():   # on a scheduler, JAX fills in what is not set
    missing = [f"--{k} (or {_ENV[k]})" for k, unset in (("coordinator_address", ""), ("num_processes", 0),
                                                        ("process_id", -1)) if getattr(cfg, k) == unset]
    if missing:
      raise ConfigError(f"a multi-process run needs {', '.join(missing)}; each process gets the same "
                        "coordinator address and process count, and its own process id")
  if cfg.explicit and cfg.process_id > 0:
    _wait_for_coordinator(cfg.coordinator_address, cfg.timeout_s)
  import jax  # pylint: disable=g-import-not-at-top
  kwargs = dict(initialization_timeout=cfg.timeout_s, heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
  if cfg.explicit:
    kwargs.update(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                  process_id=cfg.process_id)
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as e:  # the runtime's errors are long gRPC status texts: keep its first line
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    process = cfg.process_id if cfg.process_id >= 0 else "auto"
    raise ConfigError(
        f"jax.distributed.initialize(coordinator_address={cfg.coordinator_address or 'auto'!r}, "
        f"num_processes={cfg.num_processes or 'auto'}, process_id={process}) "
        f"failed within --distributed_timeout_s={cfg.timeout_s}: {first}") from e


def cache_from_every_process() -> None:
  """Lets every process write its own persistent compilation-cache entries, not process 0 alone.

  JAX writes them from process 0 only: in one SPMD program every process compiles the same executable
  under the same key, and one writer spares a shared filesystem the contention. Where the processes' keys
  differ (on CPU; the separated schedule's sides compile different programs anyway) a process other than 0
  never finds its programs in the cache and compiles every one again at every start: a resumed run, the
  next run of a config. Each process writes only its own keys, so nothing contends.
  Private JAX API (``compiler._cache_write``): nothing changes if it moved.
  """
  from jax._src import compiler, distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  original = getattr(compiler, "_cache_write", None)
  if original is None or getattr(original, "_every_process", False) or not hasattr(
      jax_distributed.global_state, "process_id"):
    return

  def write(*args, **kwargs):
    state = jax_distributed.global_state
    saved, state.process_id = state.process_id, 0
    try:
      return original(*args, **kwargs)
    finally:
      state.process_id = saved
  write._every_process = True
  compiler._cache_write = write


def _wait_for_coordinator(address: str, timeout_s: int) -> None:
  """Waits until the coordinator's port accepts connections; ConfigError naming the address when nothing
  does within ``timeout_s`` (JAX's own start-up would abort the process instead, with no Python error).
  Process 0 serves the port, so the other processes may start first."""
  host, port = address.rsplit(":", 1)
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
        return
    except (OSError, ValueError) as e:
      if time.monotonic() >= deadline:
        raise ConfigError(f"--coordinator_address={address}: nothing answers there within "
                          f"--distributed_timeout_s={timeout_s} ({e}); start process 0 (which serves it) "
                          "or fix the address") from None
      time.sleep(0.5)


def process_count() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_count()


def is_writer() -> bool:
  """Process 0 writes the run's files (config, metrics, timeline, summary); the others write none."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() == 0


def config_hash(config: Any) -> str:
  """A hash of a resolved config (anything ``json.dumps`` can write with ``default=str``)."""
  text = json.dumps(config, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def client():
  """The coordination service's client of this process (key-value store, barriers)."""
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  return jax_distributed.global_state.client


_ROUNDS: dict[str, int] = {}   # name -> rounds so far (every process counts alike)


def exchange(name: str, value: str, timeout_s: int = 600) -> list[str]:
  """Every process's ``value``, in process order: an all-gather of strings through the coordination
  service's key-value store (no device work). Every process calls it with the same ``name`` in the same
  order; each call is one round, and a process's key of round k - 2 is deleted at round k (every process
  has read it by then: it wrote round k - 1 only after reading round k - 2)."""
  kv, me, rounds = client(), process_index(), _ROUNDS.get(name, 0)
  _ROUNDS[name] = rounds + 1
  kv.key_value_set(f"rlfj/{name}/{rounds}/{me}", value)
  if rounds >= 2:
    kv.key_value_delete(f"rlfj/{name}/{rounds - 2}/{me}")
  return [value if p == me else kv.blocking_key_value_get(f"rlfj/{name}/{rounds}/{p}", timeout_s * 1000)
          for p in range(process_count())]



def check_same_config(config: Any, name: str = "config") -> None:
  """Raises ConfigError on every process when the processes' resolved configs differ."""
  if process_count() == 1:
    return
  hashes = exchange(f"hash/{name}", config_hash(config))
  if len(set(hashes)) > 1:
    listing = ", ".join(f"process {p}: {h}" for p, h in enumerate(hashes))
    raise ConfigError(f"the processes were started with different configs ({listing}); start every process "
                      "with the same --config and overrides")


def fetch(tree):
  """``jax.device_get`` that also works on arrays spanning other processes' devices: those are gathered
  (``process_allgather``, a collective every process must call in the same order) so that every process
  holds the whole value. Arrays this process holds whole are read as ``device_get`` reads them."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  spans = lambda x: isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated)
  if not any(spans(x) for x in jax.tree.leaves(tree)):
    return jax.device_get(tree)   # one call for the whole tree, as before several processes
  return jax.tree.map(lambda x: multihost_utils.process_allgather(x, tiled=True) if spans(x)
                      else jax.device_get(x), tree)


def padded_bytes(n: int) -> int:
  """The length a variable-size byte exchange pads ``n`` bytes to: a power of two of at least 256, so
  that the collectives' programs come in a few shapes (compiled once each), not one per call."""
  return max(256, 1 << max(int(n) - 1, 0).bit_length())


def allgather_bytes(payload: np.ndarray, sizes) -> list[np.ndarray]:
  """Every process's ``payload`` (uint8 [sizes[p]] on process p; ``sizes`` known to every process) -> the
  list of them, on every process: ``send_bytes`` of the payload to every process. A collective: every
  process calls it in the same order."""
  import jax  # pylint: disable=g-import-not-at-top
  count = jax.process_count()
  sizes = [int(n) for n in sizes]
  return send_bytes([payload] * count, [[n] * count for n in sizes])


_ALL_TO_ALL: dict = {}


def _all_to_all(count: int, width: int):
  """(jitted all-to-all of [count, count, width] bytes over one device per process, its sharding, this
  process's device in it), made once per shape."""
  key = (count, width)
  if key not in _ALL_TO_ALL:
    import jax  # pylint: disable=g-import-not-at-top
    from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
    devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(count)]
    mesh = Mesh(np.asarray(devices), ("process",))
    move = lambda x: jax.lax.all_to_all(x, "process", 1, 0, tiled=True)
    fn = jax.jit(jax.shard_map(move, mesh=mesh, in_specs=PartitionSpec("process"),
                               out_specs=PartitionSpec("process")))
    _ALL_TO_ALL[key] = (fn, NamedSharding(mesh, PartitionSpec("process")), devices[jax.process_index()])
  return _ALL_TO_ALL[key]


def send_bytes(payloads, sizes) -> list[np.ndarray]:
  """Point to point between processes: this process sends ``payloads[q]`` (uint8) to process q and gets
  what each process p sent it (``sizes[p][me]`` bytes from p; its own entry is its ``payloads[me]``).
  ``sizes[p][q]``: the bytes p sends q, known to every process (the same on all). One all-to-all over one
  device per process, each payload padded to ``padded_bytes`` of the largest: a collective every process
  calls in the same order; none when nothing is sent."""
  import jax  # pylint: disable=g-import-not-at-top
  me, count = jax.process_index(), jax.process_count()
  sizes = np.asarray(sizes, np.int64).reshape(count, count)
  payloads = [np.asarray(x, np.uint8).reshape(-1) for x in payloads]
  if [x.size for x in payloads] != sizes[me].tolist():
    raise ValueError(f"send_bytes: process {me} sends {[x.size for x in payloads]} bytes, "
                     f"{sizes[me].tolist()} announced")
  if count == 1 or not sizes.any():
    return [payloads[me] if p == me else np.zeros((0,), np.uint8) for p in range(count)]
  width = padded_bytes(sizes.max())
  local = np.zeros((1, count, width), np.uint8)
  for q, x in enumerate(payloads):
    local[0, q, :x.size] = x
  fn, sharding, device = _all_to_all(count, width)
  x = jax.make_array_from_single_device_arrays((count, count, width), sharding, [jax.device_put(local, device)])
  received = np.asarray(fn(x).addressable_shards[0].data)[:, 0]     # [count, width]: row p from process p
  return [received[p, :sizes[p, me]] for p in range(count)]


def broadcast_error(name: str, error: BaseException | None, timeout_s: int = 600) -> None:
  """Process 0 ran a step alone (``error`` is what it raised, or None); every process raises it.

  Used around what only process 0 does (writing the workdir), so that a failure there stops the whole
  run with the same message instead of leaving the others waiting in a collective.
  """
  if process_count() == 1:
    if error is not None:
      raise error
    return
  import jax  # pylint: disable=g-import-not-at-top
  kv, rounds = client(), _ROUNDS.get(f"error/{name}", 0)
  _ROUNDS[f"error/{name}"] = rounds + 1
  key = f"rlfj/error/{name}/{rounds}"
  if jax.process_index() == 0:
    kv.key_value_set(key, "" if error is None else
                         ("1" if isinstance(error, RunError) else "0") + f"{type(error).__name__}: {error}")
  message = kv.blocking_key_value_get(key, timeout_s * 1000)
  if error is not None:
    raise error
  if message:
    text = f"process 0 failed ({name}): {message[1:]}"
    raise ProcessError(text) if message[0] == "1" else RuntimeError(text)


def on_writer(name: str, fn, *args, **kwargs):
  """``fn(*args, **kwargs)`` on process 0 only; the others wait for its outcome (so they see the files it
  wrote) and its failure is raised on every process."""
  error, out = None, None
  if is_writer():
    try:
      out = fn(*args, **kwargs)
    except Exception as e:  # re-raised below on every process
      error = e
  broadcast_error(name, error)
  return out


def process_index() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index()


# ----------------------------------------------------------------------------------------------------
# Host values and arrays onto shardings that span processes.
# ----------------------------------------------------------------------------------------------------

def _spans_processes(sharding) -> bool:
  return not sharding.is_fully_addressable


def crosses_processes(x, sharding) -> bool:
  """Whether device array ``x`` moving to ``sharding`` changes device sets where one spans several
  processes: JAX's ``device_put`` cannot reshard that across hosts on CPU or GPU (``put`` can)."""
  import jax  # pylint: disable=g-import-not-at-top
  return (isinstance(x, jax.Array) and x.sharding.device_set != sharding.device_set
          and (_spans_processes(x.sharding) or _spans_processes(sharding)))


def put(tree, shardings):
  """``jax.device_put(tree, shardings)`` that also works where a sharding spans several processes:

  * a host value (numpy array or scalar, the same on every process) goes to this process's devices
    only, shard by shard (``device_put`` would first check with a collective over every device that all
    processes passed the same value: a hidden program that must not interleave with others);
  * a device array moving to another set of devices across processes goes through host memory (every
    process gathers it with a collective on its source devices and fills its own shards): JAX cannot
    reshard between different device sets across hosts on CPU or GPU.
  Everything else is ``jax.device_put``. ``shardings``: one sharding for every leaf, or a matching tree.
  """
  import jax  # pylint: disable=g-import-not-at-top
  leaves, treedef = jax.tree.flatten(tree)
  targets = ([shardings] * len(leaves) if isinstance(shardings, jax.sharding.Sharding)
             else treedef.flatten_up_to(shardings))
  out = []
  for x, s in zip(leaves, targets):
    if isinstance(x, jax.Array):
      if not crosses_processes(x, s):
        out.append(jax.device_put(x, s))
        continue
      x = fetch(x)
    elif not _spans_processes(s):
      out.append(jax.device_put(x, s))
      continue
    host = np.asarray(x)
    out.append(jax.make_array_from_callback(host.shape, s, lambda index, host=host: host[index]))
  return jax.tree.unflatten(treedef, out)
