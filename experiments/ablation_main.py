r"""Table 1, measured: separated vs colocated (RL Fusion), synchronous vs StaleSync, on this machine.

  python experiments/ablation_main.py --workdir=/tmp/ablation            # RESULTS.md, "Table 1"
  python experiments/ablation_main.py --workdir=/tmp/ablation_q --quick  # about a minute

Variants (same devices: every CPU core, one virtual device per core; same sample budget: every run
trains --warm_steps + --steps updates of 16 prompts x 8 samples; same engine: 128 slots; same loss,
``decoupled_ppo``, so the update costs the same everywhere):
  * ``separated_sync``: the baseline. experiments/separated_main.py, one process per side (half the
    devices each), StaleSync with s = 0: batch k is generated with the weights of update k, so each side
    waits for the other (the synchronous algorithm, exactly);
  * ``separated_stalesync``: the same processes with s = 1 (batch k with the weights of update k - 1):
    rollout and training overlap;
  * ``colocated_sync``: experiments/grpo_main.py, RL Fusion: both phases on all devices, the phase
    switch between them, the synchronous loop;
  * ``colocated_stalesync``: RL Fusion + StaleSync, s = 1, train_fraction 0.5 (32 groups outstanding,
    long tails continue in the next phase).
Workloads: ``longtail`` (experiments/configs/stalesync_longtail.py: the main job's model shape, random
init, response lengths forced to a clipped log-normal, median 8, up to 64 tokens, the same lengths for
the same sample in every variant) and ``arithmetic`` (the main job's task and warmed-up policy, exported
once by ``grpo_main.py --export_hf``, responses of 1-6 tokens chosen by the policy: no long tail).

Each run is a fresh process; with --repeats R the runs are interleaved (every variant once, then again,
the order rotated), figures are medians over the repeats. From each run's metrics.jsonl and timeline
(``rl_fusion_jax/sim/measure.py``): trained tok/s over the window from the end of the last unmeasured
update to the end of the last measured one, the step time (that window / the measured steps), generate /
train medians, seconds per step of every phase per device group, and each group's idle share of the window.
"compile steps" counts measured steps whose update or rollout phase took over 3x the run's median (a
compile of a new row bucket fell into the window); "steady tok/s" takes their excess out of the window
(the simulator is validated on that).
Writes WORKDIR/ablation.json (the rows and every run's workdir, which experiments/simulate_main.py
fits and validates against), WORKDIR/table1.md, WORKDIR/table1.png (bar chart) and
WORKDIR/timeline_<workload>_<variant>.png (the measured steps of the last repeat).
"""
from __future__ import annotations

import json
import os
import statistics
import time

from absl import app, flags

import common

HERE = os.path.dirname(os.path.abspath(__file__))

_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (runs, table, figures).")
_QUICK = flags.DEFINE_bool("quick", False, "Long-tail workload only, 1 repeat, 2 steps (none unmeasured), "
                           "the model at half depth and width (common.QUICK_MODEL).")
_WORKLOADS = flags.DEFINE_list("workloads", ["longtail", "arithmetic"], "Workloads (see the docstring).")
_VARIANTS = flags.DEFINE_list("variants", [], "Variants (default: all four).")
_STEPS = flags.DEFINE_integer("steps", 8, "Measured steps per run.")
_WARM = flags.DEFINE_integer("warm_steps", 4, "Unmeasured steps first (compiles).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per variant, interleaved across variants.")
_WARMUP_HF = flags.DEFINE_string("warmup_hf", "", "The exported warm-up policy for the arithmetic workload "
                                 "(default: made in WORKDIR/warmup_hf).")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache of the runs ('' disables).")
flags.mark_flags_as_required(["workdir"])

BASELINE = "separated_sync"
SEPARATED = ("--config.fusion.mode=separated", "--config.mesh.cpu_devices=1", "--schedule=reproducible")


def _stalesync(s: int, f: float) -> tuple[str, ...]:
  return ("--config.stalesync.enabled=True", f"--config.stalesync.max_staleness={s}",
          f"--config.stalesync.train_fraction={f}")


