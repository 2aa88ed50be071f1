"""DistQueue: packing, per-consumer consumption, eviction, back-pressure, metrics, checkpoints.

Expected values are written out by hand; the property test checks that random interleavings of writes,
reads and a checkpoint deliver every sample's exact values to every consumer exactly once.
"""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rl_fusion_jax.queue import distqueue
from rl_fusion_jax.queue.distqueue import (DistQueue, FieldSpec, NotReady, Packed, QueueFull, check_capacity,
                                           pack, unpack)

FIELDS = (FieldSpec("tokens", np.int32, True), FieldSpec("behaviour_logp", np.float32, True),
          FieldSpec("versions", np.int32, True), FieldSpec("reward", np.float32, False),
          FieldSpec("prompt_len", np.int32, False))


def make_queue(capacity=16, consumers=(("reward", ("tokens",)), ("train", ("tokens", "reward")))):
  queue = DistQueue(FIELDS, capacity)
  for name, needs in consumers:
    queue.register_consumer(name, needs)
  return queue


# ---- Packing -----------------------------------------------------------------------------------------

def test_pack_unpack_round_trip():
  packed = pack([np.array([5, 6, 7]), np.array([], np.int64), np.array([8])])
  np.testing.assert_array_equal(packed.flat, [5, 6, 7, 8])
  np.testing.assert_array_equal(packed.lengths, [3, 0, 1])
  np.testing.assert_array_equal(packed.offsets, [0, 3, 3])
  np.testing.assert_array_equal(unpack(packed, 4, pad=-1), [[5, 6, 7, -1], [-1, -1, -1, -1], [8, -1, -1, -1]])
  np.testing.assert_array_equal(packed.row(2), [8])


def test_packed_rows_and_errors():
  packed = Packed(np.array([1, 2, 3, 4, 5]), np.array([2, 0, 3]))
  part = packed.rows(1, 3)
  np.testing.assert_array_equal(part.flat, [3, 4, 5])
  np.testing.assert_array_equal(part.lengths, [0, 3])
  assert len(packed.rows(3, 3)) == 0
  with pytest.raises(ValueError, match="width=2"):
    unpack(packed, 2)
  with pytest.raises(ValueError, match="lengths sum to 4"):
    Packed(np.arange(5), np.array([2, 2]))


# ---- Writes ------------------------------------------------------------------------------------------

def test_errors_name_the_field_and_sample():
  queue = make_queue()
  with pytest.raises(KeyError, match="'advantage' is not declared"):
    queue.put([0], advantage=[1.0])
  with pytest.raises(KeyError, match="needs field 'ref_logp', which no one declared"):
    queue.register_consumer("ref", ("tokens", "ref_logp"))
  with pytest.raises(ValueError, match="field 'versions': sample 4 has 2 tokens, .* have 3"):
    queue.put([3, 4], tokens=[[1, 2], [3, 4, 5]], versions=[[0, 0], [1, 1]])
  queue.put([3], tokens=[[1, 2]])
  with pytest.raises(ValueError, match="'tokens' was already written for sample 3"):
    queue.put([3], tokens=[[9, 9]])
  with pytest.raises(ValueError, match="field 'behaviour_logp': sample 3 has 1 tokens, .* have 2"):
    queue.put([3], behaviour_logp=[[-0.5]])
  with pytest.raises(TypeError, match="field 'prompt_len': float64"):
    queue.put([3], prompt_len=[1.5])
  with pytest.raises(ValueError, match="reserved|other than"):
    FieldSpec("timeout", np.float32, False)
  assert queue.stats()["depth"] == 1.0  # the failed puts wrote nothing


def test_packed_input_and_later_fields_join_the_sample():
  queue = make_queue()
  queue.put([7, 2], tokens=Packed(np.array([10, 11, 12]), np.array([1, 2])), prompt_len=[1, 1])
  queue.write("reward", [2], [0.5])
  batch = queue.read("train", [2])
  np.testing.assert_array_equal(batch.tokens["tokens"].flat, [11, 12])
  np.testing.assert_array_equal(batch["reward"], [0.5])
  assert set(batch.sample) == {"reward"} and set(batch.tokens) == {"tokens"}


# ---- Consumers and eviction --------------------------------------------------------------------------

