"""StaleSync admission: a hand-checked example, the synchronous case, and properties over random versions,
finish orders and bounds (never beyond the bound, nothing lost or duplicated, input order irrelevant)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from rl_fusion_jax.queue.staleness import (Candidate, WaitingGroup, admissible, admit, admit_groups, at_risk_groups,
                                           stale_groups, staleness, waiting_groups)


def test_staleness_and_admissible():
  assert staleness(5, 3) == 2
  assert admissible(5, 3, 2) and not admissible(5, 2, 2)
  assert admissible(4, 4, 0) and not admissible(4, 3, 0)
  with pytest.raises(ValueError, match="stalesync.max_staleness=-1"):
    admissible(5, 5, -1)
  with pytest.raises(ValueError, match="token version 6 is newer than learner version 5"):
    staleness(5, 6)


# learner version 10, bound 2:      index  min_version  finished  response_len   staleness
EXAMPLE = [Candidate(0, 9, True, 5),     # 1: admitted
           Candidate(1, 8, True, 7),     # 2: admitted (at the bound)
           Candidate(2, 7, True, 9),     # 3: stale
           Candidate(3, 8, False, 20),   # 2: in flight, beyond the bound after the next update
           Candidate(4, 10, False, 2),   # 0: in flight
           Candidate(5, 6, False, 30),   # 4: in flight and already stale
           Candidate(6, 8, True, 4)]     # 2: admitted


def test_hand_checked_example():
  a = admit(EXAMPLE, learner_version=10, max_staleness=2)
  assert a.admitted == (1, 6, 0)          # oldest first, ties by index
  assert a.held_back == (2, 3, 4, 5)
  assert a.stale == (2, 5)
  assert a.priority == (3, 4)
  assert a.at_risk == 1
  assert a.staleness_max == 2
  assert a.staleness_mean == pytest.approx(5 / 3)
  assert a.admitted_len_mean == pytest.approx(16 / 3)
  assert a.held_back_len_mean == pytest.approx(61 / 4)
  assert a.metrics()["held_back"] == 4.0


def test_limit_admits_the_oldest():
  a = admit(EXAMPLE, learner_version=10, max_staleness=2, limit=2)
  assert a.admitted == (1, 6)
  assert a.held_back == (0, 2, 3, 4, 5)
  assert a.stale == (2, 5)  # 0 is held back by the limit, not stale


def test_zero_staleness_is_synchronous():
  fresh = [Candidate(i, 3, True, 1) for i in range(4)]
  assert admit(fresh, 3, 0).admitted == (0, 1, 2, 3)
  a = admit(fresh + [Candidate(4, 2, True, 1), Candidate(5, 3, False, 1)], 3, 0)
  assert (a.admitted, a.held_back, a.stale, a.priority, a.at_risk) == ((0, 1, 2, 3), (4, 5), (4,), (5,), 1)


def test_errors():
  with pytest.raises(ValueError, match="stalesync.max_staleness"):
    admit(EXAMPLE, 10, -1)
  with pytest.raises(ValueError, match="candidate indices repeat"):
    admit([Candidate(1, 0, True, 1), Candidate(1, 0, False, 1)], 0, 0)
  with pytest.raises(ValueError, match="limit=-1"):
    admit(EXAMPLE, 10, 2, limit=-1)


@st.composite
def pools(draw):
  learner = draw(st.integers(0, 12))
  indices = draw(st.lists(st.integers(0, 1000), unique=True, max_size=20))
  cands = [Candidate(i, draw(st.integers(0, learner)), draw(st.booleans()), draw(st.integers(1, 50)))
           for i in indices]
  return cands, learner, draw(st.integers(0, 6)), draw(st.none() | st.integers(0, 25))


@given(pools(), st.randoms(use_true_random=False))
@settings(max_examples=100, deadline=None)
def test_property_bound_and_conservation(pool, rnd):
  cands, learner, s, limit = pool
  a = admit(cands, learner, s, limit)
  by_index = {c.index: c for c in cands}
  assert len(set(a.admitted)) == len(a.admitted) and len(set(a.held_back)) == len(a.held_back)
  assert set(a.admitted).isdisjoint(a.held_back)
  assert set(a.admitted) | set(a.held_back) == set(by_index)
  for i in a.admitted:
    assert by_index[i].finished and learner - by_index[i].min_token_version <= s
  eligible = [c for c in cands if c.finished and learner - c.min_token_version <= s]
  assert len(a.admitted) == (len(eligible) if limit is None else min(limit, len(eligible)))
  assert set(a.stale) == {i for i in a.held_back if learner - by_index[i].min_token_version > s}
  assert set(a.priority) == {i for i in a.held_back if not by_index[i].finished} - set(a.stale)
  shuffled = list(cands)
  rnd.shuffle(shuffled)
  assert admit(shuffled, learner, s, limit) == a


@st.composite
def runs(draw):
  n = draw(st.integers(1, 15))
  starts = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
  durations = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
  return starts, durations, draw(st.integers(0, 4))


@given(runs())
@settings(max_examples=100, deadline=None)
def test_property_random_finish_orders(run):
  """Sample i starts at version starts[i] and finishes durations[i] updates later. Without a limit it must
  be admitted exactly at its finishing version when durations[i] <= s, and never otherwise."""
  starts, durations, s = run
  pending, admitted_at = set(range(len(starts))), {}
  for version in range(max(starts) + max(durations) + s + 2):
    cands = [Candidate(i, starts[i], starts[i] + durations[i] <= version, durations[i])
             for i in sorted(pending) if starts[i] <= version]
    a = admit(cands, version, s)
    assert a.staleness_max <= s
    for i in a.admitted:
      assert i not in admitted_at
      admitted_at[i] = version
    pending -= set(a.admitted)
  expected = {i: starts[i] + durations[i] for i in range(len(starts)) if durations[i] <= s}
  assert admitted_at == expected
  assert pending == set(range(len(starts))) - set(expected)


def test_group_rules_by_hand():
  # Queue rows 10..15 of groups 7, 7, 3, 3, 9, 9 with oldest token versions and response lengths:
  waiting = waiting_groups([10, 11, 12, 13, 14, 15], [7, 7, 3, 3, 9, 9], [4, 5, 2, 3, 5, 5], [2, 4, 6, 6, 1, 3])
  assert list(waiting) == [7, 3, 9]
  assert waiting[7] == WaitingGroup(7, 4, (10, 11), 3.0)
  assert waiting[3] == WaitingGroup(3, 2, (12, 13), 6.0)
  assert waiting[9] == WaitingGroup(9, 5, (14, 15), 2.0)
  versions = {g: w.min_token_version for g, w in waiting.items()}
  # Learner 5, s = 1: group 3 (5 - 2 = 3) is beyond the bound; group 7 (1) is within it but exceeds it
  # after the next update, group 9 (0) does not.
  assert stale_groups(versions, 5, 1) == [3]
  assert at_risk_groups(versions | {1: None}, 5, 1) == [3, 7]      # no token yet: never at risk
  assert at_risk_groups(versions, 5, 0) == [3, 7, 9]                # s = 0: everything started must finish
  a = admit_groups({g: w for g, w in waiting.items() if g != 3}, 5, 1, limit=1)
  assert a.admitted == (7,) and a.held_back == (9,)                 # oldest first
  with pytest.raises(ValueError, match="newer"):
    stale_groups({1: 6}, 5, 1)