VARIANTS = {   # name -> (binary, flags)
    "separated_sync": ("separated_main.py", _stalesync(0, 1.0) + SEPARATED),
    "separated_stalesync": ("separated_main.py", _stalesync(1, 1.0) + SEPARATED),
    "colocated_sync": ("grpo_main.py", ()),
    "colocated_stalesync": ("grpo_main.py", _stalesync(1, 0.5)),
}
# Selectable with --variants only (not in the default table): the staleness bound and the kept KV cache.
EXTRA_VARIANTS = {
    "colocated_stalesync_keep_cache": ("grpo_main.py", _stalesync(1, 0.5) + ("--config.rollout.keep_cache=True",)),
    **{f"colocated_stalesync_s{s}": ("grpo_main.py", _stalesync(s, 0.5)) for s in (2, 3, 4)},
    **{f"colocated_stalesync_s{s}_keep_cache": ("grpo_main.py", _stalesync(s, 0.5) + ("--config.rollout.keep_cache=True",))
       for s in (2, 3, 4)},
}
COMMON = ("--config.rollout.num_slots=128", "--config.algo.policy_loss=decoupled_ppo",
          "--config.run.checkpoint_every=0", "--config.run.eval_every=0")


def workload_flags(name: str, warmup_hf: str) -> list[str]:
  if name == "longtail":
    return [f"--config={os.path.join(HERE, 'configs', 'stalesync_longtail.py')}"]
  if name == "arithmetic":
    return [f"--config={os.path.join(HERE, 'configs', 'arithmetic.py')}", f"--config.model.hf_path={warmup_hf}",
            "--config.warmup.steps=0", "--config.task.eval_samples=0", "--config.task.eval_problems=16"]
  raise app.UsageError(f"--workloads: unknown {name!r}; known: longtail, arithmetic")


def run_variant(workload: str, variant: str, workdir: str, warmup_hf: str, warm: int, steps: int) -> float:
  binary, extra = {**VARIANTS, **EXTRA_VARIANTS}[variant]
  args = (workload_flags(workload, warmup_hf) + [f"--workdir={workdir}", f"--compilation_cache={_CACHE.value}",
                                                 f"--config.run.steps={warm + steps}"]
          + list(COMMON) + list(extra) + list(common.QUICK_MODEL if _QUICK.value else ()))
  return common.run_binary(binary, args, workdir + ".log")


def measure_run(workdir: str, warm: int, steps: int) -> dict:
  from rl_fusion_jax.sim import measure  # pylint: disable=g-import-not-at-top
  return measure.summarize(measure.load(workdir, warm, steps))


def combine(runs: list[dict]) -> dict:
  """Medians over repeats (nested dicts per key too); the per-repeat tokens/s kept."""
  def med(values):
    if isinstance(values[0], dict):
      return {k: med([v[k] for v in values if k in v]) for k in values[0]}
    return statistics.median(values)
  out = {k: med([r[k] for r in runs]) for k in runs[0]}
  out["trained_tokens_per_s_runs"] = [r["trained_tokens_per_s"] for r in runs]
  return out


def _phases(row: dict) -> str:
  parts = []
  for group, phases in row["phase_s"].items():
    top = sorted(phases.items(), key=lambda kv: -kv[1])
    parts.append(f"{group}: " + ", ".join(f"{n} {s:.2f}" for n, s in top if s >= 0.005))
  return "; ".join(parts)


def table(rows: dict) -> str:
  lines = ["| workload | variant | trained tok/s (per run) | x baseline | steady tok/s | step | generate | train | "
           "phase seconds per step | idle per device group | decode steps | token staleness | compile steps |",
           "|" + "---|" * 13]
  for workload, by_variant in rows.items():
    base = by_variant.get(BASELINE)
    for name, r in by_variant.items():
      ratio = f"{r['trained_tokens_per_s'] / base['trained_tokens_per_s']:.2f}" if base else "-"
      per_run = ", ".join(f"{t:,.0f}" for t in r["trained_tokens_per_s_runs"])
      idle = ", ".join(f"{g} {v:.0%}" for g, v in r["idle_frac"].items())
      lines.append(f"| {workload} | {name} | {r['trained_tokens_per_s']:,.0f} ({per_run}) | {ratio} | "
                   f"{r['trained_tokens_per_s_steady']:,.0f} | "
                   f"{r['step_s']:.3f} s | {r['generate_s']:.3f} s | {r['train_s']:.3f} s | {_phases(r)} | "
                   f"{idle} | {r['decode_steps']:.0f} | {r['staleness_mean']:.2f} | {r['compile_steps']:.0f} |")
  return "\n".join(lines)


