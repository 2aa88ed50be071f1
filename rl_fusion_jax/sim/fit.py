"""Fitting the simulator's cost parameters to measured runs, and checking it against them.

``fit_costs(runs)`` takes runs of one deployment (colocated, or separated with one process per side) on
one workload and fits, over all their measured steps:
  * generation: the engine's counts of the same step priced by ``GEN_TERMS`` (decode steps; host calls,
    i.e. decode chunks plus host prefill calls at one shared cost; in-chunk refills; and a constant per
    phase). Runs that recorded the engine's per-chunk sums are fitted over their chunks
    (``_fit_gen_chunks``); older runs by non-negative least squares of ``generate_s`` over the steps, a
    term whose count does not vary across the steps folded into the constant;
  * the update: ``train_s`` against ``train_tokens`` (fixed + per token; the mean rate alone when the
    token counts hardly vary);
  * colocated: the mean of (time between update ends - generate_s - train_s) per step, split into
    ``gap_s`` (the time outside every timeline phase, from runs without compile steps) and ``other_s``;
  * separated: the rollout lane's other phases per batch (weights, switch, score, ship), the training
    lane's (receive, reward, publish) and the weights' push (timeline phase means); generation, the update
    and the push fitted on their seconds alone: each measured phase scaled by the processor-sharing model
    (``costs.Sharing``, ``MEASURED_MACHINE``) over the run's own measured overlaps (``_fit_separated``).
``workload_from_run`` rebuilds the workload (forced lengths exactly; otherwise a log-normal fitted to
the measured mean and batch maximum of the response lengths) and ``schedule_from_run`` the schedule.
``validate`` simulates a run's configuration with fitted costs and compares step time (the mean time
between update ends in the window) and trained tokens/s with what the run measured; the measured tokens/s is the
"steady" one (``measure.summarize``: the window without the excess of steps a compile fell into, which
the simulator does not model). ``validate_manifest`` does it for every run of an ablation three times: held out
(costs fitted on the runs of the other schedule only, sync <-> StaleSync), held out and paired by repeat
(fitted on the other schedule's runs of the same repeat only) and in-sample (fitted on all runs of the
workload and deployment, this one included). Nothing here imports JAX.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

import numpy as np

from rl_fusion_jax.sim import measure
from rl_fusion_jax.sim.costs import Costs, GenCost, Sharing, TrainCost
from rl_fusion_jax.sim.engine import PhaseCounts
from rl_fusion_jax.sim.schedules import Schedule, simulate
from rl_fusion_jax.sim.workload import Workload, fit_lognormal

GEN_FEATURES = (("decode_steps", "engine/decode_steps"), ("decode_chunks", "engine/decode_chunks"),
                ("prefill_calls", "engine/prefill_calls"), ("refill_prefills", "engine/refill_prefills"))
# Fitted terms -> the counts each one multiplies. A host prefill call and a decode chunk are each one
# program call that takes and returns the whole KV cache with a host sync in between, so they share one
# cost ("host_calls"): a synchronous run makes no prefill call (nothing is carried across updates), so
# without the tie a fit on synchronous runs could not price the calls StaleSync makes. The committed runs
# support it: fitted apart on all runs the two differ by under 7% (long tail 21.0 / 20.9 ms, arithmetic
# 6.2 / 6.6 ms).
GEN_TERMS = (("decode_steps", ("decode_steps",)), ("host_calls", ("decode_chunks", "prefill_calls")),
             ("refill_prefills", ("refill_prefills",)))


def _drop_negative(solve, columns: int, keep) -> np.ndarray:
  """Non-negative coefficients: ``solve(keep)`` (least squares over the columns ``keep``), dropping the
  most negative column and solving again until none is negative."""
  keep = list(keep)
  while True:
    coef = np.zeros(columns)
    if keep:
      coef[keep] = solve(keep)
    negative = [j for j in keep if coef[j] < 0]
    if not negative:
      return coef
    keep.remove(min(negative, key=lambda j: coef[j]))


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """Least squares with non-negative coefficients (drop the most negative column and refit)."""
  return _drop_negative(lambda keep: np.linalg.lstsq(x[:, keep], y, rcond=None)[0], x.shape[1],
                        range(x.shape[1]))


# The engine's per-chunk sums (``rollout/engine.py::CHUNK_MOMENTS``; this module imports no JAX, so the
# names are repeated here and tests/sim_test.py checks the two agree): a chunk's wall seconds s, its decode
# steps n and in-chunk refills r, summed per rollout phase as s, s*n, s*r, n*n, n*r, r*r.
CHUNK_MOMENTS = ("chunk_s", "chunk_steps_x_s", "chunk_refills_x_s", "chunk_steps_sq", "chunk_steps_x_refills",
                 "chunk_refills_sq")


def _nnls_normal(gram: np.ndarray, rhs: np.ndarray, keep: list[int]) -> np.ndarray:
  """``nnls`` from the normal equations (``gram`` = X'X, ``rhs`` = X'y) over the columns ``keep``."""
  return _drop_negative(lambda k: np.linalg.lstsq(gram[np.ix_(k, k)], rhs[k], rcond=None)[0], len(rhs), keep)


def _fit_gen_chunks(rows: list[dict]) -> GenCost:
  """``fit_gen`` on runs that recorded ``CHUNK_MOMENTS``: a chunk's seconds = a + b x its decode steps +
  c x its refills, least squares over every chunk of the rows (non-negative; a count that does not vary
  across the chunks is dropped, its cost staying in a). Within one phase the chunks differ (a long tail's
  last chunk is short, its refills come in the first), so a and b are told apart even when every phase has
  the same counts, which the phase-level fit cannot do. A host prefill call costs a (``GEN_TERMS``). The
  per-phase constant is the mean of what the chunks and calls leave of ``generate_s``; when the host calls
  per phase do not vary across the rows, a chunk's intercept cannot be told from a phase's and is folded
  into it, as in the phase-level fit."""
  total = lambda key: sum(float(m.get(key, 0.0)) for m in rows)
  n, steps, refills = total("engine/decode_chunks"), total("engine/decode_steps"), total("engine/refill_prefills")
  ss, sr, rr = (total(f"engine/{k}") for k in ("chunk_steps_sq", "chunk_steps_x_refills", "chunk_refills_sq"))
  gram = np.array([[n, steps, refills], [steps, ss, sr], [refills, sr, rr]])
  rhs = np.array([total(f"engine/{k}") for k in ("chunk_s", "chunk_steps_x_s", "chunk_refills_x_s")])
  varies = lambda s1, s2: s2 / n - (s1 / n) ** 2 > 1e-9 * max(1.0, (s1 / n) ** 2)
  keep = [0] + [j for j, (s1, s2) in ((1, (steps, ss)), (2, (refills, rr))) if varies(s1, s2)]
  a, b, c = _nnls_normal(gram, rhs, keep)
  calls = np.array([float(m.get("engine/decode_chunks", 0)) + float(m.get("engine/prefill_calls", 0))
                    for m in rows])
  if calls.std() <= 1e-9 * max(1.0, calls.mean()):
    a = 0.0   # the same host calls in every phase: their intercept joins the per-phase constant below
  rest = [m["generate_s"] - a * k - b * float(m.get("engine/decode_steps", 0))
          - c * float(m.get("engine/refill_prefills", 0)) for m, k in zip(rows, calls)]
  return GenCost(phase=max(0.0, statistics.fmean(rest)), decode_steps=float(b), decode_chunks=float(a),
                 prefill_calls=float(a), refill_prefills=float(c))


def fit_gen(rows: list[dict]) -> GenCost:
  """``generate_s`` = phase + sum over ``GEN_TERMS`` of cost x count. From the engine's per-chunk sums when
  every row has them (``_fit_gen_chunks``); otherwise (runs recorded before them) non-negative least squares
  over the phases, a term whose count does not vary across the rows folded into the per-phase constant."""
  rows = [m for m in rows if m.get("generate_s", 0.0) > 0 and "engine/decode_steps" in m]
  if not rows:
    raise ValueError("fit_gen: no measured step has a rollout phase with engine counts "
                     "(engine/decode_steps); rerun with this version of the loop")
  if all("engine/chunk_s" in m for m in rows) and sum(m.get("engine/decode_chunks", 0) for m in rows) > 0:
    return _fit_gen_chunks(rows)
  keys = dict(GEN_FEATURES)
  y = np.array([m["generate_s"] for m in rows])
  cols, names = [np.ones(len(rows))], [("phase", ("phase",))]
  for term, counts in GEN_TERMS:
    v = np.array([sum(float(m.get(keys[c], 0.0)) for c in counts) for m in rows])
    if v.std() > 1e-9 * max(1.0, abs(v.mean())):
      cols.append(v)
      names.append((term, counts))
  coef = nnls(np.stack(cols, 1), y)
  return GenCost(**{c: float(x) for (_, counts), x in zip(names, coef) for c in counts})


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


# The machine the committed runs were measured on: 2 cores (RESULTS.md, "Machine: 2 CPU cores (AMD EPYC)");
# the thread counts are costs.Sharing's stated defaults.
MEASURED_MACHINE = Sharing(cores=2)


def fit_costs(runs: list[measure.MeasuredRun], sharing: Sharing = MEASURED_MACHINE) -> Costs:
  """The costs of one deployment fitted on ``runs`` (see the module docstring); ``sharing``: the
  separated deployment's processor-sharing model (ignored for colocated runs)."""
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
  return _fit_separated(runs, rows, skip, sharing)


