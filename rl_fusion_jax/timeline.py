"""Phase timeline: which phase ran when, on which device group; the data behind Gantt charts and idle time.

The loop wraps each phase (generate, reward, ref, train, switch, ...) in `timeline.phase(...)`, or
records an interval it timed itself with `timeline.record(...)`. Times are seconds since the timeline's
start on `time.perf_counter()`. Each record is appended to `<workdir>/timeline.jsonl` as one JSON line
and flushed at once, so a crash loses at most the phase in progress; a `Timeline` reopened on the same
file (resume) continues the clock after the last recorded time, so sessions never overlap.

File format, one object per line, `kind` first:

  {"kind": "session", "start": 0.0, "unix_time": 1.7e9}      a (re)start; `start` is in timeline seconds
  {"kind": "group", "name": "rollout", "devices": [0, 1]}    a device group (a resumed session on other
                                                             devices writes it again: the last counts)
  {"kind": "phase", "name": "generate", "group": "rollout", "step": 3, "start": 1.25, "end": 2.5}

`summarize` gives per group the busy seconds per phase name and the idle seconds (gaps inside the group's
span). Pure Python: this module must never import jax or a plotting library
(experiments/plot_timeline.py draws the chart).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from rl_fusion_jax.metrics import filter_jsonl

TIMELINE_FILE = "timeline.jsonl"


def timeline_path(workdir: str | os.PathLike) -> str:
  """Where a run in `workdir` keeps its timeline."""
  return os.path.join(os.fspath(workdir), TIMELINE_FILE)


@dataclasses.dataclass(frozen=True)
class Interval:
  """One phase of one step on one device group, in seconds since the timeline's start."""
  name: str
  group: str
  step: int | None
  start: float
  end: float

  @property
  def seconds(self) -> float:
    return self.end - self.start


@dataclasses.dataclass(frozen=True)
class TimelineData:
  """A loaded timeline: groups in registration order, intervals in recording order, session starts."""
  groups: dict[str, tuple[int, ...]]
  intervals: tuple[Interval, ...]
  sessions: tuple[float, ...] = ()

  @property
  def end(self) -> float:
    """The latest time recorded (0.0 when empty)."""
    return max([i.end for i in self.intervals] + list(self.sessions) + [0.0])


@dataclasses.dataclass(frozen=True)
class GroupSummary:
  """Busy seconds per phase name, and the union of busy time vs. idle gaps within [first start, last end].

  Phases that overlap inside one group (e.g. a switch recorded inside a train phase) each count fully
  in `busy_s`, but only once in `busy_total_s`, so `busy_total_s + idle_s == span_s` always holds.
  """
  busy_s: dict[str, float]
  busy_total_s: float
  idle_s: float
  span_s: float

  @property
  def busy_frac(self) -> float:
    return self.busy_total_s / self.span_s if self.span_s > 0 else 0.0


# ----------------------------------------------------------------------------------------------- checks


def _check_name(field: str, value: Any) -> str:
  if not isinstance(value, str) or not value:
    raise ValueError(f"{field}: must be a non-empty string, got {value!r}")
  return value


def _check_devices(group: str, device_ids: Any) -> tuple[int, ...]:
  try:
    ids = tuple(device_ids)
  except TypeError:
    raise ValueError(f"device_ids of group {group!r}: must be a sequence of ints, got {device_ids!r}") from None
  if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
    raise ValueError(f"device_ids of group {group!r}: must be non-empty non-negative ints, got {ids!r}")
  if len(set(ids)) != len(ids):
    raise ValueError(f"device_ids of group {group!r}: repeated ids in {ids!r}")
  return tuple(sorted(ids))


def _check_step(step: Any) -> int | None:
  if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
    raise ValueError(f"step: must be None or a non-negative int, got {step!r}")
  return step


def _check_seconds(field: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"{field}: must be a finite number of seconds, got {value!r}")
  return float(value)


def _check_times(start: Any, end: Any) -> tuple[float, float]:
  start, end = _check_seconds("start", start), _check_seconds("end", end)
  if end < start:
    raise ValueError(f"end: {end!r} is before start {start!r}")
  return start, end


# ------------------------------------------------------------------------------------------- recording


