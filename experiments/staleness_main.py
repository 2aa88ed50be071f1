r"""Learning under staleness: sync vs StaleSync s in {1, 2, 4}, with and without off-policy correction,
GRPO and PPO + GAE, several seeds, at an equal sample budget, on the main job's task.

  python experiments/staleness_main.py --workdir=/tmp/staleness          # the full grid (RESULTS.md)
  python experiments/staleness_main.py --workdir=/tmp/staleness_q --quick

The main job's warm-up (experiments/configs/arithmetic.py, 2,500 supervised steps, warmup.seed 0) runs
once and is exported as a Hugging Face folder (``grpo_main.py --export_hf``); every RL run starts from it
(``--config.model.hf_path``, no warm-up of its own), so the arms differ only in the RL. Each run is a
fresh ``grpo_main.py`` process in WORKDIR/runs/<algo>_<arm>_seed<k>; a run whose summary.json exists is
reused, so an interrupted grid continues where it stopped.

Arms (every arm trains ``--steps`` x 16 prompts x 8 samples; only the schedule and the loss differ):
  * ``sync``: the synchronous loop, ``ppo_clip`` (on-policy: the behaviour and the proximal policy are
    the same parameters);
  * ``s{S}_corrected``: StaleSync with max_staleness S and train_fraction 1 / (S + 1), so
    16 x (S + 1) groups are outstanding and, on this short-answer task, the trained groups reach the
    bound (staleness S in the steady state); one engine slot per outstanding sample; ``decoupled_ppo``
    (clip around the proximal policy, truncated behaviour weight, is_cap 5);
  * ``s{S}_uncorrected``: the same schedule with ``uncorrected`` (the behaviour log-probs never enter
    the loss: stale tokens are trained on as if sampled now);
  * ``s{S}_corrected_same_slots`` (only with ``--arms``): ``s{S}_corrected`` on the synchronous arm's 128
    slots, so a decode step costs the same in both (the outstanding groups beyond them wait queued);
  * ``s{S}_corrected_same_slots_keep_cache`` (only with ``--arms``): that arm with ``rollout.keep_cache``:
    samples carried into the next phase keep their KV cache through the update instead of being
    re-prefilled, so their later tokens are sampled by the newer policy on the older policy's cache
    (each token's version and behaviour log-prob are recorded as sampled, so the correction stays exact);
  * ``s{S}_corrected_e2m2`` / ``s{S}_uncorrected_e2m2`` (only with ``--arms``): those arms with two epochs
    of two mini-batches per batch (``algo.ppo_epochs``, ``algo.mini_batches``), where the clip acts
    against the proximal policy and the two losses' gradients differ.
Algorithms: ``grpo`` (arithmetic.py) and ``ppo`` (arithmetic.py:ppo, a critic and GAE).

``--task=arithmetic_steps`` runs the grid on arithmetic.py:steps (chained + and - with worked steps,
responses of 1-43 characters with a long tail: rewards/arithmetic_steps.py), ``--task=arithmetic_steps_long``
on arithmetic.py:steps_long (a heavier tail: 2-20 operands, responses of 1-75 characters), GRPO only, with its own
warm-up export; ``--arms`` keeps some arms (e.g. ``sync,s1_corrected``). The table then also gives, per
StaleSync arm and seed, the RL seconds it took to reach the synchronous run's final held-out accuracy
over the synchronous run's RL seconds.

Writes WORKDIR/staleness.json (per run: the held-out greedy accuracy at every evaluation, the trained
samples and the RL wall-clock seconds there, the measured staleness), WORKDIR/staleness.md (final
accuracy per arm, mean +- standard deviation across seeds, min..max) and
WORKDIR/staleness_{samples,wallclock}.png (mean over seeds with a min..max band), and
WORKDIR/staleness_export.json: every run's per-step metrics that the table and figures read (step, step_s,
train_samples, the held-out accuracy, token staleness, the behaviour IS weight std, the reward) with the
machine it was made on (recorded when it was made: RUN/machine.json), compact enough to commit under
results/ (experiments/report_main.py copies it to results/staleness/export.json).

  python experiments/staleness_main.py --from_export=results/staleness/export.json --workdir=/tmp/st_r

re-renders the table and the figures from such an export without running anything. ``--quick``: GRPO only,
sync and s = 1 both ways, one seed, the model at one layer and half width (``common.QUICK_MODEL``), a
100-step warm-up, 4 RL steps, 32 held-out problems (a check
that the pipeline works, not a result).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags

import common

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "configs", "arithmetic.py")

_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (runs, tables, figures); reused.")
_QUICK = flags.DEFINE_bool("quick", False, "A reduced grid in about a minute (see the module docstring).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "run.seed of each repeat.")
_ALGOS = flags.DEFINE_list("algos", ["grpo", "ppo"], "Algorithms: grpo, ppo.")
_STALENESS = flags.DEFINE_list("staleness", ["1", "2", "4"], "max_staleness values of the StaleSync arms.")
_STEPS = flags.DEFINE_integer("steps", 150, "RL steps per run (x 128 samples: the sample budget).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "Held-out evaluation every N RL steps.")
_EVAL_PROBLEMS = flags.DEFINE_integer("eval_problems", 512, "Held-out problems per evaluation (greedy).")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 2500, "Supervised warm-up steps of the exported policy.")
_ARMS = flags.DEFINE_list("arms", [], "Arms to run (default: every arm of the grid), e.g. sync,s1_corrected.")
_TASK = flags.DEFINE_enum("task", "arithmetic", ["arithmetic", "arithmetic_steps", "arithmetic_steps_long"],
                          "arithmetic: the main job's task (answers of 1-3 characters); arithmetic_steps: "
                          "arithmetic.py:steps, chained + and - with worked steps (responses of 1-43 characters, "
                          "a long tail; GRPO only); arithmetic_steps_long: arithmetic.py:steps_long, the same "
                          "with a heavier tail (2-20 operands, responses of 1-75 characters).")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache of the runs ('' disables).")
_FROM_EXPORT = flags.DEFINE_string("from_export", "", "A staleness_export.json (e.g. results/staleness/export.json): "
                                   "the table and figures from it, no runs.")
flags.mark_flags_as_required(["workdir"])

ALGOS = {"grpo": "", "ppo": "ppo"}
BATCH = 16 * 8   # prompts x samples of arithmetic.py


def arms(staleness: list[int]) -> dict[str, tuple[str, ...]]:
  """Arm name -> its config overrides."""
  out = {"sync": ()}
  for s in staleness:
    f = 1.0 / (s + 1)
    schedule = ("stalesync.enabled=True", f"stalesync.max_staleness={s}", f"stalesync.train_fraction={f!r}",
                f"rollout.num_slots={BATCH * (s + 1)}")
    out[f"s{s}_corrected"] = schedule + ("algo.policy_loss=decoupled_ppo",)
    out[f"s{s}_uncorrected"] = schedule + ("algo.policy_loss=uncorrected",)
    # The engine of the synchronous arm (one slot per sample of an update): the outstanding groups beyond
    # it wait queued, so a decode step costs what sync's does (the arm for wall-clock).
    out[f"s{s}_corrected_same_slots"] = schedule[:-1] + (f"rollout.num_slots={BATCH}", "algo.policy_loss=decoupled_ppo")
    # ... with the carried samples' KV cache kept across the update (no re-prefill; their later tokens
    # come from the newer policy, each token's version and behaviour log-prob recorded as sampled).
    out[f"s{s}_corrected_same_slots_keep_cache"] = out[f"s{s}_corrected_same_slots"] + ("rollout.keep_cache=True",)
    # Two epochs of two mini-batches per batch: the clip now acts against the proximal policy, so the
    # corrected and uncorrected losses differ in their gradients (with one update they weight tokens apart
    # only through the behaviour weight).
    several = ("algo.ppo_epochs=2", "algo.mini_batches=2")
    out[f"s{s}_corrected_e2m2"] = out[f"s{s}_corrected"] + several
    out[f"s{s}_uncorrected_e2m2"] = out[f"s{s}_uncorrected"] + several
  return out


def settings() -> dict:
  if _QUICK.value:
    return dict(seeds=[0], algos=["grpo"], staleness=[1], steps=4, eval_every=4, eval_problems=32,
                warmup_steps=100)
  return dict(seeds=[int(s) for s in _SEEDS.value], algos=list(_ALGOS.value),
              staleness=[int(s) for s in _STALENESS.value], steps=_STEPS.value, eval_every=_EVAL_EVERY.value,
              eval_problems=_EVAL_PROBLEMS.value, warmup_steps=_WARMUP_STEPS.value)


def run_one(root: str, hf: str, algo: str, arm: str, overrides: tuple[str, ...], seed: int, s: dict) -> str:
  workdir = os.path.join(root, "runs", f"{algo}_{arm}_seed{seed}")
  if os.path.isfile(os.path.join(workdir, "summary.json")):
    return workdir
  variant = f":{task_variant() or ALGOS[algo]}" if task_variant() or ALGOS[algo] else ""
  args = [f"--config={CONFIG}{variant}", f"--workdir={workdir}", f"--config.model.hf_path={hf}",
          "--config.warmup.steps=0", f"--config.run.seed={seed}", f"--config.run.steps={s['steps']}",
          f"--config.run.eval_every={s['eval_every']}", f"--config.task.eval_problems={s['eval_problems']}",
          "--config.task.eval_samples=0", "--config.run.checkpoint_every=0"]
  args += [f"--config.{o}" for o in overrides] + list(common.QUICK_MODEL if _QUICK.value else ())
  seconds = common.run_recorded("grpo_main.py", [f"--compilation_cache={_CACHE.value}"] + args, workdir)
  print(f"  {algo} {arm} seed {seed}: {seconds:.0f} s", flush=True)
  return workdir


def task_variant() -> str:
  """arithmetic.py's variant for ``--task`` ('' for the main job's task)."""
  return {"arithmetic_steps": "steps", "arithmetic_steps_long": "steps_long"}.get(_TASK.value, "")


def time_to_sync_ratios(results: dict) -> dict[str, dict[str, list]]:
  """algo -> arm -> per seed: the RL seconds the run took to reach the final held-out accuracy of the
  synchronous run of the same seed (first evaluation at or above it) over that sync run's RL seconds;
  None where it never did within the sample budget. The sync arm's entry is the run against itself."""
  out = {}
  for algo, by_arm in results.items():
    sync = {r["seed"]: r for r in by_arm.get("sync", [])}
    for arm, runs in by_arm.items():
      ratios = []
      for r in runs:
        ref = sync.get(r["seed"])
        if ref is None:
          continue
        goal = ref["points"][-1]["accuracy"]
        hit = next((p["seconds"] for p in r["points"] if p["accuracy"] >= goal), None)
        ratios.append(None if hit is None else hit / max(ref["rl_seconds"], 1e-9))
      out.setdefault(algo, {})[arm] = ratios
  return out