def _spans(run: measure.MeasuredRun, group: str, name: str | None = None) -> dict[int, tuple[float, float]]:
  """0-based step -> (start, end) of the group's phase ``name`` (None: the union's bounds per step)."""
  out: dict[int, tuple[float, float]] = {}
  for i in run.timeline.intervals:
    if i.group == group and i.step is not None and i.name not in measure.EXCLUDED_PHASES and (
        name is None or i.name == name):
      a, b = out.get(i.step, (i.start, i.end))
      out[i.step] = (min(a, i.start), max(b, i.end))
  return out


def alone_shares(run: measure.MeasuredRun, sharing: Sharing) -> dict[str, dict[int, float]]:
  """Separated: per activity ('gen', 'train', 'push') and 0-based step, the share of the measured
  phase's duration its work would take alone (``Sharing.work`` over the run's measured timeline: 1 for a
  phase that ran while the other activities were idle)."""
  spans = {"gen": _spans(run, "rollout", "generate"), "train": _spans(run, "train", "train"),
           "push": _spans(run, "train", "push")}
  threads = {"gen": sharing.gen_threads, "train": sharing.train_threads, "push": sharing.push_threads}
  out = {}
  for name, by_step in spans.items():
    others = [(a, b, threads[o]) for o in spans if o != name for a, b in spans[o].values()]
    out[name] = {k: sharing.work(span, threads[name], others) / (span[1] - span[0]) if span[1] > span[0] else 1.0
                 for k, span in by_step.items()}
  return out


