r"""One command for the ablation report: runs (or reuses) every part and regenerates RESULTS.md.

  python experiments/report_main.py --workdir=/tmp/report --results=RESULTS.md     # the committed report
  python experiments/report_main.py --workdir=/tmp/report_q --quick                # reduced, about a minute

Parts, each a binary of its own whose runs are reused when the workdir already holds them:
  1. learning under staleness: experiments/staleness_main.py --workdir=WORKDIR/staleness (its exported
     warm-up is shared with part 2);
  2. measured Table 1: experiments/ablation_main.py --workdir=WORKDIR/ablation;
  3. the simulator, validated on part 2's runs, then Tables 1 and 2 at cluster scale with the sweep:
     experiments/simulate_main.py --ablation=... --cluster --out=WORKDIR/sim.
Writes --results (default WORKDIR/RESULTS.md) and copies the figures next to it (--figures, default
results/ beside it; the full report also copies what the simulator reads of each measured run to
FIGURES/runs/, which tests/sim_test.py validates the simulator against), with the commands, the
seconds each part took in this invocation and the wall seconds its runs took when they were made
(``common.run_wall_seconds``: from each run's log). Exits with status 1 when a held-out (cross-schedule)
prediction of the simulator misses a measured step time by more than 15% (full report only: the quick runs
measure 2 steps with their compiles, which no simulator is held to); RESULTS.md is written either way.
--quick: every part reduced (see each binary's --quick), parts 1 and 2 run at the same time; the figures
it prints are a check that the pipeline works, not results.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import sys
import time

from absl import app, flags

import common

HERE = os.path.dirname(os.path.abspath(__file__))

_WORKDIR = flags.DEFINE_string("workdir", None, "Folder of every part's runs (reused).")
_RESULTS = flags.DEFINE_string("results", "", "The report to write (default WORKDIR/RESULTS.md).")
_FIGURES = flags.DEFINE_string("figures", "", "Folder for the report's figures (default: results/ next to "
                               "the report).")
_QUICK = flags.DEFINE_bool("quick", False, "A reduced report in a few minutes.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache of every run ('' disables).")
_TOLERANCE = 0.15
flags.mark_flags_as_required(["workdir"])


def _part(name: str, binary: str, args: list[str], log: str, seconds: dict, commands: dict) -> None:
  shown = " ".join(["python", f"experiments/{binary}"] + args)
  print(f"[{name}] {shown}", flush=True)
  commands[name] = shown
  seconds[name] = common.run_binary(binary, args, log)


def _copy(src: str, figures: str, rel_base: str) -> str:
  os.makedirs(figures, exist_ok=True)
  dst = os.path.join(figures, os.path.basename(src))
  shutil.copyfile(src, dst)
  return os.path.relpath(dst, rel_base)


KEPT_METRICS = ("step", "train_tokens", "train_s", "generate_s", "step_s", "response_len_mean",
                "response_len_max", "truncated_frac")


def export_runs(ablation_json: str, dest: str) -> str:
  """Copies what the simulator reads of every measured run (config.json, the metrics it fits on,
  timeline.jsonl) to DEST/<run>/ and writes DEST/ablation.json pointing at them (relative paths): the
  measured data tests/sim_test.py validates the simulator against."""
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
        shutil.copyfile(os.path.join(d, "config.json"), os.path.join(out, "config.json"))
        shutil.copyfile(os.path.join(d, "timeline.jsonl"), os.path.join(out, "timeline.jsonl"))
        with open(os.path.join(d, "metrics.jsonl")) as src, open(os.path.join(out, "metrics.jsonl"), "w") as dst:
          for line in src:
            if line.strip():
              row = json.loads(line)
              keep = {k: x for k, x in row.items() if k in KEPT_METRICS or k.startswith(("engine/", "stalesync/"))}
              dst.write(json.dumps(keep, sort_keys=True) + "\n")
        workdirs.setdefault(w, {}).setdefault(v, []).append(name)
  manifest = {k: ablation[k] for k in ("warm_steps", "steps", "repeats", "baseline")} | {"workdirs": workdirs}
  with open(os.path.join(dest, "ablation.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  return os.path.join(dest, "ablation.json")


def table1_findings(rows: dict, baseline: str) -> list[str]:
  out = []
  for workload, by_variant in rows.items():
    base = by_variant[baseline]["trained_tokens_per_s"]
    parts = [f"{v} x{r['trained_tokens_per_s'] / base:.2f}" for v, r in by_variant.items() if v != baseline]
    out.append(f"* {workload}: against {baseline} ({base:,.0f} tok/s): " + ", ".join(parts) + ".")
  return out


def staleness_findings(results: dict) -> list[str]:
  """Per algorithm and arm: the final accuracy against sync's, in points and against the seed spread."""
  import statistics  # pylint: disable=g-import-not-at-top
  out = []
  for algo, by_arm in results.items():
    final = {arm: [r["points"][-1]["accuracy"] for r in runs] for arm, runs in by_arm.items()}
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