def rl_seconds_ratios(results: dict) -> dict[str, dict[str, list]]:
  """algo -> arm -> per seed: the run's RL seconds (its whole sample budget) over the RL seconds of the
  synchronous run of the same seed (seeds without a sync run are left out)."""
  out = {}
  for algo, by_arm in results.items():
    sync = {r["seed"]: r for r in by_arm.get("sync", [])}
    for arm, runs in by_arm.items():
      out.setdefault(algo, {})[arm] = [r["rl_seconds"] / max(sync[r["seed"]]["rl_seconds"], 1e-9)
                                       for r in runs if r["seed"] in sync]
  return out


def time_to_sync_accuracy(results: dict) -> str:
  """The table of ``time_to_sync_ratios``: per arm, per seed, their mean over the seeds that got there. On
  a curve that flattens early the sync row's own ratio is small too: read the StaleSync rows against it,
  and beside it ``rl_seconds_ratios`` (the whole sample budget's RL seconds over sync's, per seed)."""
  lines = ["| algorithm | arm | per seed: seconds to sync's final accuracy / sync's RL seconds | mean (seeds that "
           "reached it) | reached | per seed: RL seconds of the whole budget / sync's | mean |",
           "|---|---|---|---|---|---|---|"]
  whole = rl_seconds_ratios(results)
  for algo, by_arm in time_to_sync_ratios(results).items():
    for arm, ratios in by_arm.items():
      shown = ", ".join("-" if x is None else f"{x:.2f}" for x in ratios)
      reached = [x for x in ratios if x is not None]
      mean = f"{statistics.fmean(reached):.2f}" if reached else "-"
      budget = whole[algo][arm]
      budget_mean = f"{statistics.fmean(budget):.2f}" if budget else "-"
      lines.append(f"| {algo} | {arm} | {shown} | {mean} | {len(reached)}/{len(ratios)} | "
                   f"{', '.join(f'{x:.2f}' for x in budget) or '-'} | {budget_mean} |")
  return "\n".join(lines)


