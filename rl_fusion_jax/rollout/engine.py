"""Generation engine: a host-side queue feeding fixed slots, continuous refill, and partial rollout.

``Engine.add(requests)`` queues prompts; ``Engine.run(params, version, target_...)`` generates until a
target number of samples (or of complete GRPO groups) has finished and returns exactly those, keeping
everything else: queued prompts, samples still in flight (their tokens, behaviour log-probs and per-token
versions) and samples that finished beyond the target. ``finish_groups`` (with ``target_groups``) also
waits for named groups and then returns every complete group: the hook of a bounded-staleness scheduler,
which reads ``group_min_versions()`` to find the groups about to become too stale. ``state_dict()`` /
``load_state_dict()`` carry all of this host state (not the KV cache) across a restart.

The device programs live in ``slots.py``; this module keeps the host's view (which request sits in which
slot, what finished, each sample's oldest token version) and decides what each chunk is given.

One run: re-prefill the samples carried in flight from the previous run (host prefill calls of
``prefill_rows`` rows; none with ``keep_cache``), then chunks (``slots.run_chunk``) until the target is
met or nothing is left. A chunk is one dispatch and one fetch: the first ``num_slots`` queued requests
are uploaded with the target (per tracked group, how many samples it still needs); on the device, before
every decode step, the finished samples move to their batch shard's outbox and free slots refill from the
upload once ``min(prefill_rows, requests left)`` are free (``refill='static'``: only when every slot is free, the
batch-at-a-time baseline), the samples of a group sharing one forward of their prompt
(``slots.shared_prompts``), and the chunk ends after ``chunk_steps`` steps, at the step that meets the
target, when nothing is left, or when the upload is spent and a refill is due. The host then fetches each
slot's done flag, response length and sample id, the finished samples' ids, batch shards and response
lengths (with the finished flag) in completion order, each shard's row and column counts and the counters
(3 x S + 3 x O + 2 x R + 5 numbers, O = 2 x S).
The finished rows themselves are read after the next chunk is dispatched, so that transfer overlaps the
decode, and they cross packed: each batch shard concatenates its own rows' response tokens, log-probs and
versions as bytes on its own devices (``slots.pack_finished``: a token id in as few bytes as the
vocabulary needs, the log-prob's float32 bits, the version's distance below the chunk's in 2 bytes; no row
moves between devices), and each process fetches, of the shards it reads (``_shard_owners``), the blocks
that hold them and three numbers per row (finished, prompt length, response length); prompts are never
sent back, and nothing pads a row to ``seq_len`` on the link (``link_bytes/engine_to_host`` against
``..._padded``). Across processes the shards' bytes are then exchanged, so that every host holds every row
(``link_bytes/engine_rows_between_hosts_this_host``), unless ``local_rows``: then each host keeps the rows
it read and, of the others, what the control numbers say (``readers``: who holds which;
``hold_finished`` fills the unreturned ones in before a checkpoint). Nothing is read back per token, and
the full slot state never is inside a run. The oldest token version of each in-flight sample is kept on
the host from the response lengths (each chunk's tokens carry the run's version), and goes with the
sample when it finishes (``RunResult.min_version_b``): known without its row.

Determinism: the engine's base key comes from ``seed`` and token t of a sample is drawn with key
(seed, sample id, t), always from the logits of one decode step. Under fixed weights a sample's tokens
therefore do not depend on the slot count, the chunk size, the refill order or on how runs were split.

Partial rollout, and what happens to in-flight samples between runs. The default drops the KV cache at
the end of every run and, at the start of the next, re-prefills each in-flight sample's prompt + partial
response under the weights of that run. Earlier tokens keep the log-probs and versions they were sampled
with; new tokens get the new version. The alternative, ``keep_cache=True``, keeps the cache across runs:
  * memory: re-prefill frees the whole cache (L x S x K x T x H x 2) between phases, so training gets
    that memory; keeping it holds the cache through the training phase.
  * compute: re-prefill costs one forward over every in-flight prefix per run (a prefill, so at
    matmul-friendly shapes; small next to decoding the long tail), keeping costs nothing.
  * staleness: kept KV was computed by the old weights, so new tokens attend to keys and values of a
    policy that no longer exists; the behaviour log-probs of those tokens are then not those of any
    single policy version. Re-prefill makes every new token an exact sample of the current policy given
    its prefix. Under unchanged weights both give the same tokens.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rl_fusion_jax import distributed
from rl_fusion_jax.distributed import fetch, put
from rl_fusion_jax.rollout import slots
from rl_fusion_jax.rollout.decode import GenerateSpec
from rl_fusion_jax.sharding.mesh import batch_shards
from rl_fusion_jax.sharding.rules import GENERATE_RULES, Rules
from rl_fusion_jax.types import Rollout

REFILL_POLICIES = ("continuous", "static")
_MAX_ID = 2**31 - 1
_PREFILLS_PER_BLOCK = 8   # bounded dispatch queue (multi-device CPU programs deadlock beyond ~32)
_STATE_FORMAT = 1


def _positive_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Slots, chunking and scheduling of an Engine. ``prefill_rows=0``: a quarter of the slots."""
  spec: GenerateSpec
  num_slots: int
  chunk_steps: int = 16
  prefill_rows: int = 0
  group_size: int = 1
  seed: int = 0
  refill: str = "continuous"
  keep_cache: bool = False
  # Refills prefill at the narrowest width that holds their prompts (one forward per width in the decode
  # chunk's program) instead of the prompt width (one): ``slots.refill_widths``.
  narrow_refills: bool = False

  def __post_init__(self):
    for name in ("num_slots", "chunk_steps", "group_size"):
      if not _positive_int(getattr(self, name)):
        raise ValueError(f"EngineConfig.{name}: must be a positive int, got {getattr(self, name)!r}")
    if not _positive_int(self.prefill_rows) and self.prefill_rows != 0:
      raise ValueError(f"EngineConfig.prefill_rows: must be 0 (auto) or a positive int, got "
                       f"{self.prefill_rows!r}")
    if self.prefill_rows > self.num_slots:
      raise ValueError(f"EngineConfig.prefill_rows: {self.prefill_rows} > num_slots {self.num_slots}")
    if self.num_slots % self.group_size:
      raise ValueError(f"EngineConfig.group_size: {self.group_size} does not divide num_slots "
                       f"{self.num_slots}")
    if not isinstance(self.narrow_refills, (bool, np.bool_)):
      raise ValueError(f"EngineConfig.narrow_refills: must be a bool, got {self.narrow_refills!r}")
    if self.refill not in REFILL_POLICIES:
      raise ValueError(f"EngineConfig.refill: must be one of {REFILL_POLICIES}, got {self.refill!r}")
    if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
      raise ValueError(f"EngineConfig.seed: must be an int, got {self.seed!r}")


