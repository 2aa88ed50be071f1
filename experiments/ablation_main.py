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
  * ``colocated_stalesync``: RL Fusion + StaleSync, s = 2, train_fraction 0.5 (32 groups outstanding,
    long tails continue in the next phases), ``rollout.keep_cache`` (carried samples keep their KV cache
    across the update: no re-prefill). With s = 1 a sample must finish within two phases, so a phase
    lasts at least about half the longest response; ``colocated_stalesync_s1`` (``--variants``) is that
    setting.
Workloads: ``longtail`` (experiments/configs/stalesync_longtail.py: the main job's model shape, random
init, response lengths forced to a clipped log-normal, median 8, up to 64 tokens, the same lengths for
the same sample in every variant) and ``arithmetic`` (the main job's task and warmed-up policy, exported
once by ``grpo_main.py --export_hf``, responses of 1-6 tokens chosen by the policy: no long tail).

Each run is a fresh process; with --repeats R the runs are interleaved (every variant once, then again,
the order rotated), figures are medians over the repeats. From each run's metrics.jsonl and timeline
(``rl_fusion_jax/sim/measure.py``): trained tok/s over the window from the end of the last unmeasured
update to the end of the last measured one, the step time (that window / the measured steps), generate /
train medians, seconds per step of every phase per device group, and each group's idle share of the window.

Compiles in the measured window: every run is made with JAX_LOG_COMPILES=1, and its log's tracing,
lowering and XLA compilation events (end time and duration) are written to RUN/compiles.json on the run's
timeline clock; a run is marked compile-contaminated when those events cover over 1% of its window, or
when a measured step's update or rollout phase took over 3x the run's median (the only test for runs
made before compiles were logged). The table's medians, ratios and "steady tok/s" use the unmarked runs
only; a row with no unmarked run keeps them all and is marked itself. "steady tok/s" also takes the
excess of such 3x-median steps out of the window (the simulator is validated on that).
The machine is recorded when a run is made (RUN/machine.json: CPU model, family and vector extensions, cores,
load average before and after, the commit), never read from the machine that renders a report, and so are its
CPU counters while the run is made (RUN/cpu.json, ``common.CpuMonitor``): each run's row gives the CPU seconds
that other processes used and that the hypervisor stole inside its measured window (``interference_runs``).
A run in whose window they took more than --max_interference (1%, as for compiles) of the machine's CPU seconds
is disturbed: it is set aside as RUN.disturbedK and made again, up to --remeasure times (the last attempt
is kept either way; ``disturbed_runs`` and ``remeasured_runs`` in its row say which and how often).
``--workload_steps`` measures a workload whose steps are short over more of them (e.g. arithmetic:192).

--from_runs=results/runs/ablation.json: tabulate the runs a manifest lists (folders relative to it; the
committed runs) without running anything: the table, the chart and the timelines from committed data.
Writes WORKDIR/ablation.json (the rows, every run's workdir, its machine record and compile seconds,
which experiments/simulate_main.py fits and validates against), WORKDIR/table1.md, WORKDIR/table1.png
(bar chart) and WORKDIR/timeline_<workload>_<variant>.png (the measured steps of the last repeat).
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import re
import statistics
import sys
import time

from absl import app, flags

import common

HERE = os.path.dirname(os.path.abspath(__file__))

_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (runs, table, figures).")
_QUICK = flags.DEFINE_bool("quick", False, "Long-tail workload only, 1 repeat, 2 steps (none unmeasured), "
                           "the model at one layer and half width (common.QUICK_MODEL).")
_WORKLOADS = flags.DEFINE_list("workloads", ["longtail", "arithmetic"], "Workloads (see the docstring).")
_VARIANTS = flags.DEFINE_list("variants", [], "Variants (default: all four).")
_STEPS = flags.DEFINE_integer("steps", 8, "Measured steps per run.")
_WORKLOAD_STEPS = flags.DEFINE_list("workload_steps", [], "Measured steps per run of a workload, overriding "
                                    "--steps: WORKLOAD:STEPS entries (e.g. arithmetic:192, so that a workload "
                                    "whose steps are short is measured over as many seconds as the others).")
_WARM = flags.DEFINE_integer("warm_steps", 4, "Unmeasured steps first (compiles).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per variant, interleaved across variants.")
_WARMUP_HF = flags.DEFINE_string("warmup_hf", "", "The exported warm-up policy for the arithmetic workload "
                                 "(default: made in WORKDIR/warmup_hf).")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache of the runs ('' disables).")
