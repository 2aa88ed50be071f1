"""Phase timeline: recording with a hand-driven clock, the JSON-lines file and resume, summaries, the plot.

Expected times and summaries are worked out by hand in the comments. The plot is checked as a file (PNG
magic bytes, size); the binary is also run once as a subprocess, the way a user runs it.
"""
import dataclasses
import importlib.util
import json
import pathlib
import subprocess
import sys
import threading

import pytest

from rl_fusion_jax import timeline as tl

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLOT_PATH = ROOT / "experiments" / "plot_timeline.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class FakeClock:
  """A perf_counter stand-in the test advances by hand."""

  def __init__(self, t=100.0):
    self.t = t

  def __call__(self):
    return self.t


def _lines(path):
  return [json.loads(l) for l in open(path, encoding="utf-8") if l.strip()]


def _new(tmp_path, clock=None):
  timeline = tl.Timeline(tmp_path / tl.TIMELINE_FILE, clock=clock or FakeClock())
  timeline.add_group("all", [3, 1, 0, 2])
  return timeline


# ------------------------------------------------------------------------------------------ recording


def test_phase_records_times_relative_to_start(tmp_path):
  clock = FakeClock(100.0)
  timeline = _new(tmp_path, clock)
  clock.t = 101.5
  with timeline.phase("generate", step=0):
    clock.t = 104.0
  # Relative to the start at 100.0: [101.5, 104.0] -> [1.5, 4.0].
  assert timeline.intervals == [tl.Interval("generate", "all", 0, 1.5, 4.0)]
  assert timeline.groups == {"all": (0, 1, 2, 3)}


def test_each_record_is_on_disk_at_once(tmp_path):
  clock = FakeClock(0.0)
  timeline = _new(tmp_path, clock)
  path = tmp_path / tl.TIMELINE_FILE
  assert [l["kind"] for l in _lines(path)] == ["session", "group"]
  timeline.record("reward", 2.0, 2.25, step=7)
  # Read back while the timeline is still alive: the line was flushed by record().
  assert _lines(path)[-1] == {"kind": "phase", "name": "reward", "group": "all", "step": 7,
                              "start": 2.0, "end": 2.25}
  assert _lines(path)[1] == {"kind": "group", "name": "all", "devices": [0, 1, 2, 3]}


def test_phase_is_recorded_when_the_body_raises(tmp_path):
  clock = FakeClock(0.0)
  timeline = _new(tmp_path, clock)
  with pytest.raises(RuntimeError):
    with timeline.phase("train", step=1):
      clock.t = 3.0
      raise RuntimeError("boom")
  assert timeline.intervals == [tl.Interval("train", "all", 1, 0.0, 3.0)]


def test_from_clock_converts_readings_taken_elsewhere(tmp_path):
  clock = FakeClock(50.0)
  timeline = _new(tmp_path, clock)
  t0, t1 = 52.0, 55.5   # e.g. perf_counter() readings around a phase timed by the loop
  timeline.record("ref", timeline.from_clock(t0), timeline.from_clock(t1), step=0)
  assert timeline.intervals[-1] == tl.Interval("ref", "all", 0, 2.0, 5.5)   # 52 - 50, 55.5 - 50


def test_resume_appends_and_continues_the_clock(tmp_path):
  path = tmp_path / tl.TIMELINE_FILE
  first = _new(tmp_path, FakeClock(10.0))
  first.add_group("train", [4, 5])
  first.record("generate", 0.0, 2.0, step=0)
  first.record("train", 2.0, 6.0, group="train", step=0)
  clock = FakeClock(500.0)   # a new process: the raw clock has nothing to do with the old one
  second = tl.Timeline(path, clock=clock)
  assert second.groups == {"all": (0, 1, 2, 3), "train": (4, 5)}
  second.add_group("all", [0, 1, 2, 3])   # the same registration again is a no-op
  clock.t = 501.0
  with second.phase("generate", step=1):
    clock.t = 503.0
  # The previous session ended at 6.0, so the new one starts there: [501, 503] - 500 + 6 -> [7, 9].
  assert second.intervals[-1] == tl.Interval("generate", "all", 1, 7.0, 9.0)
  data = tl.load_timeline(path)
  assert data.sessions == (0.0, 6.0)
  assert [(i.name, i.step, i.start, i.end) for i in data.intervals] == [
      ("generate", 0, 0.0, 2.0), ("train", 0, 2.0, 6.0), ("generate", 1, 7.0, 9.0)]
  assert sum(l["kind"] == "group" for l in _lines(path)) == 2   # groups written once