def test_consumption_is_per_consumer_and_eviction_waits_for_all():
  queue = make_queue()
  queue.put([0, 1, 2], tokens=[[1, 2, 3], [4], [5, 6]])
  np.testing.assert_array_equal(queue.ready("reward"), [0, 1, 2])
  assert queue.ready("train").size == 0  # no reward yet
  batch = queue.read("reward", n=2)
  np.testing.assert_array_equal(batch.indices, [0, 1])
  np.testing.assert_array_equal(batch.tokens["tokens"].flat, [1, 2, 3, 4])
  np.testing.assert_array_equal(batch.tokens["tokens"].lengths, [3, 1])
  np.testing.assert_array_equal(queue.ready("reward"), [2])
  queue.write("reward", [0, 1], [1.0, 0.0])
  np.testing.assert_array_equal(queue.ready("train"), [0, 1])
  assert queue.stats()["evicted"] == 0.0  # train has not read them yet
  batch = queue.read("train", [1, 0])
  np.testing.assert_array_equal(batch.sample["reward"], [0.0, 1.0])
  np.testing.assert_array_equal(unpack(batch.tokens["tokens"], 3), [[4, 0, 0], [1, 2, 3]])
  stats = queue.stats()
  assert (stats["evicted"], stats["depth"]) == (2.0, 1.0)
  with pytest.raises(KeyError, match="sample 0 was already consumed or dropped"):
    queue.write("reward", [0], [2.0])
  with pytest.raises(NotReady, match="already read sample 1"):
    queue.read("reward", [1])


def test_read_errors():
  queue = make_queue()
  queue.put([0], tokens=[[1]])
  with pytest.raises(NotReady, match=r"sample 0 lacks fields \['reward'\]"):
    queue.read("train", [0])
  with pytest.raises(ValueError, match="not both"):
    queue.read("reward", [0], n=1)
  with pytest.raises(NotReady, match="asked for 2 samples; 1 are ready"):
    queue.read("reward", n=2)
  with pytest.raises(KeyError, match="'critic' is not registered"):
    queue.ready("critic")


def test_drop_is_counted():
  queue = make_queue()
  queue.put([0, 1, 2], tokens=[[1], [2], [3]])
  queue.drop([0, 2], reason="stale")
  stats = queue.stats()
  assert (stats["dropped"], stats["dropped/stale"], stats["depth"], stats["evicted"]) == (2.0, 2.0, 1.0, 0.0)
  np.testing.assert_array_equal(queue.ready("reward"), [1])
  with pytest.raises(KeyError, match="sample 2 is not live"):
    queue.drop([2], reason="stale")
  with pytest.raises(KeyError, match="sample 0 was already consumed or dropped"):
    queue.put([0], tokens=[[1]])


# ---- Back-pressure -----------------------------------------------------------------------------------

def test_check_capacity_names_capacity():
  check_capacity(4, 4)
  with pytest.raises(ValueError, match="capacity=3 .* batch \\(4 samples\\)"):
    check_capacity(3, 4)
  with pytest.raises(ValueError, match="capacity=2"):
    make_queue(capacity=2).read("reward", n=3, block=True)


class ManualClock:
  """Stands in for distqueue's clock: time moves only when a test sets ``now``, and every reading is kept.

  A blocking call reads the clock as its wait starts, still holding the queue's lock, which it releases
  only by waiting: once a test has seen that reading, anything it does to the queue happens while the
  caller waits (no sleep, whatever the machine's load). Its second reading ends the wait.
  """

  def __init__(self):
    self.now = 0.0
    self.readings: list[tuple[str, float]] = []     # (thread name, time read)
    self._cond = threading.Condition()

  def __call__(self) -> float:
    with self._cond:
      self.readings.append((threading.current_thread().name, self.now))
      self._cond.notify_all()
      return self.now

  def wait_for_readings(self, n: int) -> None:
    with self._cond:   # the timeout only bounds a broken test; nothing is timed by it
      assert self._cond.wait_for(lambda: len(self.readings) >= n, timeout=60.0), self.readings


@pytest.fixture
def clock(monkeypatch):
  manual = ManualClock()
  monkeypatch.setattr(distqueue, "_clock", manual)
  return manual