_MAX_INTERFERENCE = flags.DEFINE_float("max_interference", 0.01, "A run is disturbed when other processes and "
                                       "the hypervisor (steal) took more than this share of the machine's CPU "
                                       "seconds inside its measured window (RUN/cpu.json); it is then made again.")
_REMEASURE = flags.DEFINE_integer("remeasure", 2, "How many times a disturbed run is made again (the disturbed "
                                  "attempts are kept beside it as RUN.disturbedK); 0: never (--quick: never).")
_FROM_RUNS = flags.DEFINE_string("from_runs", "", "An ablation manifest (e.g. results/runs/ablation.json): "
                                 "tabulate the runs it lists, folders relative to it, without running anything.")
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
    "colocated_stalesync": ("grpo_main.py", _stalesync(2, 0.5) + ("--config.rollout.keep_cache=True",)),
}
# Selectable with --variants only (not in the default table): the staleness bound, with and without the
# kept KV cache.
EXTRA_VARIANTS = {
    **{f"colocated_stalesync_s{s}": ("grpo_main.py", _stalesync(s, 0.5)) for s in (1, 2, 3, 4)},
    **{f"colocated_stalesync_s{s}_keep_cache": ("grpo_main.py", _stalesync(s, 0.5) + ("--config.rollout.keep_cache=True",))
       for s in (1, 3, 4)},
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
  # JAX_LOG_COMPILES: the run's log times every trace, lowering and compile.
  seconds = common.run_recorded(binary, args, workdir, env={"JAX_LOG_COMPILES": "1"})
  write_compiles(workdir, workdir + ".log")
  return seconds


# ----------------------------------------------------------------------------- compiles in the window

# absl's prefix (local time) and JAX's messages under JAX_LOG_COMPILES=1 (jax._src.dispatch).
_COMPILE_LINE = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6}) .*?\] Finished "
                           r"(tracing|jaxpr to MLIR module conversion|XLA compilation) (?:of )?(.*) in "
                           r"([0-9.eE+-]+) sec")
_KINDS = {"tracing": "trace", "jaxpr to MLIR module conversion": "lower", "XLA compilation": "compile"}
COMPILE_TOLERANCE = 0.01   # of the measured window, above which a run counts as compile-contaminated
SET_ASIDE = "set_aside.json"   # in a run folder: the interference of its attempts set aside before it


def _session_unix(path: str) -> float:
  with open(path) as f:
    return float(json.loads(f.readline())["unix_time"])


def timeline_unix_offset(workdir: str) -> float:
  """Unix time of timeline.jsonl's second 0. A separated run's timeline.jsonl merges both sides on their
  earliest phase; its training side's own timeline (timeline_train.jsonl) starts at its session's time, so
  the two are aligned on the last update's end."""
  from rl_fusion_jax import timeline as timeline_lib  # pylint: disable=g-import-not-at-top
  merged_path = os.path.join(workdir, "timeline.jsonl")
  own_path = os.path.join(workdir, "timeline_train.jsonl")
  if not os.path.isfile(own_path):
    return _session_unix(merged_path)
  last = lambda data: max(((i.step, i.end) for i in data.intervals if i.name == "train" and i.step is not None),
                          default=None)
  own, merged = last(timeline_lib.load_timeline(own_path)), last(timeline_lib.load_timeline(merged_path))
  if own is None or merged is None or own[0] != merged[0]:
    raise ValueError(f"{workdir}: cannot align timeline_train.jsonl with timeline.jsonl")
  return _session_unix(own_path) + own[1] - merged[1]


def compile_events(log_path: str, unix_offset: float) -> list[list]:
  """[start, end, kind, name] (timeline seconds) of every trace, lowering and XLA compilation the run's log
  times (both processes of a separated run write to it)."""
  year = time.localtime(unix_offset).tm_year
  out = []
  with open(log_path, errors="replace") as f:
    for line in f:
      m = _COMPILE_LINE.match(line)
      if not m:
        continue
      mon, day, h, mi, sec, us, kind, name, seconds = m.groups()
      stamp = datetime.datetime(year, int(mon), int(day), int(h), int(mi), int(sec), int(us)).timestamp()
      if stamp < unix_offset - 180 * 86400:   # the run crossed New Year
        stamp = datetime.datetime(year + 1, int(mon), int(day), int(h), int(mi), int(sec), int(us)).timestamp()
      end = stamp - unix_offset
      out.append([round(end - float(seconds), 4), round(end, 4), _KINDS[kind], name.strip()[:60]])
  return out