@dataclasses.dataclass(frozen=True)
class Request:
  """One sample to generate. ``forced_len``: the response ends at that length, EOS ignored (benchmarks)."""
  sample_id: int
  group_id: int
  prompt: Sequence[int]
  forced_len: int | None = None

  def __post_init__(self):
    for name in ("sample_id", "group_id"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= _MAX_ID:
        raise ValueError(f"Request.{name}: must be an int in [0, 2**31), got {value!r}")
    if self.forced_len is not None and not _positive_int(self.forced_len):
      raise ValueError(f"Request.forced_len: must be None or a positive int, got {self.forced_len!r}")
    prompt = np.asarray(self.prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(f"Request.prompt: must be a non-empty 1-D sequence of ints (sample {self.sample_id})")
    object.__setattr__(self, "prompt", tuple(int(t) for t in prompt))


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What one ``run`` returns: finished samples as a host Rollout (numpy), their groups, and counters.
  ``min_version_b``: each sample's oldest response-token version (-1: no response token), from the
  control numbers, so also of a row whose response another process holds (``Engine.local_rows``)."""
  rollout: Rollout
  group_id_b: np.ndarray
  stats: dict
  min_version_b: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class _Target:
  """What ends a run: ``n`` finished samples, or ``n`` complete groups and every group in ``finish``."""
  kind: str                               # "samples" or "groups"
  n: int
  finish: frozenset[int] | None = None    # groups only; when set, every complete group is returned


@dataclasses.dataclass
class _Finished:
  order: tuple[int, int]      # (chunk counter when collected, sample id): completion order
  group_id: int
  row: dict | None            # host numpy fields of one SlotState row (None until read: ``_read_rows``)
  # The oldest version among its response tokens (None: none), from the host's view of the slots: known
  # without the row, and checked against the row wherever this process reads it.
  min_version: int | None = None
  held: bool = True           # False: another process holds its response (``local_rows``); the row is blank
  # Read under ``local_rows`` across processes, and not yet sent to every process (``hold_finished``): the
  # same on every process, unlike ``held``.
  by_process: bool = False


class Engine:
  """Slots over one donated KV cache, a host queue, continuous refill and partial rollout."""

  def __init__(self, cfg: EngineConfig, mesh: Mesh, param_shardings, rules: Rules = GENERATE_RULES):
    """``rules``: the generation rule table ``param_shardings`` came from (KV cache layout, and the
    expert-parallel layout of an MoE policy)."""
    shards = batch_shards(mesh)
    if cfg.num_slots % shards:
      raise ValueError(f"EngineConfig.num_slots: {cfg.num_slots} is not a multiple of the {shards} batch "
                       "shards of the mesh (data x fsdp)")
    rows = cfg.prefill_rows or -(-max(1, cfg.num_slots // 4) // shards) * shards
    if rows % shards:
      raise ValueError(f"EngineConfig.prefill_rows: {rows} is not a multiple of the {shards} batch shards")
    self.cfg, self.rows = cfg, rows
    self.programs = slots.programs(cfg.spec, cfg.num_slots, rows, mesh, param_shardings, rules,
                                   cfg.refill == "static", cfg.group_size, bool(cfg.narrow_refills))
    self._rng = jax.random.key(cfg.seed)
    self._state = self.programs.empty()
    self._shards = shards
    self._widths_ready = False                   # every re-prefill width compiled (``_compile_widths``)
    self._blocks_ready = False                   # every block size of the finished buffer compiled
    self._owners: list[int] | None = None        # the process that reads each batch shard's rows
    # True: each process keeps only the responses of the shards it reads (no exchange between processes);
    # the other processes' samples are kept as prompt, lengths and finished flag. ``readers`` (only then):
    # the process holding each finished sample's row (``processes.Share`` reads it), kept until
    # ``forget_readers``.
    self.local_rows = False
    self.readers: dict[int, int] = {}
    # Host view of the slot state as of the last fetch: response lengths and the oldest
    # version among each occupant's generated tokens (None: none yet).
    self._response_len_s = np.zeros((cfg.num_slots,), np.int32)
    self._min_version_s: list[int | None] = [None] * cfg.num_slots
    self._cache = None
    self._kv_valid = False                       # the cache holds the KV of every in-flight prefix
    self._occupant: list[Request | None] = [None] * cfg.num_slots
    self._queue: collections.deque[Request] = collections.deque()
    self._finished: list[_Finished] = []
    self._unread: list = []     # (finished entries, their requests, the chunk's packed rows on the devices,
                                # each entry's (shard, outbox row), rows and columns per shard, the version)
    self._ids: set[int] = set()                  # live samples: queued, in flight, or not yet returned
    self._group_added: collections.Counter = collections.Counter()
    self._group_returned: collections.Counter = collections.Counter()
    self._chunks = 0
    # Called with (host Rollout, group ids, batch shards that generated them) of the samples that finished
    # in the last chunk, as soon as their rows are read (once the next chunk is dispatched: e.g. to score
    # them while it decodes); must not block.
    self.on_finished: Callable[[Rollout, np.ndarray, np.ndarray], None] | None = None

  # -- queue -----------------------------------------------------------------------------------------

  def add(self, requests: Iterable[Request]) -> None:
    """Queues requests; all are checked first, so a bad one leaves the queue unchanged.

    Sample ids must be unique among the live samples (queued, in flight, or finished but not yet
    returned); a group may not receive more than ``group_size`` samples before it has been returned.
    """
    requests = list(requests)
    spec, ids, groups = self.cfg.spec, set(), collections.Counter()
    for i, r in enumerate(requests):
      if not isinstance(r, Request):
        raise ValueError(f"requests[{i}]: expected a Request, got {type(r).__name__}")
      if len(r.prompt) > spec.max_prompt_len:
        raise ValueError(f"requests[{i}].prompt: {len(r.prompt)} tokens > max_prompt_len "
                         f"{spec.max_prompt_len} (sample {r.sample_id})")
      if min(r.prompt) < 0 or max(r.prompt) >= spec.model.vocab_size:
        raise ValueError(f"requests[{i}].prompt: token ids must be in [0, vocab_size="
                         f"{spec.model.vocab_size}) (sample {r.sample_id})")
      if r.sample_id in self._ids or r.sample_id in ids:
        raise ValueError(f"requests[{i}].sample_id: duplicate id {r.sample_id}")
      ids.add(r.sample_id)
      groups[r.group_id] += 1
      if self._group_added[r.group_id] + groups[r.group_id] > self.cfg.group_size:
        raise ValueError(f"requests[{i}].group_id: group {r.group_id} would exceed group_size "
                         f"{self.cfg.group_size}")
    self._ids |= ids
    self._group_added.update(groups)
    self._queue.extend(requests)

  @property
  def num_queued(self) -> int:
    return len(self._queue)

  @property
  def num_in_flight(self) -> int:
    return sum(r is not None for r in self._occupant)

  @property
  def num_unreturned(self) -> int:
    """Finished samples held for a later run."""
    return len(self._finished)

  @property
  def held_cache_bytes(self) -> int:
    """Device bytes of KV cache held now (0 between runs unless ``keep_cache``)."""
    return 0 if self._cache is None else sum(x.nbytes for x in self._cache.values())

  def group_ids(self) -> list[int]:
    """Every group with a sample held here (queued, in flight, or finished and unreturned), ascending."""
    return sorted({g for g, _ in self._held_versions()})

  def group_min_versions(self) -> dict[int, int | None]:
    """Per held group, the oldest policy version among its held samples' generated tokens (None: none yet).

    As of the end of the last run, ``add`` or ``load_state_dict`` (kept on the host; no device transfer).
    """
    out: dict[int, int | None] = {}
    for g, v in self._held_versions():
      old = out.get(g)
      out[g] = v if old is None else old if v is None else min(old, v)
    return dict(sorted(out.items()))

  def _held_versions(self):
    """(group id, oldest version of its generated tokens or None) for every sample held here."""
    for r in self._queue:
      yield r.group_id, None
    for s, r in enumerate(self._occupant):
      if r is not None:
        yield r.group_id, self._min_version_s[s]
    for f in self._finished:
      yield f.group_id, f.min_version

  # -- run -------------------------------------------------------------------------------------------

  def run(self, params, policy_version: int, *, target_samples: int | None = None,
          target_groups: int | None = None, finish_groups: Iterable[int] | None = None) -> RunResult:
    """Generates until the target is met (or nothing is left); returns exactly the target's samples.

    ``target_samples``: the first that many finished samples, in completion order. ``target_groups``:
    that many groups whose ``group_size`` samples have all finished (groups split by an earlier
    ``target_samples`` call never complete here), in completion order. ``finish_groups`` (only with
    ``target_groups``): the run also waits until each of these groups is complete, then returns every
    complete group, not only ``target_groups`` of them; each must be held by the engine and able to
    complete. Neither target: every finished sample once queue and slots are empty. Fewer come back
    only when nothing is left to generate.
    """
    target = self._check_target(target_samples, target_groups, finish_groups)
    t0, stats = time.perf_counter(), collections.Counter()
    version = put(np.asarray(policy_version, np.int32), self.programs.replicated)
    with jax.transfer_guard_device_to_host("disallow"):   # explicit fetches only (see the module docstring)
      while not self._target_met(target) and (self._queue or self.num_in_flight):
        if self._cache is None:
          self._cache, self._kv_valid = self.programs.init_cache(), False
        if not self._kv_valid:
          self._reprefill(params, stats)
          self._kv_valid = True
        self._chunk(params, version, policy_version, target, stats)
      self._read_rows(stats)
    result = self._take(target)
    if not self.cfg.keep_cache and self._cache is not None:
      jax.tree.map(lambda x: x.delete(), self._cache)
      self._cache, self._kv_valid = None, False
    if self.num_in_flight and not self._kv_valid and not self._widths_ready:
      self._compile_widths(params)    # the next run re-prefills: no compile inside it
    stats.update(seconds=time.perf_counter() - t0, returned=len(result[1]), in_flight=self.num_in_flight,
                 queued=len(self._queue), unreturned=len(self._finished))
    stats["slot_utilization"] = stats["generated_tokens"] / max(1, stats["decode_steps"] * self.cfg.num_slots)
    return RunResult(rollout=result[0], group_id_b=result[1], stats=dict(stats), min_version_b=result[2])

  def forget_readers(self, keep=()) -> None:
    """Drops ``readers`` of the samples already returned (the caller is done with them), but those of
    ``keep`` (sample ids the caller still holds, e.g. StaleSync's queued samples)."""
    keep = set(int(k) for k in keep)
    for sample_id in [s for s in self.readers if s not in self._ids and s not in keep]:
      del self.readers[sample_id]

  def hold_finished(self, fill) -> int:
    """``local_rows``: makes this process hold the responses of every finished sample not yet returned.
    ``fill``: a host Rollout of those samples (responses blank where another process holds them) -> the
    same with every response filled in (e.g. ``processes.fill_rows`` to every process; a collective, so
    every process calls this at the same point, and calls ``fill`` or not alike). Returns how many rows
    this process filled. What a checkpoint of ``state_dict`` needs: every process then saves the same,
    complete rows."""
    done = sorted(self._finished, key=lambda f: f.order)
    if not any(f.by_process for f in done):   # decided alike on every process (``held`` is not)
      return 0
    filled = fill(_stack([f.row for f in done], self.cfg.spec.seq_len))
    count = 0
    for b, f in enumerate(done):
      f.by_process = False
      if not f.held:
        for name, x in (("tokens_st", filled.tokens_bt), ("logp_st", filled.logp_bt),
                        ("version_st", filled.version_bt)):
          f.row[name] = np.array(x[b])
        if _min_version(f.row["version_st"], f.row["prompt_len_s"], f.row["response_len_s"]) != f.min_version:
          raise AssertionError(f"engine: sample {int(f.row['sample_id_s'])} filled with other versions than "
                               "its control numbers")
        f.held, count = True, count + 1
    return count

  def _check_target(self, target_samples, target_groups, finish_groups) -> _Target | None:
    if target_samples is not None and target_groups is not None:
      raise ValueError("run: give at most one of target_samples and target_groups")
    for name, value in (("target_samples", target_samples), ("target_groups", target_groups)):
      if value is not None and not _positive_int(value):
        raise ValueError(f"run: {name} must be None or a positive int, got {value!r}")
    if finish_groups is not None and target_groups is None:
      raise ValueError("run: finish_groups needs target_groups")
    if target_samples is not None:
      return _Target("samples", int(target_samples))
    if target_groups is None:
      return None
    finish = None if finish_groups is None else self._check_finish(finish_groups)
    return _Target("groups", int(target_groups), finish)

  def _check_finish(self, finish_groups) -> frozenset[int]:
    """``finish_groups`` as a set of group ids that the engine holds and that can still complete."""
    finish = list(finish_groups)
    if any(isinstance(g, bool) or not isinstance(g, (int, np.integer)) for g in finish):
      raise ValueError(f"run: finish_groups must be group ids (ints), got {finish!r}")
    finish = frozenset(int(g) for g in finish)
    unknown = sorted(finish - set(self.group_ids()))
    if unknown:
      raise ValueError(f"run: finish_groups {unknown} unknown to the engine (not queued, in flight or "
                       "finished and unreturned)")
    size = self.cfg.group_size
    never = sorted(g for g in finish if self._group_added[g] < size or self._group_returned[g])
    if never:
      raise ValueError(f"run: finish_groups {never} can never complete (fewer than group_size={size} "
                       "samples added, or some already returned)")
    return finish

  def _complete_groups(self) -> list[int]:
    """Groups whose samples have all finished and none been returned, in order of completion."""
    count, last = collections.Counter(), {}
    for f in self._finished:
      count[f.group_id] += 1
      last[f.group_id] = max(last.get(f.group_id, f.order), f.order)
    done = [g for g, n in count.items() if n == self.cfg.group_size]
    return sorted(done, key=lambda g: (last[g], g))

  def _target_met(self, target: _Target | None) -> bool:
    if target is None:
      return False
    if target.kind == "samples":
      return len(self._finished) >= target.n
    done = self._complete_groups()
    return len(done) >= target.n and (target.finish is None or target.finish <= set(done))

  def _take(self, target: _Target | None) -> tuple[Rollout, np.ndarray]:
    self._finished.sort(key=lambda f: f.order)
    if target is None:
      taken, self._finished = self._finished, []
    elif target.kind == "samples":
      taken, self._finished = self._finished[:target.n], self._finished[target.n:]
    else:
      groups = self._complete_groups()
      groups = groups if target.finish is not None else groups[:target.n]
      rank = {g: i for i, g in enumerate(groups)}
      taken = sorted((f for f in self._finished if f.group_id in rank),
                     key=lambda f: (rank[f.group_id], f.row["sample_id_s"]))
      self._finished = [f for f in self._finished if f.group_id not in rank]
    self._forget(taken)
    return (_stack([f.row for f in taken], self.cfg.spec.seq_len), np.asarray([f.group_id for f in taken], np.int32),
            np.asarray([-1 if f.min_version is None else f.min_version for f in taken], np.int32))

  def _forget(self, taken) -> None:
    """Drops the bookkeeping of returned samples, so it stays bounded by the live ones over a long run.

    A group's count goes once all ``group_size`` of its samples were returned.
    """
    for f in taken:
      self._ids.discard(int(f.row["sample_id_s"]))
      self._group_returned[f.group_id] += 1
      if self._group_returned[f.group_id] == self.cfg.group_size:
        del self._group_returned[f.group_id], self._group_added[f.group_id]

  # -- checkpointing --------------------------------------------------------------------------------

  def state_dict(self) -> dict:
    """Everything ``run`` continues from, as numpy arrays and Python scalars (no device arrays).

    Not while a finished sample waiting to be returned has its response on another process
    (``local_rows``): ``hold_finished`` first.

    Queued requests, in-flight slot rows (tokens, behaviour log-probs, versions, lengths; not the KV
    cache), finished samples not yet returned with their completion order, the group counters, the
    chunk counter, and the config fields that change what is generated. Flat with string keys, so
    ``np.savez(path, **state)`` stores it as is.
    """
    blank = [int(f.row["sample_id_s"]) for f in self._finished if not f.held]
    if blank:
      raise RuntimeError(f"Engine.state_dict: finished samples {blank[:5]} (of {len(blank)}) have their "
                         "responses on another process (local_rows): call hold_finished first")
    slot_f = [s for s, r in enumerate(self._occupant) if r is not None]
    host = fetch(self._state) if slot_f else None   # the in-flight rows: fetched only here
    done = sorted(self._finished, key=lambda f: f.order)
    state = {"format": _STATE_FORMAT, "chunks": self._chunks,
             **{f"config.{k}": v for k, v in _fingerprint(self.cfg).items()},
             **_queue_arrays(self._queue, self.cfg.spec.max_prompt_len),
             "flight.slot": np.asarray(slot_f, np.int32),
             "flight.group_id": np.asarray([self._occupant[s].group_id for s in slot_f], np.int32),
             "done.group_id": np.asarray([f.group_id for f in done], np.int32),
             "done.chunk": np.asarray([f.order[0] for f in done], np.int64),
             "done.rank": np.asarray([f.order[1] for f in done], np.int64)}
    for name in _SLOT_FIELDS:
      state[f"flight.{name}"] = (np.asarray(getattr(host, name))[slot_f] if slot_f
                                 else _empty_rows(name, self.cfg.spec.seq_len))
    for name in _ROW_FIELDS:
      state[f"done.{name}"] = (np.stack([f.row[name] for f in done]) if done
                               else _empty_rows(name, self.cfg.spec.seq_len))
    for name, counter in (("added", self._group_added), ("returned", self._group_returned)):
      state[f"groups.{name}"] = np.asarray(sorted(counter.items()), np.int64).reshape(-1, 2)
    return state

  def load_state_dict(self, state: dict) -> None:
    """Restores ``state_dict()`` into this engine, which must hold nothing yet.

    In-flight samples go back into slots and continue through the re-prefill path at the next run
    (their KV is recomputed under that run's weights). Fields that change what is generated (seed,
    group_size, lengths, EOS, sampling, vocabulary) must match this engine's config; scheduling fields
    (num_slots, chunk_steps, refill, ...) may differ, as long as the in-flight samples fit the slots.
    With ``keep_cache`` an uninterrupted engine would continue on its kept (stale) KV instead, so only
    the default re-prefill path continues exactly as if nothing had been restored.
    """
    self._check_state(state)
    self._queue = collections.deque(_requests(state, "queue.", "prompt_qp"))
    self._restore_slots(state)
    rows = _rows(state, "done.")
    # Completion order: (chunk, position in its outbox); states written before "done.rank" ranked a chunk's
    # samples by id.
    ranks = state.get("done.rank", [row["sample_id_s"] for row in rows])
    self._finished = [_Finished((int(chunk), int(rank)), int(g), row,
                                _min_version(row["version_st"], row["prompt_len_s"], row["response_len_s"]))
                      for chunk, rank, g, row in zip(state["done.chunk"], ranks, state["done.group_id"], rows)]
    self._group_added, self._group_returned = (
        collections.Counter({int(g): int(n) for g, n in np.asarray(state[f"groups.{name}"])})
        for name in ("added", "returned"))
    self._ids = ({r.sample_id for r in self._queue} | {r.sample_id for r in self._occupant if r is not None}
                 | {int(f.row["sample_id_s"]) for f in self._finished})
    self._chunks, self._kv_valid = int(state["chunks"]), False

  def _check_state(self, state: dict) -> None:
    if self._queue or self.num_in_flight or self._finished:
      raise ValueError("load_state_dict: the engine already holds samples; load into a fresh engine")
    if _item(state.get("format")) != _STATE_FORMAT:
      raise ValueError(f"load_state_dict: format {_item(state.get('format'))!r}, expected {_STATE_FORMAT}")
    bad = [f"{k}: {_item(state.get(f'config.{k}'))!r} in the state, {v!r} here"
           for k, v in _fingerprint(self.cfg).items() if _item(state.get(f"config.{k}")) != v]
    if bad:
      raise ValueError("load_state_dict: saved under another EngineConfig: " + "; ".join(bad))
    in_flight = len(state["flight.slot"])
    if in_flight > self.cfg.num_slots:
      raise ValueError(f"load_state_dict: {in_flight} in-flight samples > EngineConfig.num_slots "
                       f"{self.cfg.num_slots}")

  def _restore_slots(self, state: dict) -> None:
    """Writes the saved in-flight rows into slots (the saved ones when they fit) on host and device."""
    slot_f = np.asarray(state["flight.slot"], np.int64)
    if slot_f.size and slot_f.max() >= self.cfg.num_slots:
      slot_f = np.arange(slot_f.size)
    host = jax.tree.map(np.array, fetch(self._state))       # writable copies
    for name in _SLOT_FIELDS:
      getattr(host, name)[slot_f] = state[f"flight.{name}"]
    host.done_s[slot_f] = False
    self._occupant = [None] * self.cfg.num_slots
    for s, request in zip(slot_f, _requests(state, "flight.", "tokens_st")):
      self._occupant[int(s)] = request
    self._response_len_s = host.response_len_s.copy()
    self._min_version_s = [
        _min_version(host.version_st[s], host.prompt_len_s[s], host.response_len_s[s]) if r is not None else None
        for s, r in enumerate(self._occupant)]
    self._state = put(host, jax.tree.map(lambda x: x.sharding, self._state))

  # -- slots: the host side of slots.py's programs -------------------------------------------------

  def _chunk(self, params, version, policy_version: int, target: _Target | None, stats) -> None:
    """Dispatches one chunk (``slots.run_chunk``: decode steps with refill and the target test on the
    device), reads the finished rows of the chunk before it (``_read_rows``: its transfer overlaps this
    chunk), then fetches what the host needs to keep its view: each slot's done flag, response length and
    sample id, the outbox's sample ids and counters (3 x S + O + 8 numbers)."""
    t0 = time.perf_counter()
    pending = list(itertools.islice(self._queue, self.programs.pending_rows))
    group_index, group_s, remaining_g = self._group_table(pending)
    args = self._chunk_inputs(pending, group_index, remaining_g, target)
    self._state, self._cache, flat, *counters = self.programs.chunk(
        params, self._cache, self._state, put(group_s, self.programs.state_shardings.done_s), *args,
        self._rng, version)
    self._read_rows(stats)     # the previous chunk's finished rows: read while this one decodes
    (done_s, response_len_s, sample_id_s, out_ids, out_shard, out_len, out_n, columns, taken, steps, tokens,
     refills, refill_tokens) = fetch((self._state.done_s, self._state.response_len_s, self._state.sample_id_s,
                                      *counters))
    stats["link_bytes/engine_control"] += sum(np.asarray(x).nbytes for x in (
        done_s, response_len_s, sample_id_s, out_ids, out_shard, out_len, out_n, columns, taken, steps, tokens,
        refills, refill_tokens))
    by_id = {r.sample_id: r for r in self._occupant if r is not None}
    for _ in range(int(taken)):
      request = self._queue.popleft()
      by_id[request.sample_id] = request
    # Each finished sample, in the chunk's completion order, and its (shard, row in the shard's outbox).
    num_out = int(out_n.sum())
    out = [by_id[int(sid)] for sid in out_ids[:num_out]]
    rank = collections.Counter()
    places = []
    for r in out_shard[:num_out]:
      places.append((int(r), rank[int(r)]))
      rank[int(r)] += 1
    if [rank[r] for r in range(len(out_n))] != [int(n) for n in out_n]:
      raise AssertionError(f"engine: finished samples per shard {dict(rank)}, the outboxes hold {list(out_n)}")
    # A finished sample's oldest token version: its slot's as of the last chunk, or this run's if it had no
    # token before this chunk (versions only grow); None with no response token.
    slot_of = {r.sample_id: s for s, r in enumerate(self._occupant) if r is not None}
    oldest = lambda r, n: (None if n == 0 else policy_version if r.sample_id not in slot_of
                           or self._min_version_s[slot_of[r.sample_id]] is None
                           else min(self._min_version_s[slot_of[r.sample_id]], policy_version))
    entries = [_Finished((self._chunks, i), r.group_id, None, oldest(r, int(out_len[i]) >> 1))
               for i, r in enumerate(out)]
    if entries:
      self._finished.extend(entries)
      self._unread.append((entries, out, flat, places, np.array(out_len[:num_out]), np.array(out_n),
                           np.array(columns), policy_version))
    for s in range(self.cfg.num_slots):
      old = self._occupant[s]
      new = None if done_s[s] else by_id[int(sample_id_s[s])]
      if new is None or response_len_s[s] == 0:
        version_s = None
      elif new is old:
        sampled = response_len_s[s] > self._response_len_s[s]
        version_s = self._min_version_s[s] if not sampled else policy_version if self._min_version_s[s] is None \
            else min(self._min_version_s[s], policy_version)
      else:
        version_s = policy_version   # admitted in this chunk: every token it has is of this run
      self._occupant[s], self._min_version_s[s] = new, version_s
    self._response_len_s = np.array(response_len_s)
    self._chunks += 1
    stats.update(decode_chunks=1, decode_steps=int(steps), generated_tokens=int(tokens),
                 refill_prefills=int(refills), prefill_rows=int(taken), prefill_tokens=int(refill_tokens))
    _add_chunk_moments(stats, time.perf_counter() - t0, int(steps), int(refills))

  def _group_table(self, pending: list[Request]):
    """The groups a chunk tracks (those of in-flight and uploaded samples, in that order) -> ({group id:
    index}, each slot's group index (G: empty), samples each group still needs before it is complete)."""
    size, num_groups = self.cfg.group_size, self.programs.num_groups
    index: dict[int, int] = {}
    for r in [r for r in self._occupant if r is not None] + pending:
      index.setdefault(r.group_id, len(index))
    finished = collections.Counter(f.group_id for f in self._finished)
    remaining_g = np.full((num_groups,), np.iinfo(np.int32).max, np.int32)
    for g, i in index.items():
      # A group split by an earlier target_samples run never completes here (_complete_groups).
      remaining_g[i] = size - finished[g] if not self._group_returned[g] else np.iinfo(np.int32).max
    group_s = np.asarray([num_groups if r is None else index[r.group_id] for r in self._occupant], np.int32)
    return index, group_s, remaining_g

  def _chunk_inputs(self, pending: list[Request], index: dict[int, int], remaining_g, target: _Target | None):
    """(Pending, ChunkTarget, step budget) on the device, replicated."""
    rows, width, big = self.programs.pending_rows, self.cfg.spec.max_prompt_len, np.iinfo(np.int32).max
    prompt_qp = np.zeros((rows, width), np.int32)
    column = lambda fn: np.asarray([fn(r) for r in pending] + [0] * (rows - len(pending)), np.int32)
    first: dict = {}
    source_q = np.arange(rows, dtype=np.int32)
    for i, r in enumerate(pending):
      prompt_qp[i, :len(r.prompt)] = r.prompt
      source_q[i] = first.setdefault((r.group_id, r.prompt), i)
    pend = slots.Pending(prompt_qp=prompt_qp, prompt_len_q=column(lambda r: len(r.prompt)),
                         sample_id_q=column(lambda r: r.sample_id), forced_len_q=column(lambda r: r.forced_len or 0),
                         group_q=column(lambda r: index[r.group_id]), source_q=source_q, count=np.int32(len(pending)))
    awaited_g = np.zeros((self.programs.num_groups,), bool)
    need_groups, need_samples, blocked = 0, 0, False
    if target is not None and target.kind == "samples":
      need_samples = target.n - len(self._finished)
    elif target is not None:
      complete = set(self._complete_groups())
      need_groups = target.n - len(complete)
      for g in (target.finish or frozenset()) - complete:
        if g in index:
          awaited_g[index[g]] = True
        else:
          blocked = True   # its samples are all queued beyond this chunk's upload
    goal = slots.ChunkTarget(remaining_g=remaining_g, awaited_g=awaited_g, need_groups=np.int32(need_groups),
                             need_samples=np.int32(min(need_samples, big)), blocked=np.bool_(blocked),
                             armed=np.bool_(target is not None),
                             more_queued=np.bool_(len(self._queue) > len(pending)))
    return put((pend, goal, np.int32(self.cfg.chunk_steps)), self.programs.replicated)

  def _read_rows(self, stats) -> None:
    """Reads the finished rows of every chunk not yet read into its entries, then hands each batch to
    ``on_finished``. Only real tokens cross: the blocks of ``slots.pack_finished``'s buffer that hold each
    row's (finished, prompt length, response length) and the responses; the prompts are the host's.

    Each batch shard packs its own rows on its devices, and a process reads the shards it owns
    (``_shard_owners``) and nothing of the others. A run across processes then exchanges the shards' bytes
    between the processes (``distributed.allgather_bytes``), so that every host holds every row; with
    ``local_rows`` it does not, and a row of another process's shard keeps its prompt, response length and
    finished flag (its response tokens 0, log-probs 0, versions -1). ``readers`` records who holds each.

    ``stats``: ``link_bytes/engine_to_host`` (every shard's blocks, summed over the hosts that read them)
    and ``..._padded`` (the same rows at ``seq_len``: 3 per-token fields and 4 scalars, as a padded row
    would be); ``..._this_host``: the blocks this process read from its devices;
    ``link_bytes/engine_rows_between_hosts_this_host``: the bytes it received from the other processes
    (their payloads padded to ``distributed.padded_bytes``, as the collective moves them)."""
    seq_len, vocab = self.cfg.spec.seq_len, self.cfg.spec.model.vocab_size
    width = slots.wire_format(vocab, seq_len)[2]
    if self._unread and not self._blocks_ready:
      # Every block size once, on the first buffer read (each at least as wide as the largest block): a
      # chunk that later finishes more columns compiles nothing.
      for size in slots.PACK_BLOCKS:
        self.programs.take_block[size](self._unread[0][2], 0)
      self._blocks_ready = True
    owner = self._shard_owners()
    me = jax.process_index()
    for entries, requests, flat, places, out_len, out_n, columns, version in self._unread:
      shards = range(len(out_n))
      starts = {r: slots.block_starts(int(columns[r])) for r in shards}
      mine = [r for r in shards if owner[r] == me and out_n[r] > 0]
      taken = {b: self.programs.take_block[b[1]](flat, b[0]) for r in mine for b in starts[r]}
      local = {b: {s.index[0].start or 0: s.data for s in block.addressable_shards} for b, block in taken.items()}
      # One read of this process's own shards' blocks ([1, W, size] each), nothing of another shard's.
      read = jax.device_get([[local[b][r] for b in starts[r]] for r in mine])
      bytes_r = {r: np.concatenate([x[0] for x in blocks], axis=1)[:, :int(columns[r])]
                 for r, blocks in zip(mine, read)}
      stats["link_bytes/engine_to_host"] += width * sum(size for r in shards for _, size in starts[r])
      stats["link_bytes/engine_to_host_this_host"] += width * sum(size for r in mine for _, size in starts[r])
      stats["link_bytes/engine_to_host_padded"] += len(entries) * (3 * seq_len + 4) * 4
      if len(set(owner)) > 1 and not self.local_rows:   # the other processes' shards, from them (collective)
        sizes = [width * sum(int(columns[r]) for r in shards if owner[r] == p) for p in range(jax.process_count())]
        payload = np.concatenate([bytes_r[r].reshape(-1) for r in mine] or [np.zeros((0,), np.uint8)])
        received = distributed.allgather_bytes(payload, sizes)
        # What crossed to this host: the other processes' payloads, each padded as the collective pads it.
        stats["link_bytes/engine_rows_between_hosts_this_host"] += (
            (len(sizes) - 1) * distributed.padded_bytes(max(sizes)))
        for p, data in enumerate(received):
          offset = 0
          for r in (r for r in shards if owner[r] == p and p != me):
            n = width * int(columns[r])
            bytes_r[r] = data[offset:offset + n].reshape(width, int(columns[r]))
            offset += n
      index = {place: i for i, place in enumerate(places)}
      for r in shards:
        if out_n[r] == 0:
          continue
        at = [index[(r, k)] for k in range(int(out_n[r]))]
        if r in bytes_r:
          unpacked = slots.unpack_finished(bytes_r[r], len(at), version, vocab, seq_len)
        else:   # ``local_rows``: another process holds these rows; this one keeps what the control numbers say
          meta = np.asarray([[out_len[i] & 1, len(requests[i].prompt), out_len[i] >> 1] for i in at], np.int32)
          unpacked = (meta,) + (None,) * 3
        for i, row in zip(at, _unpack_rows(*unpacked, [requests[i] for i in at], seq_len)):
          entries[i].row, entries[i].held = row, r in bytes_r
          entries[i].by_process = self.local_rows and len(set(owner)) > 1
          if r in bytes_r and _min_version(row["version_st"], row["prompt_len_s"],
                                           row["response_len_s"]) != entries[i].min_version:
            raise AssertionError(f"engine: sample {int(requests[i].sample_id)}'s versions disagree with the "
                                 f"host's view of its slot ({entries[i].min_version})")
          if self.local_rows:
            self.readers[int(requests[i].sample_id)] = owner[r]
      if self.on_finished is not None:
        self.on_finished(_stack([f.row for f in entries], self.cfg.spec.seq_len),
                         np.asarray([f.group_id for f in entries], np.int32),
                         np.asarray([r for r, _ in places], np.int32))
    self._unread = []

  def _shard_owners(self) -> list[int]:
    """The process that reads each batch shard's finished rows: the lowest-numbered process holding one of
    the shard's devices (a shard replicated over a tensor axis that spans processes is read once)."""
    if self._owners is None:
      sharding = self.programs.shard_bytes
      shards = batch_shards(sharding.mesh)
      owners = [None] * shards
      for device, index in sharding.devices_indices_map((shards, 1, 1)).items():
        r = index[0].start or 0
        owners[r] = min(device.process_index, owners[r] if owners[r] is not None else device.process_index)
      self._owners = owners
    return self._owners

  def _reprefill(self, params, stats) -> None:
    """Recomputes the KV of every in-flight prefix (prompt + response so far) under ``params``: calls of
    ``rows`` rows, shortest prefixes first, each at the narrowest width that holds its longest prefix."""
    need = {s: len(r.prompt) + int(self._response_len_s[s]) - 1
            for s, r in enumerate(self._occupant) if r is not None}
    order = sorted(need, key=need.get)
    for start in range(0, len(order), self.rows):
      chunk = order[start:start + self.rows]
      width = slots.prefill_width(self.programs.widths, need[chunk[-1]])
      self._prefill(params, [(s, self._occupant[s]) for s in chunk], False, width, stats)
      stats["reprefill_rows"] += len(chunk)

  def _compile_widths(self, params) -> None:
    """Runs every re-prefill width once on a scratch cache and slot state (every row dropped), so no run
    compiles one (``prefill_widths``: one compile each)."""
    stats = collections.Counter()
    state, cache = self._state, self._cache
    self._state, self._cache = self.programs.empty(), self.programs.init_cache()
    for width in self.programs.widths:
      self._prefill(params, [], False, width, stats)
    jax.block_until_ready((self._state, self._cache))
    self._state, self._cache, self._widths_ready = state, cache, True

  def _prefill(self, params, batch, is_new: bool, width: int, stats) -> None:
    """One fixed-shape prefill call; rows past ``len(batch)`` point at slot S and are dropped."""
    rows, spec = self.rows, self.cfg.spec
    slot_r = np.full((rows,), self.cfg.num_slots, np.int32)
    prompt_rp = np.zeros((rows, spec.max_prompt_len), np.int32)
    prompt_len_r, sample_id_r, forced_r = (np.ones((rows,), np.int32), np.zeros((rows,), np.int32),
                                           np.zeros((rows,), np.int32))
    for i, (slot, request) in enumerate(batch):
      slot_r[i], sample_id_r[i], forced_r[i] = slot, request.sample_id, request.forced_len or 0
      prompt_len_r[i] = len(request.prompt)
      prompt_rp[i, :len(request.prompt)] = request.prompt
    is_new_r = np.full((rows,), is_new)
    inputs = put((slot_r, is_new_r, prompt_rp, prompt_len_r, sample_id_r, forced_r),
                            self.programs.row_shardings)
    self._state, self._cache = self.programs.prefill[width](params, self._cache, self._state, *inputs)
    stats["prefill_calls"] += 1
    stats["prefill_tokens"] += rows * width
    if stats["prefill_calls"] % _PREFILLS_PER_BLOCK == 0:
      jax.block_until_ready(self._state)


# A chunk's wall seconds (``_chunk``: inputs, dispatch, the previous chunk's rows, the control fetch and
# the host's bookkeeping) against its decode steps and refills, kept as the sums a least-squares fit over
# the chunks needs (with ``decode_chunks``, ``decode_steps`` and ``refill_prefills``): per-chunk costs are
# then identifiable from runs whose phases all have the same counts (``sim/fit.py``). The sums that hold seconds
# end in ``_s``, so they count as timings (``processes.is_timing``: they differ between runs and processes).
CHUNK_MOMENTS = ("chunk_s", "chunk_steps_x_s", "chunk_refills_x_s", "chunk_steps_sq", "chunk_steps_x_refills",
                 "chunk_refills_sq")


def _add_chunk_moments(stats, seconds: float, steps: int, refills: int) -> None:
  for key, value in zip(CHUNK_MOMENTS, (seconds, seconds * steps, seconds * refills, steps * steps,
                                        steps * refills, refills * refills)):
    stats[key] += value


_ROW_FIELDS = ("tokens_st", "logp_st", "version_st", "prompt_len_s", "response_len_s", "finished_s",
               "sample_id_s")
_SLOT_FIELDS = _ROW_FIELDS + ("forced_len_s",)    # an in-flight row: every SlotState field but done_s


def _unpack_rows(meta_k3: np.ndarray, tokens_n, logp_n, version_n, requests, seq_len: int) -> list[dict]:
  """The per-sample row dicts (``_ROW_FIELDS``, dtypes and padding of the slot state: tokens 0, log-probs 0,
  versions -1 past the sample) of the rows' ``meta_k3`` (finished, prompt length, response length), their
  responses back to back (``slots.unpack_finished``) and their ``requests``."""
  rows, start = [], 0
  for (finished, prompt_len, response_len), request in zip(meta_k3, requests):
    p, n, prompt = int(prompt_len), int(response_len), request.prompt
    if p != len(prompt):
      raise RuntimeError(f"engine: sample {request.sample_id} finished with prompt_len {p}; its request's "
                         f"prompt has {len(prompt)} tokens")
    tokens_t, logp_t = np.zeros((seq_len,), np.int32), np.zeros((seq_len,), np.float32)
    version_t = np.full((seq_len,), -1, np.int32)
    tokens_t[:p] = prompt
    if tokens_n is not None:   # None: the response is held by another process (its tokens stay 0, versions -1)
      tokens_t[p:p + n], logp_t[p:p + n], version_t[p:p + n] = (
          tokens_n[start:start + n], logp_n[start:start + n], version_n[start:start + n])
    rows.append({"tokens_st": tokens_t, "logp_st": logp_t, "version_st": version_t, "prompt_len_s": np.int32(p),
                 "response_len_s": np.int32(n), "finished_s": np.bool_(finished),
                 "sample_id_s": np.int32(request.sample_id)})
    start += n
  return rows


def _empty_rows(name: str, seq_len: int) -> np.ndarray:
  """Zero rows of slot-state field ``name`` (its dtype; [0, T] for per-token fields, [0] otherwise)."""
  dtype = {"logp_st": np.float32, "finished_s": bool}.get(name, np.int32)
  return np.zeros((0, seq_len) if name.endswith("_st") else (0,), dtype)


def _min_version(version_t, start, length) -> int | None:
  """The oldest version among a row's ``length`` generated tokens from ``start`` (None if none)."""
  start, length = int(start), int(length)
  return int(np.min(version_t[start:start + length])) if length else None


def _fingerprint(cfg: EngineConfig) -> dict:
  """The config fields that change what is generated; a loaded state must match them exactly."""
  spec = cfg.spec
  return {"seed": int(cfg.seed), "group_size": cfg.group_size, "seq_len": spec.seq_len,
          "max_prompt_len": spec.max_prompt_len, "max_new_tokens": spec.max_new_tokens,
          "eos_id": spec.eos_id, "vocab_size": spec.model.vocab_size,
          **{f"sampling.{k}": v for k, v in dataclasses.asdict(spec.sampling).items()}}


def _item(value):
  """A saved scalar as a Python value (``np.load`` gives 0-d arrays); None stays None."""
  return None if value is None else np.asarray(value).item()


def _queue_arrays(queue, width: int) -> dict:
  """Queued requests as arrays; prompts padded to ``width``, ``forced_len`` 0 for None."""
  prompt_qp = np.zeros((len(queue), width), np.int32)
  for i, r in enumerate(queue):
    prompt_qp[i, :len(r.prompt)] = r.prompt
  column = lambda fn: np.asarray([fn(r) for r in queue], np.int32).reshape(-1)
  return {"queue.sample_id_s": column(lambda r: r.sample_id), "queue.group_id": column(lambda r: r.group_id),
          "queue.forced_len_s": column(lambda r: r.forced_len or 0),
          "queue.prompt_len_s": column(lambda r: len(r.prompt)), "queue.prompt_qp": prompt_qp}


def _requests(state: dict, prefix: str, tokens: str) -> list[Request]:
  """The Requests of saved rows (queued or in flight): a prompt is the first prompt_len of ``tokens``."""
  columns = [np.asarray(state[prefix + k]) for k in ("sample_id_s", "group_id", tokens, "prompt_len_s",
                                                      "forced_len_s")]
  return [Request(int(i), int(g), row[:n], int(forced) or None) for i, g, row, n, forced in zip(*columns)]


def _rows(state: dict, prefix: str) -> list[dict]:
  """Saved finished rows as the per-sample dicts ``_collect`` builds."""
  arrays = {name: np.asarray(state[prefix + name]) for name in _ROW_FIELDS}
  return [{name: np.array(a[i]) for name, a in arrays.items()} for i in range(len(arrays["sample_id_s"]))]


def _stack(rows: list[dict], seq_len: int) -> Rollout:
  """Host Rollout (numpy) from per-sample rows; zero rows gives arrays of leading size 0."""
  def field(name, shape, dtype):
    return np.stack([r[name] for r in rows]) if rows else np.zeros(shape, dtype)
  return Rollout(
      tokens_bt=field("tokens_st", (0, seq_len), np.int32),
      prompt_len_b=field("prompt_len_s", (0,), np.int32),
      response_len_b=field("response_len_s", (0,), np.int32),
      logp_bt=field("logp_st", (0, seq_len), np.float32),
      version_bt=field("version_st", (0, seq_len), np.int32),
      finished_b=field("finished_s", (0,), bool),
      sample_id_b=field("sample_id_s", (0,), np.int32))