def test_resumed_session_may_move_a_group_to_other_devices_once(tmp_path):
  """A resume on another layout (mesh or process count): the group's new devices are recorded after the
  old ones and the last definition counts; within one session a group keeps its devices."""
  path = tmp_path / tl.TIMELINE_FILE
  first = _new(tmp_path, FakeClock(10.0))
  first.record("generate", 0.0, 2.0, step=0)
  second = tl.Timeline(path, clock=FakeClock(500.0))
  second.add_group("all", [0, 1, 2048, 2049])
  second.add_group("all", [0, 1, 2048, 2049])
  with pytest.raises(ValueError, match="group 'all': already registered"):
    second.add_group("all", [0, 1])
  assert tl.load_timeline(path).groups["all"] == (0, 1, 2048, 2049)
  assert [l["devices"] for l in _lines(path) if l["kind"] == "group"] == [[0, 1, 2, 3], [0, 1, 2048, 2049]]


def test_in_memory_timeline_writes_nothing(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  timeline = tl.Timeline(clock=FakeClock())
  timeline.add_group("all", [0])
  timeline.record("train", 0.0, 1.0)
  assert timeline.data().intervals == (tl.Interval("train", "all", None, 0.0, 1.0),)
  assert not list(tmp_path.iterdir())


def test_threads_record_concurrently(tmp_path):
  timeline = _new(tmp_path)
  timeline.add_group("train", [4])

  def work(group):
    for i in range(200):
      timeline.record("x", float(i), float(i) + 0.5, group=group, step=i)

  threads = [threading.Thread(target=work, args=(g,)) for g in ("all", "train")]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  data = tl.load_timeline(tmp_path / tl.TIMELINE_FILE)   # every line whole and parseable
  assert len(data.intervals) == 400 and len(timeline.intervals) == 400


@pytest.mark.parametrize("call, match", [
    (lambda t: t.record("x", 0.0, 1.0, group="nope"), "group 'nope': not registered"),
    (lambda t: t.record("x", 2.0, 1.0), "end: 1.0 is before start 2.0"),
    (lambda t: t.record("x", 0.0, float("nan")), "end: must be a finite"),
    (lambda t: t.record("x", 0.0, 1.0, step=-1), "step: must be None or a non-negative int"),
    (lambda t: t.record("x", 0.0, 1.0, step=True), "step"),
    (lambda t: t.record("", 0.0, 1.0), "name: must be a non-empty string"),
    (lambda t: t.add_group("g", []), "device_ids of group 'g'"),
    (lambda t: t.add_group("g", [0, 0]), "repeated ids"),
    (lambda t: t.add_group("g", 3), "device_ids of group 'g'"),
])
def test_bad_records_raise_naming_the_field(tmp_path, call, match):
  timeline = _new(tmp_path)
  with pytest.raises(ValueError, match=match):
    call(timeline)
  assert len(_lines(tmp_path / tl.TIMELINE_FILE)) == 2   # nothing written beyond session + group


def test_phase_with_unknown_group_fails_before_the_body(tmp_path):
  timeline = _new(tmp_path)
  ran = []
  with pytest.raises(ValueError, match="group 'rollout': not registered"):
    with timeline.phase("generate", group="rollout"):
      ran.append(1)
  assert not ran


# -------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("lines, match", [
    (['{"kind": "session", "start": 0.0}', "{not json"], r":2: malformed JSON"),
    (['{"kind": "bogus"}'], r":1: unknown kind 'bogus'"),
    (['{"name": "x"}'], r":1: missing field 'kind'"),
    (['{"kind": "group", "name": "a", "devices": [0]}', '{"kind": "phase", "name": "g", "group": "a", '
      '"step": 0, "start": 1.0}'], r":2: missing field 'end'"),
    (['{"kind": "group", "name": "a", "devices": [0]}', '{"kind": "phase", "name": "g", "group": "a", '
      '"step": 0, "start": 3.0, "end": 1.0}'], r":2: end: 1.0 is before start 3.0"),
    (['{"kind": "phase", "name": "g", "group": "b", "step": 0, "start": 0, "end": 1}'],
     r"names group 'b', which no 'group' line defines"),
])
def test_load_errors_name_file_and_line(tmp_path, lines, match):
  path = tmp_path / "timeline.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=match) as info:
    tl.load_timeline(path)
  assert str(path) in str(info.value)