def write_compiles(workdir: str, log_path: str) -> None:
  """RUN/compiles.json: the run's compile events on its timeline clock (see the module docstring)."""
  events = compile_events(log_path, timeline_unix_offset(workdir))
  with open(os.path.join(workdir, "compiles.json"), "w") as f:
    json.dump({"source": "the run's log under JAX_LOG_COMPILES=1 (absl time stamps, JAX's durations), "
                         "[start, end, kind, name] in timeline seconds", "events": events}, f)


def _covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
  """Seconds of [lo, hi] inside the union of ``spans``."""
  total, reach = 0.0, lo
  for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
    if b > a and b > reach:
      total += b - max(a, reach)
      reach = b
  return total


def measure_run(workdir: str, warm: int, steps: int, max_interference: float | None = None) -> dict:
  """``measure.summarize`` of the run, with its compile seconds in the window (None: not recorded), whether
  it is compile-contaminated, its machine record (None: not recorded), its CPU interference, whether that
  is over ``max_interference`` (``disturbed``; never with None) and how many attempts were set aside before
  it (RUN/set_aside.json)."""
  from rl_fusion_jax.sim import measure  # pylint: disable=g-import-not-at-top
  run = measure.load(workdir, warm, steps)
  out = measure.summarize(run)
  lo, hi = run.window()
  path = os.path.join(workdir, "compiles.json")
  window_s = None
  if os.path.isfile(path):
    with open(path) as f:
      events = json.load(f)["events"]
    window_s = _covered([(a, b) for a, b, *_ in events], lo, hi)
  machine = None
  if os.path.isfile(os.path.join(workdir, "machine.json")):
    with open(os.path.join(workdir, "machine.json")) as f:
      machine = json.load(f)
  contaminated = out["compile_steps"] > 0 or (window_s or 0.0) > COMPILE_TOLERANCE * out["wall_s"]
  with open(os.path.join(workdir, "timeline.jsonl")) as f:
    made = json.loads(f.readline()).get("unix_time")
  interference = window_interference(workdir, lo, hi)
  share = common.interference_share(interference)
  remeasured = 0
  if os.path.isfile(os.path.join(workdir, SET_ASIDE)):
    with open(os.path.join(workdir, SET_ASIDE)) as f:
      remeasured = len(json.load(f)["interference"])
  return out | {"compile_window_s": window_s, "compile_contaminated": contaminated, "machine": machine,
                "made_unix_time": made, "interference": interference, "remeasured": remeasured,
                "disturbed": share is not None and max_interference is not None and share > max_interference}


PER_RUN = ("compile_window_s", "compile_contaminated", "machine", "made_unix_time", "interference", "disturbed",
           "remeasured")


def set_aside(workdir: str, interference: dict) -> str:
  """Moves a disturbed run (folder and log) to the first free WORKDIR.disturbedK, so that it is made again."""
  k = 1
  while os.path.exists(f"{workdir}.disturbed{k}"):
    k += 1
  dest = f"{workdir}.disturbed{k}"
  print(f"  disturbed: other processes {interference['other_share']:.1%} and steal {interference['steal_share']:.1%} "
        f"of the CPU in its window: set aside as {dest}", flush=True)
  os.rename(workdir, dest)
  if os.path.isfile(workdir + ".log"):
    os.rename(workdir + ".log", dest + ".log")
  return dest


def measure_until_undisturbed(workdir: str, make, measure, attempts: int) -> dict:
  """``measure()`` of the run in ``workdir``, made first by ``make()`` unless it is there (summary.json); a
  disturbed one is set aside (``set_aside``) and made again, at most ``attempts`` times; the last attempt
  is kept either way. Returns its measurement with ``remeasured``: how many attempts were set aside."""
  set_aside_runs = []
  while True:
    if not os.path.isfile(os.path.join(workdir, "summary.json")):
      make()
    measured = measure()
    if not measured["disturbed"] or len(set_aside_runs) >= attempts:
      if set_aside_runs:   # beside the run, so that --from_runs and an export still know
        with open(os.path.join(workdir, SET_ASIDE), "w") as f:
          json.dump({"source": "ablation_main.py: earlier attempts of this run, set aside as disturbed",
                     "interference": set_aside_runs}, f, indent=1)
      return measured | {"remeasured": len(set_aside_runs)}
    set_aside(workdir, measured["interference"])
    set_aside_runs.append(measured["interference"])


