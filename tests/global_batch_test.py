"""Global batches from per-shard reads on a (data=2, fsdp=2, tensor=2) mesh of 8 CPU devices.

The batch is split over (data, fsdp): 4 row groups, each held by the 2 devices of a tensor pair. The
global array must equal the host array, and each row must be read once (4 reads, not 8).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_fusion_jax.queue import global_batch as gb
from rl_fusion_jax.queue.distqueue import DistQueue, FieldSpec, pack

HOST = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)


def mesh():
  return Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))


def counting_reader(host, reads):
  def read(start, stop):
    reads.append((start, stop))
    return host[start:stop]
  return read


def test_each_row_read_once_not_once_per_device():
  reads = []
  sharding = NamedSharding(mesh(), P(("data", "fsdp"), None))
  out = gb.global_batch(sharding, HOST.shape, np.float32, counting_reader(HOST, reads))
  np.testing.assert_array_equal(np.asarray(out), HOST)
  assert out.sharding == sharding
  assert sorted(reads) == [(0, 2), (2, 4), (4, 6), (6, 8)]
  # The plain callback is asked once per device: the tensor pairs would read every row twice.
  calls = []
  jax.make_array_from_callback(HOST.shape, sharding, lambda index: calls.append(index) or HOST[index])
  assert len(calls) == 8


def test_columns_split_over_tensor_still_read_rows_once():
  reads = []
  sharding = NamedSharding(mesh(), P(("data", "fsdp"), "tensor"))
  out = gb.global_batch(sharding, HOST.shape, np.float32, counting_reader(HOST, reads))
  np.testing.assert_array_equal(np.asarray(out), HOST)
  np.testing.assert_array_equal(np.asarray(out.addressable_shards[1].data), HOST[0:2, 2:4])
  assert sorted(reads) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_reader_shape_is_checked():
  sharding = NamedSharding(mesh(), P(("data", "fsdp"), None))
  with pytest.raises(ValueError, match=r"returned shape \(1, 4\); the shard needs \(2, 4\)"):
    gb.global_batch(sharding, HOST.shape, np.float32, lambda a, b: HOST[a:a + 1])


def test_padded_tokens_pad_each_shard_from_its_own_rows(monkeypatch):
  rows = [[1, 2, 3], [4], [], [5, 6], [7, 8, 9, 10], [11], [12, 13], [14, 15, 16]]
  calls = []
  real_unpack = gb.unpack
  monkeypatch.setattr(gb, "unpack", lambda p, w, pad: calls.append(len(p)) or real_unpack(p, w, pad))
  out = np.asarray(gb.padded_tokens(mesh(), pack(rows, np.int32), width=5, pad=-1))
  np.testing.assert_array_equal(out[:4], [[1, 2, 3, -1, -1], [4, -1, -1, -1, -1], [-1, -1, -1, -1, -1],
                                          [5, 6, -1, -1, -1]])
  np.testing.assert_array_equal(out[4], [7, 8, 9, 10, -1])
  np.testing.assert_array_equal(out[7], [14, 15, 16, -1, -1])
  assert calls == [2, 2, 2, 2]  # one unpack of 2 rows per data-parallel group
  with pytest.raises(ValueError, match="6 samples does not split over data\\*fsdp=4"):
    gb.padded_tokens(mesh(), pack(rows[:6], np.int32), width=5)


def test_batch_arrays_from_a_queue_read():
  queue = DistQueue([FieldSpec("tokens", np.int32, True), FieldSpec("behaviour_logp", np.float32, True),
                     FieldSpec("reward", np.float32, False)], capacity=8)
  queue.register_consumer("train", ("tokens", "behaviour_logp", "reward"))
  queue.put(range(4), tokens=[[1], [2, 3], [4, 5, 6], [7]],
            behaviour_logp=[[-1.0], [-2.0, -3.0], [-4.0, -5.0, -6.0], [-7.0]], reward=[0, 1, 0, 1])
  arrays = gb.batch_arrays(mesh(), queue.read("train", n=4), width=3, pads={"tokens": 99})
  np.testing.assert_array_equal(np.asarray(arrays["tokens"]), [[1, 99, 99], [2, 3, 99], [4, 5, 6],
                                                               [7, 99, 99]])
  np.testing.assert_array_equal(np.asarray(arrays["behaviour_logp"])[1], [-2.0, -3.0, 0.0])
  np.testing.assert_array_equal(np.asarray(arrays["reward"]), [0.0, 1.0, 0.0, 1.0])
  assert arrays["reward"].sharding.spec == P(("data", "fsdp"))


def test_queue_arrays_read_each_group_once_in_the_queue_order():
  """8 samples over (data 2, fsdp 2, tensor 2): 4 row groups of 2 rows, each read from the queue once."""
  queue = DistQueue([FieldSpec("tokens", np.int32, True), FieldSpec("reward", np.float32, False)], capacity=8)
  queue.register_consumer("train", ("tokens", "reward"))
  rows = [np.arange(1, 2 + i % 3, dtype=np.int32) * 10 + i for i in range(8)]   # lengths 1, 2, 3, 1, ...
  queue.put(range(8), tokens=rows, reward=np.arange(8, dtype=np.float32))
  reads = []

  def read(indices):
    reads.append(tuple(int(i) for i in indices))
    return queue.read("train", indices)

  order = [7, 6, 5, 4, 3, 2, 1, 0]              # row r of the batch holds sample order[r]
  arrays = gb.queue_arrays(mesh(), read, order, width=3)
  assert sorted(reads) == [(1, 0), (3, 2), (5, 4), (7, 6)]
  np.testing.assert_array_equal(np.asarray(arrays["reward"]), [7, 6, 5, 4, 3, 2, 1, 0])
  np.testing.assert_array_equal(np.asarray(arrays["tokens"])[0], [17, 27, 0])     # sample 7: length 2
  np.testing.assert_array_equal(np.asarray(arrays["tokens"])[7], [10, 0, 0])      # sample 0: length 1
  assert len(queue.ready("train")) == 0
  assert gb.local_row_slices(NamedSharding(mesh(), P(("data", "fsdp"))), 8) == [(0, 2), (2, 4), (4, 6), (6, 8)]
