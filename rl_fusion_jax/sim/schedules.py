"""The schedules, as discrete-event simulations over one or two device lanes.

* ``colocated`` (RL Fusion; ``orchestration/loop.py``): one lane runs every phase of a step in turn.
  With ``max_staleness`` s = 0 every step generates its batch whole (the synchronous loop); with s > 0
  the StaleSync schedule of ``orchestration/stalesync.py`` step for step: top up to
  ``ceil(num_prompts / f)`` outstanding groups, drop waiting groups beyond the bound, a rollout phase
  that ends once ``num_prompts`` groups are finished and every in-flight group at risk of exceeding s
  has finished (skipped when the queue already fills the update and nothing is at risk), admission of
  the oldest ``num_prompts`` finished groups within the bound.
* ``separated`` (``orchestration/separated.py``, one process per side, reproducible weights): the
  rollout lane generates batch k whole under weights version max(0, k - s) and waits until that version
  has arrived; the training lane trains batch k at version k once it has been shipped, then pushes the
  new weights (a background transfer of ``push_s``). s = 0 is the synchronous separated baseline. When
  the two sides share one machine's cores (``Costs.sharing``), every phase runs at the processor-sharing
  rate while the others run.

``simulate`` returns per-step records and the same window figures ``experiments/ablation_main.py``
measures: trained tokens/s between the end of the last unmeasured update and the end of the last
measured one, and each lane's idle share of that window.
"""
from __future__ import annotations

import dataclasses
import math

from rl_fusion_jax.queue.staleness import WaitingGroup, admit_groups, at_risk_groups, stale_groups
from rl_fusion_jax.sim.costs import Costs
from rl_fusion_jax.sim.engine import PhaseCounts, SimEngine
from rl_fusion_jax.sim.workload import Workload

MODES = ("colocated", "separated")


@dataclasses.dataclass(frozen=True)
class Schedule:
  mode: str = "colocated"
  max_staleness: int = 0
  train_fraction: float = 1.0     # stalesync.train_fraction
  num_slots: int = 0          # 0: one per sample of a batch
  chunk_steps: int = 16
  prefill_rows: int = 0
  batch_shards: int = 1       # generation replicas' batch shards (prefill rows round up to them)
  keep_cache: bool = False    # rollout.keep_cache: carried samples are not re-prefilled

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"Schedule.mode: {self.mode!r} not in {MODES}")
    if self.max_staleness < 0 or not 0 < self.train_fraction <= 1:
      raise ValueError(f"Schedule: max_staleness >= 0 and 0 < train_fraction <= 1, got "
                       f"{self.max_staleness}, {self.train_fraction}")
    if self.max_staleness == 0 and self.train_fraction != 1:
      raise ValueError("Schedule.train_fraction: must be 1 when max_staleness = 0 (synchronous)")
    if self.mode == "separated" and self.train_fraction != 1:
      raise ValueError("Schedule.train_fraction: the separated schedule generates whole batches (1)")


@dataclasses.dataclass
class StepRecord:
  step: int                   # 1-based, as metrics.jsonl
  generate_s: float
  train_s: float
  step_s: float               # the lane's time for the step (colocated); trainer's (separated)
  train_tokens: int
  train_end: float            # simulated clock at the end of the update
  counts: PhaseCounts
  staleness_mean: float = 0.0
  forced_groups: int = 0


@dataclasses.dataclass
class SimResult:
  steps: list[StepRecord]
  busy: dict[str, list[tuple[float, float]]]   # lane -> busy intervals

  def window(self, warm: int) -> tuple[float, float]:
    return self.steps[warm - 1].train_end if warm else 0.0, self.steps[-1].train_end

  def tokens_per_s(self, warm: int) -> float:
    lo, hi = self.window(warm)
    return sum(r.train_tokens for r in self.steps[warm:]) / (hi - lo)

  def idle_frac(self, warm: int) -> dict[str, float]:
    lo, hi = self.window(warm)
    out = {}
    for lane, spans in self.busy.items():
      merged = []                        # a lane's intervals may overlap (the trainer's push thread)
      for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
          merged[-1][1] = max(merged[-1][1], b)
        else:
          merged.append([a, b])
      busy = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in merged)
      out[lane] = max(0.0, 1.0 - busy / (hi - lo))
    return out


def _engine(w: Workload, sch: Schedule) -> SimEngine:
  return SimEngine(sch.num_slots or w.batch_size, w.group_size, sch.chunk_steps, sch.prefill_rows,
                   sch.batch_shards, keep_cache=sch.keep_cache)


def _tokens(samples) -> int:
  return sum(s.prompt_len + s.length for s in samples)


def _staleness(samples, learner: int) -> float:
  """Mean over trained tokens of learner - token version (tokens of a sample carry the versions of the
  phases that generated them; the simulator tracks only the oldest, so this is an upper bound)."""
  n = sum(s.length for s in samples)
  return sum((learner - s.min_version) * s.length for s in samples) / max(1, n)


