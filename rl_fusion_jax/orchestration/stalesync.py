"""StaleSync: bounded-staleness rollout phases over the DistQueue, in every deployment mode of one program.

One step of ``StaleSync.step``:
  1. top up: new problems enter the engine so that ``pool = ceil(num_prompts / f)`` groups are
     outstanding (queued, in flight, or finished and waiting in the queue);
  2. drop (and count) waiting groups that the learner may no longer train on, then a rollout phase under
     the current weights (version L) that ends once the queue can fill one update with ``num_prompts``
     finished groups AND every in-flight group whose oldest token has version <= L - s has finished
     (it would exceed the bound s after this update). Everything else stays in flight and continues in
     the next phase under the new weights (the engine's partial rollout);
  3. the finished groups enter the DistQueue, packed (no padding stored), and the reward stage writes
     their scores into it (``SCORE_FIELDS``: the verify stage scored most of them while they were
     generated); then the advantage stage (``advantage_stage.AdvantageStage``, a consumer of the scores)
     writes each scored group's advantages (``ADVANTAGE_FIELDS``, where ``advantage_stage.in_queue``
     holds). The trainer, the queue's last consumer, needs all of them, so a sample is ready for it once
     its group's advantages are written;
  4. admission (``queue.staleness.admit``): the oldest ``num_prompts`` groups within the bound, read from
     the queue and restored to fixed-width rows; the rest wait for the next update;
  5. the common train phase (reward shaping, reference, advantages, update, publish) on the rows and
     scores read from the queue.

Across processes each process's queue replica holds the responses that process generated, and the
other samples' prompts and lengths (``Engine.local_rows``): an update fetches from their holders only the
rows its devices train on (``_read_held``), and a checkpoint gathers every waiting response first
(``state_dict``).

Phase boundaries depend only on sample counts and versions, never on wall-clock, so a run is reproducible
for a fixed seed. With s = 0 (then f = 1) every started group must finish in its phase and the batch is
exactly the synchronous one (tested equal to ``phases.rl_step``). This module never drops a sample
silently: stale groups are counted (``stalesync/discarded_groups``), waiting ones reported as held back.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from rl_fusion_jax.orchestration import advantage_stage, phases, processes
from rl_fusion_jax.orchestration.programs import Programs
from rl_fusion_jax.orchestration.setup import Setup
from rl_fusion_jax.queue.staleness import WaitingGroup, admit_groups, at_risk_groups, stale_groups, waiting_groups
from rl_fusion_jax.queue.distqueue import Batch, DistQueue, FieldSpec, Packed, pack, unpack
from rl_fusion_jax.queue.global_batch import local_row_slices, queue_arrays, rows_by_process
from rl_fusion_jax.sharding import mesh as mesh_lib
from rl_fusion_jax.timeline import Timeline
from rl_fusion_jax.types import Rollout

TOKEN_FIELDS = (("tokens", np.int32), ("logp", np.float32), ("version", np.int32))
SAMPLE_FIELDS = (("prompt_len", np.int32), ("response_len", np.int32), ("finished", np.bool_),
                 ("sample_id", np.int32), ("group_id", np.int32), ("min_version", np.int32))
# Written by the reward stage once the verifier scored a sample (here after each rollout phase; in the
# separated deployment by the rollout side before it ships the batch).
SCORE_FIELDS = (("reward", np.float32), ("format_ok", np.bool_), ("correct", np.bool_))
# Written in ``hybrid`` from the aux stage, which scored the samples on the aux devices while they were
# generated: the reference's log-probs (a token field) and the reward model's score, fetched into the
# queue after the rollout phase.
REFERENCE_FIELDS = (("ref_logp", np.float32),)
REWARD_MODEL_FIELDS = (("rm_score", np.float32),)
CONSUMER = "train"
PADS = {"tokens": 0, "logp": 0.0, "version": -1, "ref_logp": 0.0}   # what a fixed-width row holds past its length


def make_queue(setup: Setup, extra_sample_fields=(), capacity: int | None = None,
               extra_token_fields=()) -> DistQueue:
  """The run's queue: one row per sample, room for every outstanding group (or ``capacity`` samples);
  ``extra_sample_fields`` / ``extra_token_fields``: (name, dtype) pairs beside SAMPLE_FIELDS /
  TOKEN_FIELDS, also needed by the trainer. With an ``advantage`` field the advantage stage is registered
  as a consumer too."""
  r, s = setup.cfg.rollout, setup.cfg.stalesync
  fields = ([FieldSpec(n, d, True) for n, d in TOKEN_FIELDS + tuple(extra_token_fields)]
            + [FieldSpec(n, d, False) for n, d in SAMPLE_FIELDS + tuple(extra_sample_fields)])
  queue = DistQueue(fields, capacity=capacity or s.pool_groups(r.num_prompts) * r.group_size)
  if "advantage" in queue.fields:
    queue.register_consumer(advantage_stage.CONSUMER, needs=advantage_stage.NEEDS + (
        ("rm_score",) if "rm_score" in queue.fields else ()))
  queue.register_consumer(CONSUMER, needs=tuple(f.name for f in fields))
  return queue


def queue_fields(cfg, programs: Programs) -> tuple[tuple, tuple]:
  """The fields the stages write beside SAMPLE_FIELDS and TOKEN_FIELDS -> (sample fields, token fields):
  the scores; in ``hybrid`` the aux stage's reference log-probs and reward-model scores; the advantages
  where ``advantage_stage.in_queue`` holds."""
  stage = programs.aux_stage
  reference = stage is not None and stage.reference
  rm_in_queue = stage is not None and stage.reward
  adv = advantage_stage.in_queue(cfg, programs.reward_model is not None, rm_in_queue)
  sample = (SCORE_FIELDS + (REWARD_MODEL_FIELDS if rm_in_queue else ())
            + (advantage_stage.ADVANTAGE_FIELDS if adv else ()))
  return sample, REFERENCE_FIELDS if reference else ()


def host_rollout(batches: list[Batch], width: int) -> Rollout:
  """Queue reads (in row order) -> one fixed-width host Rollout, token fields padded with ``PADS``."""
  sample = lambda name: np.concatenate([b.sample[name] for b in batches])
  tokens = lambda name: np.concatenate([unpack(b.tokens[name], width, PADS[name]) for b in batches])
  return Rollout(tokens_bt=tokens("tokens"), prompt_len_b=sample("prompt_len"),
                 response_len_b=sample("response_len"), logp_bt=tokens("logp"), version_bt=tokens("version"),
                 finished_b=sample("finished"), sample_id_b=sample("sample_id"))


class StaleSync:
  """The bounded-staleness schedule: owns the data position, the queue and the staleness counters."""

  def __init__(self, setup: Setup, programs: Programs, data_position: int = 0, queue: DistQueue | None = None,
               counters: dict | None = None):
    self.setup, self.programs = setup, programs
    self.cfg, self.r, self.s = setup.cfg.stalesync, setup.cfg.rollout, setup.cfg.stalesync.max_staleness
    self.data_position = data_position
    if queue is None:
      sample_fields, token_fields = queue_fields(setup.cfg, programs)
      queue = make_queue(setup, sample_fields, extra_token_fields=token_fields)
    self.queue = queue
    # The aux stage's results as queue fields (hybrid): fetched from it after each rollout phase.
    self.aux_fields = [n for n in ("ref_logp", "rm_score") if n in self.queue.fields]
    if self.aux_fields and programs.aux_stage is None:
      raise ValueError(f"StaleSync: the queue holds the aux stage's {self.aux_fields}, and this run has no "
                       "aux stage (fusion.mode is not hybrid?)")
    # A queue saved before the scores (the advantages) were fields of it: its samples are scored (their
    # advantages computed) at train time, as then.
    self.scores_in_queue = "reward" in self.queue.fields
    self.advantages = (advantage_stage.AdvantageStage(setup.cfg, self.queue) if "advantage" in self.queue.fields
                       else None)
    self.counters = {"discarded_groups": 0, "trained_groups": 0, "generated_groups": 0, **(counters or {})}

  # -- host bookkeeping ------------------------------------------------------------------------------

  def _waiting(self) -> dict[int, WaitingGroup]:
    """The finished groups waiting in the queue (``queue.waiting_groups``)."""
    ready = self.queue.ready(CONSUMER)
    batch = self.queue.peek(ready, ("group_id", "min_version", "response_len"))
    return waiting_groups(ready, batch["group_id"], batch["min_version"], batch["response_len"])

  def _top_up(self) -> int:
    engine, r = self.programs.engine, self.r
    outstanding = len(engine.group_min_versions()) + len(self._waiting())
    new = max(0, self.cfg.pool_groups(r.num_prompts) - outstanding)
    if new:
      first = self.data_position
      problems = [self.setup.train_task.problem(first + i) for i in range(new)]
      engine.add(phases.requests(self.setup.tokenizer, problems, r.max_prompt_len, r.group_size,
                                 first * r.group_size, first, forced_len=phases.forced_lengths(self.setup.cfg)))
      self.data_position += new
    return new

  def _discard_stale(self, learner: int) -> int:
    waiting = self._waiting()
    stale = stale_groups({g: w.min_token_version for g, w in waiting.items()}, learner, self.s)
    for g in stale:
      self.queue.drop(list(waiting[g].indices), reason="stale")
      self.programs.verify.forget(list(waiting[g].indices))        # queue indices are sample ids
      if self.programs.aux_stage is not None:
        self.programs.aux_stage.forget(list(waiting[g].indices))
    self.counters["discarded_groups"] += len(stale)
    return len(stale)

  def _put(self, rollout: Rollout, min_version_b) -> None:
    """Finished samples -> the queue, token fields cut to prompt + response (packed, no padding).
    ``min_version_b``: each sample's oldest response-token version (the engine's control numbers: also
    known for a row whose response another process holds, ``Engine.local_rows``)."""
    lengths = rollout.prompt_len_b + rollout.response_len_b
    cut = lambda x_bt: [row[:n] for row, n in zip(x_bt, lengths)]
    min_version = np.asarray(min_version_b, np.int32)
    self.queue.put(rollout.sample_id_b.astype(np.int64), tokens=cut(rollout.tokens_bt),
                   logp=cut(rollout.logp_bt),
                   version=cut(rollout.version_bt), prompt_len=rollout.prompt_len_b,
                   response_len=rollout.response_len_b, finished=rollout.finished_b,
                   sample_id=rollout.sample_id_b, group_id=rollout.sample_id_b // self.r.group_size,
                   min_version=min_version, block=False)

  def _score(self, rollout: Rollout, step: int, timeline: Timeline) -> dict[str, float]:
    """The reward stage: the verifier's scores of finished groups (``rollout``: complete groups) written
    into the queue (``SCORE_FIELDS``); most were computed while the samples were generated."""
    rollout = phases.by_sample_id(rollout)
    g = self.r.group_size
    groups = rollout.sample_id_b[::g] // g
    if len(rollout.sample_id_b) % g or np.any(rollout.sample_id_b // g != np.repeat(groups, g)):
      raise RuntimeError("StaleSync: the rollout phase returned a group in part")
    with timeline.phase("reward", group=self.programs.deployment.train_group, step=step):
      rewards, fmt, correct, m = self.programs.verify.scores(
          rollout, [self.setup.train_task.problem(int(k)) for k in groups])
      ids = rollout.sample_id_b.astype(np.int64)
      for name, values in zip(("reward", "format_ok", "correct"), (rewards, fmt, correct)):
        self.queue.write(name, ids, values, block=False)
    if self.advantages is not None:
      with timeline.phase("advantage", group=self.programs.deployment.train_group, step=step):
        groups, _ = self.advantages.run()
      m = m | {"stalesync/advantage_groups": float(groups)}
    return m

  def _aux(self, rollout: Rollout, step: int, timeline: Timeline) -> dict[str, float]:
    """The aux stage's results (hybrid): the reference's log-probs and the reward model's scores of the
    finished samples, computed on the aux devices while they were generated, fetched into the queue
    (``ref_logp``, ``rm_score``)."""
    with timeline.phase("aux_fetch", group=self.programs.deployment.aux_group, step=step):
      rows, scores, m = self.programs.aux_stage.fetch(rollout)
      ids = rollout.sample_id_b.astype(np.int64)
      if "ref_logp" in self.aux_fields:
        self.queue.write("ref_logp", ids, rows, block=False)
      if "rm_score" in self.aux_fields:
        self.queue.write("rm_score", ids, scores, block=False)
    return {f"queue/link_bytes/{k.split('/', 1)[1]}": v for k, v in m.items()}

  def _read(self, indices) -> tuple[Rollout, Rollout, dict, object, dict]:
    """The admitted samples, sorted by sample id: (host Rollout, device Rollout on the training mesh, their
    sample fields the stages wrote (``SCORE_FIELDS``, ``rm_score``, ``advantage``: those the queue has) read
    from the queue in the same order, empty for a queue without them).

    The device batch is built by ``queue_arrays``: one queue read per data-parallel group of this
    process's devices, each group's rows padded from their packed form on their own (no padded copy of
    the whole batch is built to be split). The host Rollout, for verification and statistics, is unpacked
    from the same reads; of several processes (each holds a replica of the queue: the same samples), the rows
    the other processes fed come from one uncounted read of this replica (``counted=False``), so the
    queue's byte counters hold what this process fed. Both are as wide as the update runs
    (``phases.batch_width``: ``seq_len``, or with ``optim.width_buckets`` the admitted samples' bucket).
    With the packed update taking its rows from the host (``programs.packed_inputs``) there is no device
    Rollout (None): the admitted samples are read once, as the host Rollout. Last: the reference's
    log-probs from the queue (``ref_logp``; None without that field), as the device batch holds them, or
    as host rows [B, width] for the packed update. Then metrics of the read (``_read_held``'s).

    Where each process holds only the responses it generated (``Engine.local_rows``), the device batch is
    ``_read_held``'s, and the packed update's host Rollout holds the others' rows blank
    (``phases.train_phase`` fills in those its groups train on)."""
    order = np.sort(np.asarray(indices, np.int64))
    lengths = self.queue.peek(order, ("prompt_len", "response_len"))
    width = phases.batch_width(self.setup.cfg, lengths["prompt_len"] + lengths["response_len"])
    names = [n for n, _ in SCORE_FIELDS + REWARD_MODEL_FIELDS + advantage_stage.ADVANTAGE_FIELDS
             if n in self.queue.fields]
    scores = lambda reads: {n: np.concatenate([b.sample[n] for b in reads]) for n in names}
    if self.programs.packed_inputs:
      # The packed update places its rows from the host samples itself (``phases.train_phase``): one read,
      # no padded device batch. Every process reads every admitted sample (each builds the groups' streams
      # and puts its own groups' parts: ``host_to_device_this_host``); the read is counted once for the
      # run, on process 0, so the counters summed over the processes hold what the run fed.
      batch = self.queue.read(CONSUMER, order, counted=processes.process_index() == 0)
      ref = unpack(batch.tokens["ref_logp"], width, PADS["ref_logp"]) if "ref_logp" in self.aux_fields else None
      return host_rollout([batch], width), None, scores([batch]), ref, {}
    if self.programs.engine.local_rows:
      host, device, reads, ref, metrics = self._read_held(order, width)
      return host, device, scores(reads), ref, metrics
    reads: list[Batch] = []

    def read(part):
      reads.append(self.queue.read(CONSUMER, part))
      return reads[-1]

    arrays = queue_arrays(self.programs.mesh, read, order, width, pads=PADS)
    device = Rollout(tokens_bt=arrays["tokens"], prompt_len_b=arrays["prompt_len"],
                     response_len_b=arrays["response_len"], logp_bt=arrays["logp"],
                     version_bt=arrays["version"], finished_b=arrays["finished"],
                     sample_id_b=arrays["sample_id"])
    fed = np.concatenate([b.indices for b in reads])
    others = np.setdiff1d(order, fed)
    if len(others):   # fed by other processes: this replica's copy, for the host's bookkeeping only
      reads += [self.queue.read(CONSUMER, part, counted=False) for part in _runs(others, order)]
    reads.sort(key=lambda b: int(b.indices[0]))
    host = host_rollout(reads, width)
    return host, device, scores(reads), arrays.get("ref_logp"), {}

  def _read_held(self, order: np.ndarray, width: int) -> tuple:
    """``_read``'s padded device batch where each process's replica holds the responses of the samples it
    generated only (``Engine.local_rows``; the others' rows there are blank, lengths in place): the rows
    of this process's data-parallel groups are read from the replica as ``queue_arrays`` reads them, and the
    responses of those that another process holds come from it (``processes.fill_rows``: those rows only,
    point to point). -> (host Rollout: the rows this process holds or trains on filled in, device Rollout,
    the queue reads in row order, the device batch's ``ref_logp`` (None: the queue has no such field),
    metrics: ``queue/link_bytes/rows_between_hosts_this_host``)."""
    mesh, share = self.programs.mesh, self.programs.verify.share
    sharding = mesh_lib.batch_sharding(mesh, 1)
    mine = {(a, b): self.queue.read(CONSUMER, order[a:b]) for a, b in local_row_slices(sharding, len(order))}
    fed = np.concatenate([order[a:b] for a, b in mine] or [np.zeros((0,), np.int64)])
    reads = list(mine.values()) + [self.queue.read(CONSUMER, part, counted=False)
                                   for part in _runs(np.setdiff1d(order, fed), order) if len(part)]
    reads.sort(key=lambda b: int(b.indices[0]))
    need = rows_by_process(sharding, len(order), share.count)
    host, crossed = processes.fill_rows(share, host_rollout(reads, width), need,
                                        vocab_size=self.setup.cfg.model.config.vocab_size)
    lengths = host.prompt_len_b + host.response_len_b

    def read(part):   # this group's rows, with the responses filled in
      a = int(np.searchsorted(order, part[0]))
      rows = range(a, a + len(part))
      filled = {name: pack([x[i, :lengths[i]] for i in rows], x.dtype) for name, x in
                (("tokens", host.tokens_bt), ("logp", host.logp_bt), ("version", host.version_bt))}
      return dataclasses.replace(mine[a, a + len(part)], tokens=mine[a, a + len(part)].tokens | filled)

    arrays = queue_arrays(mesh, read, order, width, pads=PADS)
    device = Rollout(tokens_bt=arrays["tokens"], prompt_len_b=arrays["prompt_len"],
                     response_len_b=arrays["response_len"], logp_bt=arrays["logp"],
                     version_bt=arrays["version"], finished_b=arrays["finished"],
                     sample_id_b=arrays["sample_id"])
    return host, device, reads, arrays.get("ref_logp"), {
        "queue/link_bytes/rows_between_hosts_this_host": float(crossed),
        "queue/link_bytes/rows_between_hosts_padded_this_host": float(processes.fill_rows_padded(share, host,
                                                                                                need))}

  # -- one step ----------------------------------------------------------------------------------------

  def _generate(self, state, step: int, timeline: Timeline):
    """The rollout phase (skipped when the queue already fills the update and nothing is at risk)."""
    engine, learner = self.programs.engine, step
    needed = self.r.num_prompts - len(self._waiting())
    at_risk = at_risk_groups(engine.group_min_versions(), learner, self.s)
    if self.s == 0:
      run = lambda params: engine.run(params, learner)        # every started group finishes: synchronous
    elif needed > 0 or at_risk:
      run = lambda params: engine.run(params, learner, target_groups=max(needed, 1), finish_groups=at_risk)
    else:
      return state, {"generate_s": 0.0, "stalesync/rollout_skipped": 1.0}
    state, result, metrics = phases.generation_phase(self.programs, state, step, timeline, run)
    if len(result.rollout.sample_id_b):
      self._put(result.rollout, result.min_version_b)
      if self.aux_fields:
        metrics |= self._aux(result.rollout, step, timeline)
      if self.scores_in_queue:
        metrics |= self._score(result.rollout, step, timeline)
    finished = result.rollout.response_len_b
    self.counters["generated_groups"] += len(finished) // self.r.group_size
    return state, metrics | {"stalesync/rollout_skipped": 0.0, "stalesync/forced_groups": float(len(at_risk)),
                             "stalesync/finished_groups": float(len(finished) // self.r.group_size),
                             "stalesync/finished_len_mean": float(finished.mean()) if len(finished) else 0.0}

  def _admit(self, learner: int) -> tuple[list[int], list[int], dict]:
    waiting = self._waiting()
    # Finished groups only: in-flight ones are the engine's business (forced_groups, engine_groups).
    adm = admit_groups(waiting, learner, self.s, limit=self.r.num_prompts)
    if len(adm.admitted) != self.r.num_prompts:
      raise RuntimeError(f"StaleSync: {len(adm.admitted)} admissible groups for an update of "
                         f"{self.r.num_prompts} (data exhausted?)")
    groups = sorted(adm.admitted)
    indices = [i for g in groups for i in waiting[g].indices]
    metrics = {f"stalesync/{k}": v for k, v in adm.metrics().items() if k not in ("at_risk", "stale")}
    return groups, indices, metrics

  def step(self, state, ref_resting, step: int, timeline: Timeline):
    """One StaleSync step at learner version ``step``; returns (state, metrics)."""
    t_start = time.perf_counter()
    # Who holds each response (Engine.local_rows): kept for the samples held in the engine or the queue.
    self.programs.engine.forget_readers(keep=self.queue.live())
    phases.begin_aux_stage(self.programs, ref_resting, timeline, step)
    added = self._top_up()
    discarded = self._discard_stale(step)
    state, metrics = self._generate(state, step, timeline)
    groups, indices, adm_metrics = self._admit(step)
    depth_before = self.queue.stats().get("depth", 0.0)
    rollout, device_rollout, read_scores, ref_logp, read_metrics = self._read(indices)
    problems = [self.setup.train_task.problem(g) for g in groups]
    scored = None
    if read_scores:
      rewards, shaped = phases.shape_rewards(self.setup.cfg, rollout, read_scores["reward"])
      scored = (rewards, read_scores["format_ok"], read_scores["correct"], shaped)
    state, m = phases.train_phase(self.setup, self.programs, state, ref_resting, step, timeline, problems,
                                  rollout, device_rollout, scored=scored, advantages=read_scores.get("advantage"),
                                  ref_logp=ref_logp, rm_scores=read_scores.get("rm_score"))
    self.counters["trained_groups"] += len(groups)
    metrics |= m | read_metrics | adm_metrics | {
        "stalesync/added_groups": float(added), "stalesync/discarded_now": float(discarded),
        "stalesync/waiting_samples_after": float(depth_before - len(indices)),
        "stalesync/engine_groups": float(len(self.programs.engine.group_min_versions())),
        "stalesync/trained_token_staleness_mean": self._staleness_mean(rollout, step),
        "data_position": float(self.data_position), "step_s": time.perf_counter() - t_start}
    metrics |= {f"stalesync/{k}_total": float(v) for k, v in self.counters.items()}
    metrics |= {f"queue/{k}": float(v) for k, v in self.queue.stats(width=self.r.seq_len).items()
                if not k.startswith("wait_s")}
    return state, metrics

  def _staleness_mean(self, rollout: Rollout, learner: int) -> float:
    """Mean of ``learner`` - version over the trained response tokens (each process sums the samples it
    owns, ``processes.Share``: with ``Engine.local_rows`` it holds the responses of those only)."""
    share = self.programs.verify.share
    owned = np.flatnonzero(share.owns(rollout.sample_id_b))
    versions = [rollout.version_bt[b, p:p + n] for b, p, n in
                zip(owned, rollout.prompt_len_b[owned], rollout.response_len_b[owned])]
    total, count = processes.sum_over("staleness", [sum(float((learner - v).sum()) for v in versions),
                                                    sum(len(v) for v in versions)], share)
    return total / count if count else 0.0

  # -- checkpointing ----------------------------------------------------------------------------------

  def state_dict(self) -> dict:
    """The schedule's host state (every process calls it at a save; the queue's transfer counters are
    the run's, summed over the processes). Where each process holds only the responses it generated
    (``Engine.local_rows``), every process first receives every waiting sample's response from its holder
    (the queue's and the engine's finished ones), so each saves the same complete state, which any process
    count restores."""
    engine, share = self.programs.engine, self.programs.verify.share
    queue = self.queue.state_dict()
    if engine.local_rows:
      everyone = lambda rollout: processes.fill_rows(share, rollout, np.ones((share.count, len(
          rollout.sample_id_b)), bool), vocab_size=self.setup.cfg.model.config.vocab_size)[0]
      engine.hold_finished(everyone)
      _fill_queue_state(queue, everyone, self.r.seq_len)
    queue["counters"] = processes.run_queue_counters(queue["counters"])
    return {"data_position": self.data_position, "counters": dict(self.counters),
            "queue": queue, "engine": engine.state_dict()}


def _fill_queue_state(queue: dict, fill, seq_len: int) -> None:
  """A queue's ``state_dict`` with every live sample's token fields (``TOKEN_FIELDS``) replaced, in place,
  by ``fill``'s: a fixed-width host Rollout of them (blank where another process holds the response) ->
  the same complete."""
  columns = queue["columns"]
  ids = columns["sample_id"]["indices"]
  for name in ("tokens", "logp", "version", "prompt_len", "response_len", "finished"):
    if not np.array_equal(columns[name]["indices"], ids):
      raise RuntimeError(f"StaleSync: the queue's {name!r} column holds other samples than its sample_id column")
  token = lambda name, pad: unpack(Packed(columns[name]["flat"], columns[name]["lengths"]), seq_len, pad)
  rollout = Rollout(tokens_bt=token("tokens", 0), prompt_len_b=columns["prompt_len"]["values"],
                    response_len_b=columns["response_len"]["values"], logp_bt=token("logp", 0.0),
                    version_bt=token("version", -1), finished_b=columns["finished"]["values"],
                    sample_id_b=columns["sample_id"]["values"])
  filled = fill(rollout)
  lengths = columns["tokens"]["lengths"]
  for name, x in (("tokens", filled.tokens_bt), ("logp", filled.logp_bt), ("version", filled.version_bt)):
    columns[name]["flat"] = pack([row[:n] for row, n in zip(x, lengths)], x.dtype).flat


def _runs(subset: np.ndarray, order: np.ndarray) -> list[np.ndarray]:
  """``subset`` (sorted, within ``order``) split into runs of consecutive positions of ``order``."""
  position = np.searchsorted(order, subset)
  breaks = np.flatnonzero(np.diff(position) != 1) + 1
  return np.split(subset, breaks)


def from_state(setup: Setup, programs: Programs, host: dict | None) -> StaleSync:
  """A fresh schedule, or the one saved in a checkpoint's host state (queue, in-flight samples, counters)."""
  if host is None:
    return StaleSync(setup, programs)
  programs.engine.load_state_dict(host["engine"])
  queue = DistQueue.from_state_dict(host["queue"] | {"counters": processes.local_queue_counters(
      host["queue"]["counters"])})
  return StaleSync(setup, programs, int(host["data_position"]), queue,
                   {k: int(v) for k, v in host["counters"].items()})

