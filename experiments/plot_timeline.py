r"""Gantt chart of a run's phase timeline: one lane per device group, one color per phase.

  python experiments/plot_timeline.py --workdir=/tmp/grpo [--out=/tmp/grpo/timeline.png] [--steps=2:5]

Reads DIR/timeline.jsonl (written by `rl_fusion_jax.timeline.Timeline`) and writes a PNG (default
DIR/timeline.png). Each lane is labelled with its devices and busy share; empty space in a lane is idle
time; dashed lines mark resumed sessions. `--steps=a:b` keeps steps a <= step < b (either side may be
empty). Needs matplotlib (the `plot` extra); nothing in the package imports it.
"""
from __future__ import annotations

import os

from absl import app, flags
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from rl_fusion_jax import timeline as timeline_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder holding timeline.jsonl.")
_OUT = flags.DEFINE_string("out", "", "PNG to write (default: WORKDIR/timeline.png).")
_STEPS = flags.DEFINE_string("steps", "", "Steps to show as a:b (a <= step < b); empty: all.")

# Fixed colors for the loop's phases, so every chart of every run reads the same; others cycle after.
PHASE_COLORS = {"generate": "tab:blue", "reward": "tab:orange", "ref": "tab:green", "train": "tab:red",
                "switch": "tab:purple", "eval": "tab:gray"}
OTHER_COLORS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan")
MAX_STEP_MARKS = 30   # beyond this, per-step marks only clutter the chart


def parse_steps(spec: str) -> tuple[int | None, int | None]:
  """'a:b' -> (a, b); 'a:' / ':b' leave a side open; '' -> (None, None)."""
  if not spec:
    return None, None
  parts = spec.split(":")
  try:
    if len(parts) != 2:
      raise ValueError
    lo, hi = (int(p) if p.strip() else None for p in parts)
  except ValueError:
    raise ValueError(f"--steps: expected 'a:b' with integer a and/or b, got {spec!r}") from None
  if lo is not None and hi is not None and hi <= lo:
    raise ValueError(f"--steps: empty range {spec!r} (need a < b)")
  return lo, hi


def device_ranges(ids: tuple[int, ...]) -> str:
  """(0, 1, 2, 3, 6) -> '0-3,6'."""
  runs: list[list[int]] = []
  for i in sorted(ids):
    if runs and i == runs[-1][1] + 1:
      runs[-1][1] = i
    else:
      runs.append([i, i])
  return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def phase_colors(names: list[str]) -> dict[str, str]:
  """Name -> color; the loop's phases first in pipeline order, then the others as they appeared."""
  order = list(PHASE_COLORS)
  names = sorted(names, key=lambda n: order.index(n) if n in order else len(order))
  others = iter(OTHER_COLORS * (1 + len(names) // len(OTHER_COLORS)))
  return {name: PHASE_COLORS.get(name) or next(others) for name in names}


def _lanes(data: timeline_lib.TimelineData) -> list[str]:
  """Groups in registration order, top to bottom; groups without any phase are still shown (idle)."""
  return list(dict.fromkeys(list(data.groups) + [i.group for i in data.intervals]))


def _draw_bars(ax, data, lanes, colors) -> None:
  for row, group in enumerate(lanes):
    for name, color in colors.items():
      bars = [(i.start, i.seconds) for i in data.intervals if i.group == group and i.name == name]
      if bars:
        ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=color, edgecolor="white", linewidth=0.5)


def _draw_marks(ax, data, lo: float, hi: float, num_lanes: int) -> None:
  """Dotted line + label at each step's first start; dashed line at each resumed session."""
  starts: dict[int, float] = {}
  for i in data.intervals:
    if i.step is not None:
      starts[i.step] = min(starts.get(i.step, i.start), i.start)
  if len(starts) <= MAX_STEP_MARKS:
    for step, t in sorted(starts.items()):
      ax.axvline(t, color="0.75", linestyle=":", linewidth=0.8, zorder=0)
      ax.text(t, num_lanes - 0.45, f"step {step}", fontsize=7, color="0.4", va="bottom")
  for t in data.sessions[1:]:
    if lo <= t <= hi:   # only resumes inside the shown range
      ax.axvline(t, color="0.3", linestyle="--", linewidth=1.0)
      ax.text(t, -0.5, " resume", fontsize=7, color="0.3", va="top")


def _title(summary: dict[str, timeline_lib.GroupSummary], total_s: float, steps: str) -> str:
  busy = "   ".join(f"{g}: {s.busy_frac:.0%} busy" for g, s in summary.items())
  where = f" (steps {steps})" if steps else ""
  return f"Phase timeline{where}: {total_s:.2f} s total\n{busy}"


def render(data: timeline_lib.TimelineData, out_path: str, *, steps: str = "") -> str:
  """Draws `data` as a Gantt chart into the PNG `out_path` (Agg, no display needed); returns the path."""
  if not data.intervals:
    raise ValueError(f"no phases to plot{f' in steps {steps}' if steps else ''}")
  lanes = _lanes(data)
  colors = phase_colors(list(dict.fromkeys(i.name for i in data.intervals)))
  summary = timeline_lib.summarize(data)
  lo, hi = min(i.start for i in data.intervals), max(i.end for i in data.intervals)
  fig = Figure(figsize=(12, 1.6 + 0.9 * len(lanes)), layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  _draw_bars(ax, data, lanes, colors)
  _draw_marks(ax, data, lo, hi, len(lanes))
  ax.set_yticks(range(len(lanes)),
                [f"{g}\ndevices {device_ranges(data.groups.get(g, ()))}" for g in lanes])
  ax.set_ylim(len(lanes) - 0.3, -0.7)   # first registered group on top
  pad = 0.01 * max(hi - lo, 1e-6)
  ax.set_xlim(lo - pad, hi + pad)
  ax.set_xlabel("seconds since start")
  ax.grid(axis="x", color="0.9", zorder=0)
  ax.set_axisbelow(True)
  ax.set_title(_title(summary, hi - lo, steps), fontsize=10)
  ax.legend([Patch(color=c) for c in colors.values()], list(colors), loc="upper left",
            bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False, title="phase")
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  fig.savefig(out_path, dpi=110)
  return out_path


def main(argv):
  del argv
  data = timeline_lib.load_timeline(timeline_lib.timeline_path(_WORKDIR.value))
  lo, hi = parse_steps(_STEPS.value)
  out = render(timeline_lib.select_steps(data, lo, hi),
               _OUT.value or os.path.join(_WORKDIR.value, "timeline.png"), steps=_STEPS.value)
  print(f"wrote {out}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
