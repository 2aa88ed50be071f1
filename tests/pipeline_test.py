"""Pipeline parallelism over the 'stage' axis (sharding/pipeline.py) on 8 virtual CPU devices.

Meshes (stage=2, data=2, fsdp=2) and (stage=4, data=2); a dense and a tiny Qwen3-MoE model of 4 layers
(8 experts over data x fsdp under TRAIN_RULES; on the stage-2 mesh the MoE computes its experts
expert-parallel inside each stage, as the programs wrap it, on the stage-4 mesh under GSPMD). References
run unpipelined on one device: the hidden states, router aux and gradients of ``decoder.hidden_with_aux``,
and for the MoE load-balance loss the token-weighted mean of its value on each pipeline micro-batch alone
(pipelined_hidden's documented meaning). Float32 throughout; the pipeline sums in other orders, hence
tolerances of ~1e-5 relative.
"""
import dataclasses
import gc
import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_fusion_jax import models
from rl_fusion_jax import shared_programs
from rl_fusion_jax.config import AlgoConfig, MeshConfig, OptimConfig, experiment_from_dict
from rl_fusion_jax.models import decoder
from rl_fusion_jax.sharding import expert_parallel, memory, pipeline
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.reshard import Phase, make_layouts, to_phase
from rl_fusion_jax.sharding.rules import GENERATE_RULES, TRAIN_RULES, param_shardings
from rl_fusion_jax.train import packed_step
from rl_fusion_jax.train import state as state_lib

DENSE = models.ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                           intermediate_size=48, qkv_bias=True)
MOE = models.ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                         intermediate_size=48, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                         model_type="qwen3_moe", qk_norm=True)
MESHES = {"stage2_data2_fsdp2": (MeshConfig(stage=2, data=2, fsdp=2), 2),    # (mesh, pipeline pieces)
          "stage4_data2": (MeshConfig(stage=4, data=2), 4)}
B, T = 16, 10
RTOL, ATOL = 1e-5, 1e-6
# Loss weights of the router aux keys that are token means (exact under the pipeline).
AUX_COEF = {"router_z_loss": 0.1, "expert_load": 0.3, "dropped_fraction": 1.0}


def packed_inputs(seed: int, rows: int = B, width: int = T):
  """Rows of two samples each (positions restart, segment ids 1 and 2) and trailing padding (id 0)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 64, (rows, width)).astype(np.int32)
  first = rng.integers(2, width // 2 + 1, rows)
  second = rng.integers(1, width - first + 1)
  col = np.arange(width)[None]
  segments = np.where(col < first[:, None], 1, np.where(col < (first + second)[:, None], 2, 0))
  positions = np.where(segments == 2, col - first[:, None], np.where(segments == 1, col, 0))
  return tuple(jnp.asarray(x, jnp.int32) for x in (tokens, positions, segments))


def readout(cfg, h_btd, aux, seed=7):
  """A scalar mixing every hidden entry (fixed random weights) and the exact aux keys."""
  w_btd = jax.random.normal(jax.random.key(seed), h_btd.shape, jnp.float32) / h_btd.size ** 0.5
  return jnp.sum(h_btd * w_btd) + sum(c * jnp.sum(aux[k]) for k, c in AUX_COEF.items() if k in aux)


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
  """(cfg, host params, inputs, reference (loss, hidden, aux, grads) on one device)."""
  cfg = {"dense": DENSE, "moe": MOE}[request.param]
  params = jax.device_get(models.init_params(cfg, jax.random.key(0), init_std=0.3))
  inputs = packed_inputs(1)

  def loss(p):
    h, aux = decoder.hidden_with_aux(cfg, p, inputs[0], positions_bt=inputs[1], segment_ids_bt=inputs[2])
    return readout(cfg, h, aux), (h, aux)

  (value, (h, aux)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return cfg, params, inputs, jax.device_get((value, h, aux, grads))


def micro_batch_load_balance(cfg, params, inputs, pieces):
  """Token-weighted mean over pipeline micro-batches (rows m, m + M, ...) of each one's load-balance loss."""
  fn = jax.jit(lambda p, t, pos, seg: decoder.hidden_with_aux(cfg, p, t, positions_bt=pos,
                                                              segment_ids_bt=seg)[1])
  tokens = np.array([np.sum(np.asarray(inputs[2])[m::pieces] != 0) for m in range(pieces)], np.float64)
  values = [float(fn(params, *(x[m::pieces] for x in inputs))["load_balance_loss"]) for m in range(pieces)]
  return float(np.dot(tokens / tokens.sum(), values))


