"""The phase switch on 8 virtual CPU devices, mesh (data=2, fsdp=2, tensor=2), a tiny Qwen2-style model.

Model: vocab 128, hidden 64, 2 layers, 4 heads, 2 KV heads (head_dim 16), MLP 128, float32, QKV bias.
Under TRAIN_RULES every weight with an ``embed`` axis is split over fsdp x tensor (1/4 per device);
under GENERATE_RULES over tensor only (1/2 per device). Norm scales and biases keep their layout.

Hand arithmetic used below (float32, 4 bytes):
  embedding 128*64*4 = 32768 B, lm_head 64*128*4 = 32768 B
  per layer: q 64*4*16*4 = 16384, k 64*2*16*4 = 8192, v 8192, o 16384, gate/up/down 3 * 64*128*4 = 98304
             -> 147456 B per layer, 294912 B for 2 layers (each a single leaf stacked over the 2 layers:
             q is one [2, 64, 4, 16] array of 32768 B)
  params that change layout: 2 * 32768 + 294912 = 360448 B; per device 360448/2 = 180224 B in the
  generation layout and 360448/4 = 90112 B in the training layout.
  params that keep their layout, per device: 5 norm scales 64*4 = 1280 B (replicated) + per layer the
  q/k/v biases (4*16 + 2*16 + 2*16)*4/2 = 256 B (split over tensor) -> 1280 + 2*256 = 1792 B.
  optimizer per device: Adam mu and nu follow the params, 2 * (90112 + 1792), plus two int32 step
  counters (Adam's and the learning-rate schedule's), replicated: 2 * 4 B -> 183816 B.
Expected per-device bytes elsewhere come from each array's shape and PartitionSpec (``_spec_bytes``),
never from the accounting under test.
"""
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rl_fusion_jax.config import MeshConfig, OptimConfig
from rl_fusion_jax.models import ModelConfig, abstract_params, init_params, param_logical_axes
from rl_fusion_jax.sharding import memory
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.reshard import Phase, make_layouts, move, plan_buckets, release, to_phase
from rl_fusion_jax.sharding.rules import GENERATE_RULES, TRAIN_RULES, param_shardings
from rl_fusion_jax.train import state as state_lib

CFG = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, qkv_bias=True)
MOVED_PARAM_BYTES = 360448
GEN_MOVED_PER_DEVICE = 180224
TRAIN_MOVED_PER_DEVICE = 90112
# = the largest single destination shard: a stacked MLP kernel ([2 layers, 64, 128] float32 = 65536 B)
# split over tensor in the generation layout.
SMALL_BUCKET = 32768


@pytest.fixture(scope="module")
def setup():
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  tx = state_lib.make_optimizer(OptimConfig(learning_rate=1e-3))
  abstract, axes = abstract_params(CFG), param_logical_axes(CFG)
  layouts = make_layouts(mesh, abstract, axes, tx)
  train = param_shardings(abstract, axes, mesh, TRAIN_RULES)
  shardings = state_lib.state_shardings(tx, abstract, train, mesh)
  return mesh, tx, layouts, shardings


def _random_like(tree, seed):
  """Distinct random values per leaf (same shape, dtype and sharding): a swapped leaf is detected."""
  rng = np.random.default_rng(seed)
  def one(x):
    values = (rng.standard_normal(x.shape) if np.issubdtype(x.dtype, np.floating)
              else rng.integers(1, 1000, x.shape))
    return jax.device_put(values.astype(x.dtype), x.sharding)
  return jax.tree.map(one, tree)


def _state(setup, seed=0):
  _, tx, _, shardings = setup
  params = jax.device_put(init_params(CFG, jax.random.key(seed)), shardings.params)
  state = state_lib.create_train_state(params, tx, shardings, policy_version=3)
  return state.replace(opt_state=_random_like(state.opt_state, seed))


