r"""Training curves of one or more runs, seeds of one config drawn as a mean line with a min..max band.

  python experiments/plot_metrics.py --workdir=/tmp/a_s0 --workdir=/tmp/a_s1 --workdir=/tmp/b \
      --out=/tmp/curves.png [--label=grpo --label=dr_grpo] [--smooth=5]

Reads DIR/metrics.jsonl (step 0: the evaluation before RL; steps >= 1: training metrics and, every
run.eval_every steps, eval/*) and DIR/config.json of every run. Runs whose configs differ only in run.seed
(and in fields that do not change the computation, IGNORED_FIELDS) form one group; `--label` names the
groups in the order their first run was given (default: the config fields that tell the groups apart).
Panels: reward, accuracy (training samples, held-out greedy eval/accuracy, eval/pass@1 and pass@k), KL,
entropy, mean response length; x is the RL step. `--smooth=N` is a trailing moving average over N points of
the per-step training curves (never the eval points). Also prints, per group, the first and last
eval/accuracy (mean over seeds, min..max). Bad input is reported as one line `error: ...` naming the file,
before anything is drawn. Needs matplotlib (the `plot` extra) only for the figure.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys

import numpy as np
from absl import app, flags

from rl_fusion_jax.errors import ConfigError, RunError

METRICS_FILE, CONFIG_FILE = "metrics.jsonl", "config.json"
# Config fields that never change what a run computes; with run.seed they do not split groups.
IGNORED_FIELDS = ("run.seed", "run.checkpoint_every", "run.keep_checkpoints", "run.progress_every_s")
MAX_LABEL_FIELDS = 3
PASS_AT = re.compile(r"eval/pass@(\d+)$")


@dataclasses.dataclass(frozen=True)
class Run:
  workdir: str
  config: dict
  steps: np.ndarray                 # sorted, unique
  metrics: dict[str, np.ndarray]    # name -> values aligned with steps; NaN where absent


@dataclasses.dataclass(frozen=True)
class Group:
  label: str
  runs: tuple[Run, ...]


@dataclasses.dataclass(frozen=True)
class Band:
  """One metric of a group: per step over the seeds with a finite value there (`count` of them)."""
  steps: np.ndarray
  mean: np.ndarray
  lo: np.ndarray
  hi: np.ndarray
  count: np.ndarray


# -------------------------------------------------------------------------------------------- loading


def _read_rows(path: str) -> dict[int, dict[str, float]]:
  rows: dict[int, dict[str, float]] = {}
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
      step = record.get("step") if isinstance(record, dict) else None
      if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"{path}:{lineno}: expected an object with a non-negative integer 'step'")
      row = rows.setdefault(step, {})
      for k, v in record.items():
        if k == "step":
          continue
        try:
          row[k] = float(v)   # JsonlWriter writes non-finite values as the strings 'nan' / 'inf'
        except (TypeError, ValueError):
          raise ConfigError(f"{path}:{lineno}: {k}: not a number ({v!r})") from None
  return rows


def _read_config(workdir: str) -> dict:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ConfigError(f"{path}: no config file (needed to tell seeds of one config from other configs)")
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path}: malformed JSON ({e.msg}, line {e.lineno})") from None
  if not isinstance(config, dict):
    raise ConfigError(f"{path}: expected a JSON object")
  return config


def load_run(workdir: str) -> Run:
  """Reads DIR/metrics.jsonl and DIR/config.json; every error names the file (and line)."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.isfile(path):
    raise ConfigError(f"{path}: no metrics file (is {workdir} a run folder?)")
  rows = _read_rows(path)
  if not rows:
    raise ConfigError(f"{path}: empty metrics file")
  steps = sorted(rows)
  if steps[-1] < 1:
    raise ConfigError(f"{path}: no RL steps (only the evaluation at step 0)")
  names = sorted({k for row in rows.values() for k in row})
  metrics = {k: np.array([rows[s].get(k, math.nan) for s in steps]) for k in names}
  return Run(workdir, _read_config(workdir), np.array(steps), metrics)


# ------------------------------------------------------------------------------------------- grouping


def flatten(config: dict, prefix: str = "") -> dict:
  """{'run': {'seed': 0}} -> {'run.seed': 0}."""
  flat = {}
  for k, v in config.items():
    if isinstance(v, dict):
      flat |= flatten(v, f"{prefix}{k}.")
    else:
      flat[f"{prefix}{k}"] = v
  return flat


def group_key(config: dict) -> str:
  flat = {k: v for k, v in flatten(config).items() if k not in IGNORED_FIELDS}
  return json.dumps(flat, sort_keys=True)


