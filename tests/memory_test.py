"""Memory accounting on 8 virtual CPU devices, mesh (data=2, fsdp=2, tensor=2); expected bytes by hand.

Each test measures the difference its own arrays make, after ``gc.collect()``, so arrays other tests
left alive do not matter.
"""
import gc

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.sharding import memory
from rl_fusion_jax.sharding.mesh import make_mesh


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))


def _put(mesh, shape, spec, kind=None, dtype=np.float32):
  values = np.arange(np.prod(shape)).reshape(shape).astype(dtype)
  return jax.device_put(values, NamedSharding(mesh, spec, memory_kind=kind))


def _diff(after, before):
  return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)
          if after.get(k, 0) != before.get(k, 0)}


def _live():
  gc.collect()
  return memory.live_bytes()


def test_sharded_replicated_and_host_arrays(mesh):
  before = _live()
  a = _put(mesh, (8, 16), P("fsdp", "tensor"))               # shard 4x8 float32 = 128 B per device
  b = _put(mesh, (4, 4), P())                                 # replicated 4*4*4 = 64 B on every device
  c = _put(mesh, (8, 16), P(None, "tensor"), "pinned_host")   # shard 8x8 float32 = 256 B, host kind
  d = _put(mesh, (6,), P(), dtype=np.int8)                    # 6 B on every device
  expected = {(i, "device"): 128 + 64 + 6 for i in range(8)} | {(i, "pinned_host"): 256 for i in range(8)}
  assert _diff(_live(), before) == expected
  del a, b, c, d


def test_views_of_an_array_are_not_counted_twice(mesh):
  before = _live()
  a = _put(mesh, (8, 16), P("data", "tensor"))    # 4x8x4 = 128 B per device
  shards = [s.data for s in a.addressable_shards]   # per-device views: more entries in live_arrays()
  moved = jax.device_put(a, NamedSharding(mesh, P(), memory_kind="pinned_host"))   # 8*16*4 = 512 B
  moved.block_until_ready()
  assert len(jax.live_arrays()) > 2
  expected = {(i, "device"): 128 for i in range(8)} | {(i, "pinned_host"): 512 for i in range(8)}
  assert _diff(_live(), before) == expected
  assert memory.live_bytes([a, moved]) == expected
  assert memory.live_buffer_count([a, moved]) == 16
  del shards


def test_deleted_arrays_are_not_counted(mesh):
  before = _live()
  a = _put(mesh, (8, 16), P("fsdp", "tensor"))
  a.delete()
  assert _diff(_live(), before) == {}
  assert memory.live_bytes([a]) == {}


def test_per_device_sums_kinds_or_filters_one():
  live = {(0, "device"): 10, (0, "pinned_host"): 5, (1, "device"): 7}
  assert memory.per_device(live) == {0: 15, 1: 7}
  assert memory.per_device(live, "pinned_host") == {0: 5}


def test_device_memory_stats_absent_on_cpu():
  assert jax.devices()[0].platform == "cpu"
  assert memory.device_memory_stats() is None


def test_tracker_keeps_the_peak(mesh):
  gc.collect()
  tracker = memory.MemoryTracker()
  base = memory.per_device(tracker.before)
  a = _put(mesh, (16, 16), P("fsdp"))            # 8x16x4 = 512 B per device
  tracker.sample()
  b = _put(mesh, (16, 16), P(), "pinned_host")   # 16*16*4 = 1024 B per device, host kind
  tracker.sample()
  a.delete()
  b.delete()
  now = memory.per_device(tracker.sample())
  for d in range(8):
    assert tracker.peak_per_device[d] - base.get(d, 0) == 512 + 1024
    assert now.get(d, 0) == base.get(d, 0)
    assert tracker.peak[(d, "pinned_host")] - tracker.before.get((d, "pinned_host"), 0) == 1024
  assert tracker.samples == 4 and tracker.seconds > 0