# What read_run reads of a run's metrics: the export keeps these, per step.
EXPORTED = ("step_s", "train_samples", "eval/accuracy", "stalesync/trained_token_staleness_mean",
            "stalesync/staleness_max", "is_weight_std", "reward", "generate_s", "train_s")


def run_rows(workdir: str) -> dict[int, dict]:
  """step -> the run's metrics of that step (the lines of one step merged)."""
  rows = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      if line.strip():
        r = json.loads(line)
        rows.setdefault(r["step"], {}).update(r)
  return rows


def read_run(workdir: str) -> dict:
  """Held-out accuracy at each evaluation with the samples trained and RL seconds so far."""
  return summarize_rows(run_rows(workdir))


def summarize_rows(rows: dict[int, dict]) -> dict:
  """``read_run`` of a run's merged per-step metrics (from its workdir or from an export)."""
  points, seconds, samples = [], 0.0, 0
  for step in sorted(rows):
    r = rows[step]
    if step >= 2:   # step 1's time is mostly compiles (cached or not, depending on the run order)
      seconds += float(r.get("step_s", 0.0))
    samples += int(round(float(r.get("train_samples", BATCH if step else 0))))
    if "eval/accuracy" in r:
      points.append({"step": step, "samples": samples, "seconds": seconds, "accuracy": float(r["eval/accuracy"])})
  steps = [rows[k] for k in sorted(rows) if k >= 1]
  stale = [float(r.get("stalesync/trained_token_staleness_mean", 0.0)) for r in steps]
  timed = [rows[k] for k in sorted(rows) if k >= 2]
  median = lambda key: (statistics.median(float(r[key]) for r in timed if key in r)
                        if any(key in r for r in timed) else None)
  return {"points": points, "token_staleness_mean": statistics.fmean(stale) if stale else 0.0,
          "median_step_s": median("step_s"), "median_generate_s": median("generate_s"),
          "median_train_s": median("train_s"),
          "staleness_max": max((float(r.get("stalesync/staleness_max", 0.0)) for r in steps), default=0.0),
          "is_weight_std": statistics.fmean(float(r.get("is_weight_std", 0.0)) for r in steps) if steps else 0.0,
          "rl_seconds": seconds}