def _spec_bytes(x) -> int:
  """Per-device bytes of ``x`` from its shape and PartitionSpec alone (every device holds one shard)."""
  n = int(np.prod(x.shape))
  for part in x.sharding.spec:
    for axis in (part if isinstance(part, tuple) else (part,)):
      if axis is not None:
        n //= x.sharding.mesh.shape[axis]
  return n * x.dtype.itemsize


def _tree_spec_bytes(tree) -> int:
  return sum(_spec_bytes(x) for x in jax.tree.leaves(tree))


def _host_copy(tree):
  return jax.tree.map(np.asarray, tree)


def _live():
  gc.collect()
  return memory.live_bytes()


def test_plan_buckets_groups_consecutive_items():
  # bucket 8: 4+4 fit; 4 then 10 would exceed; 10 alone (larger than a bucket); 1+1 fit.
  assert plan_buckets([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
  assert plan_buckets([], 8) == []
  assert plan_buckets([9], 8) == [[0]]


def test_train_to_generate_layouts_and_offload(setup):
  mesh, _, layouts, _ = setup
  state = _state(setup)
  opt_per_device = _tree_spec_bytes(state.opt_state)
  assert opt_per_device == 183816   # module docstring
  before = _live()
  state, stats = to_phase(state, Phase.GENERATE, layouts=layouts, bucket_bytes=SMALL_BUCKET)
  after = _live()
  gen = param_shardings(abstract_params(CFG), param_logical_axes(CFG), mesh, GENERATE_RULES)
  for x, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(gen)):
    assert x.sharding.is_equivalent_to(s, x.ndim) and x.sharding.memory_kind == "device"
  assert state.params["embed"]["embedding"].sharding.is_equivalent_to(NamedSharding(mesh, P("tensor")), 2)
  assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(state.opt_state))
  for d in range(8):
    # device kind: the optimizer left, the moved params grew from 1/4 to 1/2 per device.
    assert (memory.per_device(after, "device")[d] - memory.per_device(before, "device")[d]
            == -opt_per_device + GEN_MOVED_PER_DEVICE - TRAIN_MOVED_PER_DEVICE)
    assert (memory.per_device(after, "pinned_host").get(d, 0)
            - memory.per_device(before, "pinned_host").get(d, 0) == opt_per_device)
  assert stats.params_bytes == MOVED_PARAM_BYTES
  assert stats.offload_bytes == sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
  assert int(state.policy_version) == 3


def test_round_trip_is_bitwise_and_restores_layouts(setup):
  state = _state(setup, seed=1)
  expected = _host_copy((state.params, state.opt_state))
  shardings = jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state))
  layouts = setup[2]
  state, _ = to_phase(state, Phase.GENERATE, layouts=layouts, bucket_bytes=SMALL_BUCKET)
  state, back = to_phase(state, Phase.TRAIN, layouts=layouts, bucket_bytes=SMALL_BUCKET)
  got = (state.params, state.opt_state)
  for e, x, s in zip(jax.tree.leaves(expected), jax.tree.leaves(got), jax.tree.leaves(shardings)):
    assert np.array_equal(e, np.asarray(x)) and x.dtype == e.dtype
    assert x.sharding.is_equivalent_to(s, x.ndim) and x.sharding.memory_kind == "device"
  assert back.params_bytes == MOVED_PARAM_BYTES and int(state.step) == 0


def _bound_holds(stats, extra):
  """peak <= max(live before, live after) + extra, per device.

  Not just "before + extra": the generation layout is itself larger per device (no fsdp split), so
  train -> generate legitimately ends 90112 B higher than it started. At the sample of bucket k the live
  bytes are before + (growth of buckets < k) + destination of bucket k; when every moved leaf grows this
  is <= after + source of bucket k, when every moved leaf shrinks it is <= before + destination of k.
  """
  before, after = memory.per_device(stats.before), memory.per_device(stats.after)
  return all(stats.peak_per_device[d] <= max(before[d], after[d]) + extra for d in before)


