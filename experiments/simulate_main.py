r"""The schedule simulator (rl_fusion_jax/sim): validated against measured runs, then at cluster scale.

  python experiments/simulate_main.py --ablation=results/runs/ablation.json --out=/tmp/sim
  python experiments/simulate_main.py --cluster --out=/tmp/sim [--quick]
  python experiments/simulate_main.py --fit_run=RUN_DIR --warm_steps=4 --out=/tmp/sim

--fit_run: the cost parameters fitted to one measured run's metrics.jsonl and timeline.jsonl (the
workload and schedule read from its config.json), and that run re-simulated with them (OUT/fit_run.json).

--ablation (the JSON experiments/ablation_main.py writes; results/runs/ablation.json holds the committed
runs, ~10 s): per workload and deployment (colocated; separated with one process per side) every run is
predicted held out, with costs fitted only on the runs of the other schedule (fit on sync, predict
StaleSync, and the reverse: ``sim/fit.py::validate_manifest``), again held out with costs fitted only on
the other schedule's runs of the same repeat (paired by repeat: made in the same interleaved round), then
simulated in-sample, with costs fitted on all runs (labelled as such). Prints per run the measured and predicted step time and tokens/s, and the
largest held-out error per workload, deployment and predicted schedule; with --sharing_sweep (default) the
separated deployment's held-out errors under other thread counts of the processor-sharing model (~30 s).
Writes OUT/validation.md and OUT/validation.json; exits with status 1 when a held-out step time misses by
more than --tolerance (unless --nofail_on_miss: experiments/report_main.py reports the miss in its tables).

--cluster: Tables 1 and 2 and the sweep at cluster scale (``sim/tables.py``, every input with its source
in ``sim/cluster.py``): Table 1 on one 384-device supernode, Table 2 on 1, 2 and 4 supernodes (weak
scaling) with the terms that grow with the supernodes, and the sweep of the inputs that move it. Writes
OUT/cluster.md and OUT/cluster.json (~4 min; --quick: a smaller workload, fewer steps and one value per swept
input, ~8 s).
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
_QUICK = flags.DEFINE_bool("quick", False, "Cluster: a smaller workload, fewer steps, one value per swept input.")
_SHARING_SWEEP = flags.DEFINE_bool("sharing_sweep", True, "--ablation: also the separated deployment's held-out "
                                   "errors under other processor-sharing thread counts.")
_TOLERANCE = flags.DEFINE_float("tolerance", 0.15, "Largest held-out step-time error a prediction may have.")
_FAIL_ON_MISS = flags.DEFINE_bool("fail_on_miss", True, "Exit with status 1 when a held-out step time misses by "
                                  "more than --tolerance (--nofail_on_miss: the tables still say which miss).")
flags.mark_flags_as_required(["out"])

# Threads: generation, update, push. (1.35, 1.7, 1): the cores generation and the update keep busy alone,
# measured (costs.Sharing's docstring).
SHARING_ALTERNATIVES = ((1, 2, 1), (1.35, 1.7, 1), (1, 1, 1), (2, 2, 1), (1, 2, 2))


def _write(name: str, text: str | None = None, data: dict | None = None) -> None:
  with open(os.path.join(_OUT.value, name), "w") as f:
    if data is not None:
      json.dump(data, f, indent=1)
    else:
      f.write(text + "\n")


def fit_run() -> None:
  from rl_fusion_jax.sim import fit, measure  # pylint: disable=g-import-not-at-top
  run = measure.load(_FIT_RUN.value, _WARM.value)
  costs = fit.fit_costs([run])
  check = fit.validate(_FIT_RUN.value, run, costs)
  out = {"costs": dataclasses.asdict(costs), "workload": dataclasses.asdict(fit.workload_from_run(run)),
         "schedule": dataclasses.asdict(fit.schedule_from_run(run)), "check": dataclasses.asdict(check)
         | {"step_error": check.step_error, "tokens_error": check.tokens_error}}
  print(json.dumps(out, indent=1))
  _write("fit_run.json", data=out)


def _maybe_pct(x: float | None) -> str:
  return "-" if x is None else f"{x:.1%}"


def validation() -> bool:
  """Prints and writes the validation; True when a held-out step time misses by more than --tolerance."""
  from rl_fusion_jax.sim import fit, tables  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  v = fit.validate_manifest(_ABLATION.value)
  md = tables.validation_markdown(v, _TOLERANCE.value)
  if _SHARING_SWEEP.value:
    used = fit.MEASURED_MACHINE
    rows = []
    for g, t, p in SHARING_ALTERNATIVES:
      sharing = dataclasses.replace(used, gen_threads=g, train_threads=t, push_threads=p)
      other = v if sharing == used else fit.validate_manifest(_ABLATION.value, sharing)
      rows.append({"threads": f"{g} / {t} / {p}", "used": sharing == used,
                   "worst": [w for w in fit.worst_held_out(other) if w["mode"] == "separated"]})
    v["sharing_sweep"] = rows
    md += "\n\n" + tables.sharing_markdown(rows)
  v["seconds"] = time.perf_counter() - t0
  print(md)
  _write("validation.md", md)
  _write("validation.json", data=v)
  print(f"largest held-out (cross-schedule) error: step time {v['max_held_out_step_error']:.1%}, tok/s "
        f"{v['max_held_out_tokens_error']:.1%} (tolerance {_TOLERANCE.value:.0%} on step time); paired by "
        f"repeat: {_maybe_pct(v['max_held_out_paired_step_error'])}, "
        f"{_maybe_pct(v['max_held_out_paired_tokens_error'])}; in-sample: "
        f"{v['max_in_sample_step_error']:.1%}, {v['max_in_sample_tokens_error']:.1%}")
  return v["max_held_out_step_error"] > _TOLERANCE.value


def cluster_tables() -> None:
  from rl_fusion_jax.sim import cluster, tables  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  c = cluster.Cluster(work=cluster.QUICK_WORK) if _QUICK.value else cluster.Cluster()
  t1, t2 = tables.table1(c, _QUICK.value), tables.table2(c, _QUICK.value)
  sw = tables.sweep(c, _QUICK.value)
  md = tables.markdown(c, t1, t2, sw, _QUICK.value)
  print(md)
  _write("cluster.md", md)
  t2_json = {v: {"linearity": {str(n): x for n, x in r["linearity"].items()},
                 "replay_linearity": {str(n): x for n, x in r["replay_linearity"].items()},
                 "longest": {str(n): x for n, x in r["longest"].items()},
                 "scaled": {str(n): dataclasses.asdict(s) | {"step_s": s.step_s, "tokens_per_s": s.tokens_per_s}
                            for n, s in r["scaled"].items()}} for v, r in t2.items()}
  _write("cluster.json", data={"table1": t1, "table2": t2_json, "ratios": tables.ratios(t1, t2),
                               "reference": tables.REFERENCE, "sweep": sw, "fixed_terms": tables.fixed_terms(c),
                               "max_len": c.work.max_len, "quick": _QUICK.value,
                               "seconds": time.perf_counter() - t0})


def main(argv):
  del argv
  if not (_ABLATION.value or _CLUSTER.value or _FIT_RUN.value):
    raise app.UsageError("pass --fit_run=DIR, --ablation=PATH (validation), --cluster, or several")
  if _ABLATION.value and not os.path.isfile(_ABLATION.value):
    raise app.UsageError(f"--ablation: {_ABLATION.value} does not exist")
  os.makedirs(_OUT.value, exist_ok=True)
  if _FIT_RUN.value:
    fit_run()
  failed = validation() if _ABLATION.value else False
  if _CLUSTER.value:
    cluster_tables()
  if failed and _FAIL_ON_MISS.value:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