def _default_labels(groups: list[list[Run]]) -> list[str]:
  """The fields whose values tell the groups apart; with none, the common start of the folder names."""
  flats = [{k: v for k, v in flatten(g[0].config).items() if k not in IGNORED_FIELDS} for g in groups]
  differ = [k for k in sorted(set().union(*flats)) if len({json.dumps(f.get(k)) for f in flats}) > 1]
  if not differ:
    return [_common_name([r.workdir for r in g]) for g in groups]
  more = ", ..." if len(differ) > MAX_LABEL_FIELDS else ""
  return [", ".join(f"{k}={f.get(k)}" for k in differ[:MAX_LABEL_FIELDS]) + more for f in flats]


def _common_name(workdirs: list[str]) -> str:
  """['grpo_s0', 'grpo_s1'] -> 'grpo': the common start, cut back to the last whole '_', '-' or '.' part."""
  names = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(set(names)) == 1:
    return names[0]
  return re.sub(r"[-_.][^-_.]*$", "", os.path.commonprefix(names)) or names[0]


def group_runs(runs: list[Run], labels: list[str] | None = None) -> list[Group]:
  """Runs with equal configs but for IGNORED_FIELDS, in order of first appearance."""
  by_key: dict[str, list[Run]] = {}
  for run in runs:
    by_key.setdefault(group_key(run.config), []).append(run)
  members = list(by_key.values())
  if labels and len(labels) != len(members):
    raise ConfigError(f"--label: got {len(labels)} labels for {len(members)} run groups "
                      f"({', '.join('+'.join(r.workdir for r in g) for g in members)})")
  labels = labels or _default_labels(members)
  return [Group(label, tuple(g)) for label, g in zip(labels, members)]


# ------------------------------------------------------------------------------------------- curves


def smooth(values: np.ndarray, n: int) -> np.ndarray:
  """Trailing moving average over n points; the first n - 1 points average what there is so far."""
  if n <= 1:
    return values
  csum = np.concatenate([[0.0], np.cumsum(values)])
  i = np.arange(1, len(values) + 1)
  start = np.maximum(i - n, 0)
  return (csum[i] - csum[start]) / (i - start)


def band(group: Group, name: str, n_smooth: int = 1) -> Band | None:
  """`name` over the group's seeds (each smoothed first); None when no seed has a finite value."""
  series = []
  for run in group.runs:
    values = run.metrics.get(name)
    if values is not None:
      ok = np.isfinite(values)
      series.append(dict(zip(run.steps[ok].tolist(), smooth(values[ok], n_smooth))))
  steps = sorted(set().union(*series)) if series else []
  if not steps:
    return None
  table = np.array([[s.get(step, math.nan) for step in steps] for s in series])
  return Band(np.array(steps), np.nanmean(table, 0), np.nanmin(table, 0), np.nanmax(table, 0),
              np.isfinite(table).sum(0))


def pass_at_k(group: Group) -> str | None:
  """The largest eval/pass@k with k > 1 any seed logged, or None."""
  ks = [int(m[1]) for run in group.runs for k in run.metrics if (m := PASS_AT.match(k)) and int(m[1]) > 1]
  return f"eval/pass@{max(ks)}" if ks else None


def seeds_text(n: int) -> str:
  return f"{n} seed{'s' if n != 1 else ''}"


def summarise(group: Group) -> dict:
  """First and last eval/accuracy of a group: step, mean over seeds, min, max and how many seeds."""
  b = band(group, "eval/accuracy")

  def point(i):
    return dict(step=int(b.steps[i]), mean=float(b.mean[i]), min=float(b.lo[i]), max=float(b.hi[i]),
                seeds=int(b.count[i]))
  return dict(label=group.label, seeds=len(group.runs),
              first=point(0) if b is not None else None, last=point(-1) if b is not None else None)


def format_summary(s: dict) -> str:
  head = f"{s['label']} ({seeds_text(s['seeds'])}): eval/accuracy"
  if s["first"] is None:
    return f"{head}: none logged"

  def point(p):
    spread = f" [{p['min']:.3f}..{p['max']:.3f}]" if p["seeds"] > 1 else ""
    partial = f" ({p['seeds']} of {s['seeds']} seeds)" if p["seeds"] < s["seeds"] else ""
    return f"step {p['step']}: {p['mean']:.3f}{spread}{partial}"
  return f"{head} {point(s['first'])} -> {point(s['last'])}"


# ----------------------------------------------------------------------------------------------- plot