@pytest.mark.parametrize("offload", [True, False])
def test_peak_stays_within_one_bucket(setup, offload):
  # Every leaf's destination (and source) shard is <= 32768 B per device (SMALL_BUCKET, above), so no
  # bucket costs more than SMALL_BUCKET on any device. Slack 0: buffers are counted exactly once
  # (memory_test checks that views of an array are not counted again).
  state = _state(setup, seed=2)
  layouts = setup[2]
  gc.collect()   # garbage freed mid-switch would make "before" too high and the bound too loose
  state, to_gen = to_phase(state, Phase.GENERATE, layouts=layouts, bucket_bytes=SMALL_BUCKET,
                           offload_optimizer=offload)
  state, to_train = to_phase(state, Phase.TRAIN, layouts=layouts, bucket_bytes=SMALL_BUCKET,
                             offload_optimizer=offload)
  for stats in (to_gen, to_train):
    # at least the moved params' destination bytes / bucket: 90112 / 32768 -> 3 buckets towards train
    assert stats.buckets >= 3 and stats.largest_bucket_bytes <= SMALL_BUCKET
    assert _bound_holds(stats, SMALL_BUCKET)
    assert 0 < stats.transient_bytes() <= SMALL_BUCKET
  # generate -> train shrinks the params: there the bound is the plain "before + one bucket".
  assert max(to_train.peak_per_device.values()) <= max(memory.per_device(to_train.before).values()) + (
      SMALL_BUCKET)
  assert to_gen.peak_extra_bytes() >= GEN_MOVED_PER_DEVICE - TRAIN_MOVED_PER_DEVICE


def test_whole_tree_put_breaks_the_bound(setup):
  # One bucket holds every moved param: at the sample all 1/2-per-device destinations (180224 B) and
  # all sources are alive at once, far above one small bucket. This is what the bound test guards.
  state = _state(setup, seed=3)
  gc.collect()
  state, stats = to_phase(state, Phase.GENERATE, layouts=setup[2], bucket_bytes=1 << 40,
                          offload_optimizer=False)
  assert stats.buckets == 1
  assert stats.peak_extra_bytes() == GEN_MOVED_PER_DEVICE
  # over the end state (params now 1/2 per device) the sources were still alive: 90112 B more.
  assert stats.transient_bytes() == TRAIN_MOVED_PER_DEVICE
  assert not _bound_holds(stats, SMALL_BUCKET)


def test_no_leak_over_ten_round_trips(setup):
  layouts = setup[2]
  state = _state(setup, seed=4)
  old = jax.tree.leaves((state.params, state.opt_state))
  state, _ = to_phase(state, Phase.GENERATE, layouts=layouts, bucket_bytes=SMALL_BUCKET)
  state, _ = to_phase(state, Phase.TRAIN, layouts=layouts, bucket_bytes=SMALL_BUCKET)
  # Leaves that had to move are deleted; norms and biases keep their layout, so they stay the same array.
  kept = {id(x) for x in jax.tree.leaves((state.params, state.opt_state))}
  assert all(x.is_deleted() for x in old if id(x) not in kept)
  gc.collect()
  count, buffers, live = len(jax.live_arrays()), memory.live_buffer_count(), memory.live_bytes()
  for _ in range(10):
    state, _ = to_phase(state, Phase.GENERATE, layouts=layouts, bucket_bytes=SMALL_BUCKET)
    state, _ = to_phase(state, Phase.TRAIN, layouts=layouts, bucket_bytes=SMALL_BUCKET)
  gc.collect()
  assert (len(jax.live_arrays()), memory.live_buffer_count(), memory.live_bytes()) == (count, buffers, live)


def test_same_phase_moves_nothing(setup):
  state = _state(setup, seed=5)
  leaves = jax.tree.leaves(state)
  new, stats = to_phase(state, Phase.TRAIN, layouts=setup[2], bucket_bytes=SMALL_BUCKET)
  assert (stats.buckets, stats.params_bytes, stats.offload_bytes) == (0, 0, 0)
  assert all(a is b for a, b in zip(leaves, jax.tree.leaves(new)))


