r"""One command for the ablation report: runs (or reuses) every part and regenerates RESULTS.md.

  python experiments/report_main.py --workdir=/tmp/report --results=RESULTS.md     # every part run, ~45 min
  python experiments/report_main.py --workdir=/tmp/report_r --results=RESULTS.md --from_results
                                                                # the committed data, no runs (~7 min)
  python experiments/report_main.py --workdir=/tmp/report_q --quick                # reduced, a few minutes

Parts, each a binary of its own whose runs are reused when the workdir already holds them:
  1. learning under staleness: experiments/staleness_main.py --workdir=WORKDIR/staleness (its exported
     warm-up is shared with part 2);
  2. measured Table 1: experiments/ablation_main.py --workdir=WORKDIR/ablation;
  3. the simulator, validated on part 2's runs, then Tables 1 and 2 at cluster scale with the sweep:
     experiments/simulate_main.py --ablation=... --cluster --out=WORKDIR/sim.
Writes --results (default WORKDIR/RESULTS.md) and, in --figures (default results/ next to it), the figures
and the data every table is computed from: runs/ (what Table 1 and the simulator read of each measured
run, with the machine it was made on and its logged compiles; runs/ablation.json lists them;
tests/sim_test.py validates the simulator against them) and staleness/export.json (every staleness run's
per-step metrics and machine). When --figures holds staleness_steps/export.json or
staleness_steps_long/export.json (the exports of ``staleness_main.py --task=arithmetic_steps`` and
``--task=arithmetic_steps_long``, committed by hand: the report never makes those runs), each one's table
and curves are rendered into a section of its own. --from_results runs nothing and reads that data back: Table 1 by
``ablation_main.py --from_runs``, the staleness table by ``staleness_main.py --from_export`` (the section
says plainly that the table is absent when no export is there), and the simulator recomputed from runs/
and its stated inputs. --sim_from=DIR takes the simulator's outputs from DIR (made by the simulate command
the report names, on the same runs) instead of recomputing them (~6 min of the ~7).

The machine of each part is the one recorded when its runs were made (RUN/machine.json, written by
ablation_main.py and staleness_main.py), never the machine rendering the report: "not recorded" for runs
made before that record existed. The report leads with the simulator's held-out validation; in-sample
figures are labelled as such; each simulated table says what it can and cannot show; Table 1 marks the
runs whose measured window held a compile and leaves them out of its medians and ratios.
Exits with status 1 when a held-out (cross-schedule) prediction of the simulator misses a measured step
time by more than 15% (a full report that ran its parts only: the quick runs measure 2 steps with their
compiles, which no simulator is held to; a re-render reports what the committed data say); RESULTS.md is
written either way. --quick: every part reduced (see each binary's --quick), parts 1 and 2 run at the same
time; the figures it prints are a check that the pipeline works, not results.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import shutil
import sys
import time

from absl import app, flags

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_WORKDIR = flags.DEFINE_string("workdir", None, "Folder of every part's runs (reused).")
_RESULTS = flags.DEFINE_string("results", "", "The report to write (default WORKDIR/RESULTS.md).")
_FIGURES = flags.DEFINE_string("figures", "", "Folder for the report's figures and data (default: results/ "
                               "next to the report).")
_QUICK = flags.DEFINE_bool("quick", False, "A reduced report in a few minutes.")
_FROM_RESULTS = flags.DEFINE_bool("from_results", False, "Run nothing: render every table from the data in "
                                  "--figures (runs/ablation.json, staleness/export.json) and the simulator.")
_SIM_FROM = flags.DEFINE_string("sim_from", "", "A folder with the simulator's outputs (validation.json/.md, "
                                "cluster.json/.md) for the same runs: used instead of running the simulator.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache of every run ('' disables).")
_TOLERANCE = 0.15
flags.mark_flags_as_required(["workdir"])

RUNS_MANIFEST = os.path.join("runs", "ablation.json")
STALENESS_EXPORT = os.path.join("staleness", "export.json")
# The StaleSync-to-the-same-accuracy studies (staleness_main.py --task=...): folder under --figures -> task;
# each rendered from its committed export when there is one; the report never makes these runs.
STEPS_STUDIES = {"staleness_steps": "arithmetic_steps", "staleness_steps_long": "arithmetic_steps_long"}
SIM_OUTPUTS = ("validation.json", "validation.md", "cluster.json", "cluster.md")


def _shown(text: str) -> str:
  """Paths inside the repository as relative ones (how the commands read in the report)."""
  return text.replace(ROOT + os.sep, "")


def _part(name: str, binary: str, args: list[str], log: str, seconds: dict, commands: dict) -> None:
  shown = _shown(" ".join(["python", f"experiments/{binary}"] + args))
  print(f"[{name}] {shown}", flush=True)
  commands[name] = shown
  seconds[name] = common.run_binary(binary, args, log)


def _copy(src: str, figures: str, rel_base: str) -> str:
  os.makedirs(figures, exist_ok=True)
  dst = os.path.join(figures, os.path.basename(src))
  if os.path.abspath(src) != os.path.abspath(dst):
    shutil.copyfile(src, dst)
  return os.path.relpath(dst, rel_base)


KEPT_METRICS = ("step", "train_tokens", "train_s", "generate_s", "step_s", "response_len_mean",
                "response_len_max", "truncated_frac")
# Written by ablation_main.py next to each run.
RUN_RECORDS = ("machine.json", "compiles.json", "cpu.json", "set_aside.json")


def export_runs(ablation_json: str, dest: str) -> str:
  """Copies what Table 1 and the simulator read of every measured run (config.json, the metrics they use,
  timeline.jsonl, and where recorded the machine and the logged compiles) to DEST/<run>/ and writes
  DEST/ablation.json pointing at them (relative paths), with the command and the wall seconds of the runs:
  the measured data that ablation_main.py --from_runs tabulates and tests/sim_test.py validates against."""
  with open(ablation_json) as f:
    ablation = json.load(f)
  if os.path.isdir(dest):
    shutil.rmtree(dest)
  workdirs = {}
  for w, by_variant in ablation["workdirs"].items():
    for v, dirs in by_variant.items():
      for d in dirs:
        name = os.path.basename(d)
        out = os.path.join(dest, name)
        os.makedirs(out)
        for kept in ("config.json", "timeline.jsonl", "timeline_train.jsonl") + RUN_RECORDS:
          if os.path.isfile(os.path.join(d, kept)):
            shutil.copyfile(os.path.join(d, kept), os.path.join(out, kept))
        with open(os.path.join(d, "metrics.jsonl")) as src, open(os.path.join(out, "metrics.jsonl"), "w") as dst:
          for line in src:
            if line.strip():
              row = json.loads(line)
              keep = {k: x for k, x in row.items() if k in KEPT_METRICS or k.startswith(("engine/", "stalesync/"))}
              dst.write(json.dumps(keep, sort_keys=True) + "\n")
        workdirs.setdefault(w, {}).setdefault(v, []).append(name)
  manifest = ({k: ablation[k] for k in ("warm_steps", "steps", "repeats", "baseline")}
              | {k: ablation.get(k) for k in ("command", "runs_seconds", "max_interference")} | {"workdirs": workdirs})
  with open(os.path.join(dest, "ablation.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  return os.path.join(dest, "ablation.json")


# ------------------------------------------------------------------------------- machines and dates


def _steps_text(steps) -> str:
  """An ablation manifest's measured steps: one count, or per workload."""
  if isinstance(steps, dict):
    return " / ".join(f"{n} ({w})" for w, n in steps.items())
  return str(steps)


