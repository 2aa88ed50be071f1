r"""The synchronous loop vs StaleSync on a long-tail workload (forced response lengths), as one table.

  python experiments/benchmark_stalesync_main.py --out=/tmp/stalesync_longtail.json --timeline_dir=docs

About 6-7 minutes on 2 CPU cores with the defaults (7 variants x 2 repeats); results in BENCHMARKS.md,
"StaleSync on a long tail".

Each variant is one run of the real binary (experiments/grpo_main.py) in a fresh subprocess with its
own workdir, on --config (default experiments/configs/stalesync_longtail.py: response lengths forced
from a clipped log-normal, the same length for the same sample id in every variant) plus the variant's
overrides: sync; StaleSync (s, f) = (1, 0.5), (1, 0.75), (2, 0.5), (2, 0.75), all colocated;
StaleSync (1, 0.5) in separated mode in one process, where JAX on CPU runs the two sub-meshes one after
the other (that row shows the cost of splitting the devices, not the overlap separated mode is for);
separated mode with one process per side (experiments/separated_main.py, s = 1, whole batches),
where rollout and training overlap; and StaleSync (1, 0.5) colocated as 2 processes x 1 device
(grpo_main.py with the multi-host settings: every program spans both processes), whose idle column has
a lane per process ("all" is process 0, "all@p1" process 1).
With --repeats=R the runs are interleaved (every variant once, then every variant again, the order
rotated each round), so drift on a shared machine hits all variants alike; figures are medians over
the repeats.

Each run has --warm_steps unmeasured steps (compiles), then --steps measured ones. From its
metrics.jsonl and timeline.jsonl over the measured steps:
  * trained tok/s: real (prompt + response) tokens trained (``train_tokens``) / the window from the end
    of the last unmeasured update to the end of the last measured one (timeline 'train' phases), so a
    rollout side that runs ahead of the trainer (one process per side) is measured like the others;
  * step: the window / the measured steps; generate, train: medians of ``generate_s``, ``train_s``;
  * decode steps: median per step (the engine's steps do not depend on the machine's load);
  * slot utilization: generated tokens / (decode steps x slots), summed over the steps;
  * awaited groups: median ``stalesync/forced_groups``, in-flight groups a rollout phase had to finish
    because they would exceed s otherwise;
  * staleness of trained tokens: mean of ``stalesync/trained_token_staleness_mean``, max of
    ``stalesync/staleness_max`` (0 for sync);
  * idle per device group: the share of that window in which the group ran no phase.
Prints a markdown table and the ratios to sync; --out writes both as JSON; --timeline_dir draws the
measured steps of sync and StaleSync (1, 0.5) of the last repeat (experiments/plot_timeline.py).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import types

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))

_CONFIG = flags.DEFINE_string("config", os.path.join(HERE, "configs", "stalesync_longtail.py"),
                              "Experiment config file of every run.")
_OVERRIDES = flags.DEFINE_multi_string("override", [], "Extra config override for every run, e.g. "
                                       "rollout.forced_length_median=16 (passed as --config.<override>).")
_VARIANTS = flags.DEFINE_list("variants", [], "Variants to run (default: all, see VARIANTS).")
_STEPS = flags.DEFINE_integer("steps", 8, "Measured steps per run.")
_WARM = flags.DEFINE_integer("warm_steps", 3, "Unmeasured steps first (compiles).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Runs per variant, interleaved across variants.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Folder for the runs' workdirs (default: a new temp dir).")
_OUT = flags.DEFINE_string("out", "", "Write the table and ratios as JSON here.")
_TIMELINE_DIR = flags.DEFINE_string("timeline_dir", "", "Write timeline_{sync,stalesync}_longtail.png here.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache of the runs ('' disables).")


def _stalesync(s: int, f: float) -> tuple[str, ...]:
  return ("stalesync.enabled=True", f"stalesync.max_staleness={s}", f"stalesync.train_fraction={f}")


VARIANTS = {
    "sync": (),
    "stalesync_s1_f0.5": _stalesync(1, 0.5),
    "stalesync_s1_f0.75": _stalesync(1, 0.75),
    "stalesync_s2_f0.5": _stalesync(2, 0.5),
    "stalesync_s2_f0.75": _stalesync(2, 0.75),
    "separated_1proc_stalesync_s1_f0.5": _stalesync(1, 0.5) + ("fusion.mode=separated",),
    # One process per side (experiments/separated_main.py): rollout and training overlap for real.
    # Whole batches (f = 1), batch k generated with version max(0, k - 1): reproducible.
    "separated_2proc_stalesync_s1": _stalesync(1, 1.0) + ("fusion.mode=separated", "mesh.cpu_devices=1"),
    # The colocated StaleSync run as 2 processes x 1 device (grpo_main.py with the multi-host settings,
    # docs/multihost.md): the same schedule as stalesync_s1_f0.5, every program across processes.
    "stalesync_s1_f0.5_2proc": _stalesync(1, 0.5),
}
TWO_PROCESSES = ("separated_2proc_stalesync_s1",)
MULTI_HOST = ("stalesync_s1_f0.5_2proc",)   # grpo_main.py as 2 local processes x 1 CPU device
TIMELINE_PNGS = {"sync": "timeline_sync_longtail.png", "stalesync_s1_f0.5": "timeline_stalesync_longtail.png"}


def run_variant(name: str, workdir: str) -> None:
  """experiments/grpo_main.py (separated_main.py for the two-process variants) in a fresh process; its log
  goes to WORKDIR.log."""
  binary = "separated_main.py" if name in TWO_PROCESSES else "grpo_main.py"
  args = [sys.executable, os.path.join(HERE, binary), f"--config={_CONFIG.value}",
          f"--workdir={workdir}", f"--compilation_cache={_CACHE.value}",
          f"--config.run.steps={_WARM.value + _STEPS.value}"]
  args += [f"--config.{o}" for o in list(_OVERRIDES.value) + list(VARIANTS[name])]
  if name in MULTI_HOST:
    from rl_fusion_jax.testing import launch  # pylint: disable=g-import-not-at-top
    run = launch.start("grpo_main.py", args[2:], processes=2, devices=1, log_dir=workdir + "_logs")
    codes = run.wait(3600)
    if any(codes):
      raise RuntimeError(f"variant {name} failed (status {codes}):\n{run.log(0)[-3000:]}")
    return
  with open(workdir + ".log", "w") as log:
    done = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, check=False)
  if done.returncode:
    with open(workdir + ".log") as log:
      tail = log.read()[-3000:]
    raise RuntimeError(f"variant {name} failed (status {done.returncode}):\n{tail}")


def check_forced(name: str, cfg: dict, rows: list[dict]) -> None:
  """Raises when a measured step trained a truncated sample (the loop did not force the lengths) or, for
  sync, when a step's mean response length is not the mean forced length of its sample ids."""
  r = cfg["rollout"]
  if not r["forced_length_median"]:
    return
  if any(row["truncated_frac"] for row in rows):
    raise RuntimeError(f"{name}: truncated samples although rollout.forced_length_median is set: the loop "
                       "does not pass phases.forced_lengths(cfg) to phases.requests")
  if name == "sync":
    from rl_fusion_jax import config as config_lib  # pylint: disable=g-import-not-at-top
    from rl_fusion_jax.orchestration import phases  # pylint: disable=g-import-not-at-top
    length = phases.forced_lengths(types.SimpleNamespace(rollout=config_lib.RolloutConfig(**r),
                                                         run=config_lib.RunConfig(**cfg["run"])))
    batch = r["num_prompts"] * r["group_size"]
    for row in rows:
      expected = statistics.fmean(length(i) for i in range((row["step"] - 1) * batch, row["step"] * batch))
      if abs(row["response_len_mean"] - expected) > 1e-6:
        raise RuntimeError(f"sync step {row['step']}: mean response length {row['response_len_mean']} is "
                           f"not that of the forced lengths ({expected})")