def test_parts_mapping_with_gradients(setup):
  # A caller holding accumulated gradients passes them with the params; they go to host like the moments.
  state = _state(setup, seed=6)
  grads = _random_like(state.params, seed=7)
  expected = _host_copy(grads)
  parts = {"params": state.params, "opt_state": state.opt_state, "grads": grads}
  parts, stats = to_phase(parts, Phase.GENERATE, layouts=setup[2], bucket_bytes=SMALL_BUCKET)
  assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(parts["grads"]))
  parts, _ = to_phase(parts, Phase.TRAIN, layouts=setup[2], bucket_bytes=SMALL_BUCKET)
  assert all(np.array_equal(e, np.asarray(x))
             for e, x in zip(jax.tree.leaves(expected), jax.tree.leaves(parts["grads"])))
  assert stats.offload_bytes == 3 * sum(x.nbytes for x in jax.tree.leaves(grads)) + sum(
      x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim == 0)


def test_metrics_are_flat_floats(setup):
  state = _state(setup, seed=8)
  state, stats = to_phase(state, Phase.GENERATE, layouts=setup[2], bucket_bytes=SMALL_BUCKET)
  metrics = stats.as_metrics("to_generate/")
  assert metrics["to_generate/params_bytes"] == float(MOVED_PARAM_BYTES)
  assert metrics["to_generate/buckets"] == float(stats.buckets)
  assert all(k.startswith("to_generate/") and isinstance(v, float) for k, v in metrics.items())
  assert {"to_generate/peak_bytes_max", "to_generate/seconds"} <= set(metrics)


@pytest.mark.parametrize("bucket_bytes", [0, -1, 1.5, True])
def test_bad_bucket_bytes_fails_before_moving(setup, bucket_bytes):
  state = _state(setup, seed=9)
  with pytest.raises(ValueError, match="bucket_bytes"):
    to_phase(state, Phase.GENERATE, layouts=setup[2], bucket_bytes=bucket_bytes)
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_rule_naming_unknown_mesh_axis_fails(setup):
  mesh, tx = setup[0], setup[1]
  abstract, axes = abstract_params(CFG), param_logical_axes(CFG)
  bad = TRAIN_RULES + (("experts", "expert"),)   # unused by this model: still caught
  with pytest.raises(ValueError, match=r"train_rules: rule \('experts', 'expert'\).*'expert'"):
    make_layouts(mesh, abstract, axes, tx, train_rules=bad)
  bad = (("vocab", ("tensor", "model")),) + GENERATE_RULES[1:]
  with pytest.raises(ValueError, match="generate_rules: rule.*'model'"):
    make_layouts(mesh, abstract, axes, tx, generate_rules=bad)


def test_mismatched_state_fails_naming_the_field(setup):
  state = _state(setup, seed=10)
  params = dict(state.params)
  del params["lm_head"]
  with pytest.raises(ValueError, match="state.params"):
    to_phase(state.replace(params=params), Phase.GENERATE, layouts=setup[2], bucket_bytes=SMALL_BUCKET)
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))   # checked before the optimizer moved


# --- move (keep_source) and release: sending weights to another mesh, placing host arrays ------------


def _two_meshes():
  """A training mesh (fsdp 2 x tensor 2) on devices 4-7 and a rollout mesh (data 2 x tensor 2) on 0-3."""
  devices = jax.devices()
  return (make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices[4:]),
          make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), devices[:4]))


