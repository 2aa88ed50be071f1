"""The phase switch of a MoE model on 8 virtual CPU devices, mesh (data=2, fsdp=4, tensor=1): memory bound,
bit-exact round trip, and what each device must receive of the expert weights (``reshard.Traffic``).

Model: Qwen3-MoE style, vocab 64, hidden 32, 2 sparse layers, 4 heads / 2 KV heads (head_dim 8), 8 experts
(top-2) of intermediate 16, float32. Hand arithmetic (4 bytes per element):
  expert leaves: gate / up [2 layers, 8, 32, 16] and down [2, 8, 16, 32], 32768 B each, 98304 B in all.
  TRAIN_RULES split 'expert' over (fsdp, data) = 8 shards: 4096 B per leaf and device, device (d, f)
  holding expert f * 2 + d of each layer; GENERATE_RULES over fsdp = 4 shards: 8192 B per leaf, device
  (d, f) holding experts 2f and 2f + 1, which include its training expert.
  train -> generate: each device receives 8192 - 4096 = 4096 B per leaf, 3 * 4096 = 12288 B (E / 8
    experts); the all-gather baseline brings every leaf whole minus the device's own shard:
    3 * (32768 - 4096) = 86016 B, 7 times as much.
  generate -> train: each device already holds its training shard: 0 B received; all-gather baseline
    3 * (32768 - 8192) = 73728 B.
  Dense leaves that change layout: 'embed' over fsdp while training (1/4 per device), whole while
  generating (tensor = 1), so received = all-gather = 3/4 of the leaf per device: embedding [64, 32] and
  lm head 6144 B each, q [2, 32, 4, 8] and o 6144 B each, k and v [2, 32, 2, 8] 3072 B each, router
  [2, 32, 8] 1536 B -> 32256 B (norm scales are replicated in both layouts and do not move).
  The largest destination shard of any leaf is 8192 B (an expert leaf in the generation layout; also the
  embedding, the lm head and the stacked q / o kernels, replicated there): ``BUCKET``.
"""
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax.config import MeshConfig, OptimConfig
from rl_fusion_jax.models import ModelConfig, abstract_params, init_params, param_logical_axes
from rl_fusion_jax.sharding import memory
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.reshard import Phase, leaf_traffic, make_layouts, to_phase
from rl_fusion_jax.sharding.rules import GENERATE_RULES, TRAIN_RULES, param_shardings
from rl_fusion_jax.train import state as state_lib

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, model_type="qwen3_moe",
                  qk_norm=True)
BUCKET = 8192
TO_GENERATE_RECEIVED = 12288
TO_GENERATE_ALLGATHER = 86016
TO_TRAIN_ALLGATHER = 73728
DENSE_RECEIVED = 32256


@pytest.fixture(scope="module")
def setup():
  mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
  tx = state_lib.make_optimizer(OptimConfig(learning_rate=1e-3))
  abstract, axes = abstract_params(CFG), param_logical_axes(CFG)
  shardings = state_lib.state_shardings(tx, abstract, param_shardings(abstract, axes, mesh, TRAIN_RULES), mesh)
  return mesh, tx, shardings


def _layouts(setup, **kwargs):
  mesh, tx, _ = setup
  return make_layouts(mesh, abstract_params(CFG), param_logical_axes(CFG), tx, **kwargs)


def _state(setup, seed):
  """A train-layout TrainState with distinct random values in every leaf (a swapped leaf is detected)."""
  _, tx, shardings = setup
  params = jax.device_put(init_params(CFG, jax.random.key(seed)), shardings.params)
  state = state_lib.create_train_state(params, tx, shardings)
  rng = np.random.default_rng(seed)
  def random_like(x):
    values = (rng.standard_normal(x.shape) if np.issubdtype(x.dtype, np.floating)
              else rng.integers(1, 1000, x.shape))
    return jax.device_put(values.astype(x.dtype), x.sharding)
  return state.replace(opt_state=jax.tree.map(random_like, state.opt_state))


def _bound_holds(stats, extra):
  """peak <= max(live before, live after) + extra on every device (reshard_test's bound)."""
  before, after = memory.per_device(stats.before), memory.per_device(stats.after)
  return all(stats.peak_per_device[d] <= max(before[d], after[d]) + extra for d in before)


