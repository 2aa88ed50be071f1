"""Orbax checkpoints of a run: named pytrees (params, optimizer state, ...) plus a JSON ``meta`` record.

Guarantees, and how they are kept:
  * Atomic: orbax writes each step into a temporary folder and renames it when complete, so a crash never
    leaves a half-written checkpoint that resume would pick up (left-over temporary folders are removed).
  * Fails whole: a save that cannot be written (disk full, quota, permissions) is a ``WriteError`` naming
    the step folder, the errno text and the bytes the checkpoint needs; its temporary folder is removed,
    so the previous checkpoint stays the newest intact one. Before writing, ``save`` compares the bytes
    it needs (uncompressed: an upper bound) with the filesystem's free space and refuses at once, with
    nothing written, when they do not fit. orbax's own error logs of a failed save (a traceback per
    writer thread) are dropped: the failure reaches the caller as that one exception instead.
  * Never non-finite: ``save`` computes a fingerprint of every saved tree on device (one small program)
    and refuses to write when a floating-point value is NaN or infinite.
  * Verified: the fingerprints (a position-weighted sum of each leaf's bit patterns modulo 2**32, so
    any single flipped bit changes it) are stored in ``meta`` and checked after a restore, so a corrupt
    file is a ``CheckpointError`` naming the step folder, never silently wrong weights.
  * Shapes first: before reading arrays, ``restore`` compares the stored tree metadata with the target
    and names the first leaf whose shape or dtype differs (not orbax's "set strict=False" advice).

Small arrays are written whole: orbax's replica-parallel writes split each replicated shard among its
replicas by slicing it on device first (an eager slice per shard, and a compile per new shape on a
process's first save); here only shards of at least ``MIN_REPLICA_PARALLEL_BYTES`` per replica are split.

Params and optimizer state are separate items, so generation or evaluation can restore params alone.
Restores take abstract targets carrying shardings, so a run can resume onto another mesh. This module
never decides which step to resume from; ``orchestration/resume.py`` does.
"""
from __future__ import annotations

import base64
import errno as errno_lib
import glob
import hashlib
import json
import logging as std_logging
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from rl_fusion_jax import distributed
from rl_fusion_jax.distributed import fetch
from rl_fusion_jax.errors import CheckpointError, WriteError

# Bytes per replica below which a replicated shard is written whole by one replica (module docstring).
MIN_REPLICA_PARALLEL_BYTES = 8 << 20


def set_replica_parallel_threshold(min_bytes: int | None) -> None:
  """Registers orbax's default jax.Array handler again (with the default's array metadata store), splitting
  replicated shards among their replicas only from ``min_bytes`` per replica (None: orbax's default, every
  replicated shard split). orbax's warning that a handler is replaced is not shown."""
  absl_logger = std_logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(std_logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=min_bytes,
        array_metadata_store=getattr(ocp.type_handlers.get_type_handler(jax.Array), "_array_metadata_store",
                                     None)), override=True)
  finally:
    absl_logger.setLevel(level)


set_replica_parallel_threshold(MIN_REPLICA_PARALLEL_BYTES)


