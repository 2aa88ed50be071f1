"""Fitting the simulator's cost parameters to measured runs, and checking it against them.

``fit_costs(runs)`` takes runs of one deployment (colocated, or separated with one process per side) on
one workload and fits, over all their measured steps:
  * generation: ``generate_s`` against the engine's counts of the same step (``engine/decode_steps``,
    ``engine/decode_chunks``, ``engine/prefill_calls``, and a constant per phase), non-negative least
    squares; a count that does not vary across the steps is folded into the constant;
  * the update: ``train_s`` against ``train_tokens`` (fixed + per token; the mean rate alone when the
    token counts hardly vary);
  * colocated: the mean of (time between update ends - generate_s - train_s) per step, split into
    ``gap_s`` (the time outside every timeline phase, from runs without compile steps) and ``other_s``;
  * separated: the rollout lane's other phases per batch (weights, switch, score, ship), the training
    lane's (receive, reward, publish) and the weights' push (timeline phase means); generation and the
    update fitted on the steps that ran while the other side was idle, and their slowdown while it was
    busy (two processes sharing this machine's cores) on the others (``_fit_separated``).
``workload_from_run`` rebuilds the workload (forced lengths exactly; otherwise a log-normal fitted to
the measured mean and batch maximum of the response lengths) and ``schedule_from_run`` the schedule.
``validate`` simulates a run's configuration with fitted costs and compares step time (the mean time
between update ends in the window) and trained tokens/s with what the run measured; the measured tokens/s is the
"steady" one (``measure.summarize``: the window without the excess of steps a compile fell into, which
the simulator does not model). Nothing here imports JAX.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

import numpy as np

from rl_fusion_jax.sim import measure
from rl_fusion_jax.sim.costs import Costs, GenCost, TrainCost
from rl_fusion_jax.sim.engine import PhaseCounts
from rl_fusion_jax.sim.schedules import Schedule, overlap, simulate
from rl_fusion_jax.sim.workload import Workload, fit_lognormal

GEN_FEATURES = (("decode_steps", "engine/decode_steps"), ("decode_chunks", "engine/decode_chunks"),
                ("prefill_calls", "engine/prefill_calls"), ("refill_prefills", "engine/refill_prefills"))


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """Least squares with non-negative coefficients (drop the most negative column and refit)."""
  keep = list(range(x.shape[1]))
  while True:
    coef = np.zeros(x.shape[1])
    if keep:
      coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
    negative = [j for j in keep if coef[j] < 0]
    if not negative:
      return coef
    keep.remove(min(negative, key=lambda j: coef[j]))


def fit_gen(rows: list[dict]) -> GenCost:
  rows = [m for m in rows if m.get("generate_s", 0.0) > 0 and "engine/decode_steps" in m]
  if not rows:
    raise ValueError("fit_gen: no measured step has a rollout phase with engine counts "
                     "(engine/decode_steps); rerun with this version of the loop")
  y = np.array([m["generate_s"] for m in rows])
  cols, names = [np.ones(len(rows))], ["phase"]
  for name, key in GEN_FEATURES:
    v = np.array([float(m.get(key, 0.0)) for m in rows])
    if v.std() > 1e-9 * max(1.0, abs(v.mean())):
      cols.append(v)
      names.append(name)
  coef = nnls(np.stack(cols, 1), y)
  fitted = dict(zip(names, coef.tolist()))
  return GenCost(**fitted)


def fit_train(rows: list[dict]) -> TrainCost:
  t = np.array([m["train_s"] for m in rows])
  n = np.array([m["train_tokens"] for m in rows], float)
  if n.std() < 0.05 * n.mean():
    return TrainCost(0.0, float(t.mean() / n.mean()))
  coef = nnls(np.stack([np.ones(len(n)), n], 1), t)
  return TrainCost(float(coef[0]), float(coef[1]))


def compile_steps(run: measure.MeasuredRun) -> set[int]:
  """Steps a compile fell into (``measure.compile_excess``): left out of the fit."""
  return measure.compile_excess(run)[0]


def fit_costs(runs: list[measure.MeasuredRun]) -> Costs:
  modes = {r.mode for r in runs}
  if len(modes) != 1:
    raise ValueError(f"fit_costs: runs of one deployment at a time, got {sorted(modes)}")
  skip = {(id(r), k) for r in runs for k in compile_steps(r)}
  rows = [m for r in runs for m in r.rows if (id(r), m["step"]) not in skip]
  gen, train = fit_gen(rows), fit_train(rows)
  if modes == {"colocated"}:
    other = [w - m["generate_s"] - m["train_s"] for r in runs for w, m in zip(r.step_seconds(), r.rows)
             if (id(r), m["step"]) not in skip]
    other_s = max(0.0, statistics.fmean(other))
    # The share of it outside every timeline phase (host work between phases): idle on the lane.
    gaps = [statistics.fmean(r.step_seconds()) - sum(sum(p.values()) for p in r.phase_seconds().values())
            for r in runs if not compile_steps(r)]
    gap_s = min(other_s, max(0.0, statistics.fmean(gaps))) if gaps else 0.0
    return Costs(gen, train, other_s=other_s - gap_s, gap_s=gap_s)
  return _fit_separated(runs, rows, skip)


ALONE = 0.25   # a phase overlapped by the other side for less than this share counts as running alone


def _spans(run: measure.MeasuredRun, group: str, name: str | None = None) -> dict[int, tuple[float, float]]:
  """0-based step -> (start, end) of the group's phase ``name`` (None: the union's bounds per step)."""
  out: dict[int, tuple[float, float]] = {}
  for i in run.timeline.intervals:
    if i.group == group and i.step is not None and i.name not in measure.EXCLUDED_PHASES and (
        name is None or i.name == name):
      a, b = out.get(i.step, (i.start, i.end))
      out[i.step] = (min(a, i.start), max(b, i.end))
  return out


def _busy(run: measure.MeasuredRun, group: str) -> list[tuple[float, float]]:
  return [(i.start, i.end) for i in run.timeline.intervals
          if i.group == group and i.name not in measure.EXCLUDED_PHASES]


def _contention(cost_fn, rows: list[tuple[dict, float]], measured_key: str) -> float:
  """The slowdown factor c of ``measured = predicted x (1 + (c - 1) x overlap)``, median over the rows
  overlapped for at least ALONE of their duration (1 when there are none)."""
  cs = [1 + (m[measured_key] / cost_fn(m) - 1) / ov for m, ov in rows if ov >= ALONE and cost_fn(m) > 0]
  return max(1.0, statistics.median(cs)) if cs else 1.0


def _fit_separated(runs, rows, skip) -> Costs:
  """Separated (one process per side): per measured step, the share of its generate phase during which
  the trainer was busy and of its update during which the rollout side was; costs are fitted on the
  steps that ran alone (when there are some: the synchronous runs) and the slowdown while overlapped
  (``Costs.gen_contention`` / ``train_contention``) on the others."""
  gen_rows, train_rows, push = [], [], []
  for r in runs:
    gen, upd, pushes = _spans(r, "rollout", "generate"), _spans(r, "train", "train"), _spans(r, "train", "push")
    trainer, rollout = _busy(r, "train"), _busy(r, "rollout")
    for m in r.rows:
      if (id(r), m["step"]) in skip:
        continue
      k = m["step"] - 1
      if k in gen:
        gen_rows.append((m, overlap(gen[k], trainer)))
      if k in upd:
        train_rows.append((m, overlap(upd[k], rollout)))
      if k in pushes:
        push.append((pushes[k][1] - pushes[k][0], overlap(pushes[k], rollout)))
  alone = lambda pairs: [m for m, ov in pairs if ov < ALONE]
  gen_fit = alone(gen_rows) if len(alone(gen_rows)) >= 3 else [m for m, _ in gen_rows]
  train_fit = alone(train_rows) if len(alone(train_rows)) >= 3 else [m for m, _ in train_rows]
  gen, train = fit_gen(gen_fit or rows), fit_train(train_fit or rows)
  gen_pred = lambda m: gen.seconds(_counts(m))
  train_pred = lambda m: train.seconds(m["train_tokens"])
  c_gen = _contention(gen_pred, gen_rows, "generate_s") if len(gen_fit) < len(gen_rows) else 1.0
  c_train = _contention(train_pred, train_rows, "train_s") if len(train_fit) < len(train_rows) else 1.0
  alone_push = [d for d, ov in push if ov < ALONE]
  phases = [r.phase_seconds() for r in runs]
  mean = lambda group, names: statistics.fmean(sum(p.get(group, {}).get(n, 0.0) for n in names) for p in phases)
  roll = {n for p in phases for n in p.get("rollout", {})} - {"generate"}
  trn = {n for p in phases for n in p.get("train", {})} - {"train", "push"}
  push_s = statistics.fmean(alone_push) if alone_push else mean("train", ["push"])
  c_push = 1.0
  if alone_push and len(alone_push) < len(push):
    cs = [1 + (d / push_s - 1) / ov for d, ov in push if ov >= ALONE]
    c_push = max(1.0, statistics.median(cs)) if cs else 1.0
  return Costs(gen, train, other_s=mean("train", trn), rollout_other_s=mean("rollout", roll), push_s=push_s,
               gen_contention=c_gen, train_contention=c_train, push_contention=c_push)


def _counts(m: dict) -> PhaseCounts:
  return PhaseCounts(**{name: int(m.get(key, 0)) for name, key in GEN_FEATURES})


def workload_from_run(run: measure.MeasuredRun) -> Workload:
  cfg = run.config
  r, seed = cfg["rollout"], cfg["run"]["seed"]
  batch = r["num_prompts"] * r["group_size"]
  response = statistics.fmean(m["response_len_mean"] for m in run.rows)
  prompt = max(1, round(statistics.fmean(m["train_tokens"] for m in run.rows) / batch - response))
  if r.get("forced_length_median"):
    return Workload(r["num_prompts"], r["group_size"], prompt, r["max_new_tokens"],
                    r["forced_length_median"], r["forced_length_sigma"], seed=seed, forced=True)
  mean_max = statistics.fmean(m["response_len_max"] for m in run.rows)
  median, sigma = fit_lognormal(response, mean_max, batch, r["max_new_tokens"])
  return Workload(r["num_prompts"], r["group_size"], prompt, r["max_new_tokens"], median, sigma, seed=seed)


def schedule_from_run(run: measure.MeasuredRun) -> Schedule:
  cfg = run.config
  s, r = cfg["stalesync"], cfg["rollout"]
  staleness = s["max_staleness"] if s["enabled"] else 0
  return Schedule(mode=run.mode, max_staleness=staleness,
                  rollout_fraction=s["rollout_fraction"] if s["enabled"] else 1.0,
                  num_slots=r["num_slots"], chunk_steps=r["chunk_steps"], prefill_rows=r.get("prefill_rows", 0),
                  keep_cache=bool(r.get("keep_cache", False)),
                  batch_shards=len(run.timeline.groups[run.rollout_group]))


@dataclasses.dataclass(frozen=True)
class Check:
  name: str
  measured_step_s: float
  simulated_step_s: float
  measured_tokens_per_s: float
  simulated_tokens_per_s: float
  measured_idle: dict
  simulated_idle: dict
  measured_decode_steps: float
  simulated_decode_steps: float

  @property
  def step_error(self) -> float:
    return self.simulated_step_s / self.measured_step_s - 1

  @property
  def tokens_error(self) -> float:
    return self.simulated_tokens_per_s / self.measured_tokens_per_s - 1


def validate(name: str, run: measure.MeasuredRun, costs: Costs) -> Check:
  """Simulates ``run``'s configuration (its workload, schedule and step count) with ``costs``."""
  w, sch = workload_from_run(run), schedule_from_run(run)
  sim = simulate(w, sch, costs, run.warm + run.steps)
  lo, hi = sim.window(run.warm)
  got = measure.summarize(run)
  sim_idle = sim.idle_frac(run.warm)
  return Check(name, got["step_s_steady"], (hi - lo) / run.steps,
               got["trained_tokens_per_s_steady"], sim.tokens_per_s(run.warm), got["idle_frac"],
               sim_idle, got["decode_steps"],
               statistics.median(r.counts.decode_steps for r in sim.steps[run.warm:]))