def window_interference(workdir: str, lo: float, hi: float) -> dict | None:
  """``common.cpu_interference`` over the measured window [lo, hi] (timeline seconds) from RUN/cpu.json;
  None for a run made without it."""
  path = os.path.join(workdir, "cpu.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    cpu = json.load(f)
  offset = timeline_unix_offset(workdir)
  return common.cpu_interference(cpu["rows"], cpu["cores"], offset + lo, offset + hi)


def combine(runs: list[dict]) -> dict:
  """Medians over the repeats whose window held no compile (over all of them when none is clean, the row
  then marked ``all_contaminated``), nested dicts per key too; per repeat: tokens/s, compile steps and
  seconds, the contamination mark."""
  def med(values):
    if isinstance(values[0], dict):
      return {k: med([v[k] for v in values if k in v]) for k in values[0]}
    return statistics.median(values)
  clean = [r for r in runs if not r["compile_contaminated"]]
  used = clean or runs
  out = {k: med([r[k] for r in used]) for k in runs[0] if k not in PER_RUN}
  out["trained_tokens_per_s_runs"] = [r["trained_tokens_per_s"] for r in runs]
  out["compile_steps_runs"] = [r["compile_steps"] for r in runs]
  out["compile_window_s_runs"] = [r["compile_window_s"] for r in runs]
  out["contaminated_runs"] = [r["compile_contaminated"] for r in runs]
  out["interference_runs"] = [r.get("interference") for r in runs]
  out["disturbed_runs"] = [r.get("disturbed", False) for r in runs]
  out["remeasured_runs"] = [r.get("remeasured", 0) for r in runs]
  out["runs_used"], out["all_contaminated"] = len(used), not clean
  return out


def _phases(row: dict) -> str:
  parts = []
  for group, phases in row["phase_s"].items():
    top = sorted(phases.items(), key=lambda kv: -kv[1])
    parts.append(f"{group}: " + ", ".join(f"{n} {s:.2f}" for n, s in top if s >= 0.005))
  return "; ".join(parts)


def _compiles(r: dict) -> str:
  """Per run: measured steps over 3x the median, and the logged compile seconds in the window."""
  parts = [f"{steps:.0f} / " + ("not logged" if secs is None else f"{secs:.2f} s")
           for steps, secs in zip(r["compile_steps_runs"], r["compile_window_s_runs"])]
  return f"{parts[0]} (each run)" if len(parts) > 1 and len(set(parts)) == 1 else ", ".join(parts)


def table(rows: dict) -> str:
  lines = ["| workload | variant | trained tok/s (per run; † compile in its window) | x baseline | steady tok/s | "
           "step | generate | train | phase seconds per step | idle per device group | decode steps | "
           "token staleness | compiles per run: steps over 3x median / logged seconds in the window |",
           "|" + "---|" * 13]
  for workload, by_variant in rows.items():
    base = by_variant.get(BASELINE)
    for name, r in by_variant.items():
      ratio = f"{r['trained_tokens_per_s'] / base['trained_tokens_per_s']:.2f}" if base else "-"
      if base and (r["all_contaminated"] or base["all_contaminated"]):
        steady = f"{r['trained_tokens_per_s_steady'] / base['trained_tokens_per_s_steady']:.2f}"
        ratio += " †" + (f" (steady {steady})" if steady != ratio else "")
      per_run = ", ".join(f"{t:,.0f}{'†' if c else ''}" for t, c in zip(r["trained_tokens_per_s_runs"],
                                                                      r["contaminated_runs"]))
      value = f"{r['trained_tokens_per_s']:,.0f}" + (" †" if r["all_contaminated"] else "")
      idle = ", ".join(f"{g} {v:.0%}" for g, v in r["idle_frac"].items())
      lines.append(f"| {workload} | {name} | {value} ({per_run}) | {ratio} | "
                   f"{r['trained_tokens_per_s_steady']:,.0f} | "
                   f"{r['step_s']:.3f} s | {r['generate_s']:.3f} s | {r['train_s']:.3f} s | {_phases(r)} | "
                   f"{idle} | {r['decode_steps']:.0f} | {r['staleness_mean']:.2f} | {_compiles(r)} |")
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


def _from_manifest(path: str) -> dict:
  """The runs a manifest lists (folders relative to it), with its settings and what it says of them."""
  with open(path) as f:
    manifest = json.load(f)
  here = os.path.dirname(os.path.abspath(path))
  manifest["workdirs"] = {w: {v: [os.path.join(here, d) for d in dirs] for v, dirs in by.items()}
                          for w, by in manifest["workdirs"].items()}
  return manifest


def main(argv):
  del argv
  root = os.path.abspath(_WORKDIR.value)
  t0 = time.perf_counter()
  if _FROM_RUNS.value:
    manifest = _from_manifest(_FROM_RUNS.value)
    os.makedirs(root, exist_ok=True)
    warm, repeats = manifest["warm_steps"], manifest["repeats"]
    workdirs = manifest["workdirs"]
    workloads, variants = list(workdirs), list(next(iter(workdirs.values())))
    from rl_fusion_jax.sim import fit  # pylint: disable=g-import-not-at-top
    steps = {w: fit.steps_of(manifest, w) for w in workloads}
    command, runs_seconds = manifest.get("command"), manifest.get("runs_seconds")
    max_interference = manifest.get("max_interference")   # None (runs made before the rule): none disturbed
    runs = {w: {v: [measure_run(d, warm, steps[w], max_interference) for d in workdirs[w][v]] for v in variants}
            for w in workloads}
  else:
    quick = _QUICK.value
    workloads = ["longtail"] if quick else list(_WORKLOADS.value)
    variants = _VARIANTS.value or list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS and v not in EXTRA_VARIANTS]
    if unknown:
      raise app.UsageError(f"--variants: unknown {unknown}; known: {list(VARIANTS) + list(EXTRA_VARIANTS)}")
    max_interference = _MAX_INTERFERENCE.value
    if _REMEASURE.value < 0:
      raise app.UsageError(f"--remeasure: must be >= 0, got {_REMEASURE.value}")
    warm, repeats = (0, 1) if quick else (_WARM.value, _REPEATS.value)
    for w in workloads:
      workload_flags(w, "")          # unknown names fail before anything runs
    steps = {w: 2 if quick else _STEPS.value for w in workloads}
    for entry in _WORKLOAD_STEPS.value:
      name, _, count = entry.partition(":")
      if name not in workloads or not count.isdigit() or int(count) < 1:
        raise app.UsageError(f"--workload_steps: {entry!r} is not WORKLOAD:STEPS with a workload of this run "
                             f"({', '.join(workloads)}) and a positive step count")
      steps[name] = int(count)
    os.makedirs(os.path.join(root, "runs"), exist_ok=True)    # the flags checked: nothing written before
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

          def make(w=w, v=v, workdir=workdir, rep=rep):
            print(f"repeat {rep + 1}/{repeats}: {w} {v} -> {workdir}", flush=True)
            run_variant(w, v, workdir, warmup_hf, warm, steps[w])

          measure = functools.partial(measure_run, workdir, warm, steps[w], max_interference)
          runs[w][v].append(measure_until_undisturbed(workdir, make, measure, 0 if quick else _REMEASURE.value))
          workdirs[w].setdefault(v, []).append(workdir)
    command = " ".join(["python experiments/ablation_main.py"] + sys.argv[1:])
    runs_seconds = sum(common.run_wall_seconds(d + ".log") for by in workdirs.values()
                       for ds in by.values() for d in ds)
  rows = {w: {v: combine(runs[w][v]) for v in variants} for w in workloads}
  md = table(rows)
  print(md)
  with open(os.path.join(root, "table1.md"), "w") as f:
    f.write(md + "\n")
  bar_chart(rows, os.path.join(root, "table1.png"))
  for w in workloads:
    for v in variants:
      common.run_binary("plot_timeline.py", [f"--workdir={workdirs[w][v][-1]}", f"--steps={warm}:{warm + steps[w]}",
                                             f"--out={os.path.join(root, f'timeline_{w}_{v}.png')}"],
                        os.path.join(root, f"timeline_{w}_{v}.log"))
  per_run = [r for by in runs.values() for rs in by.values() for r in rs]
  made = [r["made_unix_time"] for r in per_run if r["made_unix_time"]]
  with open(os.path.join(root, "ablation.json"), "w") as f:
    # "steps": one count for every workload, or workload -> count where they differ.
    json.dump({"warm_steps": warm, "steps": steps if len(set(steps.values())) > 1 else next(iter(steps.values())),
               "repeats": repeats, "rows": rows, "workdirs": workdirs,
               "baseline": BASELINE, "seconds": time.perf_counter() - t0, "runs_seconds": runs_seconds,
               "command": command, "from_runs": _FROM_RUNS.value or None, "max_interference": max_interference,
               # Recorded when each run was made (None where it was not), not read from this machine.
               "machines": [r["machine"] for r in per_run],
               "made_unix_time": [min(made), max(made)] if made else None}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