def bar_chart(rows: dict, out: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 3.8), squeeze=False)
  for ax, (workload, by_variant) in zip(axes[0], rows.items()):
    names = list(by_variant)
    values = [by_variant[n]["trained_tokens_per_s"] for n in names]
    base = by_variant.get(BASELINE, {}).get("trained_tokens_per_s")
    bars = ax.bar(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
    for b, v in zip(bars, values):
      ax.text(b.get_x() + b.get_width() / 2, v, f"{v / base:.2f}x" if base else "", ha="center", va="bottom")
    ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=8)
    ax.set_ylabel("trained tokens / s")
    ax.set_title(f"{workload} (x = vs {BASELINE})")
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  root = os.path.abspath(_WORKDIR.value)
  os.makedirs(os.path.join(root, "runs"), exist_ok=True)
  quick = _QUICK.value
  workloads = ["longtail"] if quick else list(_WORKLOADS.value)
  variants = _VARIANTS.value or list(VARIANTS)
  unknown = [v for v in variants if v not in VARIANTS and v not in EXTRA_VARIANTS]
  if unknown:
    raise app.UsageError(f"--variants: unknown {unknown}; known: {list(VARIANTS) + list(EXTRA_VARIANTS)}")
  warm, steps, repeats = (0, 2, 1) if quick else (_WARM.value, _STEPS.value, _REPEATS.value)
  for w in workloads:
    workload_flags(w, "")          # unknown names fail before anything runs
  t0 = time.perf_counter()
  warmup_hf = ""
  if "arithmetic" in workloads:
    warmup_hf = _WARMUP_HF.value or common.exported_warmup(root, 2500, _CACHE.value)
  runs = {w: {v: [] for v in variants} for w in workloads}
  workdirs = {w: {} for w in workloads}
  for rep in range(repeats):
    order = variants[rep % len(variants):] + variants[:rep % len(variants)]
    for w in workloads:
      for v in order:
        workdir = os.path.join(root, "runs", f"r{rep}_{w}_{v}")
        if not os.path.isfile(os.path.join(workdir, "summary.json")):
          print(f"repeat {rep + 1}/{repeats}: {w} {v} -> {workdir}", flush=True)
          run_variant(w, v, workdir, warmup_hf, warm, steps)
        runs[w][v].append(measure_run(workdir, warm, steps))
        workdirs[w].setdefault(v, []).append(workdir)
  rows = {w: {v: combine(runs[w][v]) for v in variants} for w in workloads}
  md = table(rows)
  print(md)
  with open(os.path.join(root, "table1.md"), "w") as f:
    f.write(md + "\n")
  bar_chart(rows, os.path.join(root, "table1.png"))
  for w in workloads:
    for v in variants:
      common.run_binary("plot_timeline.py", [f"--workdir={workdirs[w][v][-1]}", f"--steps={warm}:{warm + steps}",
                                             f"--out={os.path.join(root, f'timeline_{w}_{v}.png')}"],
                        os.path.join(root, f"timeline_{w}_{v}.log"))
  with open(os.path.join(root, "ablation.json"), "w") as f:
    json.dump({"warm_steps": warm, "steps": steps, "repeats": repeats, "rows": rows, "workdirs": workdirs,
               "baseline": BASELINE, "seconds": time.perf_counter() - t0,
               "runs_seconds": sum(common.run_wall_seconds(d + ".log") for by in workdirs.values()
                                   for ds in by.values() for d in ds)}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