def machines_line(records: list) -> str:
  """The machine(s) of a part's runs, from the records made with them ('not recorded' where none is)."""
  known = [r for r in records if r]
  if not known:
    return "not recorded"
  kinds = {}
  for r in known:
    usable = f", {r['usable_cores']} usable" if r.get("usable_cores") not in (None, r["cpu_count"]) else ""
    cpu = r["cpu_model"] + (f", family {r['cpu_family']}" if r.get("cpu_family") is not None else "")
    if r.get("cpu_features") is not None:
      cpu += ": " + (", ".join(r["cpu_features"]) or "no AVX2")
    k = f"{r['cpu_count']} CPU cores{usable} ({cpu})"
    kinds[k] = kinds.get(k, 0) + 1
  out = "; ".join(k + (f" ({n} runs)" if len(kinds) > 1 else "") for k, n in kinds.items())
  loads = [r["load_avg_1m"] for r in known if r.get("load_avg_1m") is not None]
  if loads:
    out += f", 1-minute load average {min(loads):.1f}-{max(loads):.1f} as the runs started"
  commits = sorted({r["commit"][:9] + ("+modified" if r["commit"].endswith("+modified") else "")
                    for r in known if r.get("commit")})
  if commits:
    out += ", commit " + ", ".join(commits)
  if len(known) < len(records):
    out += f"; not recorded for {len(records) - len(known)} of {len(records)} runs"
  return out


def _utc(t: float) -> datetime.datetime:
  return datetime.datetime.fromtimestamp(t, datetime.timezone.utc)


def made_line(span) -> str:
  """'2026-12-02 22:29-22:37 UTC' from [first, last] unix times, or 'not recorded'."""
  if not span:
    return "not recorded"
  a, b = _utc(span[0]), _utc(span[1])
  return (f"{a:%Y-%m-%d %H:%M}-" + (f"{b:%H:%M}" if a.date() == b.date() else f"{b:%Y-%m-%d %H:%M}") + " UTC")


def _seconds(x) -> str:
  return "not recorded" if x is None else f"{x:.0f}"


# ------------------------------------------------------------------------------------------- Table 1


def _ratio(r: dict, b: dict) -> str:
  """r's trained tok/s over b's; marked, with the steady ratio, when either row has no compile-free run."""
  raw = r["trained_tokens_per_s"] / b["trained_tokens_per_s"]
  out = f"x{raw:.2f}"
  if r.get("all_contaminated") or b.get("all_contaminated"):
    steady = r["trained_tokens_per_s_steady"] / b["trained_tokens_per_s_steady"]
    out += " †" + (f" (x{steady:.2f} without the 3x-median steps' excess)" if f"{steady:.2f}" != f"{raw:.2f}" else "")
  return out


def table1_findings(rows: dict, baseline: str) -> list[str]:
  out = []
  for workload, by_variant in rows.items():
    base = by_variant[baseline]
    parts = [f"{v} {_ratio(r, base)}" for v, r in by_variant.items() if v != baseline]
    line = f"* {workload}: against {baseline} ({base['trained_tokens_per_s']:,.0f} tok/s): " + ", ".join(parts)
    if "colocated_stalesync" in by_variant and "colocated_sync" in by_variant:
      line += f"; colocated_stalesync / colocated_sync {_ratio(by_variant['colocated_stalesync'], by_variant['colocated_sync'])}"
    out.append(line + ".")
  return out


def compile_findings(rows: dict) -> list[str]:
  """Which runs the medians left out (a compile in the window), which rows had no other, and how compiles
  were detected."""
  left_out, kept, logged, runs = [], [], 0, 0
  for workload, by_variant in rows.items():
    for v, r in by_variant.items():
      marks = r.get("contaminated_runs", [])
      windows = r.get("compile_window_s_runs", [None] * len(marks))
      runs += len(marks)
      logged += sum(x is not None for x in windows)
      if r.get("all_contaminated"):
        kept.append(f"{workload} {v}")
      else:
        left_out += [f"{workload} {v} repeat {i}" for i, bad in enumerate(marks) if bad]
  if not logged:
    how = ("by the 3x-median test, the only one for these runs: they were made before ablation_main.py logged "
           "compiles")
  elif logged == runs:
    how = "compile seconds logged for every run"
  else:
    how = f"compile seconds logged for {logged} of {runs} runs, the 3x-median test for the rest"
  if not left_out and not kept:
    return [f"* No measured window held a compile ({how})."]
  out = []
  if left_out:
    out.append(f"* Left out of the medians and ratios, a compile in the measured window ({how}): "
               + "; ".join(left_out) + ".")
  if kept:
    out.append("* Every run of these rows had a compile in its measured window, so their figures include it "
               f"(marked †; {how}): " + ", ".join(kept) + ".")
  return out