def _fit_separated(runs, rows, skip, sharing: Sharing) -> Costs:
  """Separated (one process per side on one machine): each measured generate, update and push phase is
  scaled to the seconds its work takes alone (``alone_shares``: the processor-sharing model over the
  run's own measured overlaps, nothing fitted), and the costs are fitted on those; the simulation then
  slows the phases by the same model wherever its own schedule overlaps them."""
  gen_rows, train_rows, push = [], [], []
  for r in runs:
    shares = alone_shares(r, sharing)
    for m in r.rows:
      k = m["step"] - 1
      if (id(r), m["step"]) in skip:
        continue
      share = shares["gen"].get(k, 1.0)   # the phase's chunks are scaled alike
      gen_rows.append(m | {"generate_s": m["generate_s"] * share,
                           **{f"engine/{c}": m[f"engine/{c}"] * share for c in CHUNK_MOMENTS[:3]
                              if f"engine/{c}" in m}})
      train_rows.append(m | {"train_s": m["train_s"] * shares["train"].get(k, 1.0)})
    for k, (a, b) in _spans(r, "train", "push").items():
      if r.warm <= k < r.warm + r.steps:
        push.append((b - a) * shares["push"][k])
  gen, train = fit_gen(gen_rows or rows), fit_train(train_rows or rows)
  phases = [r.phase_seconds() for r in runs]
  mean = lambda group, names: statistics.fmean(sum(p.get(group, {}).get(n, 0.0) for n in names) for p in phases)
  roll = {n for p in phases for n in p.get("rollout", {})} - {"generate"}
  trn = {n for p in phases for n in p.get("train", {})} - {"train", "push"}
  push_s = statistics.fmean(push) if push else mean("train", ["push"])
  return Costs(gen, train, other_s=mean("train", trn), rollout_other_s=mean("rollout", roll), push_s=push_s,
               sharing=sharing)


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
                  # stalesync.train_fraction, named rollout_fraction in the config.json of older runs
                  train_fraction=s.get("train_fraction", s.get("rollout_fraction")) if s["enabled"] else 1.0,
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


