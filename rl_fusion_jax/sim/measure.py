"""What a finished run measured, from its workdir alone (config.json, metrics.jsonl, timeline.jsonl).

The window of a run with ``warm`` unmeasured steps and ``steps`` measured ones runs from the end of the
update of step ``warm`` to the end of the update of step ``warm + steps`` (the timeline's 'train'
phases), so a rollout side that runs ahead of the trainer is measured like a colocated run. Figures:
  * trained tok/s: real (prompt + response) tokens trained in the measured steps / the window; and
    "steady", the same with the excess of compile steps (an update or rollout phase over 3x the run's
    median) taken out of the window;
  * step time: the window / the measured steps (the mean time between update ends), and "steady";
  * generate / train: medians of ``generate_s`` / ``train_s``;
  * idle per device group: the share of the window in which the group ran no phase;
  * phase seconds: per device group and phase name, the mean per measured step.
Shared by ``experiments/ablation_main.py``, ``experiments/benchmark_stalesync_main.py`` and the
simulator's fit (``sim/fit.py``). Reads files only: nothing here imports JAX.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax import timeline as timeline_lib

EXCLUDED_PHASES = ("warmup", "evaluate", "checkpoint")   # not part of a step


@dataclasses.dataclass
class MeasuredRun:
  workdir: str
  config: dict
  rows: list[dict]                      # metrics of the measured steps, in step order
  warm: int
  timeline: timeline_lib.TimelineData

  @property
  def steps(self) -> int:
    return len(self.rows)

  @property
  def mode(self) -> str:
    return "separated" if set(self.timeline.groups) == {"rollout", "train"} else "colocated"

  @property
  def train_group(self) -> str:
    return "train" if self.mode == "separated" else next(iter(self.timeline.groups))

  @property
  def rollout_group(self) -> str:
    return "rollout" if self.mode == "separated" else self.train_group

  def update_end(self, step: int) -> float:
    """Clock at the end of the update of 1-based ``step`` (0: the start of the first RL phase)."""
    if step == 0:
      return min(i.start for i in self.timeline.intervals if i.step is not None and i.step >= 0
                 and i.name not in EXCLUDED_PHASES)
    ends = [i.end for i in self.timeline.intervals if i.name == "train" and i.step == step - 1]
    if not ends:
      raise ValueError(f"{self.workdir}: no 'train' phase of step {step} on the timeline")
    return max(ends)

  def window(self) -> tuple[float, float]:
    return self.update_end(self.warm), self.update_end(self.warm + self.steps)

  def step_seconds(self) -> list[float]:
    ends = [self.update_end(k) for k in range(self.warm, self.warm + self.steps + 1)]
    return [b - a for a, b in zip(ends, ends[1:])]

  def phase_seconds(self) -> dict[str, dict[str, float]]:
    """group -> phase name -> mean seconds per measured step (phases of the measured steps only)."""
    lo, hi = self.warm, self.warm + self.steps          # 0-based timeline steps lo .. hi - 1
    out: dict[str, dict[str, float]] = {}
    for i in self.timeline.intervals:
      if i.step is not None and lo <= i.step < hi and i.name not in EXCLUDED_PHASES:
        g = out.setdefault(i.group, {})
        g[i.name] = g.get(i.name, 0.0) + (i.end - i.start) / self.steps
    return out


def load(workdir: str, warm: int, steps: int | None = None) -> MeasuredRun:
  """The run in ``workdir`` with its first ``warm`` steps unmeasured (and ``steps`` measured: all the
  rest by default); raises ValueError naming the file when something is missing."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"{path}: missing (is {workdir} a run folder?)")
  with open(path) as f:
    config = json.load(f)
  rows = sorted((m for m in metrics_lib.read_metrics(workdir) if "train_tokens" in m and m["step"] > warm),
                key=lambda m: m["step"])
  if steps is not None:
    rows = [m for m in rows if m["step"] <= warm + steps]
    if len(rows) != steps:
      raise ValueError(f"{workdir}/metrics.jsonl: {len(rows)} measured steps after {warm} warm ones, "
                       f"expected {steps}")
  if not rows:
    raise ValueError(f"{workdir}/metrics.jsonl: no training step after the first {warm}")
  data = timeline_lib.load_timeline(timeline_lib.timeline_path(workdir))
  return MeasuredRun(workdir, config, rows, warm, data)


def compile_excess(run: MeasuredRun) -> tuple[set[int], float]:
  """Measured steps whose update or rollout phase took over 3x the run's median (a compile fell into
  them: a new packed-row or width bucket), and their seconds beyond the median."""
  steps, excess = set(), 0.0
  for key in ("train_s", "generate_s"):
    values = [m.get(key, 0.0) for m in run.rows]
    med = statistics.median(values)
    for m, v in zip(run.rows, values):
      if med > 0 and v > 3 * med:
        steps.add(m["step"])
        excess += v - med
  return steps, excess


def summarize(run: MeasuredRun) -> dict:
  """The measured figures of a run (see the module docstring)."""
  lo, hi = run.window()
  wall = hi - lo
  compiles, excess = compile_excess(run)
  groups = timeline_lib.summarize_between(run.timeline, lo, hi)
  r = run.config["rollout"]
  slots = r["num_slots"] or r["num_prompts"] * r["group_size"]
  total = lambda key: sum(m.get(key, 0.0) for m in run.rows)
  median = lambda key: statistics.median(m.get(key, 0.0) for m in run.rows)
  return {
      "wall_s": wall, "steps": run.steps, "trained_tokens": total("train_tokens"),
      "trained_tokens_per_s": total("train_tokens") / wall,
      # The same with the compile steps' excess taken out of the window (what a simulator without a
      # compile model can be held to); equal to the above when no compile fell into the window.
      "compile_steps": len(compiles), "compile_excess_s": excess,
      "trained_tokens_per_s_steady": total("train_tokens") / (wall - excess),
      "step_s": wall / run.steps, "step_s_steady": (wall - excess) / run.steps,
      "generate_s": median("generate_s"), "train_s": median("train_s"),
      "decode_steps": median("engine/decode_steps"),
      "slot_utilization": total("engine/generated_tokens") / max(1.0, total("engine/decode_steps") * slots),
      "staleness_mean": statistics.fmean(m.get("stalesync/trained_token_staleness_mean", 0.0) for m in run.rows),
      "staleness_max": max(m.get("stalesync/staleness_max", 0.0) for m in run.rows),
      "forced_groups": median("stalesync/forced_groups"),
      "response_len_mean": median("response_len_mean"),
      "idle_frac": {g: s.idle_s / s.span_s for g, s in groups.items()},
      "phase_s": run.phase_seconds()}