def interference_findings(rows: dict, limit: float | None = None) -> list[str]:
  """What other processes and the hypervisor (steal) took of the machine's CPU inside the measured windows
  (RUN/cpu.json, sampled while each run was made; nothing for runs made without it), and the runs made
  again because it was over ``limit`` (the manifest's ``max_interference``)."""
  seen = [(f"{w} {v} repeat {i}", x) for w, by in rows.items() for v, r in by.items()
          for i, x in enumerate(r.get("interference_runs") or []) if x is not None]
  if not seen:
    return []
  share = common.interference_share
  name, worst = max(seen, key=lambda item: share(item[1]))
  line = (f"* Other processes and steal inside the measured windows ({len(seen)} runs sampled): at most "
          f"{share(worst):.1%} of the machine's CPU seconds ({name}: other processes {worst['other_share']:.1%}, "
          f"steal {worst['steal_share']:.1%}).")
  remade = [(f"{w} {v} repeat {i}", k) for w, by in rows.items() for v, r in by.items()
            for i, k in enumerate(r.get("remeasured_runs") or []) if k]
  still = [f"{w} {v} repeat {i}" for w, by in rows.items() for v, r in by.items()
           for i, d in enumerate(r.get("disturbed_runs") or []) if d]
  if remade:
    line += (f" {len(remade)} run{'s' if len(remade) != 1 else ''} had over {limit:.0%} taken in their window and "
             f"{'were' if len(remade) != 1 else 'was'} made again (`ablation_main.py --max_interference`): "
             + ", ".join(f"{name} ({k} attempt{'s' if k != 1 else ''} set aside)" for name, k in remade) + ".")
  if still:
    line += f" Still over {limit:.0%} after the last attempt, kept: " + ", ".join(still) + "."
  if share(worst) < 0.02:
    line += " The spread between repeats is not load that this machine's own counters can see."
  return [line]


TABLE1_NOTE = (
    "*Can show*: the four deployments' throughput on this small model on the machine named above, the "
    "variants interleaved so that a drift of the machine's load hits each alike, with the spread between "
    "repeats (per run, in the table). *Cannot show*: throughput on accelerators or at scale (CPU cores as "
    "devices: the separated deployment gives each process half of them, and the two processes share the "
    "machine's memory bandwidth), or a difference smaller than the spread between repeats of one variant.")


def variant_settings(ablation: dict) -> str:
  """Each variant's schedule as its first run's config.json records it (StaleSync bound, train fraction,
  kept KV cache), so the table says what was run, not what the binary does today."""
  out = []
  for variant, dirs in next(iter(ablation["workdirs"].values()), {}).items():
    try:
      with open(os.path.join(dirs[0], "config.json")) as f:
        cfg = json.load(f)
    except (OSError, IndexError, ValueError):
      out.append(f"`{variant}` (config not found)")
      continue
    st, keep = cfg.get("stalesync", {}), cfg.get("rollout", {}).get("keep_cache", False)
    s = st.get("max_staleness", 0) if st.get("enabled") else 0
    text = f"s = {s}" + (f", f = {st.get('train_fraction')}" if s else "") + (", `rollout.keep_cache`" if keep else "")
    out.append(f"`{variant}` {text}")
  return "; ".join(out)


def staleness_findings(results: dict) -> list[str]:
  """Per algorithm and arm: the final accuracy against sync's, in points and against the seed spread."""
  import statistics  # pylint: disable=g-import-not-at-top
  out = []
  for algo, by_arm in results.items():
    final = {arm: [r["points"][-1]["accuracy"] for r in runs] for arm, runs in by_arm.items()}
    if "sync" not in final:
      continue
    sync = final["sync"]
    spread = statistics.stdev(sync) if len(sync) > 1 else 0.0
    parts = []
    for arm, values in final.items():
      if arm == "sync":
        continue
      delta = statistics.fmean(values) - statistics.fmean(sync)
      beyond = spread and abs(delta) > 2 * spread
      parts.append(f"{arm} {100 * delta:+.1f}{' (beyond 2 sync std)' if beyond else ''}")
    out.append(f"* {algo}: sync {statistics.fmean(sync):.3f} (std {spread:.3f} over {len(sync)} seeds); "
               "final accuracy minus sync's, in points: " + ", ".join(parts) + ".")
  return out


def steps_short(stale: dict) -> str:
  """Per StaleSync arm of a staleness study: its median step against sync's and the RL seconds it took to
  reach the sync run's final accuracy over sync's (``time_to_sync`` of staleness.json: mean over the seeds
  that got there), next to the sync run's own ratio, and the RL seconds of its whole sample budget over
  sync's (``rl_seconds_to_sync``: mean of the per-seed ratios)."""
  import statistics  # pylint: disable=g-import-not-at-top
  out = []
  for algo, by_arm in stale["results"].items():
    if "sync" not in by_arm:
      continue
    def to_goal(arm):
      ratios = stale["time_to_sync"][algo][arm]
      got = [x for x in ratios if x is not None]
      return (f"{statistics.fmean(got):.2f}" if got else "-") + f" ({len(got)}/{len(ratios)} seeds)"
    step = lambda runs: (statistics.fmean(r["median_step_s"] for r in runs)
                         if all(r.get("median_step_s") for r in runs) else None)
    base = step(by_arm["sync"])
    whole = stale.get("rl_seconds_to_sync", {}).get(algo, {})
    parts = [f"sync itself {to_goal('sync')}"]
    for arm, runs in by_arm.items():
      if arm != "sync":
        ratio = f"median step x{step(runs) / base:.2f} sync's, " if base and step(runs) else ""
        if whole.get(arm):
          ratio += f"RL seconds of the whole budget x{statistics.fmean(whole[arm]):.2f} sync's, "
        parts.append(f"{arm}: {ratio}to sync's final accuracy in {to_goal(arm)} of sync's RL seconds")
    out.append("; ".join(parts))
  return " ".join(out)


def _span(times: list) -> list | None:
  return [min(times), max(times)] if times else None


def _read(path: str) -> str:
  with open(path) as f:
    return f.read().strip()



# ------------------------------------------------------------------------------------------- simulator

REFERENCE_SYSTEM = (
    "The reference system is the RL Fusion / StaleSync / DistQueue design this project implements, on "
    "supernodes of 384 accelerators. It reports RL Fusion at 1.785x its separated baseline, RL Fusion + "
    "StaleSync at 2.5x, and scaling from 1 to 4 supernodes at 85% of linear synchronous (25k -> 85k tok/s) "
    "and 91% with StaleSync (35k -> 127k tok/s). Apart from the supernode's size, none of its figures enters "
    "the simulator: they are printed beside the simulated ones.")