def validate_manifest(path: str) -> dict:
  """Validates the simulator on the runs an ``experiments/ablation_main.py`` manifest (ablation.json) lists.

  Per workload and deployment, costs are fitted on all of its runs ("pooled") and on the runs of its other
  schedules only ("cross-schedule"); every run is then simulated with both. Returns the checks, the
  pooled costs and the largest pooled error (step time or tokens/s)."""
  with open(path) as f:
    ablation = json.load(f)
  warm, steps = ablation["warm_steps"], ablation["steps"]
  out = {"checks": [], "costs": {}}
  here = os.path.dirname(os.path.abspath(path))   # relative run folders are relative to the JSON
  for workload, by_variant in ablation["workdirs"].items():
    runs = {v: [measure.load(os.path.join(here, d), warm, steps) for d in dirs] for v, dirs in by_variant.items()}
    for mode in ("colocated", "separated"):
      names = [v for v in runs if runs[v][0].mode == mode]
      if not names:
        continue
      pooled = fit_costs([r for v in names for r in runs[v]])
      out["costs"][f"{workload}/{mode}"] = dataclasses.asdict(pooled)
      for v in names:
        others = [r for u in names if u != v for r in runs[u]]
        cross = fit_costs(others) if others else None
        for i, run in enumerate(runs[v]):
          c = validate(f"{workload}/{v}", run, pooled)
          x = validate(f"{workload}/{v}", run, cross) if cross else None
          out["checks"].append({
              "workload": workload, "variant": v, "repeat": i, "mode": mode,
              "measured_step_s": c.measured_step_s, "simulated_step_s": c.simulated_step_s,
              "step_error": c.step_error, "measured_tokens_per_s": c.measured_tokens_per_s,
              "simulated_tokens_per_s": c.simulated_tokens_per_s, "tokens_error": c.tokens_error,
              "measured_decode_steps": c.measured_decode_steps, "simulated_decode_steps": c.simulated_decode_steps,
              "measured_idle": c.measured_idle, "simulated_idle": c.simulated_idle,
              "cross_step_error": x.step_error if x else None,
              "cross_tokens_error": x.tokens_error if x else None})
  errors = [abs(c[k]) for c in out["checks"] for k in ("step_error", "tokens_error")]
  out["max_abs_error"] = max(errors) if errors else None
  return out