def export_run(workdir: str) -> dict:
  """A run's per-step metrics that ``summarize_rows`` reads (EXPORTED, as columns over its steps; None
  where a step has none) and its machine record (None: not recorded)."""
  rows = run_rows(workdir)
  steps = sorted(rows)
  columns = {k: [rows[st].get(k) for st in steps] for k in EXPORTED}
  machine = None
  if os.path.isfile(os.path.join(workdir, "machine.json")):
    with open(os.path.join(workdir, "machine.json")) as f:
      machine = json.load(f)
  return {"steps": steps, "columns": {k: v for k, v in columns.items() if any(x is not None for x in v)},
          "machine": machine}


def rows_from_export(run: dict) -> dict[int, dict]:
  return {st: {k: col[i] for k, col in run["columns"].items() if col[i] is not None}
          for i, st in enumerate(run["steps"])}


def table(results: dict) -> str:
  """Per arm: the final held-out accuracy (mean +- std over seeds), the mean of every evaluation in the
  run's second half (a less noisy level where the curve has flattened), staleness, IS weights, seconds."""
  lines = ["| algorithm | arm | seeds | final accuracy (mean +- std) | min..max | second-half mean | start | "
           "token staleness (mean) | behaviour IS weight std (mean) | RL seconds (mean) | median step s "
           "(generate, train) |", "|" + "---|" * 11]
  for algo, by_arm in results.items():
    for arm, runs in by_arm.items():
      final = [r["points"][-1]["accuracy"] for r in runs]
      start = runs[0]["points"][0]["accuracy"]
      std = statistics.stdev(final) if len(final) > 1 else 0.0
      half = [p["accuracy"] for r in runs for p in r["points"] if 2 * p["step"] > r["points"][-1]["step"]]
      lines.append(f"| {algo} | {arm} | {len(runs)} | {statistics.fmean(final):.3f} +- {std:.3f} | "
                   f"{min(final):.3f}..{max(final):.3f} | {statistics.fmean(half):.3f} | {start:.3f} | "
                   f"{statistics.fmean(r['token_staleness_mean'] for r in runs):.2f} | "
                   f"{statistics.fmean(r['is_weight_std'] for r in runs):.4f} | "
                   f"{statistics.fmean(r['rl_seconds'] for r in runs):.0f} | {_step_times(runs)} |")
  return "\n".join(lines)


