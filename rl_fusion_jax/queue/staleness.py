"""StaleSync admission: which finished samples the learner may train on at its current policy version.

A sample's staleness is ``learner_version - min_token_version``: how many updates ago the oldest of its
tokens was sampled. It is admissible iff finished and staleness <= ``max_staleness`` (s); with s = 0 only
samples generated entirely by the current policy pass, which is the synchronous algorithm. The rule also
says what generation should finish first: in-flight samples closest to the bound, oldest first.

Groups: every schedule (``orchestration/stalesync.py``, ``orchestration/separated.py``, the simulator's
``sim/schedules.py``) trains GRPO groups whole, so it applies the rule per group through the functions
below: ``waiting_groups`` (the finished groups in a queue, from its columns), ``stale_groups`` (beyond the
bound: dropped), ``at_risk_groups`` (in flight, beyond the bound after the next update unless they finish
now) and ``admit_groups``.

Pure and deterministic (ties broken by sample index, the input order never matters). This module must
never import jax, start threads, admit a sample beyond the bound, or lose or duplicate a sample: every
candidate comes back either admitted or held back, and held-back ones are counted, never dropped here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A sample the queue could hand to the learner: its oldest token's version, and whether it is done."""
  index: int
  min_token_version: int
  finished: bool
  response_len: int


@dataclasses.dataclass(frozen=True)
class Admission:
  admitted: tuple[int, ...]   # finished, within the bound; oldest first (they are closest to it)
  held_back: tuple[int, ...]  # every other candidate, ascending index
  stale: tuple[int, ...]      # held back and already beyond the bound: never admissible again
  priority: tuple[int, ...]   # in-flight and not yet stale, oldest first: finish these first
  at_risk: int                # how many of ``priority`` exceed the bound after the next update
  staleness_max: int          # over the admitted (0 when none)
  staleness_mean: float       # over the admitted (0 when none)
  admitted_len_mean: float    # response lengths, to measure the length bias of holding back
  held_back_len_mean: float

  def metrics(self) -> dict[str, float]:
    return {"admitted": float(len(self.admitted)), "held_back": float(len(self.held_back)),
            "stale": float(len(self.stale)), "at_risk": float(self.at_risk),
            "staleness_max": float(self.staleness_max), "staleness_mean": self.staleness_mean,
            "admitted_len_mean": self.admitted_len_mean, "held_back_len_mean": self.held_back_len_mean}


def check_max_staleness(max_staleness: int) -> None:
  if max_staleness < 0:
    raise ValueError(f"stalesync.max_staleness={max_staleness} must be >= 0 (0 is synchronous)")


def staleness(learner_version: int, min_token_version: int) -> int:
  """Updates since the oldest token was sampled; a token from a policy the learner has not made is a bug."""
  if min_token_version > learner_version:
    raise ValueError(f"token version {min_token_version} is newer than learner version {learner_version}")
  return learner_version - min_token_version


def admissible(learner_version: int, min_token_version: int, max_staleness: int) -> bool:
  check_max_staleness(max_staleness)
  return staleness(learner_version, min_token_version) <= max_staleness


def _age_order(c: Candidate) -> tuple[int, int]:
  return (c.min_token_version, c.index)


def _mean(values: Sequence[float]) -> float:
  return float(sum(values)) / len(values) if values else 0.0


def _check_unique(candidates: Sequence[Candidate]) -> None:
  seen = [c.index for c in candidates]
  if len(set(seen)) != len(seen):
    raise ValueError(f"candidate indices repeat: {sorted(seen)}")


def admit(candidates: Sequence[Candidate], learner_version: int, max_staleness: int,
          limit: int | None = None) -> Admission:
  """Splits ``candidates`` into admitted and held back at ``learner_version`` under bound ``max_staleness``.

  At most ``limit`` samples are admitted (oldest first); the other eligible ones stay held back.
  """
  check_max_staleness(max_staleness)
  _check_unique(candidates)
  if limit is not None and limit < 0:
    raise ValueError(f"admit: limit={limit} must be >= 0")
  age = {c.index: staleness(learner_version, c.min_token_version) for c in candidates}
  eligible = sorted((c for c in candidates if c.finished and age[c.index] <= max_staleness), key=_age_order)
  admitted = eligible[:limit] if limit is not None else eligible
  taken = {c.index for c in admitted}
  held = sorted((c for c in candidates if c.index not in taken), key=lambda c: c.index)
  in_flight = sorted((c for c in held if not c.finished and age[c.index] <= max_staleness), key=_age_order)
  return Admission(
      admitted=tuple(c.index for c in admitted),
      held_back=tuple(c.index for c in held),
      stale=tuple(c.index for c in held if age[c.index] > max_staleness),
      priority=tuple(c.index for c in in_flight),
      at_risk=sum(age[c.index] + 1 > max_staleness for c in in_flight),
      staleness_max=max((age[i] for i in taken), default=0),
      staleness_mean=_mean([age[i] for i in taken]),
      admitted_len_mean=_mean([c.response_len for c in admitted]),
      held_back_len_mean=_mean([c.response_len for c in held]))


@dataclasses.dataclass(frozen=True)
class WaitingGroup:
  """A finished group waiting to be trained: its oldest token's version and its rows in the queue."""
  group_id: int
  min_token_version: int
  indices: tuple[int, ...]
  response_len_mean: float


def waiting_groups(indices: Iterable[int], group_ids: Iterable[int], min_versions: Iterable[int],
                   response_lens: Iterable[int]) -> dict[int, WaitingGroup]:
  """The groups of a queue's ready rows (one value per row in each column), in order of first row."""
  rows: dict[int, list[tuple[int, int, int]]] = {}
  for i, g, v, n in zip(indices, group_ids, min_versions, response_lens, strict=True):
    rows.setdefault(int(g), []).append((int(i), int(v), int(n)))
  return {g: WaitingGroup(g, min(v for _, v, _ in r), tuple(i for i, _, _ in r), _mean([n for _, _, n in r]))
          for g, r in rows.items()}


def stale_groups(versions: Mapping[int, int | None], learner_version: int, max_staleness: int) -> list[int]:
  """Groups (id -> oldest token version; None: no token yet) already beyond the bound, ascending: they
  can never be admitted again."""
  check_max_staleness(max_staleness)
  return sorted(g for g, v in versions.items()
                if v is not None and staleness(learner_version, v) > max_staleness)


def at_risk_groups(versions: Mapping[int, int | None], learner_version: int, max_staleness: int) -> list[int]:
  """Groups (id -> oldest token version; None: no token yet) within the bound now but beyond it after the
  next update (oldest version <= learner - s), ascending: generation must finish them in this phase."""
  check_max_staleness(max_staleness)
  return sorted(g for g, v in versions.items()
                if v is not None and staleness(learner_version, v) + 1 > max_staleness)


def admit_groups(waiting: Mapping[int, WaitingGroup], learner_version: int, max_staleness: int,
                 limit: int | None = None) -> Admission:
  """``admit`` over whole finished groups (their oldest token decides): indices are group ids."""
  return admit([Candidate(g, w.min_token_version, True, w.response_len_mean) for g, w in waiting.items()],
               learner_version, max_staleness, limit=limit)