class Timeline:
  """Records phases; with a `path`, also appends them to that JSON-lines file (reopened: appends).

  Safe to record from several threads (e.g. rollout and training running side by side).
  """

  def __init__(self, path: str | os.PathLike | None = None, *,
               clock: Callable[[], float] = time.perf_counter):
    self.path = None if path is None else os.fspath(path)
    self._lock = threading.Lock()
    self._clock = clock
    previous = TimelineData({}, ())
    if self.path is not None and os.path.exists(self.path):
      previous = load_timeline(self.path)
    self.groups: dict[str, tuple[int, ...]] = dict(previous.groups)
    self._registered: set[str] = set()   # groups registered in this session
    self.intervals: list[Interval] = list(previous.intervals)
    self.sessions: list[float] = list(previous.sessions)
    self._offset = previous.end   # a resumed timeline continues after everything already recorded
    self._origin = clock()
    if self.path is not None:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    self.sessions.append(self._offset)
    self._append({"kind": "session", "start": self._offset, "unix_time": time.time()})

  def now(self) -> float:
    """Seconds since the timeline's start (continuing across resumed sessions)."""
    return self.from_clock(self._clock())

  def from_clock(self, t: float) -> float:
    """Converts a reading of the timeline's clock (`time.perf_counter()` by default) to timeline seconds."""
    return self._offset + (t - self._origin)

  def add_group(self, name: str, device_ids: Iterable[int]) -> None:
    """Registers a device group once; registering it again with the same devices is a no-op. A group
    loaded from the file (an earlier session) may be registered with other devices: a resumed run on
    another layout (another mesh or process count); the file then holds both, and the last one counts."""
    _check_name("group", name)
    ids = _check_devices(name, device_ids)
    with self._lock:
      if name in self.groups and (self.groups[name] == ids or name in self._registered):
        if self.groups[name] != ids:
          raise ValueError(f"group {name!r}: already registered with devices {list(self.groups[name])}, "
                           f"got {list(ids)}")
        return
      self._registered.add(name)   # a group of an earlier session (resumed) may change devices once
      self.groups[name] = ids
      self._append({"kind": "group", "name": name, "devices": list(ids)})

  def record(self, name: str, start: float, end: float, *, group: str = "all",
             step: int | None = None) -> Interval:
    """Records a phase measured elsewhere; `start`/`end` are timeline seconds (see `from_clock`)."""
    _check_name("name", name)
    _check_name("group", group)
    interval = Interval(name, group, _check_step(step), *_check_times(start, end))
    with self._lock:
      self._check_group(group)
      self.intervals.append(interval)
      self._append({"kind": "phase", **dataclasses.asdict(interval)})
    return interval

  @contextlib.contextmanager
  def phase(self, name: str, *, group: str = "all", step: int | None = None) -> Iterator[None]:
    """Times the body as phase `name`; recorded even when the body raises (the time was spent)."""
    _check_name("name", name)
    self._check_group(group)   # fail before the work, not after it
    _check_step(step)
    start = self.now()
    try:
      yield
    finally:
      self.record(name, start, self.now(), group=group, step=step)

  def data(self) -> TimelineData:
    with self._lock:
      return TimelineData(dict(self.groups), tuple(self.intervals), tuple(self.sessions))

  def _check_group(self, group: str) -> None:
    if group not in self.groups:
      raise ValueError(f"group {group!r}: not registered (call add_group first; known: {sorted(self.groups)})")

  def _append(self, record: dict[str, Any]) -> None:
    # Opened per record: nothing to close, and each line reaches the OS before the call returns.
    if self.path is None:
      return
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")
      f.flush()


# ------------------------------------------------------------------------------------------ truncation


def truncate_file(path: str | os.PathLike, until: float | None) -> int:
  """Keeps what happened by timeline time `until` (None: nothing but the groups); returns lines dropped.

  A resumed run calls this with the clock saved in its checkpoint, so phases recorded after that
  checkpoint (work the resume redoes) appear once. Group lines are kept; a torn last line (a kill
  mid-write) is dropped. The file is replaced atomically.
  """
  def keep(record: dict) -> bool:
    time_of = {"phase": record.get("end"), "session": record.get("start")}.get(record.get("kind"))
    return record.get("kind") == "group" or (until is not None and time_of is not None and time_of <= until)
  return filter_jsonl(os.fspath(path), keep, sort_keys=False)   # kept lines keep `kind` first


# --------------------------------------------------------------------------------------------- loading


def _field(record: dict, key: str, where: str) -> Any:
  if key not in record:
    raise ValueError(f"{where}: missing field '{key}'")
  return record[key]


def _parse_line(line: str, where: str) -> dict:
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: malformed JSON ({e})") from None
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  return record


def _add_loaded_group(groups: dict, record: dict, where: str) -> None:
  name, devices = _field(record, "name", where), _field(record, "devices", where)
  try:
    ids = _check_devices(_check_name("name", name), devices)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  groups[name] = ids   # a later definition (a resumed session on another layout) replaces an earlier one