def measure(name: str, workdir: str) -> dict:
  """The row of one run: the measured steps' figures (``rl_fusion_jax/sim/measure.py``, shared with
  experiments/ablation_main.py and the simulator's fit)."""
  from rl_fusion_jax.sim import measure as measure_lib  # pylint: disable=g-import-not-at-top
  run = measure_lib.load(workdir, _WARM.value, _STEPS.value)
  check_forced(name, run.config, run.rows)
  out = measure_lib.summarize(run)
  # A train phase 3x the median is most likely a compile (a new packed-row bucket) inside the window.
  out["train_outliers"] = out.pop("compile_steps")
  for key in ("phase_s", "compile_excess_s", "trained_tokens_per_s_steady", "trained_tokens", "steps",
              "step_s_steady"):
    out.pop(key)
  return out


def combine(runs: list[dict]) -> dict:
  """Medians over repeats (idle fractions per group too); the per-repeat tokens/s kept."""
  out = {}
  for key, value in runs[0].items():
    if isinstance(value, dict):
      out[key] = {g: statistics.median(r[key][g] for r in runs) for g in value}
    else:
      out[key] = statistics.median(r[key] for r in runs)
  out["trained_tokens_per_s_runs"] = [round(r["trained_tokens_per_s"], 1) for r in runs]
  return out