def _cpu() -> str:
  model = ""
  try:
    with open("/proc/cpuinfo") as f:
      model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
  except OSError:
    pass
  return f"{os.cpu_count()} CPU cores" + (f" ({model})" if model else "")


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
    "StaleSync, colocated and separated on this 2-core machine) from a cost model fitted on the other "
    "schedule's runs, within the held-out errors above.",
    "* At cluster scale, what follows from its inputs: how the schedules' step times respond to them (a "
    "what-if), and which inputs move Table 2's linearity and by how much.",
    "",
    "What it cannot show:",
    "",
    "* Throughput at cluster scale. No cost figure at that scale was measured; every figure in the cluster "
    "tables is a consequence of the inputs listed with their sources, and agreeing or disagreeing with the "
    "reference system's figures validates nothing.",
    "* Run-to-run variation of a shared machine (here up to {spread:.0%} in step time between repeats of "
    "one configuration), compiles, memory limits, failures, network congestion, and learning (accuracy "
    "under staleness: the last section measures that).",
    "* Thread usage: the separated deployment's processor sharing is a stated model of this machine (2 "
    "cores; 1 / 2 / 1 busy threads for generation / update / push), not a measurement, and the held-out "
    "errors of that deployment depend on it (table above); its thread counts were chosen after the "
    "StaleSync residuals had been seen, though not fitted to them.",
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
  out = []
  for c in validation["checks"]:
    x = c["held_out"]
    if x and abs(x["step_error"]) > _TOLERANCE:
      others = [o["measured_step_s"] for o in validation["checks"] if o["workload"] == c["workload"]
                and o["variant"] == c["variant"] and o["repeat"] != c["repeat"]]
      out.append(f"* Miss: {c['workload']} {c['variant']} repeat {c['repeat']}, predicted from the "
                 f"{c['fitted_on']} runs {x['simulated_step_s']:.3f} s a step, measured {c['measured_step_s']:.3f} s "
                 f"({x['step_error']:+.1%}); the other repeats of the same configuration measured "
                 + " and ".join(f"{o:.3f} s" for o in others) + ".")
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
  out = [f"* Table 2 predicts {r['linearity_4_nodes_sync']:.1%} of linear on 4 supernodes synchronous and "
         f"{r['linearity_4_nodes_stalesync']:.1%} with StaleSync under the default inputs (reference system: "
         f"{cluster_json['reference']['linearity_4_nodes_sync']:.0%} and "
         f"{cluster_json['reference']['linearity_4_nodes_stalesync']:.0%})."]
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


def simulator_sections(validation: dict, sim: str) -> list[str]:
  """RESULTS.md's simulator sections: the held-out validation first, then in-sample (labelled), what the
  simulator can and cannot show, and the cluster tables."""
  with open(os.path.join(sim, "cluster.json")) as f:
    cluster_json = json.load(f)
  held = [c for c in validation["checks"] if c["held_out"]]
  good = sum(abs(c["held_out"]["step_error"]) <= _TOLERANCE for c in held)
  return [
      "## The simulator, validated against the measured runs",
      "",
      "`rl_fusion_jax/sim/` (no JAX) replays the engine's slot scheduling and the schedules step by step and "
      "prices each step with costs fitted on measured runs (`sim/fit.py`): per decode step, per host call "
      "(a decode chunk or a host prefill call, one shared cost), per in-chunk refill, per rollout phase, per "
      "trained token, and the host time between phases; in the separated deployment each phase is first "
      "scaled to its time alone by a processor-sharing model of the two processes on this machine's cores "
      "(`costs.Sharing`).",
      "",
      f"**Held out (cross-schedule)**: per workload and deployment, costs fitted on the synchronous runs only "
      f"predict the StaleSync runs, and costs fitted on the StaleSync runs predict the synchronous ones. "
      f"Largest held-out error: **{validation['max_held_out_step_error']:.1%}** on step time "
      f"({validation['max_held_out_tokens_error']:.1%} on tok/s); {good} of {len(held)} runs within "
      f"{_TOLERANCE:.0%} on step time.",
      "",
      *held_out_findings(validation),
      "",
      f"**In-sample** (fitted on all runs of the workload and deployment, this one included: how well the model "
      f"describes the runs, not a prediction): largest error {validation['max_in_sample_step_error']:.1%} on "
      f"step time ({validation['max_in_sample_tokens_error']:.1%} on tok/s).",
      "",
      _read(os.path.join(sim, "validation.md")),
      "",
      REFERENCE_SYSTEM,
      "",
      *[line.format(spread=repeat_spread(validation)) for line in CAN_AND_CANNOT],
      "",
      "## Tables 1 and 2, simulated at cluster scale",
      "",
      "Every input is listed below with its source (`sim/cluster.py`); none was measured at cluster scale. "
      "The schedules and the engine's slot scheduling are the simulator's replay of this codebase's; Table 2 "
      "adds to the one-supernode replay the effects that grow with the supernodes (`cluster.scaled`).",
      "",
      *table2_findings(cluster_json),
      "",
      _read(os.path.join(sim, "cluster.md")),
      "",
  ]