CAN_AND_CANNOT = [
    "What the simulator can show:",
    "",
    "* The engine's work per update for a configuration and its length draws: decode steps, chunks, in-chunk "
    "refills, host prefill calls, prefill tokens (`sim/engine.py` replays `rollout/engine.py`; "
    "tests/sim_test.py and tests/stalesync_test.py check every count against the real engine).",
    "* Step time and trained tok/s of the runs measured here (the tiny model, both workloads, sync and "
    "StaleSync, colocated and separated, on the machine of the runs) from a cost model fitted on the other "
    "schedule's runs, within the held-out errors above.",
    "* At cluster scale, what follows from its inputs: how the schedules' step times respond to them (a "
    "what-if), and which inputs move Table 2's linearity and by how much.",
    "",
    "What it cannot show:",
    "",
    "* Throughput at cluster scale. No cost figure at that scale was measured; every figure in the cluster "
    "tables is a consequence of the inputs listed with their sources, and agreeing or disagreeing with the "
    "reference system's figures validates nothing.",
    "* Run-to-run variation of a shared machine (in these runs up to {spread:.0%} in step time between repeats of "
    "one configuration), compiles, memory limits, failures, network congestion, and learning (the staleness "
    "study measures accuracy under staleness).",
    "* Thread usage: the separated deployment's processor sharing is a stated model of a 2-core machine "
    "(`fit.MEASURED_MACHINE`; 1 / 2 / 1 busy threads for generation / update / push), not a measurement, "
    "and the held-out "
    "errors of that deployment depend on it (table above); its thread counts were chosen after the "
    "StaleSync residuals had been seen, though not fitted to them. Measured alone on one device "
    "(`experiments/benchmark_main.py`'s `generate_cores` and `train_cores`: process CPU seconds per wall "
    "second), generation keeps 1.35 cores busy on the long tail (1.22 on the arithmetic task from a random "
    "init) and the update 1.70 (1.75): the count of 1 for generation is contradicted, and as thread counts "
    "the measured figures give the row 1.35 / 1.7 / 1 of the table above. Against processes that keep a core "
    "busy (`benchmark_main.py --spinners`), the update slowed by up to 2.1x beside one of them, more than "
    "processor sharing allows any thread count (1.5x), and the same measurement repeated moved by a third: "
    "no measured thread count replaces the stated ones.",
    "* Per-group rollout engines with their own queues: the replay is this codebase's one SPMD engine over "
    "all replicas. Table 2's tail barrier is the expected longest sample over all of a step's draws (the "
    "same as the slowest group's longest when every sample has a slot), and StaleSync's is a first-order "
    "1 / (s + 1) of it, not a replay.",
    "* Stragglers: off by default (no per-device figure we could check); they slow both schedules alike, "
    "so they cannot make StaleSync scale better than synchronous training.",
]


def held_out_findings(validation: dict) -> list[str]:
  """Each held-out miss beyond the tolerance, with the measured step times of the same configuration's
  other repeats."""
  from rl_fusion_jax.sim import fit  # pylint: disable=g-import-not-at-top
  out = []
  for c in validation["checks"]:
    x = c["held_out"]
    if x and abs(x["step_error"]) > _TOLERANCE:
      others = [o["measured_step_s"] for o in validation["checks"] if o["workload"] == c["workload"]
                and o["variant"] == c["variant"] and o["repeat"] != c["repeat"]]
      runs = [c["measured_step_s"], *others]
      floor = fit.spread_floor(runs)
      if floor <= _TOLERANCE:
        window = (f"a value within {_TOLERANCE:.0%} of every one of them would have to lie in "
                  f"{(1 - _TOLERANCE) * max(runs):.4f}-{(1 + _TOLERANCE) * min(runs):.4f} s")
      else:
        window = f"no value is within {_TOLERANCE:.0%} of every one of them"
      out.append(f"* Miss: {c['workload']} {c['variant']} repeat {c['repeat']}, predicted from the "
                 f"{c['fitted_on']} runs {x['simulated_step_s']:.3f} s a step, measured {c['measured_step_s']:.3f} s "
                 f"({x['step_error']:+.1%}); the other repeats of the same configuration measured "
                 + " and ".join(f"{o:.3f} s" for o in others)
                 + f": one value can come no closer than {floor:.1%} to all of them, and {window}.")
  return out


def repeat_spread(validation: dict) -> float:
  """The largest (slowest / fastest - 1) measured step time among the repeats of one configuration."""
  by = {}
  for c in validation["checks"]:
    by.setdefault((c["workload"], c["variant"]), []).append(c["measured_step_s"])
  return max(max(x) / min(x) - 1 for x in by.values())


def table2_findings(cluster_json: dict) -> list[str]:
  """What Table 2 predicts and, per swept input, the range of the linearity on 4 supernodes."""
  r = cluster_json["ratios"]
  out = [f"* Under the default inputs Table 2 gives {r['linearity_4_nodes_sync']:.1%} of linear on 4 supernodes "
         f"synchronous and {r['linearity_4_nodes_stalesync']:.1%} with StaleSync (reference system: "
         f"{cluster_json['reference']['linearity_4_nodes_sync']:.0%} and "
         f"{cluster_json['reference']['linearity_4_nodes_stalesync']:.0%}): a consequence of the inputs, not a "
         "measurement (the table's note says why)."]
  sync = cluster_json["table2"]["colocated_sync"]
  four, longest = sync["scaled"]["4"], sync["longest"]
  out.append(f"* Why, synchronous on 4 supernodes: the expected longest response of a step is {longest['1']:,.0f} "
             f"tokens on 1 supernode and {longest['4']:,.0f} on 4 (cap {cluster_json['max_len']:,}), a tail barrier "
             f"of {four['barrier_s']:.2f} s; all-reduce {1e3 * four['allreduce_s']:.1f} ms, weight publication "
             f"{1e3 * four['publish_s']:.1f} ms, DistQueue {1e3 * four['queue_s']:.3f} ms, straggler factor "
             f"{four['straggler']:.3f}; against a step of {four['step_s']:.1f} s.")
  by_input = {}
  for row in cluster_json["sweep"]:
    by_input.setdefault((row["input"], row["tail"]), []).append(row)
  for (name, tail), rows in by_input.items():
    rng = lambda k: f"{min(x[k] for x in rows):.1%}-{max(x[k] for x in rows):.1%}"
    out.append(f"* {name} ({', '.join(x['value'] for x in rows)}; length distribution {tail}): sync "
               f"{rng('linearity_4_sync')}, StaleSync {rng('linearity_4_stalesync')}.")
  return out


def _note(can: str, cannot: str) -> str:
  return f"*Can show*: {can} *Cannot show*: {cannot}"