def test_round_trip_memory_bound_bit_exact_and_expert_traffic(setup):
  layouts = _layouts(setup)
  state = _state(setup, seed=0)
  expected = jax.tree.map(np.asarray, (state.params, state.opt_state))
  shardings = jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state))
  gc.collect()   # garbage freed mid-switch would make "before" too high and the bound too loose
  state, to_gen = to_phase(state, Phase.GENERATE, layouts=layouts, bucket_bytes=BUCKET)
  experts = state.params["layers"]["moe"]["experts"]
  assert all(x.addressable_shards[0].data.nbytes == 8192 for x in jax.tree.leaves(experts))
  state, to_train = to_phase(state, Phase.TRAIN, layouts=layouts, bucket_bytes=BUCKET)
  for stats in (to_gen, to_train):
    assert 0 < stats.largest_bucket_bytes <= BUCKET
    assert _bound_holds(stats, stats.largest_bucket_bytes)
  for e, x, s in zip(jax.tree.leaves(expected), jax.tree.leaves((state.params, state.opt_state)),
                     jax.tree.leaves(shardings)):
    assert np.array_equal(e, np.asarray(x)) and x.dtype == e.dtype and x.sharding.is_equivalent_to(s, x.ndim)
  # every device, not only the fullest: the layouts nest, so the expert traffic is uniform
  assert to_gen.traffic.expert_received == {d: TO_GENERATE_RECEIVED for d in range(8)}
  assert to_gen.traffic.expert_allgather == {d: TO_GENERATE_ALLGATHER for d in range(8)}
  assert to_train.traffic.expert_received == {d: 0 for d in range(8)}
  assert to_train.traffic.expert_allgather == {d: TO_TRAIN_ALLGATHER for d in range(8)}
  metrics = to_gen.as_metrics("switch/to_generate/")
  assert metrics["switch/to_generate/expert_received_bytes_max"] == TO_GENERATE_RECEIVED
  assert metrics["switch/to_generate/expert_allgather_bytes_max"] == TO_GENERATE_ALLGATHER
  # all moved params: the dense leaves are whole on every device while generating (module docstring)
  assert metrics["switch/to_generate/received_bytes_max"] == DENSE_RECEIVED + TO_GENERATE_RECEIVED
  assert metrics["switch/to_generate/allgather_bytes_max"] == DENSE_RECEIVED + TO_GENERATE_ALLGATHER


def test_bf16_generation_copy_counts_destination_bytes(setup):
  # train -> generate makes a bfloat16 copy: 2 bytes per element, 3 * (4096 - 2048) received per device;
  # going back the float32 masters return from the host to the same shards: nothing crosses devices.
  layouts = _layouts(setup, generate_dtype=jnp.bfloat16)
  state, to_gen = to_phase(_state(setup, seed=1), Phase.GENERATE, layouts=layouts, bucket_bytes=BUCKET,
                           track_memory=False)
  assert to_gen.traffic.expert_received == {d: 3 * 2048 for d in range(8)}
  assert to_gen.traffic.expert_allgather == {d: 3 * (16384 - 2048) for d in range(8)}
  _, to_train = to_phase(state, Phase.TRAIN, layouts=layouts, bucket_bytes=BUCKET, track_memory=False)
  assert to_train.traffic.expert_received == {} and to_train.traffic.maxima()["received_bytes_max"] == 0


def test_data_major_expert_order_would_move_whole_shards(setup):
  # With 'expert' over (data, fsdp) device (d, f) would train on expert 4d + f, inside its generation
  # shard {2f, 2f + 1} only for devices (0, 0) and (1, 3): the six others receive their whole 8192 B.
  mesh = setup[0]
  axes, abstract = param_logical_axes(CFG), abstract_params(CFG)
  data_major = tuple((n, ("data", "fsdp") if n == "expert" else a) for n, a in TRAIN_RULES)
  for rules, expected in ((TRAIN_RULES, [4096] * 8), (data_major, [4096] * 2 + [8192] * 6)):
    src = param_shardings(abstract, axes, mesh, rules)["layers"]["moe"]["experts"]["gate_proj"]
    dst = param_shardings(abstract, axes, mesh, GENERATE_RULES)["layers"]["moe"]["experts"]["gate_proj"]
    received = {d: r for d, r, _ in leaf_traffic((2, 8, 32, 16), 4, src, dst)}
    assert sorted(received.values()) == expected


def test_unchanged_layout_and_host_sources():
  mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
  s = param_shardings(abstract_params(CFG), param_logical_axes(CFG), mesh, TRAIN_RULES)["embed"]["embedding"]
  assert leaf_traffic((64, 32), 4, s, s) == ()
  # a host array is held by no device: each device receives its whole shard (64 * 32 * 4 / 4 fsdp shards)
  assert {r for _, r, _ in leaf_traffic((64, 32), 4, None, s)} == {2048}