def test_full_queue_blocks_producer_until_a_consumer_reads(clock):
  queue = make_queue(capacity=2, consumers=(("train", ("tokens",)),))
  queue.put([0, 1], tokens=[[1], [2]])
  with pytest.raises(QueueFull, match="capacity=2"):
    queue.put([2], tokens=[[3]], block=False)
  queue.put([1], versions=[[0]], block=False)  # a field for a live sample needs no room
  assert clock.readings == []                  # neither waited
  with pytest.raises(QueueFull):
    queue.put([2], tokens=[[3]], timeout=0.05, producer="gen")
  assert len(clock.readings) == 2 and queue.stats()["wait_s/producer/gen"] == 0.0  # counted; the clock stood
  done = threading.Event()
  thread = threading.Thread(target=lambda: (queue.put([2, 3], tokens=[[3], [4]], timeout=60.0,
                                                      producer="gen"), done.set()), name="producer")
  thread.start()
  clock.wait_for_readings(3)                   # the producer waits for room
  assert clock.readings[2] == ("producer", 0.0)
  assert not done.is_set() and queue.stats()["depth"] == 2.0  # blocked, nothing written
  clock.now = 2.5
  queue.read("train", n=2)                     # frees both rows: the producer writes and returns
  thread.join(timeout=60.0)
  assert done.is_set() and clock.readings[3] == ("producer", 2.5)
  np.testing.assert_array_equal(queue.ready("train"), [2, 3])
  assert queue.stats()["wait_s/producer/gen"] == 2.5  # the failed wait (0 on this clock) plus the blocked one


def test_writes_are_checked_again_after_waiting(clock):
  queue = make_queue(capacity=2, consumers=(("train", ("reward",)),))
  queue.put([0, 1], reward=[1.0, 2.0])
  errors = []

  def blocked_put():
    try:
      queue.put([1, 2], versions=[[0], [0]], timeout=60.0)
    except ValueError as e:
      errors.append(str(e))

  thread = threading.Thread(target=blocked_put, name="producer")
  thread.start()
  clock.wait_for_readings(1)   # the first check passed (sample 1 had no versions); it waits for room for 2
  queue.put([1], versions=[[5]], block=False)  # sample 1 is live: no room needed
  assert errors == [] and len(clock.readings) == 1   # still waiting: 1 live + 2 still over capacity
  queue.read("train", [0])                     # evicts 0: room for sample 2, the put wakes
  thread.join(timeout=60.0)
  assert errors == ["field 'versions' was already written for sample 1 (no overwrite)"]
  assert [who for who, _ in clock.readings] == ["producer", "producer"]  # refused after its wait ended
  assert queue.stats()["depth"] == 1.0  # the late put opened nothing


def test_consumer_waits_for_a_producer(clock):
  queue = make_queue(consumers=(("train", ("tokens",)),))
  batches = []
  thread = threading.Thread(target=lambda: batches.append(queue.read("train", n=2, block=True, timeout=60.0)),
                            name="consumer")
  thread.start()
  clock.wait_for_readings(1)                   # the consumer waits: nothing is ready
  queue.put([5], tokens=[[1]])                 # one of two: wakes it, and it waits on
  assert batches == []
  clock.now = 4.0
  queue.put([6], tokens=[[2]])
  thread.join(timeout=60.0)
  np.testing.assert_array_equal(batches[0].indices, [5, 6])
  assert clock.readings == [("consumer", 0.0), ("consumer", 4.0)]   # one wait, ended by the second put
  assert queue.stats()["wait_s/consumer/train"] == 4.0
  with pytest.raises(NotReady):
    queue.read("train", n=1, block=True, timeout=0.01)


# ---- Metrics and checkpoints -------------------------------------------------------------------------

def test_bytes_packed_vs_padded():
  queue = make_queue(consumers=(("train", ("tokens", "reward")),))
  queue.put([0, 1], tokens=[[1, 2, 3], [4]], reward=[1.0, 0.0])
  queue.read("train", n=2)
  # tokens: 4 int32 packed = 16 B; rewards: 2 float32 = 8 B.
  assert queue.stats()["bytes_read_packed"] == 24.0
  assert queue.stats(width=8)["bytes_read_padded"] == 2 * 8 * 4 + 8
  assert queue.stats()["bytes_read_padded"] == 2 * 3 * 4 + 8  # padded to the longest row read