def _step_times(runs: list[dict]) -> str:
  """Mean over seeds of each run's median step, generate and train seconds (from step 2); '-' when the
  runs' metrics (an older export) do not have them."""
  mean = lambda key: (f"{statistics.fmean(r[key] for r in runs):.3f}"
                      if runs and all(r.get(key) is not None for r in runs) else "-")
  return f"{mean('median_step_s')} ({mean('median_generate_s')}, {mean('median_train_s')})"


def plot(results: dict, x_key: str, xlabel: str, out: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.2), squeeze=False)
  for ax, (algo, by_arm) in zip(axes[0], results.items()):
    levels = sorted({arm.split("_")[0] for arm in by_arm}, key=lambda a: (a != "sync", a))
    for arm, runs in by_arm.items():
      n = min(len(r["points"]) for r in runs)
      acc = np.array([[p["accuracy"] for p in r["points"][:n]] for r in runs])
      x = np.array([[p[x_key] for p in r["points"][:n]] for r in runs]).mean(0)
      color = f"C{levels.index(arm.split('_')[0])}"   # one colour per staleness bound
      style = "--" if arm.endswith("_uncorrected") else ":" if arm.endswith("_keep_cache") else "-"
      seeds = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
      ax.plot(x, acc.mean(0), style, color=color, marker="o", ms=3, label=f"{arm} ({seeds})")
      ax.fill_between(x, acc.min(0), acc.max(0), color=color, alpha=0.15, lw=0)
    ax.set_title(f"{algo}: held-out greedy accuracy\n(band: min..max over seeds; dashed: uncorrected; "
                 "dotted: keep_cache)", fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


def render(root: str, results: dict) -> str:
  """WORKDIR/staleness.md and the figures from the per-arm results; returns the markdown."""
  md = table(results) + "\n\n" + time_to_sync_accuracy(results)
  plot(results, "samples", "samples trained", os.path.join(root, "staleness_samples.png"))
  plot(results, "seconds", "RL seconds (sum of step_s from step 2)", os.path.join(root, "staleness_wallclock.png"))
  with open(os.path.join(root, "staleness.md"), "w") as f:
    f.write(md + "\n")
  return md


def from_export(root: str, path: str) -> None:
  """The table, figures and staleness.json from an export (``staleness_export.json``), no runs."""
  t0 = time.perf_counter()
  with open(path) as f:
    export = json.load(f)
  results: dict[str, dict[str, list]] = {}
  for run in export["runs"]:
    results.setdefault(run["algo"], {}).setdefault(run["arm"], []).append(
        summarize_rows(rows_from_export(run)) | {"seed": run["seed"]})
  md = render(root, results)
  with open(os.path.join(root, "staleness.json"), "w") as f:
    json.dump({"settings": export["settings"], "results": results, "time_to_sync": time_to_sync_ratios(results),
               "rl_seconds_to_sync": rl_seconds_ratios(results),
               "seconds": time.perf_counter() - t0,
               "runs_seconds": export.get("runs_seconds"), "command": export.get("command"),
               "from_export": path, "machines": [r.get("machine") for r in export["runs"]]}, f, indent=1)
  print(md)


def main(argv):
  del argv
  root = os.path.abspath(_WORKDIR.value)
  os.makedirs(os.path.join(root, "runs"), exist_ok=True)
  if _FROM_EXPORT.value:
    from_export(root, _FROM_EXPORT.value)
    return
  s = settings()
  t0 = time.perf_counter()
  if task_variant() and any(ALGOS[a] for a in s["algos"]):
    raise app.UsageError(f"--task={_TASK.value} runs GRPO only (--algos=grpo)")
  hf = common.exported_warmup(root, s["warmup_steps"], _CACHE.value, common.QUICK_MODEL if _QUICK.value else (),
                              variant=task_variant())
  grid = arms(s["staleness"])
  if not _ARMS.value:
    grid = {k: v for k, v in grid.items() if not k.endswith(("_same_slots", "_keep_cache", "_e2m2"))}
  if _QUICK.value:
    grid = {k: v for k, v in grid.items() if k in ("sync", "s1_corrected", "s1_uncorrected")}
  if _ARMS.value:
    unknown = sorted(set(_ARMS.value) - set(grid))
    if unknown:
      raise app.UsageError(f"--arms: unknown {unknown}; known: {sorted(grid)}")
    grid = {k: v for k, v in grid.items() if k in _ARMS.value}
  results: dict[str, dict[str, list]] = {}
  exported = []
  for seed in s["seeds"]:           # seed-major: a partial grid already has every arm
    for algo in s["algos"]:
      if algo not in ALGOS:
        raise app.UsageError(f"--algos: unknown {algo!r}; known: {sorted(ALGOS)}")
      for arm, overrides in grid.items():
        workdir = run_one(root, hf, algo, arm, overrides, seed, s)
        results.setdefault(algo, {}).setdefault(arm, []).append(read_run(workdir) | {"seed": seed})
        exported.append({"algo": algo, "arm": arm, "seed": seed} | export_run(workdir))
  md = render(root, results)
  logs = [os.path.join(root, "warmup_run.log")] + [os.path.join(root, "runs", f"{r['algo']}_{r['arm']}_seed{r['seed']}.log")
                                                   for r in exported]
  runs_seconds = sum(common.run_wall_seconds(p) for p in logs)
  command = " ".join(["python experiments/staleness_main.py"] + sys.argv[1:])
  settings_ = s | {"task": _TASK.value}
  with open(os.path.join(root, "staleness.json"), "w") as f:
    json.dump({"settings": settings_, "results": results, "time_to_sync": time_to_sync_ratios(results),
               "rl_seconds_to_sync": rl_seconds_ratios(results),
               "seconds": time.perf_counter() - t0,
               "runs_seconds": runs_seconds, "command": command,
               "machines": [r["machine"] for r in exported]}, f, indent=1)
  with open(os.path.join(root, "staleness_export.json"), "w") as f:
    json.dump({"settings": settings_, "command": command, "runs_seconds": runs_seconds,
               "metrics": "per run: its steps and, per metric, one value per step (null: none that step)",
               "runs": exported}, f)
  print(md)


if __name__ == "__main__":
  app.run(main)