def abstract_like(tree, shardings):
  """ShapeDtypeStructs of ``tree`` (arrays or abstract values) carrying ``shardings``."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# ----------------------------------------------------------------------------------------------------
# Fingerprints: computed on device, identical for any sharding (integer sums are order-independent).
# ----------------------------------------------------------------------------------------------------

def _leaf_fingerprint(x: jax.Array) -> jax.Array:
  """uint32: sum_i bits_i * (2i + 1) mod 2**32 over the flattened leaf (odd weights: a bit flip shows)."""
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
    if width is None:
      raise ValueError(f"no fingerprint for dtype {x.dtype} (itemsize {x.dtype.itemsize})")
    bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
  index = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
  return jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


@jax.jit
def _fingerprints(tree):
  prints = [_leaf_fingerprint(x) for x in jax.tree.leaves(tree)]
  finite = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return prints, jnp.all(jnp.stack(finite)) if finite else jnp.bool_(True)


def _paths(tree) -> list[str]:
  return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def fingerprint(tree) -> tuple[dict[str, int], bool]:
  """({leaf path: fingerprint}, all floating-point values finite) of a tree of jax arrays."""
  prints, finite = fetch(_fingerprints(tree))
  return dict(zip(_paths(tree), (int(p) for p in prints))), bool(finite)


# ----------------------------------------------------------------------------------------------------
# Host state (queues, in-flight samples): JSON with numpy arrays as base64, exact and checksummed.
# ----------------------------------------------------------------------------------------------------

def encode_host(obj):
  """Nested dicts / lists / scalars / numpy arrays -> JSON-able (arrays as dtype, shape, base64 bytes)."""
  if isinstance(obj, np.ndarray):
    data = np.ascontiguousarray(obj)
    return {"__ndarray__": base64.b64encode(data.tobytes()).decode("ascii"), "dtype": data.dtype.str,
            "shape": list(data.shape)}
  if isinstance(obj, dict):
    return {str(k): encode_host(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [encode_host(v) for v in obj]
  if isinstance(obj, np.generic):
    return obj.item()
  return obj


def decode_host(obj):
  if isinstance(obj, dict) and "__ndarray__" in obj:
    data = base64.b64decode(obj["__ndarray__"])
    return np.frombuffer(data, np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
  if isinstance(obj, dict):
    return {k: decode_host(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [decode_host(v) for v in obj]
  return obj


def _host_digest(encoded) -> str:
  return hashlib.sha256(json.dumps(encoded, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------
# Write failures: one error naming the folder, the errno text and the size, and no orbax log noise.
# ----------------------------------------------------------------------------------------------------

class _DropOrbaxErrors(std_logging.Filter):
  """orbax logs each failed writer thread's traceback before the save raises; the raise is reported."""

  def filter(self, record):
    return not (record.levelno >= std_logging.ERROR and "/orbax/" in record.pathname.replace(os.sep, "/"))


class _DropClosedLoopCallbacks:
  """``sys.unraisablehook`` wrapper. When a save fails, orbax closes the event loop of that save while
  tensorstore writes are still in flight; each later completion calls ``loop.call_soon_threadsafe`` from
  tensorstore's C++ thread, which raises "Event loop is closed" where nothing can catch it, and Python
  prints it as an unraisable exception. Nothing waits on those writes (the save already failed and its
  folder is removed): this drops exactly that report and passes every other one on."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, unraisable):
    frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
    if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
            and frames and frames[0].name == "call_soon_threadsafe"):
      self.previous(unraisable)


def _quiet_orbax_errors() -> None:
  logger = std_logging.getLogger("absl")
  if not any(isinstance(f, _DropOrbaxErrors) for f in logger.filters):
    logger.addFilter(_DropOrbaxErrors())
  if not isinstance(sys.unraisablehook, _DropClosedLoopCallbacks):
    sys.unraisablehook = _DropClosedLoopCallbacks(sys.unraisablehook)


def _errno_of(e: BaseException) -> int | None:
  """The errno behind an orbax / tensorstore failure: an OSError in the chain, else tensorstore's
  ``[os_error_code='28']`` in the message."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno:
      return e.errno
    m = re.search(r"os_error_code='?(\d+)", str(e))
    if m:
      return int(m.group(1))
    e = e.__cause__ or e.__context__
  return None


def _mib(n: int) -> str:
  return f"{n / 2**20:.1f} MiB ({n} bytes)"


def free_bytes(directory: str) -> int:
  """Free bytes on the filesystem that holds ``directory`` (or its nearest existing parent)."""
  probe = os.path.abspath(directory)
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  return shutil.disk_usage(probe).free


def _write_error(path: str, code: int | None, detail: str, needed: int, free: int) -> WriteError:
  what = f"{os.strerror(code)} (errno {errno_lib.errorcode.get(code, code)})" if code else detail
  return WriteError(f"cannot write checkpoint {path}: {what}; it needs up to {_mib(needed)}, "
                    f"{_mib(free)} free there")


# ----------------------------------------------------------------------------------------------------
# The checkpointer.
# ----------------------------------------------------------------------------------------------------