def schedule_name(run: measure.MeasuredRun) -> str:
  """'stalesync' for a run with a staleness bound above 0, else 'sync' (s = 0 is the synchronous loop)."""
  s = run.config["stalesync"]
  return "stalesync" if s["enabled"] and s["max_staleness"] > 0 else "sync"


def _check(c: Check) -> dict:
  return {"simulated_step_s": c.simulated_step_s, "step_error": c.step_error,
          "simulated_tokens_per_s": c.simulated_tokens_per_s, "tokens_error": c.tokens_error,
          "simulated_decode_steps": c.simulated_decode_steps, "simulated_idle": c.simulated_idle}


def steps_of(manifest: dict, workload: str) -> int:
  """The measured steps per run of ``workload`` in an ablation manifest ("steps": a count, or per workload)."""
  steps = manifest["steps"]
  return steps[workload] if isinstance(steps, dict) else steps


def load_manifest(path: str) -> dict[str, list[tuple[str, int, measure.MeasuredRun]]]:
  """workload -> (variant, repeat, run) of every run an ablation manifest lists (run folders relative to
  the manifest's own folder), each with the manifest's warm and measured steps (of its workload)."""
  with open(path) as f:
    ablation = json.load(f)
  warm = ablation["warm_steps"]
  here = os.path.dirname(os.path.abspath(path))
  return {workload: [(v, i, measure.load(os.path.join(here, d), warm, steps_of(ablation, workload)))
                     for v, dirs in by_variant.items() for i, d in enumerate(dirs)]
          for workload, by_variant in ablation["workdirs"].items()}