def validation_notes(spread: float) -> dict[str, str]:
  """Per validation table (by heading): what it can and cannot show."""
  return {
      "Held out": _note(
          "whether costs fitted on one schedule's runs predict the other schedule's runs (which the fit never "
          "saw) of the same model, workload and deployment, on the machine that made them.",
          f"a prediction on another machine, model or scale; closer agreement than the runs' own spread "
          f"(repeats of one configuration differ by up to {spread:.0%} in step time)."),
      "In-sample": _note(
          "how closely the cost model's form can describe these runs.",
          "a prediction: the run compared is among those fitted (quote the held-out table above)."),
      "Separated deployment": _note(
          "how much the separated deployment's held-out errors depend on the processor-sharing model's thread "
          "counts.",
          "that the counts used are right: they come from the code's structure but were chosen after the "
          "StaleSync residuals had been seen."),
  }


def tail_clause(cluster_json: dict) -> str:
  """Why Table 2's tail barrier grows or not, from the expected longest response on 1 and 4 supernodes."""
  four = cluster_json["table2"]["colocated_sync"]["scaled"]["4"]
  longest = cluster_json["table2"]["colocated_sync"]["longest"]
  cap = cluster_json["max_len"]
  if longest["1"] == longest["4"]:
    return (f"the expected longest response is the same ({longest['1']:,.0f} tokens"
            + (", the length cap" if longest["1"] == cap else "") + f") on 1 and on 4 supernodes, so the tail "
            f"barrier does not grow ({four['barrier_s']:.2f} s)")
  return (f"the expected longest response grows from {longest['1']:,.0f} to {longest['4']:,.0f} tokens, a tail "
          f"barrier of {four['barrier_s']:.2f} s")


def table2_short(cluster_json: dict) -> str:
  """One sentence: Table 2's linearity and what in the model makes it."""
  r = cluster_json["ratios"]
  four = cluster_json["table2"]["colocated_sync"]["scaled"]["4"]
  cross = four["allreduce_s"] + four["publish_s"] + four["queue_s"]
  return (f"Table 2's linearity on 4 supernodes ({r['linearity_4_nodes_sync']:.1%} synchronous, "
          f"{r['linearity_4_nodes_stalesync']:.1%} StaleSync) follows from the model: {tail_clause(cluster_json)}, "
          f"and its assumed cross-supernode costs add {1e3 * cross:.0f} ms to a step of {four['step_s']:.0f} s")


def cluster_notes(cluster_json: dict, cluster_md: str) -> dict[str, str]:
  """Per cluster table (by heading): what it can and cannot show, with the figures that decide it."""
  ref, r = cluster_json["reference"], cluster_json["ratios"]
  four = cluster_json["table2"]["colocated_sync"]["scaled"]["4"]
  tail = tail_clause(cluster_json)
  labels = {}
  for line in cluster_md.split("#### Cluster inputs", 1)[-1].splitlines():
    cells = [c.strip() for c in line.split("|")]
    if len(cells) > 3 and ":" in cells[3]:
      label = cells[3].split(":")[0].split(" ")[0]
      labels[label] = labels.get(label, 0) + 1
  counts = ", ".join(f"{n} {k}" for k, n in sorted(labels.items(), key=lambda kv: -kv[1]))
  return {
      "Simulated Table 1": _note(
          "the four schedules replayed step by step on one supernode (this codebase's engine and schedules) "
          "under the prices the inputs below give (datasheet figures times ASSUMED efficiencies, an ASSUMED "
          "workload): which phases dominate, and how co-location and StaleSync change them under those prices.",
          "the throughput of any real cluster. No cost here was measured or fitted at this scale (the held-out "
          "validation above is of the tiny model on CPU cores, and its fitted costs are not used here), so the "
          "ratios move with the ASSUMED inputs; agreement or disagreement with the reference system's "
          f"x{ref['fusion_vs_separated']:.3f} / x{ref['fusion_stalesync_vs_separated']:.1f} (simulated "
          f"x{r['fusion_vs_separated']:.2f} / x{r['fusion_stalesync_vs_separated']:.2f}) validates nothing."),
      "Simulated Table 2": _note(
          "how the one-supernode step grows under the effects the model makes grow with the supernodes (tail "
          "barrier, all-reduce, weight publication, DistQueue reads, stragglers), each a stated function of "
          "the inputs.",
          f"how a real cluster scales. Its linearity on 4 supernodes ({r['linearity_4_nodes_sync']:.1%} "
          f"synchronous, {r['linearity_4_nodes_stalesync']:.1%} StaleSync) follows from the model's "
          f"assumptions: {tail}, and the assumed cross-supernode costs are milliseconds (all-reduce "
          f"{1e3 * four['allreduce_s']:.1f} ms, weight publication {1e3 * four['publish_s']:.1f} ms, DistQueue "
          f"{1e3 * four['queue_s']:.3f} ms) against a step of {four['step_s']:.0f} s; the straggler factor is "
          f"{four['straggler']:.3f}{' (stragglers off)' if four['straggler'] == 1 else ''}. What the model "
          "leaves out (congestion, per-group rollout engines with their own queues, "
          "failures, a fabric slower than cited) cannot lower it. The last column checks the tail barrier only."),
      "What moves Table 2": _note(
          "which of the model's inputs move its linearity and how far, each varied alone (the others at their "
          "defaults, and again under an uncapped tail where the tail barrier can act); the table after it, "
          "the cross-supernode terms too small to move it under the cited bandwidths.",
          "what moves a real cluster's linearity: an effect the model lacks has no row, and every range is "
          "within the model's stated form."),
      "Cluster inputs": _note(
          f"every input of the cluster tables and where its value comes from ({counts}).",
          "that any of them holds on a given cluster: none was measured on one."),
  }


def with_notes(md: str, notes: dict[str, str]) -> str:
  """MD with each table's note under its '#### ' heading (matched by the heading's start)."""
  out = []
  for line in md.split("\n"):
    out.append(line)
    if line.startswith("#### "):
      note = next((n for prefix, n in notes.items() if line[5:].startswith(prefix)), None)
      if note:
        out += ["", note]
  return "\n".join(out)


def held_out_errors(validation: dict, kind: str = "held_out", bold: bool = True) -> str | None:
  """'**16.1%** on step time (20.0% on tok/s); 23 of 24 runs within 15%' for the checks of ``kind``
  ("held_out" or "held_out_paired"); None where no check has it (a validation made before pairing)."""
  held = [c for c in validation["checks"] if c.get(kind)]
  if not held:
    return None
  good = sum(abs(c[kind]["step_error"]) <= _TOLERANCE for c in held)
  step = f"{validation[f'max_{kind}_step_error']:.1%}"
  return (f"{f'**{step}**' if bold else step} on step time "
          f"({validation[f'max_{kind}_tokens_error']:.1%} on tok/s); {good} of {len(held)} runs within "
          f"{_TOLERANCE:.0%} on step time")