def test_keep_source_move_adds_only_the_destination(setup):
  # Rollout mesh, generation layout: 1/2 of every moved param per device (+ 1792 B that keep their
  # layout) = 182016 B per rollout device. The training devices get nothing: no whole-tree copy.
  train_mesh, rollout_mesh = _two_meshes()
  abstract, axes = abstract_params(CFG), param_logical_axes(CFG)
  params = jax.device_put(init_params(CFG, jax.random.key(11)),
                          param_shardings(abstract, axes, train_mesh, TRAIN_RULES))
  expected = _host_copy(params)
  dst = param_shardings(abstract, axes, rollout_mesh, GENERATE_RULES)
  gc.collect()
  copy, stats = move(params, dst, bucket_bytes=SMALL_BUCKET, keep_source=True, track_memory=True)
  dest_per_device = GEN_MOVED_PER_DEVICE + 1792
  # A bucket holds at least one leaf: the bound is one bucket or the largest destination shard.
  bucket = max(SMALL_BUCKET, max(_spec_bytes(y) for y in jax.tree.leaves(copy)))
  before = memory.per_device(stats.before)
  for d in range(4):         # rollout devices: the destination, built bucket by bucket, and nothing more
    assert stats.peak_per_device[d] - before.get(d, 0) <= dest_per_device + bucket
    assert memory.per_device(stats.after)[d] - before.get(d, 0) == dest_per_device
  for d in range(4, 8):      # training devices: unchanged throughout
    assert stats.peak_per_device[d] == before[d]
  assert stats.moved_bytes == sum(x.nbytes for x in jax.tree.leaves(params))
  assert stats.buckets >= dest_per_device // bucket and stats.largest_bucket_bytes <= bucket
  for e, x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(params), jax.tree.leaves(copy)):
    assert not x.is_deleted() and np.array_equal(e, np.asarray(x)) and np.array_equal(e, np.asarray(y))
  # What publishing did before: a whole-tree copy on the training devices, a full extra copy there.
  tracker = memory.MemoryTracker()
  whole = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), params))
  tracker.sample()
  assert min(tracker.peak_per_device[d] - before[d] for d in range(4, 8)) >= TRAIN_MOVED_PER_DEVICE
  release(whole)


def test_keep_source_copies_leaves_already_in_place(setup):
  mesh = setup[0]
  x = jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(mesh, P()))
  (y,), _ = move([x], [x.sharding], bucket_bytes=SMALL_BUCKET, keep_source=True)
  assert y is not x and memory.live_buffer_count([x, y]) == 2 * memory.live_buffer_count([x])
  release([y])
  assert y.is_deleted() and not x.is_deleted()
  ([z], stats) = move([x], [x.sharding], bucket_bytes=SMALL_BUCKET)   # consuming: already in place
  assert z is x and stats.buckets == 0


def test_host_arrays_go_straight_to_host_memory(setup):
  mesh = setup[0]
  abstract, axes = abstract_params(CFG), param_logical_axes(CFG)
  host = _host_copy(init_params(CFG, jax.random.key(12)))
  dst = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"),
                     param_shardings(abstract, axes, mesh, TRAIN_RULES))
  gc.collect()
  placed, stats = move(host, dst, bucket_bytes=SMALL_BUCKET, track_memory=True)
  assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(placed))
  # Sampled after every bucket: device-kind bytes never rose; all of it landed on the host kind.
  device_before = memory.per_device(stats.before, "device")
  assert all(memory.per_device(stats.after, "device").get(d, 0) == device_before.get(d, 0) for d in range(8))
  assert all(stats.peak_per_device[d] == memory.per_device(stats.after)[d] for d in range(8))
  assert stats.moved_bytes == sum(x.nbytes for x in jax.tree.leaves(host))
  for e, x in zip(jax.tree.leaves(host), jax.tree.leaves(placed)):
    assert np.array_equal(e, np.asarray(x))