def test_state_dict_round_trip():
  queue = make_queue(capacity=8)
  queue.put([0, 1, 2, 3], tokens=[[1, 2], [3], [4, 5, 6], [7]], reward=[0.5, 1.5, 2.5, 3.5])
  queue.put([0, 1, 2], behaviour_logp=[[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6]])
  queue.read("reward", [0, 1, 2])
  queue.read("train", [1])       # 1 is evicted, 0 and 2 wait for train, 3 for both
  queue.drop([3], reason="stale")
  state = queue.state_dict()
  json.dumps(state, default=lambda a: a.tolist())  # plain values and numpy arrays only
  restored = DistQueue.from_state_dict(state)
  assert restored.stats() == queue.stats()
  for name in ("reward", "train"):
    np.testing.assert_array_equal(restored.ready(name), queue.ready(name))
  np.testing.assert_array_equal(restored.ready("train"), [0, 2])
  with pytest.raises(KeyError, match="sample 1 was already consumed"):
    restored.put([1], versions=[[0]])
  with pytest.raises(ValueError, match="'behaviour_logp' was already written for sample 2"):
    restored.put([2], behaviour_logp=[[0.0, 0.0, 0.0]])
  restored.put([0], versions=[[4, 4]])
  batch = restored.read("train", n=2)
  np.testing.assert_array_equal(batch.tokens["tokens"].flat, [1, 2, 4, 5, 6])
  np.testing.assert_array_equal(batch.sample["reward"], [0.5, 2.5])
  assert restored.stats()["depth"] == 0.0


# ---- Property: every consumer gets every sample's exact values exactly once ----------------------------

@st.composite
def schedules(draw):
  n = draw(st.integers(1, 12))
  lengths = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
  writes = [(f, i) for f in ("tokens", "versions", "reward") for i in range(n)]
  order = draw(st.permutations(writes))
  chunk = draw(st.integers(1, 4))
  reads = draw(st.lists(st.integers(1, 3), min_size=1, max_size=6))
  checkpoint_at = draw(st.integers(0, len(order)))
  return lengths, order, chunk, reads, checkpoint_at


def expected_value(field, i, lengths):
  if field == "reward":
    return np.float32(i) / 2
  return np.arange(lengths[i], dtype=np.int32) + (100 * i if field == "tokens" else 0)


def drain(queue, consumer, reads, got):
  for n in reads:
    ready = queue.ready(consumer)
    if ready.size:
      batch = queue.read(consumer, n=min(n, ready.size))
      for k, i in enumerate(batch.indices):
        got.setdefault(consumer, []).append((int(i), {f: np.array(batch[f].row(k)) if f in batch.tokens
                                                      else batch[f][k] for f in (*batch.tokens, *batch.sample)}))


@given(schedules())
@settings(max_examples=60, deadline=None)
def test_property_every_sample_once_per_consumer(schedule):
  lengths, order, chunk, reads, checkpoint_at = schedule
  queue = make_queue(capacity=len(lengths), consumers=(("reward", ("tokens",)),
                                                       ("train", ("tokens", "versions", "reward"))))
  got = {}
  for start in range(0, len(order), chunk):
    if start <= checkpoint_at < start + chunk:
      queue = DistQueue.from_state_dict(queue.state_dict())
    for field, i in order[start:start + chunk]:
      value = expected_value(field, i, lengths)
      queue.write(field, [i], [value], block=False)
    for consumer in ("reward", "train"):
      drain(queue, consumer, reads, got)
  for consumer in ("reward", "train"):
    drain(queue, consumer, [len(lengths)], got)
    indices = sorted(i for i, _ in got[consumer])
    assert indices == list(range(len(lengths)))
    for i, values in got[consumer]:
      for field, value in values.items():
        np.testing.assert_array_equal(value, expected_value(field, i, lengths))
  assert queue.stats()["depth"] == 0.0
  assert queue.stats()["evicted"] == len(lengths)


def test_peek_reads_sample_fields_without_consuming():
  q = DistQueue([FieldSpec("tokens", np.int32, True), FieldSpec("group", np.int32, False)], capacity=4)
  q.register_consumer("train", needs=("tokens", "group"))
  q.put([0, 1], tokens=[np.array([5, 6]), np.array([7])], group=np.array([3, 3]))
  np.testing.assert_array_equal(q.peek([1, 0], ("group",))["group"], [3, 3])
  np.testing.assert_array_equal(q.ready("train"), [0, 1])              # still unread
  with pytest.raises(ValueError, match="'tokens' is not a declared sample field"):
    q.peek([0], ("tokens",))
