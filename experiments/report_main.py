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
(``common.run_wall_seconds``: from each run's log). Exits with status 1 when the fitted simulation misses a measured step time or tokens/s
by more than 15% (full report only: the quick runs measure 2 steps with their compiles, which no simulator
is held to).
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
  err = validation["max_abs_error"]
  cross = max((abs(c[k]) for c in validation["checks"] for k in ("cross_step_error", "cross_tokens_error")
               if c[k] is not None), default=0.0)
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
      "## The simulator, validated against the measured runs",
      "",
      "`rl_fusion_jax/sim/` (no JAX). Costs fitted per workload and deployment on all of its measured runs "
      "(`sim/fit.py`), then each run's configuration simulated (its workload, with forced lengths replayed "
      "exactly, its schedule and step count) and compared; `cross-schedule` fits only on the other schedule "
      "of the same deployment (sync <-> StaleSync) and predicts this one, a stricter test the tolerance "
      f"does not apply to. Largest error of the fitted simulation: **{err:.1%}** (tolerance 15%: "
      f"{'met' if within else 'NOT met'}); largest cross-schedule error: "
      f"{cross:.1%}.",
      "",
      _read(os.path.join(sim, "validation.md")),
      "",
      "## Tables 1 and 2, simulated at cluster scale",
      "",
      "Every cost figure here is assumed (listed with its source below), none measured; the schedules and "
      "the engine's slot scheduling are the simulator's replay of this codebase's.",
      "",
      _read(os.path.join(sim, "cluster.md")),
      "",
      "## Learning under staleness",
      "",
      f"The main job's task from one shared warm-up ({s['warmup_steps']} supervised steps, exported and "
      f"loaded with `model.hf_path`), then {s['steps']} RL steps x 128 samples in every arm (equal sample "
      f"budget), held-out greedy accuracy on {s['eval_problems']} problems every {s['eval_every']} steps, "
      f"seeds {s['seeds']}. StaleSync arms: s in {s['staleness']}, rollout_fraction 1 / (s + 1); corrected = "
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
  print(f"wrote {results} ({seconds['total']:.0f} s); simulator error {err:.1%}")
  if not _QUICK.value and not within:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