def test_release_reports_freed_bytes(setup):
  mesh = setup[0]
  tree = {"a": jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("fsdp"))),
          "b": jax.device_put(np.ones((4,), np.int32), NamedSharding(mesh, P()))}
  gc.collect()
  stats = release(tree, used_by=tree["a"] + 1, track_memory=True)
  assert stats.moved_bytes == 8 * 8 * 4 + 4 * 4 and stats.buckets == 0
  assert all(x.is_deleted() for x in jax.tree.leaves(tree))
  assert stats.as_metrics("r/")["r/bytes"] == float(stats.moved_bytes)
  drop = {d: b - memory.per_device(stats.after).get(d, 0) for d, b in memory.per_device(stats.before).items()}
  assert drop == {d: 8 * 8 * 4 // 2 + 16 for d in range(8)}


def test_sharding_does_not_import_train():
  import subprocess
  import sys
  code = ("import sys, rl_fusion_jax.sharding.reshard, rl_fusion_jax.sharding.memory;"
          "print([m for m in sys.modules if m.startswith('rl_fusion_jax.train')])")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


# --- mixed precision: a bfloat16 generation copy, float32 masters on the host while generating -------


def test_mixed_precision_switch_parks_float32_masters_and_returns_them_bit_for_bit(setup):
  # Generation copy in bfloat16 (2 B) and the generation layout: (180224 + 1792) / 2 = 91008 B per device,
  # half of what the float32 generation layout holds. The masters (91904 B per device, float32) and the
  # optimizer (183816 B) go to pinned_host.
  mesh, tx, _, _ = setup
  layouts = make_layouts(mesh, abstract_params(CFG), param_logical_axes(CFG), tx, generate_dtype="bfloat16")
  state = _state(setup, seed=6)
  expected = _host_copy((state.params, state.opt_state))
  shardings = jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state))
  gc.collect()
  state, to_gen = to_phase(state, Phase.GENERATE, layouts=layouts, bucket_bytes=SMALL_BUCKET // 2)
  gen = param_shardings(abstract_params(CFG), param_logical_axes(CFG), mesh, GENERATE_RULES)
  for x, s, e in zip(jax.tree.leaves(state.params), jax.tree.leaves(gen), jax.tree.leaves(expected[0])):
    assert x.dtype == jnp.bfloat16 and x.sharding.is_equivalent_to(s, x.ndim)
    assert x.sharding.memory_kind == "device"
    assert np.array_equal(np.asarray(x), e.astype(jnp.bfloat16))
  for x, e in zip(jax.tree.leaves(state.master_params), jax.tree.leaves(expected[0])):
    assert x.dtype == np.float32 and x.sharding.memory_kind == "pinned_host"
    assert np.array_equal(np.asarray(x), e)
  before, after = memory.per_device(to_gen.before, "device"), memory.per_device(to_gen.after, "device")
  for d in range(8):
    assert before[d] - after[d] == 91904 + 183816 - 91008
  # Every param is copied, 2 B per value: the moved ones and the 2304 B (float32) that keep their layout
  # (5 norm scales 5*64*4 = 1280, q/k/v biases 2 layers * 128*4 = 1024).
  assert to_gen.params_bytes == (MOVED_PARAM_BYTES + 2304) // 2
  assert _bound_holds(to_gen, SMALL_BUCKET // 2)
  state, to_train = to_phase(state, Phase.TRAIN, layouts=layouts, bucket_bytes=SMALL_BUCKET // 2)
  assert state.master_params is None
  for e, x, s in zip(jax.tree.leaves(expected), jax.tree.leaves((state.params, state.opt_state)),
                     jax.tree.leaves(shardings)):
    assert x.dtype == e.dtype and np.array_equal(e, np.asarray(x))
    assert x.sharding.is_equivalent_to(s, x.ndim) and x.sharding.memory_kind == "device"
  assert memory.per_device(to_train.after, "device") == before
  assert _bound_holds(to_train, SMALL_BUCKET // 2)


def test_generate_dtype_is_dropped_when_nothing_would_change(setup):
  mesh, tx, _, _ = setup
  assert make_layouts(mesh, abstract_params(CFG), param_logical_axes(CFG), tx,
                      generate_dtype="float32").generate_dtype is None