def table(rows: dict[str, dict]) -> str:
  sync = rows.get("sync")
  lines = ["| variant | trained tok/s (per run) | x sync | step (median) | generate | train | decode steps | "
           "slot util | awaited groups | staleness mean / max | idle per group | response len |",
           "|" + "---|" * 12]
  for name, r in rows.items():
    ratio = f"{r['trained_tokens_per_s'] / sync['trained_tokens_per_s']:.2f}" if sync else "-"
    per_run = ", ".join(f"{t:,.0f}" for t in r["trained_tokens_per_s_runs"])
    idle = ", ".join(f"{g} {v:.0%}" for g, v in r["idle_frac"].items())
    lines.append(f"| {name} | {r['trained_tokens_per_s']:,.0f} ({per_run}) | {ratio} | {r['step_s']:.2f} s | "
                 f"{r['generate_s']:.2f} s | {r['train_s']:.2f} s | {r['decode_steps']:.0f} | "
                 f"{r['slot_utilization']:.2f} | {r['forced_groups']:.1f} | "
                 f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {idle} | "
                 f"{r['response_len_mean']:.1f} |")
  return "\n".join(lines)


def ratios(rows: dict[str, dict]) -> dict:
  if "sync" not in rows:
    return {}
  sync = rows["sync"]
  return {name: {"trained_tokens_per_s": round(r["trained_tokens_per_s"] / sync["trained_tokens_per_s"], 3),
                 "step_s": round(r["step_s"] / sync["step_s"], 3),
                 "generate_s": round(r["generate_s"] / sync["generate_s"], 3)} for name, r in rows.items()}


def plot_timelines(workdirs: dict[str, str]) -> None:
  for name, png in TIMELINE_PNGS.items():
    if name in workdirs:
      subprocess.run([sys.executable, os.path.join(HERE, "plot_timeline.py"), f"--workdir={workdirs[name]}",
                      f"--out={os.path.join(_TIMELINE_DIR.value, png)}",
                      f"--steps={_WARM.value}:{_WARM.value + _STEPS.value}"], check=True)


def main(argv):
  del argv
  names = _VARIANTS.value or list(VARIANTS)
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    raise app.UsageError(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
  root = _WORKDIR.value or tempfile.mkdtemp(prefix="stalesync_longtail_")
  os.makedirs(root, exist_ok=True)
  runs, order, last = {n: [] for n in names}, [], {}
  for rep in range(_REPEATS.value):
    for name in names[rep % len(names):] + names[:rep % len(names)]:
      workdir = os.path.join(root, f"r{rep}_{name}")
      print(f"run {rep + 1}/{_REPEATS.value}: {name} -> {workdir}", flush=True)
      run_variant(name, workdir)
      runs[name].append(measure(name, workdir))
      order.append(name)
      last[name] = workdir
  rows = {n: combine(runs[n]) for n in names}
  print(table(rows))
  print(json.dumps({"ratios_vs_sync": ratios(rows)}, sort_keys=True))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"config": _CONFIG.value, "overrides": _OVERRIDES.value, "warm_steps": _WARM.value,
                 "steps": _STEPS.value, "repeats": _REPEATS.value, "order": order, "rows": rows,
                 "ratios_vs_sync": ratios(rows), "workdirs": last}, f, indent=1, sort_keys=True)
  if _TIMELINE_DIR.value:
    plot_timelines(last)


if __name__ == "__main__":
  app.run(main)