def _plain_key(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _by_plain_path(tree) -> dict[str, Any]:
  """Leaves by '/'-joined path; namedtuple fields and dict keys read alike (orbax stores both as dicts)."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
  return {"/" + "/".join(_plain_key(k) for k in path): leaf for path, leaf in flat if leaf is not None}


def _describe_mismatch(name: str, stored, target) -> str | None:
  """The first leaf whose structure, shape or dtype differs between stored metadata and target."""
  stored_leaves, target_leaves = _by_plain_path(stored), _by_plain_path(target)
  for path in sorted(set(stored_leaves) | set(target_leaves)):
    if path not in stored_leaves:
      return f"{name}{path} is missing from the checkpoint"
    if path not in target_leaves:
      return f"{name}{path} is in the checkpoint but not in this config's model"
    s, t = stored_leaves[path], target_leaves[path]
    if tuple(s.shape) != tuple(t.shape) or np.dtype(s.dtype) != np.dtype(t.dtype):
      return (f"{name}{path} has shape {tuple(s.shape)} {np.dtype(s.dtype)} in the checkpoint, "
              f"{tuple(t.shape)} {np.dtype(t.dtype)} in this config")
  return None


class Checkpointer:
  """Numbered checkpoints under ``directory``, the newest ``keep`` kept.

  ``create=False`` opens an existing folder for reading without creating anything (resume inspection).
  """

  def __init__(self, directory: str, keep: int = 2, *, create: bool = True):
    self.directory, self.keep = os.path.abspath(directory), keep
    self._create = create
    self._mngr = None
    self._pending: tuple[int, int] | None = None   # (step, bytes needed) of the save in flight
    _quiet_orbax_errors()

  @property
  def _manager(self) -> ocp.CheckpointManager:
    if self._mngr is None:
      options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=self._create,
                                             cleanup_tmp_directories=self._create)
      self._mngr = ocp.CheckpointManager(self.directory, options=options)
    return self._mngr

  def exists(self) -> bool:
    return os.path.isdir(self.directory)

  def steps(self) -> list[int]:
    """Completed steps, oldest first (temporary folders of unfinished saves are not steps)."""
    if not self.exists():
      return []
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def step_path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, items: Mapping[str, Any], meta: dict[str, Any], host=None) -> None:
    """Starts an asynchronous save of ``items`` (name -> pytree) and ``meta``; refuses non-finite trees.

    ``host``: optional host state (dicts, lists, scalars, numpy arrays) saved exactly, with a digest.
    """
    self._raise_pending()   # a failure of the previous (asynchronous) save is reported first
    checksums = {}
    for name, tree in items.items():
      checksums[name], finite = fingerprint(tree)
      if not finite:
        raise ValueError(f"refusing to write checkpoint step {step}: {name} holds non-finite values")
    args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
    meta = {**meta, "checksums": checksums}
    needed = sum(int(x.nbytes) for x in jax.tree.leaves(items))
    if host is not None:
      encoded = encode_host(host)
      meta["host_sha256"] = _host_digest(encoded)
      args["host"] = ocp.args.JsonSave(encoded)
      needed += len(json.dumps(encoded))
    args["meta"] = ocp.args.JsonSave(meta)
    needed += len(json.dumps(meta)) + 64 * 1024   # orbax's own metadata files, a few KiB per item
    self._check_space(step, needed)
    self._pending = (step, needed)
    try:
      self._manager.save(step, args=ocp.args.Composite(**args))
    except Exception as e:  # pylint: disable=broad-except
      self._fail(e)

  def _check_space(self, step: int, needed: int) -> None:
    """WriteError (on every process, before anything is written) when the checkpoint cannot fit."""
    free = free_bytes(self.directory)
    mine = "" if free >= needed else str(_write_error(self.step_path(step), errno_lib.ENOSPC, "", needed, free))
    verdicts = [mine] if distributed.process_count() == 1 else distributed.exchange("ckpt_space", mine)
    failed = [v for v in verdicts if v]
    if failed:
      raise WriteError(failed[0])

  def _fail(self, e: BaseException) -> None:
    """Turns orbax's failure of the pending save into a WriteError; removes its temporary folders."""
    step, needed = self._pending if self._pending is not None else (-1, 0)
    self._pending = None
    mngr, self._mngr = self._mngr, None
    if mngr is not None:
      try:
        mngr.close()
      except Exception:  # pylint: disable=broad-except
        pass   # the same failure again
    self._remove_temporary(step)
    detail = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    raise _write_error(self.step_path(step), _errno_of(e), detail, needed,
                       free_bytes(self.directory)) from e

  def _remove_temporary(self, step: int, quiet_s: float = 0.1, timeout_s: float = 10.0) -> None:
    """Removes the failed save's temporary folders. A failed save can still have writes in flight in
    tensorstore's threads (orbax stops waiting at the first error), which may recreate a folder: remove
    until none reappears for ``quiet_s``."""
    pattern = os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")
    deadline = time.monotonic() + timeout_s
    while True:
      for tmp in glob.glob(pattern):
        shutil.rmtree(tmp, ignore_errors=True)
      time.sleep(quiet_s)
      if not glob.glob(pattern) or time.monotonic() > deadline:
        return

  def _raise_pending(self) -> None:
    if self._mngr is None or self._pending is None:
      return
    try:
      self._mngr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._fail(e)
    self._pending = None

  def restore_host(self, step: int, meta: dict[str, Any]):
    """The host state saved with ``step`` (None if none was), digest-checked."""
    if "host_sha256" not in meta:
      return None
    path = self.step_path(step)
    try:
      encoded = self._manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))["host"]
    except Exception as e:
      raise CheckpointError(path, f"host state unreadable ({type(e).__name__}: {e})") from e
    if _host_digest(encoded) != meta["host_sha256"]:
      raise CheckpointError(path, "checksum mismatch in the host state")
    return decode_host(encoded)

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON record of ``step`` (reads no arrays); CheckpointError when it is missing or corrupt."""
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      meta = dict(out["meta"])
    except Exception as e:  # orbax / tensorstore / json raise many types for one broken file
      raise CheckpointError(self.step_path(step), f"meta record unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(meta.get("checksums"), Mapping):
      raise CheckpointError(self.step_path(step), "meta record has no checksums")
    return meta

  def restore(self, step: int, targets: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(items, meta) for ``targets`` (name -> abstract tree with shardings), shape- and checksum-checked."""
    path = self.step_path(step)
    meta = self.read_meta(step)
    for name, target in targets.items():
      if name not in meta["checksums"]:
        raise CheckpointError(path, f"not saved: item {name!r}, which this config needs")
      try:
        tree = ocp.StandardCheckpointHandler().metadata(epath.Path(path) / name).tree
      except Exception as e:
        raise CheckpointError(path, f"item {name!r} unreadable ({type(e).__name__}: {e})") from e
      mismatch = _describe_mismatch(name, tree, target)
      if mismatch:
        raise CheckpointError(path, mismatch)
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          **{name: ocp.args.StandardRestore(t) for name, t in targets.items()}))
    except Exception as e:
      raise CheckpointError(path, f"arrays unreadable ({type(e).__name__}: {e})") from e
    items = {name: out[name] for name in targets}
    for name, tree in items.items():
      got, _ = fingerprint(tree)
      want = meta["checksums"].get(name)
      if got != want:
        bad = sorted(k for k in got if (want or {}).get(k) != got[k])
        raise CheckpointError(path, f"checksum mismatch in {name} ({', '.join(bad[:3]) or 'structure'})")
    return items, meta

  def move_aside(self, step: int, reason: str) -> str:
    """Moves a broken step folder to ``<directory>_corrupt/`` (never deletes it); returns the new path."""
    dest_dir = self.directory + "_corrupt"
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, f"{step}.{int(time.time())}")
    shutil.move(self.step_path(step), dest)
    with open(dest + ".reason.txt", "w", encoding="utf-8") as f:
      f.write(reason + "\n")
    self._manager.reload()
    return dest

  def prune(self) -> list[int]:
    """Deletes the oldest steps beyond ``keep`` (after a crash between a save and its clean-up)."""
    extra = self.steps()[:-self.keep]
    for step in extra:
      self._manager.delete(step)
    return extra

  def wait(self) -> None:
    """Blocks until the pending save is on disk; WriteError when it failed."""
    self._raise_pending()

  def close(self) -> None:
    """Waits for the pending save (WriteError when it failed) and ends orbax's threads in any case."""
    try:
      self._raise_pending()
    finally:
      if self._mngr is not None:
        self._mngr.close()
        self._mngr = None