def _loaded_interval(record: dict, where: str) -> Interval:
  values = [_field(record, key, where) for key in ("name", "group", "step", "start", "end")]
  try:
    _check_name("name", values[0])
    _check_name("group", values[1])
    return Interval(values[0], values[1], _check_step(values[2]), *_check_times(values[3], values[4]))
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def _loaded_session(record: dict, where: str) -> float:
  value = _field(record, "start", where)
  try:
    return _check_seconds("start", value)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def load_timeline(path: str | os.PathLike) -> TimelineData:
  """Reads a timeline.jsonl; every error names `path:line` and the field."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no timeline file")
  groups, intervals, sessions = {}, [], []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      record = _parse_line(line, where)
      kind = _field(record, "kind", where)
      if kind == "group":
        _add_loaded_group(groups, record, where)
      elif kind == "phase":
        intervals.append(_loaded_interval(record, where))
      elif kind == "session":
        sessions.append(_loaded_session(record, where))
      else:
        raise ValueError(f"{where}: unknown kind {kind!r} (expected 'session', 'group' or 'phase')")
  for i, interval in enumerate(intervals):
    if interval.group not in groups:
      raise ValueError(f"{path}: phase {interval.name!r} (#{i}) names group {interval.group!r}, "
                       f"which no 'group' line defines")
  return TimelineData(groups, tuple(intervals), tuple(sessions))


# ------------------------------------------------------------------------------------------ summaries


def select_steps(data: TimelineData, start: int | None = None, stop: int | None = None) -> TimelineData:
  """Only the intervals with `start <= step < stop` (either bound may be None: open); with a bound given,
  intervals without a step are dropped."""
  if start is None and stop is None:
    return data
  lo, hi = -math.inf if start is None else start, math.inf if stop is None else stop
  kept = tuple(i for i in data.intervals if i.step is not None and lo <= i.step < hi)
  return dataclasses.replace(data, intervals=kept)


def _union_seconds(intervals: list[Interval]) -> float:
  """Seconds covered by at least one interval (overlaps counted once)."""
  total, reach = 0.0, -math.inf
  for interval in sorted(intervals, key=lambda i: i.start):
    if interval.end > reach:   # only the part beyond what earlier intervals covered is new
      total += interval.end - max(interval.start, reach)
      reach = interval.end
  return total


def summarize_group(intervals: list[Interval]) -> GroupSummary:
  """Busy seconds per phase name, busy union, idle gaps and span of one group's intervals."""
  busy: dict[str, float] = {}
  for interval in intervals:
    busy[interval.name] = busy.get(interval.name, 0.0) + interval.seconds
  if not intervals:
    return GroupSummary(busy, 0.0, 0.0, 0.0)
  span = max(i.end for i in intervals) - min(i.start for i in intervals)
  union = _union_seconds(intervals)
  return GroupSummary(busy, union, max(span - union, 0.0), span)


def summarize(data: TimelineData) -> dict[str, GroupSummary]:
  """Per group (registration order; groups with no phase included, all zeros), see `GroupSummary`."""
  by_group: dict[str, list[Interval]] = {name: [] for name in data.groups}
  for interval in data.intervals:
    by_group.setdefault(interval.group, []).append(interval)
  return {name: summarize_group(intervals) for name, intervals in by_group.items()}


def summarize_window(data: TimelineData, start: int | None = None,
                     stop: int | None = None) -> dict[str, GroupSummary]:
  """Per group, the steps ``start <= step < stop`` measured against their common window.

  The window runs from the first start to the last end of those steps' intervals in any group, so a
  group's `idle_s` also counts the time it waited while another group worked (and host time between
  phases); every group's `span_s` is the window. Raises if no interval falls in the steps.
  """
  selected = select_steps(data, start, stop)
  if not selected.intervals:
    raise ValueError(f"no phases in steps [{start}, {stop})")
  span = max(i.end for i in selected.intervals) - min(i.start for i in selected.intervals)
  return {name: GroupSummary(s.busy_s, s.busy_total_s, max(span - s.busy_total_s, 0.0), span)
          for name, s in summarize(selected).items()}


def summarize_between(data: TimelineData, start: float, end: float) -> dict[str, GroupSummary]:
  """Per group, its phases clipped to the time window [start, end] (timeline seconds), whatever their
  step: every group's `span_s` is the window and `idle_s` the part of it the group ran no phase."""
  if not end > start:
    raise ValueError(f"summarize_between: end {end!r} must be after start {start!r}")
  span = end - start
  out = {}
  for name, s in summarize(dataclasses.replace(data, intervals=tuple(
      dataclasses.replace(i, start=max(i.start, start), end=min(i.end, end))
      for i in data.intervals if i.end > start and i.start < end))).items():
    out[name] = GroupSummary(s.busy_s, s.busy_total_s, max(span - s.busy_total_s, 0.0), span)
  return out