def paired_sentence(validation: dict) -> str:
  paired = held_out_errors(validation, "held_out_paired", bold=False)
  return "" if paired is None else (
      f" **Paired by repeat** (each run predicted from the other schedule's run of the same interleaved round "
      f"only, made minutes apart, so that a drift of the machine's speed between rounds reaches both; still "
      f"held out): {paired}.")


def held_out_summary(validation: dict) -> str:
  held = [c for c in validation["checks"] if c["held_out"]]
  return (f"costs fitted on one schedule's runs predict the other schedule's runs ({len(held)} in all) with "
          f"a largest error of {held_out_errors(validation)}")


def simulator_sections(validation: dict, sim: str) -> list[str]:
  """RESULTS.md's simulator sections: the held-out validation first, then in-sample (labelled), each table
  with what it can and cannot show, and the cluster tables likewise."""
  with open(os.path.join(sim, "cluster.json")) as f:
    cluster_json = json.load(f)
  cluster_md = _read(os.path.join(sim, "cluster.md"))
  spread = repeat_spread(validation)
  return [
      "## The simulator, validated against the measured runs",
      "",
      "`rl_fusion_jax/sim/` (no JAX) replays the engine's slot scheduling and the schedules step by step and "
      "prices each step with costs fitted on measured runs (`sim/fit.py`): per decode step, per host call "
      "(a decode chunk or a host prefill call, one shared cost), per in-chunk refill, per rollout phase, per "
      "trained token, and the host time between phases. The generation costs are fitted over the decode "
      "chunks (the engine records each chunk's seconds, decode steps and refills as per-phase sums), so a "
      "chunk's cost and a decode step's are told apart even when every phase of a run has the same counts; "
      "in the separated deployment each phase is first "
      "scaled to its time alone by a processor-sharing model of the two processes on the measuring machine's "
      "cores (`costs.Sharing`).",
      "",
      f"**Held out (cross-schedule), the figure to quote**: per workload and deployment, costs fitted on the "
      f"synchronous runs only predict the StaleSync runs, and costs fitted on the StaleSync runs predict the "
      f"synchronous ones. Largest held-out error {held_out_errors(validation)}." + paired_sentence(validation),
      "",
      *held_out_findings(validation),
      "",
      f"**In-sample** (fitted on all runs of the workload and deployment, the compared run included: how well "
      f"the model describes the runs, not a prediction): largest in-sample error "
      f"{validation['max_in_sample_step_error']:.1%} on step time ({validation['max_in_sample_tokens_error']:.1%} "
      "on tok/s).",
      "",
      with_notes(_read(os.path.join(sim, "validation.md")), validation_notes(spread)),
      "",
      REFERENCE_SYSTEM,
      "",
      *[line.format(spread=spread) for line in CAN_AND_CANNOT],
      "",
      "## Tables 1 and 2, simulated at cluster scale",
      "",
      "Every input is listed below with its source (`sim/cluster.py`); none was measured at cluster scale. "
      "The schedules and the engine's slot scheduling are the simulator's replay of this codebase's; Table 2 "
      "adds to the one-supernode replay the effects that grow with the supernodes (`cluster.scaled`). "
      "Each table says what it can and cannot show.",
      "",
      *table2_findings(cluster_json),
      "",
      with_notes(cluster_md, cluster_notes(cluster_json, cluster_md)),
      "",
  ]


# --------------------------------------------------------------------------------- learning under staleness


def staleness_section(stale: dict | None, curves: list[str], data: str, make: str,
                      heading: str = "## Learning under staleness") -> list[str]:
  """The staleness study from its data, or a plain statement that its table is absent."""
  head = [heading, ""]
  if stale is None:
    return head + [
        f"**Absent until its runs are made.** No per-step metrics of the study are committed ({data} does not "
        "exist), so there is no table to compute. The table of earlier reports (GRPO and PPO, synchronous and "
        "StaleSync s = 1, 2, 4 with and without correction, 3 seeds) came from runs whose metrics were never "
        "committed, made with an earlier engine; it cannot be recomputed and is not repeated here (git history "
        "keeps it). To make the study and commit its data:",
        "",
        "```",
        *make.splitlines(),
        "```",
        ""]
  s = stale["settings"]
  task = s.get("task", "arithmetic")
  out = head + [
      f"Data: `{data}` (every run's per-step metrics). Made by `{stale.get('command') or 'not recorded'}`; "
      f"machine: {machines_line(stale.get('machines') or [])}; seconds its runs took: "
      f"{_seconds(stale.get('runs_seconds'))}.",
      "",
      f"{'The main job' + chr(39) + 's task' if task == 'arithmetic' else f'The `{task}` task'} from one shared "
      f"warm-up ({s['warmup_steps']} "
      f"supervised steps, exported and loaded with `model.hf_path`), then {s['steps']} RL steps x 128 samples in "
      f"every arm (equal sample budget), held-out greedy accuracy on {s['eval_problems']} problems every "
      f"{s['eval_every']} steps, seeds {s['seeds']}. StaleSync arms: s in {s['staleness']}, train_fraction "
      "1 / (s + 1); corrected = `decoupled_ppo`, uncorrected = `uncorrected` (the behaviour policy never enters "
      "the loss). Table: final accuracy, mean +- standard deviation across seeds.",
      "",
      *([("Arm suffixes: `_same_slots` runs on the synchronous arm's 128 engine slots (the outstanding groups "
          "beyond them wait queued), `_keep_cache` keeps the carried samples' KV cache through the update "
          "(`rollout.keep_cache`: no re-prefill; each token's version and behaviour log-prob are recorded as "
          "sampled). RL seconds and median steps count from step 2 (step 1 is mostly compiles)."), ""]
        if any(arm.endswith(("_same_slots", "_keep_cache")) for by_arm in stale["results"].values()
               for arm in by_arm) else []),
      _note("each arm's final held-out accuracy at an equal sample budget on this task and model, against the "
            "spread of the seeds.",
            "a difference smaller than that spread, other tasks or model sizes, or wall-clock at scale (RL "
            "seconds are of the machine named, as loaded while the runs were made)."),
      "",
      _read(stale["md"]),
      "",
      *staleness_findings(stale["results"]),
      *(["* The second table's criterion (StaleSync at sync's final accuracy within 0.75x of sync's RL "
         "seconds) is read against its `sync` row: where the synchronous run itself reached its final accuracy "
         "early (a curve that flattens), every arm's ratio is small, and the median step time and the "
         "second-half mean say more."] if task != "arithmetic" else []),
      ""]
  out += [f"![accuracy vs samples]({curves[0]})", f"![accuracy vs wall-clock]({curves[1]})", ""]
  return out