def _colocated(w: Workload, sch: Schedule, costs: Costs, steps: int) -> SimResult:
  engine, s = _engine(w, sch), sch.max_staleness
  pool = math.ceil(w.num_prompts / sch.train_fraction - 1e-9)
  waiting: dict[int, list] = {}          # finished groups in the queue: group -> samples
  position, clock, records, busy = 0, 0.0, [], []
  for learner in range(steps):
    outstanding = len(engine.group_min_versions()) + len(waiting)
    new = max(0, pool - outstanding) if s else w.num_prompts
    engine.add(w.requests(position, new))
    position += new
    gver = lambda g: min(x.min_version for x in waiting[g])
    for g in stale_groups({g: gver(g) for g in waiting}, learner, s):
      del waiting[g]                     # beyond the bound: discarded (counted by the real loop)
    needed = w.num_prompts - len(waiting)
    at_risk = at_risk_groups(engine.group_min_versions(), learner, s)
    counts, generate_s = PhaseCounts(), 0.0
    if s == 0:
      taken, counts = engine.run(learner)
    elif needed > 0 or at_risk:
      taken, counts = engine.run(learner, target_groups=max(needed, 1), finish_groups=at_risk)
    else:
      taken = []
    if s == 0 or needed > 0 or at_risk:
      generate_s = costs.gen.seconds(counts)
    for x in taken:
      waiting.setdefault(x.group_id, []).append(x)
    groups = {g: WaitingGroup(g, gver(g), tuple(x.sample_id for x in xs), 0.0) for g, xs in waiting.items()}
    admitted = admit_groups(groups, learner, s, limit=w.num_prompts).admitted
    batch = [x for g in admitted for x in waiting.pop(g)]
    tokens = _tokens(batch)
    train_s = costs.train.seconds(tokens)
    start = clock
    busy.append((start, start + generate_s + train_s + costs.other_s))
    clock += generate_s + train_s + costs.other_s + costs.gap_s
    records.append(StepRecord(learner + 1, generate_s, train_s, clock - start, tokens, clock, counts,
                              _staleness(batch, learner), len(at_risk)))
  return SimResult(records, {"all": busy})


def _separated_pass(w, sch, costs, steps, base, stretch):
  """One timing pass of the separated schedule with each phase's duration stretched by ``stretch``."""
  s = sch.max_staleness
  weights_at = {0: 0.0}                  # version -> when the rollout side has it
  rollout_free = train_free = push_free = 0.0
  ready, spans, records = {}, {"gen": {}, "train": {}, "push": {}}, []

  def train(L):
    nonlocal train_free, push_free
    start = max(train_free, ready[L])
    end = start + (base["train"][L] + costs.other_s) * stretch["train"][L]
    push_start = max(push_free, end)
    push_free = push_start + costs.push_s * stretch["push"][L]
    weights_at[L + 1] = push_free
    spans["train"][L], spans["push"][L] = (start, end), (push_start, push_free)
    records.append(StepRecord(L + 1, base["gen"][L] * stretch["gen"][L], base["train"][L] * stretch["train"][L],
                              end - start, base["tokens"][L], end, base["counts"][L], float(min(L, s)), 0))
    train_free = end

  for k in range(steps):
    # Batch k needs version max(0, k - s): the updates before it are simulated first.
    need = max(0, k - s)
    while need not in weights_at:
      train(len(records))
    start = max(rollout_free, weights_at[need])
    rollout_free = start + base["gen"][k] * stretch["gen"][k] + costs.rollout_other_s
    spans["gen"][k] = (start, rollout_free)
    ready[k] = rollout_free
  while len(records) < steps:
    train(len(records))
  return records, spans


def _separated(w: Workload, sch: Schedule, costs: Costs, steps: int) -> SimResult:
  """Batch k is generated whole (a fresh engine, so its counts depend on the batch alone). When the two
  sides share one machine's cores (``costs.sharing``), each phase (generation, update, weight push) takes
  as long as its work alone needs at the processor-sharing rate while the others run
  (``costs.Sharing.finish``); the schedule is iterated to a fixed point of those stretch factors."""
  base = {"gen": [], "train": [], "tokens": [], "counts": []}
  for k in range(steps):
    engine = _engine(w, sch)
    engine.add(w.requests(k * w.num_prompts, w.num_prompts))
    taken, counts = engine.run(max(0, k - sch.max_staleness))
    base["gen"].append(costs.gen.seconds(counts))
    base["tokens"].append(_tokens(taken))
    base["train"].append(costs.train.seconds(base["tokens"][-1]))
    base["counts"].append(counts)
  stretch = {k: [1.0] * steps for k in ("gen", "train", "push")}
  share = costs.sharing
  alone = {"gen": lambda k: base["gen"][k], "train": lambda k: base["train"][k] + costs.other_s,
           "push": lambda k: costs.push_s}
  for _ in range(1 if share is None or share.cores <= 0 else 12):
    records, spans = _separated_pass(w, sch, costs, steps, base, stretch)
    threads = {"gen": share.gen_threads, "train": share.train_threads, "push": share.push_threads} if share else {}
    for k in range(steps):   # damped update of the stretch factors
      for name in ("gen", "train", "push") if threads else ():
        others = [(a, b, threads[o]) for o in threads if o != name for a, b in spans[o].values()]
        start, work = spans[name][k][0], alone[name](k)
        target = (share.finish(start, work, threads[name], others) - start) / work if work > 0 else 1.0
        stretch[name][k] = 0.5 * (stretch[name][k] + target)
  busy = {"rollout": sorted(spans["gen"].values()),
          "train": sorted(list(spans["train"].values()) + list(spans["push"].values()))}
  return SimResult(records, busy)


def simulate(w: Workload, sch: Schedule, costs: Costs, steps: int) -> SimResult:
  if steps < 1:
    raise ValueError(f"simulate: steps must be >= 1, got {steps}")
  return (_colocated if sch.mode == "colocated" else _separated)(w, sch, costs, steps)