def validate_manifest(path: str, sharing: Sharing = MEASURED_MACHINE) -> dict:
  """Validates the simulator on the runs an ``experiments/ablation_main.py`` manifest (ablation.json) lists.

  Per workload and deployment, every run is simulated three times: "held_out", with costs fitted only on
  the runs of the other schedule (fit on sync, predict StaleSync, and the reverse); "held_out_paired",
  with costs fitted only on the other schedule's runs of the same repeat (``ablation_main.py`` interleaves
  the variants, so those were made in the same round, minutes apart, under the machine's speed of the
  moment); and "in_sample", with costs fitted on all runs of the workload and deployment, this one
  included. Returns one check per run, the costs of the pooled fits, and the largest errors of each kind
  (step time and tokens/s)."""
  out = {"checks": [], "costs": {}}
  for workload, runs in load_manifest(path).items():
    for mode in ("colocated", "separated"):
      mine = [(v, i, r) for v, i, r in runs if r.mode == mode]
      if not mine:
        continue
      pooled = fit_costs([r for _, _, r in mine], sharing)
      out["costs"][f"{workload}/{mode}/all"] = dataclasses.asdict(pooled)
      by_schedule = {}
      for sch in sorted({schedule_name(r) for _, _, r in mine}):
        others = [r for _, _, r in mine if schedule_name(r) != sch]
        by_schedule[sch] = fit_costs(others, sharing) if others else None
        if others:
          out["costs"][f"{workload}/{mode}/fitted_without_{sch}"] = dataclasses.asdict(by_schedule[sch])
      for v, i, run in mine:
        c, held = validate(f"{workload}/{v}", run, pooled), by_schedule[schedule_name(run)]
        x = validate(f"{workload}/{v}", run, held) if held else None
        # Paired: the other schedule's runs of the same repeat only (made in the same interleaved round).
        partners = [r for _, j, r in mine if j == i and schedule_name(r) != schedule_name(run)]
        p = validate(f"{workload}/{v}", run, fit_costs(partners, sharing)) if partners else None
        out["checks"].append({
            "workload": workload, "variant": v, "repeat": i, "mode": mode, "schedule": schedule_name(run),
            "fitted_on": "sync" if schedule_name(run) == "stalesync" else "stalesync",
            "measured_step_s": c.measured_step_s, "measured_tokens_per_s": c.measured_tokens_per_s,
            "measured_decode_steps": c.measured_decode_steps, "measured_idle": c.measured_idle,
            "in_sample": _check(c), "held_out": _check(x) if x else None,
            "held_out_paired": _check(p) if p else None})
  for kind in ("in_sample", "held_out", "held_out_paired"):
    for key in ("step_error", "tokens_error"):
      errors = [abs(c[kind][key]) for c in out["checks"] if c[kind]]
      out[f"max_{kind}_{key}"] = max(errors) if errors else None
  return out


def spread_floor(measured: list[float]) -> float:
  """The smallest largest relative error (|p - m| / m) that any one value p can have against every one of
  ``measured``: (max - min) / (max + min), reached at p = 2 max min / (max + min). A prediction that is the
  same for runs of the same work (repeats) cannot be closer to all of them than this."""
  lo, hi = min(measured), max(measured)
  return (hi - lo) / (hi + lo)


def worst_held_out(v: dict) -> list[dict]:
  """Per workload, deployment and predicted schedule: the largest held-out errors over its runs (pooled
  fits; ``max_paired_step_error``: fits paired by repeat, None where a run had no partner), and
  ``repeat_floor``: ``spread_floor`` of the runs' measured step times per variant, the largest over the
  variants of the group (how close one value per variant could come to every run)."""
  out, steps = {}, {}
  for c in v["checks"]:
    if not c["held_out"]:
      continue
    key = (c["workload"], c["mode"], c["schedule"])
    row = out.setdefault(key, {"workload": key[0], "mode": key[1], "predicted": key[2], "fitted_on": c["fitted_on"],
                               "runs": 0, "max_step_error": 0.0, "max_tokens_error": 0.0,
                               "max_paired_step_error": 0.0})
    row["runs"] += 1
    row["max_step_error"] = max(row["max_step_error"], abs(c["held_out"]["step_error"]))
    row["max_tokens_error"] = max(row["max_tokens_error"], abs(c["held_out"]["tokens_error"]))
    paired = c.get("held_out_paired")
    if paired is None or row["max_paired_step_error"] is None:
      row["max_paired_step_error"] = None
    else:
      row["max_paired_step_error"] = max(row["max_paired_step_error"], abs(paired["step_error"]))
    steps.setdefault(key, {}).setdefault(c["variant"], []).append(c["measured_step_s"])
  for key, row in out.items():
    row["repeat_floor"] = max(spread_floor(m) for m in steps[key].values())
  return list(out.values())