def assert_close_per_leaf(got, want):
  # Relative to each leaf's largest entry: other summation orders move small entries by more than RTOL
  # of themselves (float32 activations of order 1 differ by ~1e-6 absolute).
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    scale = float(np.max(np.abs(b)))
    assert float(np.max(np.abs(np.asarray(a) - b))) <= RTOL * scale + ATOL, jax.tree_util.keystr(path)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_pipelined_hidden_aux_and_gradients_equal_unpipelined(model, mesh_name):
  cfg, params, inputs, (want_loss, want_h, want_aux, want_grads) = model
  mesh_cfg, pieces = MESHES[mesh_name]
  mesh = make_mesh(mesh_cfg)
  shardings = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  assert shardings["layers"]["attn"]["q_proj"]["kernel"].spec[0] == "stage"
  sharded = jax.device_put(params, shardings)

  def loss(p):
    h, aux = pipeline.pipelined_hidden(cfg, p, *inputs, mesh=mesh, num_micro=pieces)
    return readout(cfg, h, aux), (h, aux)

  if mesh_name.startswith("stage2"):   # the programs' expert-parallel wrapper: EP inside each stage
    loss = expert_parallel.with_expert_parallel(loss, cfg, mesh, TRAIN_RULES)
  (value, (h, aux)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(sharded)
  assert_close_per_leaf(np.asarray(h), want_h)
  np.testing.assert_allclose(float(value), float(want_loss), rtol=RTOL)
  assert set(aux) == set(want_aux)
  for key in AUX_COEF.keys() & set(aux):
    assert_close_per_leaf(np.asarray(aux[key]), want_aux[key])
  if cfg.is_moe:
    np.testing.assert_allclose(float(aux["load_balance_loss"]),
                               micro_batch_load_balance(cfg, params, inputs, pieces), rtol=RTOL)
  assert_close_per_leaf(jax.device_get(grads), want_grads)
  last_layer = want_grads["layers"]["attn"]["q_proj"]["kernel"][-1]
  assert float(np.max(np.abs(last_layer))) > 1e-3   # the last stage's layers get gradients too


def test_schedule_counts_the_gpipe_bubble():
  s = pipeline.Schedule(stages=4, micro=6)
  assert s.iterations == 9 and s.idle_slots == 4 * 3
  assert s.bubble_fraction == pytest.approx(3 / 9)
  table = s.table()
  assert list(table[:, 0]) == [0, 1, 2, 3, 4, 5, -1, -1, -1]
  assert list(table[:, 3]) == [-1] * 3 + list(range(6))
  assert all(sorted(table[:, st][table[:, st] >= 0]) == list(range(6)) for st in range(4))


# ----------------------------------------------------------------------------------------------------
# The packed RL step on a stage=2 mesh: the unpipelined step's update, one compile.
# ----------------------------------------------------------------------------------------------------

def packed_batch(mesh, seed):
  tokens, positions, segments = (np.asarray(x) for x in packed_inputs(seed))
  rng = np.random.default_rng(seed)
  mask = ((segments > 0) & (positions >= 1)).astype(np.float32)
  fields = dict(tokens_rw=tokens, positions_rw=positions, segment_ids_rw=segments, mask_rw=mask,
                advantages_rw=(rng.normal(size=(B, 1)) * (segments == 1)
                               + rng.normal(size=(B, 1)) * (segments == 2)).astype(np.float32) * mask,
                behaviour_logp_rw=(rng.normal(size=(B, T)) * 0.1 - 4).astype(np.float32) * mask,
                ref_logp_rw=(rng.normal(size=(B, T)) * 0.3 - 4).astype(np.float32) * mask,
                version_rw=np.where(mask > 0, seed, -1).astype(np.int32))
  return jax.device_put(packed_step.PackedTrainBatch(**fields), packed_step.packed_batch_shardings(mesh))


def make_step(mesh_cfg, tx):
  mesh = make_mesh(mesh_cfg)
  abstract = models.abstract_params(DENSE)
  psh = param_shardings(abstract, models.param_logical_axes(DENSE), mesh, TRAIN_RULES)
  ssh = state_lib.state_shardings(tx, abstract, psh, mesh)
  new_state = lambda: state_lib.create_train_state(
      jax.device_put(models.init_params(DENSE, jax.random.key(0), init_std=0.3), psh), tx, ssh)
  step = packed_step.make_packed_rl_step(DENSE, AlgoConfig(kl_coef=0.1), 1.0, tx, 1, mesh, T, ssh)
  return mesh, new_state, step


def test_packed_step_on_stages_is_the_unpipelined_update_and_compiles_once():
  shared_programs.clear()   # count this test's own traces: none shared from earlier tests
  tx = optax.sgd(1.0)     # params after one step are init - gradient
  mesh, new_state, step = make_step(MeshConfig(stage=2, data=2, fsdp=2), tx)
  ref_mesh, ref_state, ref_step = make_step(MeshConfig(data=2, fsdp=4), tx)
  init = jax.device_get(new_state().params)
  state, want_state = new_state(), ref_state()
  for seed in (3, 4):     # different contents, same shapes: no second compile
    state, metrics = step(state, packed_batch(mesh, seed))
    want_state, want = ref_step(want_state, packed_batch(ref_mesh, seed))
    assert set(metrics) == set(want) and float(metrics["nonfinite"]) == 0.0
    for name in want:
      np.testing.assert_allclose(float(metrics[name]), float(want[name]), rtol=RTOL, atol=ATOL, err_msg=name)
    if seed == 3:
      assert_close_per_leaf(jax.tree.map(lambda a, b: a - b, jax.device_get(state.params), init),
                            jax.tree.map(lambda a, b: a - b, jax.device_get(want_state.params), init))
  assert step._cache_size() == 1 and int(state.policy_version) == 2


# ----------------------------------------------------------------------------------------------------
# The phase switch with the layers over 'stage' in training and on every device while generating.
# ----------------------------------------------------------------------------------------------------

def test_switch_gathers_the_stages_within_one_bucket_and_round_trips_bit_exactly():
  mesh = make_mesh(MeshConfig(stage=2, data=2, fsdp=2))
  tx = state_lib.make_optimizer(OptimConfig(learning_rate=1e-3))
  abstract, axes = models.abstract_params(DENSE), models.param_logical_axes(DENSE)
  layouts = make_layouts(mesh, abstract, axes, tx)
  train = layouts.params[Phase.TRAIN]
  shardings = state_lib.state_shardings(tx, abstract, train, mesh)
  state = state_lib.create_train_state(jax.device_put(models.init_params(DENSE, jax.random.key(2)), train),
                                       tx, shardings)
  state = state.replace(opt_state=jax.tree.map(lambda x: x + 1 if x.ndim else x, state.opt_state))
  expected = jax.device_get((state.params, state.opt_state))
  gen = param_shardings(abstract, axes, mesh, GENERATE_RULES)
  assert gen["layers"]["mlp"]["up_proj"]["kernel"].spec[0] is None
  bucket = 8192     # the largest destination shard: a stacked MLP kernel [4, 32, 48] float32 over tensor=1
  gc.collect()
  state, to_gen = to_phase(state, Phase.GENERATE, layouts=layouts, bucket_bytes=bucket)
  for x, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(gen)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  state, to_train = to_phase(state, Phase.TRAIN, layouts=layouts, bucket_bytes=bucket)
  for stats in (to_gen, to_train):
    before, after = memory.per_device(stats.before), memory.per_device(stats.after)
    assert stats.largest_bucket_bytes <= 4 * 32 * 48 * 4 and stats.buckets > 2
    assert all(stats.peak_per_device[d] <= max(before[d], after[d]) + stats.largest_bucket_bytes
               for d in before)
  for e, x, s in zip(jax.tree.leaves(expected), jax.tree.leaves((state.params, state.opt_state)),
                     jax.tree.leaves((train, shardings.opt_state))):
    assert np.array_equal(e, np.asarray(x)) and x.sharding.is_equivalent_to(s, x.ndim)


# ----------------------------------------------------------------------------------------------------
# Bad input fails before any compile, naming the field.
# ----------------------------------------------------------------------------------------------------

def test_bad_pipelines_fail_naming_the_fields():
  mesh = make_mesh(MeshConfig(stage=2, data=2, fsdp=2))
  tokens, positions, segments = packed_inputs(0)
  with pytest.raises(ValueError, match=r"model.num_layers=3 does not divide over mesh.stage=2"):
    pipeline.check_pipeline(dataclasses.replace(DENSE, num_layers=3), 2, 2)
  mixed = dataclasses.replace(MOE, mlp_only_layers=(0,))
  with pytest.raises(ValueError, match=r"model.mlp_only_layers=\(0,\).*mix dense and sparse.*mesh.stage=2"):
    pipeline.check_pipeline(mixed, 2, 2)
  with pytest.raises(ValueError, match=r"optim.pipeline_micro_batches=1 is fewer than mesh.stage=2"):
    pipeline.pipelined_hidden(DENSE, None, tokens, positions, segments, mesh=mesh, num_micro=1)
  with pytest.raises(ValueError, match=r"16 rows do not split into optim.pipeline_micro_batches=8 .*=4"):
    pipeline.pipelined_hidden(DENSE, None, tokens, positions, segments, mesh=mesh, num_micro=8)
  with pytest.raises(ValueError, match="mesh.stage"):
    MeshConfig(stage=0)


def test_experiment_config_checks_the_pipeline_at_start():
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "configs", "arithmetic.py")
  c = runpy.run_path(path)["get_config"]("").to_dict()    # 4 layers, 128 sequences, micro_batches=1
  c["mesh"].update(stage=2, data=2, fsdp=2)
  with pytest.raises(ValueError, match=r"config.mesh.stage: 2 pipeline stages .* set optim.pack_rows=True"):
    experiment_from_dict(c).check_devices(8)
  c["optim"]["pack_rows"] = True
  assert experiment_from_dict(c).check_devices(8) == {"stage": 2, "data": 2, "fsdp": 2, "tensor": 1}
  c["optim"]["pipeline_micro_batches"] = 1
  with pytest.raises(ValueError, match=r"config.optim.pipeline_micro_batches=1 is fewer than mesh.stage=2"):
    experiment_from_dict(c).check_devices(8)
  c["optim"]["pipeline_micro_batches"] = 64
  with pytest.raises(ValueError, match=r"config.optim.pipeline_micro_batches: .*128 sequences .*64 pipeline"):
    experiment_from_dict(c).check_devices(8)
  c["optim"]["pipeline_micro_batches"] = 0
  c["model"]["num_layers"] = 3
  with pytest.raises(ValueError, match=r"config.model.num_layers=3 does not divide over mesh.stage=2"):
    experiment_from_dict(c).check_devices(8)