# Panel title, [(metric, style)], what to say when no group has the metric. Styles: "train" (per-step
# line, smoothed) or an eval marker (points joined by dashed lines, never smoothed).
PANELS = (
    ("reward", [("reward", "train")], "no reward"),
    ("accuracy", [("accuracy", "train"), ("eval/accuracy", "o"), ("eval/pass@1", "s"), ("pass@k", "^")],
     "no accuracy"),
    ("KL to reference", [("kl", "train")], "no reference model"),
    ("entropy", [("entropy", "train")], "no entropy"),
    ("response length (mean tokens)", [("response_len_mean", "train")], "no response_len_mean"),
)
STYLE_NAMES = {"train": "training samples", "o": "eval/accuracy (greedy)", "s": "eval/pass@1", "^": "eval/pass@k"}


def _draw(ax, b: Band, color: str, style: str, seeds: int) -> None:
  train = style == "train"
  ax.plot(b.steps, b.mean, color=color, linewidth=1.4 if train else 1.0, linestyle="-" if train else "--",
          marker=None if train else style, markersize=4)
  if seeds > 1:
    ax.fill_between(b.steps, b.lo, b.hi, color=color, alpha=0.2, linewidth=0)


def _draw_panel(ax, groups, colors, title, curves, empty, n_smooth) -> set[str]:
  """Draws one panel; returns the styles it used (for the legend)."""
  used, missing = set(), []
  for group, color in zip(groups, colors):
    drawn = False
    for name, style in curves:
      name = pass_at_k(group) if name == "pass@k" else name
      b = band(group, name, n_smooth if style == "train" else 1) if name else None
      if b is not None:
        _draw(ax, b, color, style, len(group.runs))
        used.add(style)
        drawn = True
    missing += [] if drawn else [group.label]
  if not used:
    ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="0.4")
  elif missing:   # e.g. KL of runs with a reference model next to runs without one
    ax.text(0.99, 0.01, f"{empty}: {', '.join(missing)}", transform=ax.transAxes, ha="right", va="bottom",
            fontsize=7, color="0.4")
  ax.set_title(title, fontsize=10)
  ax.set_xlabel("RL step")
  ax.grid(color="0.9")
  return used


def render(groups: list[Group], out_path: str, *, n_smooth: int = 1) -> str:
  """Draws the panels into the PNG `out_path` (Agg, no display needed); returns the path."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg   # the `plot` extra; loading needs none
  from matplotlib.figure import Figure
  from matplotlib.lines import Line2D
  fig = Figure(figsize=(15, 8), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(2, 3).ravel()
  colors = [f"C{i % 10}" for i in range(len(groups))]
  styles = set()
  for ax, (title, curves, empty) in zip(axes, PANELS):
    styles |= _draw_panel(ax, groups, colors, title, curves, empty, n_smooth)
  legend_ax = axes[-1]
  legend_ax.axis("off")
  runs = legend_ax.legend([Line2D([], [], color=c, linewidth=3) for c in colors],
                          [f"{g.label} ({seeds_text(len(g.runs))})" for g in groups],
                          loc="upper left", title="runs (band: min..max over seeds)", fontsize=8, frameon=False)
  legend_ax.add_artist(runs)
  order = [s for s in STYLE_NAMES if s in styles]
  ks = {pass_at_k(g) for g in groups} - {None}
  names = STYLE_NAMES | ({"^": ks.pop()} if len(ks) == 1 else {})
  legend_ax.legend([Line2D([], [], color="0.2", linestyle="-" if s == "train" else "--",
                           marker=None if s == "train" else s) for s in order],
                   [names[s] for s in order], loc="lower left", title="accuracy panel", fontsize=8,
                   frameon=False)
  fig.suptitle(f"RL metrics{f' (training curves: moving average over {n_smooth})' if n_smooth > 1 else ''}")
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  fig.savefig(out_path, dpi=100)
  return out_path


def define_flags() -> None:
  """Only when run as a binary: tests import this file next to plot_timeline.py, whose --workdir and --out
  live in the same absl registry."""
  flags.DEFINE_multi_string("workdir", None, "Run folder holding metrics.jsonl and config.json.")
  flags.DEFINE_string("out", None, "PNG to write.")
  flags.DEFINE_multi_string("label", [], "Legend name per run group, in order of first appearance.")
  flags.DEFINE_integer("smooth", 1, "Trailing moving average over N points of the training curves.", lower_bound=1)
  flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  del argv
  args = flags.FLAGS
  try:
    groups = group_runs([load_run(w) for w in args.workdir], args.label)
  except RunError as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(1)
  for group in groups:
    print(format_summary(summarise(group)))
  print(f"wrote {render(groups, args.out, n_smooth=args.smooth)}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
