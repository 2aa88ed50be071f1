r"""The schedule simulator (rl_fusion_jax/sim): validated against measured runs, then at cluster scale.

  python experiments/simulate_main.py --ablation=/tmp/ablation/ablation.json --out=/tmp/sim
  python experiments/simulate_main.py --cluster --out=/tmp/sim [--quick]
  python experiments/simulate_main.py --fit_run=RUN_DIR --warm_steps=4 --out=/tmp/sim

--fit_run: the cost parameters fitted to one measured run's metrics.jsonl and timeline.jsonl (the
workload and schedule read from its config.json), and that run re-simulated with them (OUT/fit_run.json).

--ablation (the JSON experiments/ablation_main.py writes): per workload and deployment (colocated;
separated with one process per side) the cost parameters are fitted to all its measured runs
(``sim/fit.py``); every run's configuration is then simulated with them and its step time (median time
between update ends) and trained tokens/s compared with the measured ones. A stricter column
("cross-schedule") fits only on the runs of the other schedule of the same deployment (sync <->
StaleSync) and predicts this one. Writes OUT/validation.md and OUT/validation.json; exits with status 1
when a fitted simulation misses a measured step time or tokens/s by more than --tolerance.

--cluster: the same schedules with the assumed cluster costs of ``sim/cluster.py`` (every figure listed
with its source in OUT/assumptions.md): Table 1 on one 384-device supernode (separated vs colocated,
sync vs StaleSync s = 1), Table 2 on 1, 2 and 4 supernodes (weak scaling: 512 prompts x 16 samples per
supernode; synchronous vs StaleSync tokens/s and linearity), and a sensitivity sweep of the ratios over
the assumed figures they depend on most. Writes OUT/cluster.md and OUT/cluster.json. --quick: a smaller
workload (64 prompts per supernode, responses up to 4,096 tokens) and fewer steps.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags

_ABLATION = flags.DEFINE_string("ablation", "", "ablation.json of experiments/ablation_main.py.")
_FIT_RUN = flags.DEFINE_string("fit_run", "", "One measured run's workdir: print the costs fitted to it and "
                                "its re-simulation (with --warm_steps unmeasured steps).")
_WARM = flags.DEFINE_integer("warm_steps", 4, "--fit_run: its first N steps are not measured (compiles).")
_CLUSTER = flags.DEFINE_bool("cluster", False, "Simulate Tables 1 and 2 at cluster scale and the sweep.")
_OUT = flags.DEFINE_string("out", None, "Output folder.")
_QUICK = flags.DEFINE_bool("quick", False, "Cluster: a smaller workload and fewer steps.")
_TOLERANCE = flags.DEFINE_float("tolerance", 0.15, "Largest relative error a fitted simulation may have.")
flags.mark_flags_as_required(["out"])

CLUSTER_VARIANTS = {   # name -> (mode, s, f)
    "separated_sync": ("separated", 0, 1.0),
    "separated_stalesync": ("separated", 1, 1.0),
    "colocated_sync": ("colocated", 0, 1.0),
    "colocated_stalesync": ("colocated", 1, 0.5),
}
REFERENCE = {"fusion_vs_separated": 1.785, "fusion_stalesync_vs_separated": 2.5,
             "linearity_4_nodes_sync": 85 / (25 * 4), "linearity_4_nodes_stalesync": 127 / (35 * 4)}


# ----------------------------------------------------------------------------------------- validation


def validation_table(v: dict) -> str:
  pct = lambda x: "-" if x is None else f"{x:+.1%}"
  lines = ["| workload | variant | repeat | step measured / simulated | error | tok/s measured / simulated | "
           "error | decode steps measured / simulated | idle measured / simulated | cross-schedule error "
           "(step, tok/s) |", "|" + "---|" * 10]
  for c in v["checks"]:
    idle = "; ".join(f"{g} {c['measured_idle'][g]:.0%} / {c['simulated_idle'].get(g if g in c['simulated_idle'] else 'all', 0):.0%}"
                     for g in c["measured_idle"])
    lines.append(f"| {c['workload']} | {c['variant']} | {c['repeat']} | {c['measured_step_s']:.3f} / "
                 f"{c['simulated_step_s']:.3f} s | {pct(c['step_error'])} | {c['measured_tokens_per_s']:,.0f} / "
                 f"{c['simulated_tokens_per_s']:,.0f} | {pct(c['tokens_error'])} | "
                 f"{c['measured_decode_steps']:.0f} / {c['simulated_decode_steps']:.0f} | {idle} | "
                 f"{pct(c['cross_step_error'])}, {pct(c['cross_tokens_error'])} |")
  return "\n".join(lines)


# --------------------------------------------------------------------------------------------- cluster


def simulate_cluster(c, variant: str, quick: bool) -> dict:
  from rl_fusion_jax.sim import cluster, schedules  # pylint: disable=g-import-not-at-top
  mode, s, f = CLUSTER_VARIANTS[variant]
  w = (cluster.workload(c, prompts_per_node=64, max_len=4096, median=1024) if quick else cluster.workload(c))
  warm, steps = (1, 3) if quick else (2, 6)
  res = schedules.simulate(w, cluster.schedule(c, mode, s, f), cluster.costs(c, mode), warm + steps)
  lo, hi = res.window(warm)
  return {"tokens_per_s": res.tokens_per_s(warm), "step_s": (hi - lo) / steps,
          "idle": res.idle_frac(warm),
          "decode_steps": sum(r.counts.decode_steps for r in res.steps[warm:]) / steps,
          "generate_s": sum(r.generate_s for r in res.steps[warm:]) / steps,
          "train_s": sum(r.train_s for r in res.steps[warm:]) / steps,
          "staleness": sum(r.staleness_mean for r in res.steps[warm:]) / steps}


def table1(c, quick: bool) -> dict:
  return {v: simulate_cluster(c, v, quick) for v in CLUSTER_VARIANTS}


def table2(c, quick: bool) -> dict:
  out = {}
  for v in ("colocated_sync", "colocated_stalesync"):
    out[v] = {n: simulate_cluster(dataclasses.replace(c, nodes=n), v, quick) for n in (1, 2, 4)}
  return out


def ratios(t1: dict, t2: dict | None) -> dict:
  base = t1["separated_sync"]["tokens_per_s"]
  out = {"fusion_vs_separated": t1["colocated_sync"]["tokens_per_s"] / base,
         "fusion_stalesync_vs_separated": t1["colocated_stalesync"]["tokens_per_s"] / base,
         "separated_stalesync_vs_separated": t1["separated_stalesync"]["tokens_per_s"] / base}
  if t2:
    for v, key in (("colocated_sync", "sync"), ("colocated_stalesync", "stalesync")):
      out[f"linearity_4_nodes_{key}"] = t2[v][4]["tokens_per_s"] / (4 * t2[v][1]["tokens_per_s"])
  return out


SWEEP = (   # (label, field path, values): the assumed figures the ratios depend on most
    ("training MFU", "eff.train_mfu", (0.25, 0.40, 0.55)),
    ("achieved HBM efficiency", "eff.hbm_eff", (0.5, 0.7, 0.9)),
    ("bandwidth between supernodes (B/s)", "hw.inter_bw", (12.5e9, 50e9, 200e9)),
    ("per-step host time (s)", "eff.other_s", (0.5, 2.0, 8.0)),
)


def _replace(c, path: str, value):
  part, field = path.split(".")
  return dataclasses.replace(c, **{part: dataclasses.replace(getattr(c, part), **{field: value})})


def sweep(c, quick: bool) -> list[dict]:
  rows = []
  for label, path, values in (SWEEP[:2] if quick else SWEEP):
    for value in (values[::2] if quick else values):
      cv = _replace(c, path, value)
      t1 = table1(cv, quick)
      scale = {v: [simulate_cluster(dataclasses.replace(cv, nodes=n), v, quick) for n in (1, 2)]
               for v in ("colocated_sync", "colocated_stalesync")}
      r = ratios(t1, None)
      for v, key in (("colocated_sync", "sync"), ("colocated_stalesync", "stalesync")):
        r[f"linearity_2_nodes_{key}"] = scale[v][1]["tokens_per_s"] / (2 * scale[v][0]["tokens_per_s"])
      rows.append({"assumption": label, "value": value, **r})
  return rows


def cluster_markdown(t1: dict, t2: dict, r: dict, sw: list[dict], quick: bool) -> str:
  from rl_fusion_jax.sim import cluster  # pylint: disable=g-import-not-at-top
  base = t1["separated_sync"]["tokens_per_s"]
  lines = ["#### Simulated Table 1: one supernode (384 devices)" + (" (quick workload)" if quick else ""), "",
           "| variant | trained tok/s | x separated sync | step | generate | train | decode steps / step | "
           "idle per lane | token staleness |", "|" + "---|" * 9]
  for v, x in t1.items():
    idle = ", ".join(f"{g} {f:.0%}" for g, f in x["idle"].items())
    lines.append(f"| {v} | {x['tokens_per_s']:,.0f} | {x['tokens_per_s'] / base:.2f} | {x['step_s']:.0f} s | "
                 f"{x['generate_s']:.0f} s | {x['train_s']:.0f} s | {x['decode_steps']:,.0f} | {idle} | "
                 f"{x['staleness']:.2f} |")
  lines += ["", f"Reference system: RL Fusion x{REFERENCE['fusion_vs_separated']:.3f}, RL Fusion + StaleSync "
            f"x{REFERENCE['fusion_stalesync_vs_separated']:.1f}; simulated x{r['fusion_vs_separated']:.2f} and "
            f"x{r['fusion_stalesync_vs_separated']:.2f}.", "",
            "#### Simulated Table 2: 1, 2 and 4 supernodes (weak scaling)", "",
            "| schedule | 1 node tok/s | 2 nodes | 4 nodes | linearity at 2 | linearity at 4 |", "|---|---|---|---|---|---|"]
  for v, by_n in t2.items():
    one = by_n[1]["tokens_per_s"]
    lines.append(f"| {v} | {one:,.0f} | {by_n[2]['tokens_per_s']:,.0f} | {by_n[4]['tokens_per_s']:,.0f} | "
                 f"{by_n[2]['tokens_per_s'] / (2 * one):.0%} | {by_n[4]['tokens_per_s'] / (4 * one):.0%} |")
  lines += ["", f"Reference system: synchronous 25k -> 85k tok/s ({REFERENCE['linearity_4_nodes_sync']:.0%} of "
            f"linear), StaleSync 35k -> 127k ({REFERENCE['linearity_4_nodes_stalesync']:.0%}).", "",
            "#### Sensitivity of the simulated ratios to the assumed figures", "",
            "| assumption | value | fusion / separated | fusion + StaleSync / separated | separated StaleSync / "
            "separated | linearity at 2 nodes, sync | linearity at 2 nodes, StaleSync |", "|---|---|---|---|---|---|---|"]
  for row in sw:
    lines.append(f"| {row['assumption']} | {row['value']:g} | {row['fusion_vs_separated']:.2f} | "
                 f"{row['fusion_stalesync_vs_separated']:.2f} | {row['separated_stalesync_vs_separated']:.2f} | "
                 f"{row['linearity_2_nodes_sync']:.0%} | {row['linearity_2_nodes_stalesync']:.0%} |")
  lines += ["", "#### Assumed figures (none measured here)", "", "| figure | value | source |", "|---|---|---|"]
  lines += [f"| {a} | {v} | {s} |" for a, v, s in cluster.ASSUMPTIONS]
  return "\n".join(lines)


def main(argv):
  del argv
  if not (_ABLATION.value or _CLUSTER.value or _FIT_RUN.value):
    raise app.UsageError("pass --fit_run=DIR, --ablation=PATH (validation), --cluster, or several")
  if _ABLATION.value and not os.path.isfile(_ABLATION.value):
    raise app.UsageError(f"--ablation: {_ABLATION.value} does not exist")
  os.makedirs(_OUT.value, exist_ok=True)
  failed = False
  if _FIT_RUN.value:
    from rl_fusion_jax.sim import fit, measure  # pylint: disable=g-import-not-at-top
    run = measure.load(_FIT_RUN.value, _WARM.value)
    costs = fit.fit_costs([run])
    check = fit.validate(_FIT_RUN.value, run, costs)
    out = {"costs": dataclasses.asdict(costs), "workload": dataclasses.asdict(fit.workload_from_run(run)),
           "schedule": dataclasses.asdict(fit.schedule_from_run(run)), "check": dataclasses.asdict(check)
           | {"step_error": check.step_error, "tokens_error": check.tokens_error}}
    print(json.dumps(out, indent=1))
    with open(os.path.join(_OUT.value, "fit_run.json"), "w") as f:
      json.dump(out, f, indent=1)
  if _ABLATION.value:
    t0 = time.perf_counter()
    from rl_fusion_jax.sim import fit  # pylint: disable=g-import-not-at-top
    v = fit.validate_manifest(_ABLATION.value)
    v["seconds"] = time.perf_counter() - t0
    md = validation_table(v)
    print(md)
    with open(os.path.join(_OUT.value, "validation.md"), "w") as f:
      f.write(md + "\n")
    with open(os.path.join(_OUT.value, "validation.json"), "w") as f:
      json.dump(v, f, indent=1)
    print(f"largest error of the fitted simulation: {v['max_abs_error']:.1%} (tolerance {_TOLERANCE.value:.0%})")
    failed = v["max_abs_error"] > _TOLERANCE.value
  if _CLUSTER.value:
    from rl_fusion_jax.sim import cluster  # pylint: disable=g-import-not-at-top
    t0 = time.perf_counter()
    c = cluster.Cluster()
    t1, t2 = table1(c, _QUICK.value), table2(c, _QUICK.value)
    r = ratios(t1, t2)
    sw = sweep(c, _QUICK.value)
    md = cluster_markdown(t1, t2, r, sw, _QUICK.value)
    print(md)
    with open(os.path.join(_OUT.value, "cluster.md"), "w") as f:
      f.write(md + "\n")
    with open(os.path.join(_OUT.value, "cluster.json"), "w") as f:
      json.dump({"table1": t1, "table2": {v: {str(n): x for n, x in by.items()} for v, by in t2.items()},
                 "ratios": r, "reference": REFERENCE, "sweep": sw, "quick": _QUICK.value,
                 "seconds": time.perf_counter() - t0}, f, indent=1)
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