def main(argv):
  del argv
  root = os.path.abspath(_WORKDIR.value)
  results = os.path.abspath(_RESULTS.value or os.path.join(root, "RESULTS.md"))
  figures = os.path.abspath(_FIGURES.value or os.path.join(os.path.dirname(results), "results"))
  os.makedirs(root, exist_ok=True)
  quick = ["--quick"] if _QUICK.value else []
  cache = [f"--compilation_cache={_CACHE.value}"]
  seconds, commands, t0 = {}, {}, time.perf_counter()
  st, ab, sim = (os.path.join(root, p) for p in ("staleness", "ablation", "sim"))
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
  sim_args = [f"--ablation={os.path.join(ab, 'ablation.json')}", "--cluster", f"--out={sim}",
              "--tolerance=1e9"] + quick
  _part("simulator", "simulate_main.py", sim_args, os.path.join(root, "sim.log"), seconds, commands)

  with open(os.path.join(st, "staleness.json")) as f:
    stale = json.load(f)
  with open(os.path.join(ab, "ablation.json")) as f:
    ablation = json.load(f)
  with open(os.path.join(sim, "validation.json")) as f:
    validation = json.load(f)
  base = os.path.dirname(results)
  bars = _copy(os.path.join(ab, "table1.png"), figures, base)
  timelines = [_copy(os.path.join(ab, f"timeline_{w}_{v}.png"), figures, base)
               for w in ablation["rows"] for v in ablation["rows"][w]]
  curves = [_copy(os.path.join(st, f"staleness_{k}.png"), figures, base) for k in ("samples", "wallclock")]
  if not _QUICK.value:
    export_runs(os.path.join(ab, "ablation.json"), os.path.join(figures, "runs"))
  err = validation["max_held_out_step_error"]
  within = err <= _TOLERANCE
  seconds["total"] = time.perf_counter() - t0
  s = stale["settings"]
  lines = [
      "# Results: the ablations, measured here and simulated at cluster scale",
      "",
      ("**Quick report** (`--quick`): every part reduced to check that the pipeline works; the figures "
       "below are not results." if _QUICK.value else
       "Regenerated by one command (below); every figure comes from the runs it lists."),
      "",
      "```",
      " ".join(["python experiments/report_main.py", f"--workdir={_WORKDIR.value}"]
               + ([f"--results={_RESULTS.value}"] if _RESULTS.value else []) + quick),
      "```",
      "",
      f"Machine: {_cpu()}. Seconds are wall-clock on it as it was loaded while the runs were made: compare "
      "rows within one table, not with other machines.",
      "",
      "| part | command | seconds in this invocation | seconds its runs took when made |",
      "|---|---|---|---|",
      f"| learning under staleness | `{commands['learning under staleness']}` | "
      f"{seconds['learning under staleness']:.0f} | {stale.get('runs_seconds', 0):.0f} |",
      f"| measured Table 1 | `{commands['measured Table 1']}` | {seconds['measured Table 1']:.0f} | "
      f"{ablation.get('runs_seconds', 0):.0f} |",
      f"| simulator (validation, Tables 1 and 2, sweep) | `{commands['simulator']}` | {seconds['simulator']:.0f} | "
      "(recomputed every time) |",
      f"| total | | {seconds['total']:.0f} | |",
      "",
      "## Table 1, measured on this machine",
      "",
      f"{ablation['warm_steps']} unmeasured + {ablation['steps']} measured steps per run, {ablation['repeats']} "
      "interleaved repeat(s), medians; trained tok/s over the window between update ends; `x baseline` is "
      "against `separated_sync` (the synchronous separated baseline, one process per side). Variants and "
      "workloads: `experiments/ablation_main.py`'s docstring.",
      "",
      _read(os.path.join(ab, "table1.md")),
      "",
      *table1_findings(ablation["rows"], ablation["baseline"]),
      "",
      f"![trained tokens/s per variant]({bars})",
      "",
      "Timelines of the measured steps (last repeat): " + ", ".join(f"[{os.path.basename(t)[9:-4]}]({t})"
                                                                   for t in timelines),
      "",
      *simulator_sections(validation, sim),
      "## Learning under staleness",
      "",
      f"The main job's task from one shared warm-up ({s['warmup_steps']} supervised steps, exported and "
      f"loaded with `model.hf_path`), then {s['steps']} RL steps x 128 samples in every arm (equal sample "
      f"budget), held-out greedy accuracy on {s['eval_problems']} problems every {s['eval_every']} steps, "
      f"seeds {s['seeds']}. StaleSync arms: s in {s['staleness']}, train_fraction 1 / (s + 1); corrected = "
      "`decoupled_ppo`, uncorrected = `uncorrected` (the behaviour policy never enters the loss). Table: "
      "final accuracy, mean +- standard deviation across seeds.",
      "",
      _read(os.path.join(st, "staleness.md")),
      "",
      *staleness_findings(stale["results"]),
      "",
      f"![accuracy vs samples]({curves[0]})",
      f"![accuracy vs wall-clock]({curves[1]})",
      ""]
  with open(results, "w") as f:
    f.write("\n".join(lines))
  print(f"wrote {results} ({seconds['total']:.0f} s); largest held-out simulator error {err:.1%}")
  if not _QUICK.value and not within:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