def main(argv):
  del argv
  root = os.path.abspath(_WORKDIR.value)
  results = os.path.abspath(_RESULTS.value or os.path.join(root, "RESULTS.md"))
  figures = os.path.abspath(_FIGURES.value or os.path.join(os.path.dirname(results), "results"))
  if _FROM_RESULTS.value and _QUICK.value:
    raise app.UsageError("--from_results renders committed data; --quick makes reduced runs: pass one")
  os.makedirs(root, exist_ok=True)
  quick = ["--quick"] if _QUICK.value else []
  cache = [f"--compilation_cache={_CACHE.value}"]
  seconds, commands, t0 = {}, {}, time.perf_counter()
  st, ab, sim = (os.path.join(root, p) for p in ("staleness", "ablation", "sim"))
  runs_manifest, stale_export = os.path.join(figures, RUNS_MANIFEST), os.path.join(figures, STALENESS_EXPORT)
  studies = [(name, task, os.path.join(figures, name, "export.json"), os.path.join(root, name))
             for name, task in STEPS_STUDIES.items() if os.path.isfile(os.path.join(figures, name, "export.json"))]
  for name, task, export, out in studies:
    _part(f"StaleSync to the same accuracy ({task})", "staleness_main.py",
          [f"--from_export={export}", f"--workdir={out}"], os.path.join(root, f"{name}.log"), seconds, commands)
  if _FROM_RESULTS.value:
    if not os.path.isfile(runs_manifest):
      raise app.UsageError(f"--from_results: {runs_manifest} does not exist (run the full report once)")
    _part("measured Table 1", "ablation_main.py", [f"--from_runs={runs_manifest}", f"--workdir={ab}"],
          os.path.join(root, "ablation.log"), seconds, commands)
    have_stale = os.path.isfile(stale_export)
    if have_stale:
      _part("learning under staleness", "staleness_main.py", [f"--from_export={stale_export}", f"--workdir={st}"],
            os.path.join(root, "staleness.log"), seconds, commands)
    manifest = runs_manifest
  else:
    parts = [("learning under staleness", "staleness_main.py", [f"--workdir={st}"] + quick + cache,
              os.path.join(root, "staleness.log")),
             ("measured Table 1", "ablation_main.py",
              [f"--workdir={ab}", f"--warmup_hf={os.path.join(st, 'warmup_hf')}"] + quick + cache,
              os.path.join(root, "ablation.log"))]
    if _QUICK.value:
      # The quick ablation needs no warm-up (long-tail workload only): both parts at once. They share the
      # machine, which a check of the pipeline can afford and a measurement cannot.
      with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(_part, *p, seconds, commands) for p in parts]:
          f.result()
    else:
      for p in parts:
        _part(*p, seconds, commands)
    have_stale = True
    manifest = os.path.join(ab, "ablation.json")
  sim_args = [f"--ablation={manifest}", "--cluster", f"--out={sim}", "--nofail_on_miss"] + quick
  if _SIM_FROM.value:
    os.makedirs(sim, exist_ok=True)
    for name in SIM_OUTPUTS:
      _copy(os.path.join(_SIM_FROM.value, name), sim, sim)
    commands["simulator"] = _shown(" ".join(["python", "experiments/simulate_main.py"] + sim_args))
    seconds["simulator"] = None
  else:
    _part("simulator", "simulate_main.py", sim_args, os.path.join(root, "sim.log"), seconds, commands)

  with open(os.path.join(ab, "ablation.json")) as f:
    ablation = json.load(f)
  with open(os.path.join(sim, "validation.json")) as f:
    validation = json.load(f)
  with open(os.path.join(sim, "cluster.json")) as f:
    cluster_json = json.load(f)
  stale = None
  if have_stale:
    with open(os.path.join(st, "staleness.json")) as f:
      stale = json.load(f) | {"md": os.path.join(st, "staleness.md")}
  loaded = []   # (task, staleness.json + md, export path)
  for name, task, export, out in studies:
    with open(os.path.join(out, "staleness.json")) as f:
      loaded.append((name, task, json.load(f) | {"md": os.path.join(out, "staleness.md")}, export, out))
  base = os.path.dirname(results)
  study_curves = {}
  for name, _, _, _, out in loaded:
    os.makedirs(figures, exist_ok=True)
    for k in ("samples", "wallclock"):
      dst = os.path.join(figures, f"{name}_{k}.png")
      shutil.copyfile(os.path.join(out, f"staleness_{k}.png"), dst)
      study_curves.setdefault(name, []).append(os.path.relpath(dst, base))
  bars = _copy(os.path.join(ab, "table1.png"), figures, base)
  timelines = [_copy(os.path.join(ab, f"timeline_{w}_{v}.png"), figures, base)
               for w in ablation["rows"] for v in ablation["rows"][w]]
  curves = ([_copy(os.path.join(st, f"staleness_{k}.png"), figures, base) for k in ("samples", "wallclock")]
            if stale else [])
  if not _FROM_RESULTS.value:   # the data every table is computed from, next to the figures
    export_runs(os.path.join(ab, "ablation.json"), os.path.join(figures, "runs"))
    os.makedirs(os.path.dirname(stale_export), exist_ok=True)
    shutil.copyfile(os.path.join(st, "staleness_export.json"), stale_export)
  err = validation["max_held_out_step_error"]
  within = err <= _TOLERANCE
  seconds["total"] = time.perf_counter() - t0
  rel = lambda p: os.path.relpath(p, base)
  report_cmd = " ".join(["python experiments/report_main.py", f"--workdir={_WORKDIR.value}"]
                        + ([f"--results={_RESULTS.value}"] if _RESULTS.value else [])
                        + (["--from_results"] if _FROM_RESULTS.value else []) + quick)
  machine_t1 = machines_line(ablation.get("machines") or [])
  stale_make = "\n".join([
      "python experiments/staleness_main.py --workdir=/tmp/staleness   # 42 runs and a warm-up: about an hour on 2 cores",
      f"mkdir -p {os.path.dirname(rel(stale_export))} && cp /tmp/staleness/staleness_export.json {rel(stale_export)}",
      "python experiments/report_main.py --from_results --workdir=/tmp/report_r --results=RESULTS.md"])
  in_this = lambda name: ("reused (that command's outputs)" if seconds.get(name) is None and name in commands
                          else "-" if name not in seconds else f"{seconds[name]:.0f}")
  if _QUICK.value:
    lead = ("**Quick report** (`--quick`): every part reduced to check that the pipeline works; the figures "
            "below are not results.")
  elif _FROM_RESULTS.value:
    lead = (f"Rendered from the data committed under `{rel(figures)}/` by the command below, which runs no "
            "training: Table 1 is recomputed from the measured runs' committed metrics and timelines, the "
            "simulator from those runs and its stated inputs, the staleness table from its committed export"
            + ("." if stale else " (none is committed yet: see its section)."))
  else:
    lead = "Regenerated by one command (below), which makes every run; every figure comes from the runs it lists."
  seeds = len(stale["settings"]["seeds"]) if stale else 0
  stale_short = (f"final held-out accuracy per arm, {seeds} seed{'s' if seeds != 1 else ''}: see the section "
                 "(differences within the seeds' spread are not findings)." if stale else
                 f"**absent**: its per-step metrics are not committed (`{rel(stale_export)}`); the section "
                 "gives the commands that make them.")
  lines = [
      "# Results: the ablations, measured here and simulated at cluster scale",
      "",
      lead,
      "",
      "```",
      report_cmd,
      "```",
      "",
      "## In short",
      "",
      f"* **The simulator, held out** (the figure to quote), on the runs of Table 1: "
      f"{held_out_summary(validation)}.{paired_sentence(validation)} **In-sample** (the compared run among those "
      f"fitted: a description, not a prediction): {validation['max_in_sample_step_error']:.1%} at worst.",
      "* **Table 1, measured** on the machine of its runs (" + machine_t1 + "): "
      + " ".join(x[2:] for x in table1_findings(ablation["rows"], ablation["baseline"])) + " Runs whose measured "
      "window held a compile are marked † and left out of the medians and ratios.",
      "* **Tables 1 and 2 at cluster scale, simulated**: consequences of stated inputs (none measured at that "
      f"scale), not measurements. {table2_short(cluster_json)}; its section says what it cannot show.",
      f"* **Learning under staleness**: {stale_short}",
      *[f"* **StaleSync to the same accuracy** (`{task}`, {len(st_['settings']['seeds'])} seeds): "
        f"{steps_short(st_)}." for _, task, st_, _, _ in loaded],
      "",
      "## Where every figure comes from",
      "",
      "Machines are as recorded when the runs were made (not the machine that rendered this report). Seconds "
      "are wall-clock on that machine as it was loaded then: compare rows within one table, not with other "
      "machines.",
      "",
      "| part | data | command that made the data | machine of the runs | made | seconds its runs took | "
      "seconds in this invocation |",
      "|---|---|---|---|---|---|---|",
      f"| measured Table 1 | `{rel(runs_manifest)}` and the runs it lists | "
      f"`{_shown(ablation.get('command') or 'not recorded')}` | {machine_t1} | "
      f"{made_line(ablation.get('made_unix_time'))} (the runs' timelines) | {_seconds(ablation.get('runs_seconds'))} "
      f"| {in_this('measured Table 1')} |",
      (f"| learning under staleness | `{rel(stale_export)}` | `{_shown(stale.get('command') or 'not recorded')}` | "
       f"{machines_line(stale.get('machines') or [])} | "
       f"{made_line(_span([m['unix_time'] for m in stale.get('machines') or [] if m]))} | "
       f"{_seconds(stale.get('runs_seconds'))} | {in_this('learning under staleness')} |" if stale else
       f"| learning under staleness | not committed (`{rel(stale_export)}`) | see its section | - | - | - | - |"),
      *[f"| StaleSync to the same accuracy (`{task}`) | `{rel(export)}` | `{_shown(st_.get('command') or 'not recorded')}` "
        f"| {machines_line(st_.get('machines') or [])} | "
        f"{made_line(_span([m['unix_time'] for m in st_.get('machines') or [] if m]))} | "
        f"{_seconds(st_.get('runs_seconds'))} | {in_this(f'StaleSync to the same accuracy ({task})')} |"
        for _, task, st_, export, _ in loaded],
      f"| simulator (held-out and in-sample validation, Tables 1 and 2, sweep) | `{rel(runs_manifest)}` and the "
      f"inputs in `rl_fusion_jax/sim/cluster.py` | `{commands['simulator']}` | (computed, deterministic) | "
      f"by that command | - | {in_this('simulator')} |",
      "",
      "## Table 1, measured",
      "",
      f"{ablation['warm_steps']} unmeasured + {_steps_text(ablation['steps'])} measured steps per run, "
      f"{ablation['repeats']} "
      "interleaved repeat(s); trained tok/s over the window between update ends; `x baseline` is against "
      "`separated_sync` (the synchronous separated baseline, one process per side). Figures are medians over "
      "the runs whose measured window held no compile; † marks a run whose window held one (a measured step "
      "whose update or rollout took over 3x the run's median, or logged compile seconds over 1% of the "
      "window), and a row none of whose runs is free of one (it then keeps them all, and its ratio is also "
      "given without the compile's excess). Variants and workloads: `experiments/ablation_main.py`'s docstring; "
      f"as run: {variant_settings(ablation)}.",
      "",
      TABLE1_NOTE,
      "",
      _read(os.path.join(ab, "table1.md")),
      "",
      *table1_findings(ablation["rows"], ablation["baseline"]),
      *compile_findings(ablation["rows"]),
      *interference_findings(ablation["rows"], ablation.get("max_interference")),
      "* The reference system reports RL Fusion + StaleSync at x2.5 its separated baseline and x1.4 RL Fusion "
      "(accelerators at scale: not comparable with these CPU figures).",
      "",
      f"![trained tokens/s per variant]({bars})",
      "",
      "Timelines of the measured steps (last repeat): " + ", ".join(f"[{os.path.basename(t)[9:-4]}]({t})"
                                                                   for t in timelines),
      "",
      *simulator_sections(validation, sim),
      *staleness_section(stale, curves, rel(stale_export), stale_make),
      *[line for name, task, st_, export, _ in loaded
        for line in staleness_section(st_, study_curves[name], rel(export), "",
                                      heading=f"## StaleSync to the same accuracy, on response lengths that vary (`{task}`)")]]
  with open(results, "w") as f:
    f.write("\n".join(lines))
  print(f"wrote {results} ({seconds['total']:.0f} s); largest held-out simulator error {err:.1%}")
  if not _QUICK.value and not _FROM_RESULTS.value and not within:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