def test_load_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="no timeline file"):
    tl.load_timeline(tmp_path / "nope.jsonl")


# ------------------------------------------------------------------------------------------ summaries


def _example():
  groups = {"rollout": (0, 1), "train": (2, 3), "spare": (4,)}
  intervals = (
      tl.Interval("generate", "rollout", 0, 0.0, 2.0),
      tl.Interval("reward", "rollout", 0, 2.0, 2.5),
      tl.Interval("generate", "rollout", 1, 3.0, 5.0),
      tl.Interval("train", "train", 0, 2.5, 4.5),
      tl.Interval("switch", "train", 0, 3.0, 3.5),   # inside the train phase
      tl.Interval("train", "train", 1, 6.0, 7.0),
      tl.Interval("eval", "train", None, 7.0, 7.5),
  )
  return tl.TimelineData(groups, intervals, (0.0,))


def test_summary_by_hand():
  summary = tl.summarize(_example())
  assert list(summary) == ["rollout", "train", "spare"]
  rollout, train, spare = summary["rollout"], summary["train"], summary["spare"]
  # rollout: generate 2 + 2 = 4, reward 0.5; span 0 -> 5 = 5; busy union 4.5; idle the gap 2.5 -> 3 = 0.5.
  assert rollout.busy_s == {"generate": 4.0, "reward": 0.5}
  assert (rollout.busy_total_s, rollout.idle_s, rollout.span_s) == (4.5, 0.5, 5.0)
  assert rollout.busy_frac == pytest.approx(0.9)
  # train: train 2 + 1 = 3, switch 0.5 (nested, counted once in the union), eval 0.5;
  # span 2.5 -> 7.5 = 5; union [2.5, 4.5] + [6, 7.5] = 2 + 1.5 = 3.5; idle 1.5 (the gap 4.5 -> 6).
  assert train.busy_s == {"train": 3.0, "switch": 0.5, "eval": 0.5}
  assert (train.busy_total_s, train.idle_s, train.span_s) == (3.5, 1.5, 5.0)
  assert (spare.busy_s, spare.busy_total_s, spare.idle_s, spare.span_s, spare.busy_frac) == ({}, 0, 0, 0, 0)


def test_select_steps():
  data = _example()
  assert [(i.name, i.step) for i in tl.select_steps(data, 1, 2).intervals] == [("generate", 1), ("train", 1)]
  assert len(tl.select_steps(data, None, 1).intervals) == 4   # steps 0 only; the step-less eval dropped
  assert tl.select_steps(data) is data


def test_summarize_window_by_hand():
  # Step 1: rollout generate 3 -> 5, train 6 -> 7; the window is 3 -> 7 = 4 s for every group.
  summary = tl.summarize_window(_example(), 1, 2)
  rollout, train, spare = summary["rollout"], summary["train"], summary["spare"]
  assert (rollout.busy_total_s, rollout.idle_s, rollout.span_s) == (2.0, 2.0, 4.0)
  assert (train.busy_total_s, train.idle_s, train.span_s) == (1.0, 3.0, 4.0)
  assert (spare.busy_total_s, spare.idle_s, spare.span_s) == (0.0, 4.0, 4.0)
  # Steps 0-1: window 0 -> 7; rollout busy 4.5 (the eval without a step is not in the steps).
  assert tl.summarize_window(_example(), 0, 2)["rollout"].idle_s == pytest.approx(2.5)
  with pytest.raises(ValueError, match="no phases"):
    tl.summarize_window(_example(), 5, 6)


def test_summarize_between_by_hand():
  # Window 2.0 -> 6.5 (4.5 s), any step: rollout reward 2.0-2.5 + generate 3.0-5.0 = 2.5 busy;
  # train 2.5-4.5 (the switch inside counts once) + 6.0-6.5 (clipped) = 2.5 busy; the eval is outside.
  summary = tl.summarize_between(_example(), 2.0, 6.5)
  rollout, train, spare = summary["rollout"], summary["train"], summary["spare"]
  assert (rollout.busy_total_s, rollout.idle_s, rollout.span_s) == (2.5, 2.0, 4.5)
  assert rollout.busy_s == {"reward": 0.5, "generate": 2.0}
  assert (train.busy_total_s, train.idle_s, train.span_s) == (2.5, 2.0, 4.5)
  assert train.busy_s == {"train": 2.5, "switch": 0.5}
  assert (spare.busy_total_s, spare.idle_s) == (0.0, 4.5)
  with pytest.raises(ValueError, match="after start"):
    tl.summarize_between(_example(), 3.0, 3.0)


def test_core_imports_neither_jax_nor_matplotlib():
  code = ("import sys, rl_fusion_jax.timeline; "
          "bad = [m for m in ('jax', 'matplotlib', 'numpy') if m in sys.modules]; "
          "assert not bad, bad")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  offenders = [str(p) for p in (ROOT / "rl_fusion_jax").rglob("*.py") if "matplotlib" in p.read_text()]
  assert not offenders


# ----------------------------------------------------------------------------------------------- plot


@pytest.fixture(scope="module")
def plot():
  spec = importlib.util.spec_from_file_location("plot_timeline", PLOT_PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _assert_png(path):
  data = pathlib.Path(path).read_bytes()
  assert data[:8] == PNG_MAGIC
  assert len(data) > 10_000   # an empty 12-inch figure alone is a few KB; bars, labels and legend add more


def test_render_writes_png(tmp_path, plot):
  data = dataclasses.replace(_example(), sessions=(0.0, 5.5))   # a resume at 5.5
  out = plot.render(data, str(tmp_path / "sub" / "t.png"))
  _assert_png(out)
  with pytest.raises(ValueError, match="no phases to plot in steps 9:10"):
    plot.render(tl.select_steps(data, 9, 10), str(tmp_path / "empty.png"), steps="9:10")


def test_plot_helpers(plot):
  assert plot.device_ranges((6, 0, 1, 2, 3)) == "0-3,6"
  assert plot.device_ranges((5,)) == "5"
  assert plot.parse_steps("2:5") == (2, 5)
  assert plot.parse_steps(":5") == (None, 5) and plot.parse_steps("3:") == (3, None)
  assert plot.parse_steps("") == (None, None)
  for bad in ("5", "a:b", "5:2", "1:2:3"):
    with pytest.raises(ValueError, match="--steps"):
      plot.parse_steps(bad)
  colors = plot.phase_colors(["mystery", "train", "generate"])
  assert list(colors) == ["generate", "train", "mystery"]   # the loop's phases first, in pipeline order
  assert len(set(colors.values())) == 3


def test_binary_writes_png(tmp_path):
  timeline = _new(tmp_path, FakeClock(0.0))
  timeline.add_group("train", [4, 5, 6, 7])
  for step in range(3):
    timeline.record("generate", 3.0 * step, 3.0 * step + 2.0, step=step)
    timeline.record("train", 3.0 * step + 2.0, 3.0 * step + 3.0, group="train", step=step)
  cmd = [sys.executable, str(PLOT_PATH), f"--workdir={tmp_path}", "--steps=1:3"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  _assert_png(tmp_path / "timeline.png")
  proc = subprocess.run(cmd[:-1] + ["--steps=3:1"], capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and "--steps: empty range" in proc.stderr
