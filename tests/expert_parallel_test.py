"""Expert parallelism (sharding/expert_parallel.py) on 8 virtual CPU devices against one device.

Model: Qwen2-MoE style, vocab 64, hidden 32, 2 sparse layers, 4 heads / 2 KV heads, 8 experts top-2 with
intermediate 16, a shared expert of 24, QKV bias, q/k norm, init std 0.2, float32. Tokens [8, 6] with
padding (segment 0) at the ends of two rows, so the router aux runs over a mask.

Per device, each mesh runs E / ep experts with F / tp columns (E = 8, F = 16; fsdp before data in the
training rule, so ep counts both axes there):
  TRAIN_RULES, (data=2, fsdp=4, tensor=1): ep = 8, tp = 1 -> local expert weights [1, 32, 16]
  TRAIN_RULES, (data=2, fsdp=2, tensor=2): ep = 4, tp = 2 -> [2, 32, 8]
  GENERATE_RULES, (data=2, fsdp=2, tensor=2): ep = fsdp = 2, tp = 2 -> [4, 32, 8]
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.models import ModelConfig, abstract_params, decoder, init_cache, moe, param_logical_axes
from rl_fusion_jax.models.kv_cache import forward_with_cache
from rl_fusion_jax.sharding import expert_parallel as ep_lib
from rl_fusion_jax.sharding.mesh import batch_sharding, make_mesh, replicated
from rl_fusion_jax.sharding.rules import GENERATE_RULES, TRAIN_RULES, cache_sharding, param_shardings

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, model_type="qwen2_moe",
                  qk_norm=True, shared_expert_intermediate_size=24, qkv_bias=True, router_z_loss_coef=0.01)
CASES = {"train_2x4x1": ((2, 4, 1), TRAIN_RULES, (1, 32, 16)),
         "train_2x2x2": ((2, 2, 2), TRAIN_RULES, (2, 32, 8)),
         "generate_2x2x2": ((2, 2, 2), GENERATE_RULES, (4, 32, 8))}


def _mesh(data, fsdp, tensor):
  return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))


def _loss(params, tokens_bt, segments_bt):
  """Mean next-token NLL over the non-padding tokens + the router's load-balance and z losses."""
  h_btd, aux = decoder.hidden_with_aux(CFG, params, tokens_bt, segment_ids_bt=segments_bt)
  logits_btv = decoder.bind(CFG, params).head(h_btd)
  logp_bt = jnp.take_along_axis(jax.nn.log_softmax(logits_btv[:, :-1]), tokens_bt[:, 1:, None], -1)[..., 0]
  mask_bt = (segments_bt[:, 1:] != 0).astype(jnp.float32)
  nll = -jnp.sum(logp_bt * mask_bt) / jnp.sum(mask_bt)
  loss = nll + CFG.router_aux_loss_coef * 10 * aux["load_balance_loss"] + CFG.router_z_loss_coef * aux[
      "router_z_loss"]
  return loss, (h_btd, logits_btv, aux)


_VALUE_AND_GRAD = jax.value_and_grad(_loss, has_aux=True)


@pytest.fixture(scope="module")
def data():
  params = init_params_f32()
  tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, CFG.vocab_size)
  segments = jnp.ones((8, 6), jnp.int32).at[2, 4:].set(0).at[5, 3:].set(0)
  reference = jax.tree.map(np.asarray, jax.jit(_VALUE_AND_GRAD)(params, tokens, segments))
  return params, tokens, segments, reference


def init_params_f32():
  return decoder.init_params(CFG, jax.random.key(0), init_std=0.2)


def _close(got, want, rtol=1e-5):
  """Every leaf within rtol of the reference, relative to the leaf's largest magnitude."""
  for path, g, w in zip(*zip(*jax.tree_util.tree_flatten_with_path(want)[0]), jax.tree.leaves(got)):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype, jax.tree_util.keystr(path)
    err = float(np.max(np.abs(g - w), initial=0.0))
    assert err <= rtol * float(np.max(np.abs(w), initial=0.0)) + 1e-12, (jax.tree_util.keystr(path), err)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_forward_and_grads_equal_one_device(data, case, monkeypatch):
  params, tokens, segments, reference = data
  shape, rules, local_shape = CASES[case]
  mesh = _mesh(*shape)
  ps = param_shardings(abstract_params(CFG), param_logical_axes(CFG), mesh, rules)
  rows = batch_sharding(mesh, 2)
  seen = []   # the expert weights each grouped_ffn call gets, at trace time (inside the shard_map)
  grouped = moe.grouped_ffn
  monkeypatch.setattr(moe, "grouped_ffn", lambda *a, **k: (seen.append(a[2].shape), grouped(*a, **k))[1])
  out_shardings = ((replicated(mesh), (batch_sharding(mesh, 3), batch_sharding(mesh, 3), replicated(mesh))), ps)
  fn = jax.jit(ep_lib.with_expert_parallel(_VALUE_AND_GRAD, CFG, mesh, rules), in_shardings=(ps, rows, rows),
               out_shardings=out_shardings)
  compiled = fn.lower(params, tokens, segments).compile()
  # grouped_ffn (traced once for the scanned sparse layers) gets only the device's own E / ep experts,
  # F / tp columns each
  assert seen and set(seen) == {local_shape}
  # No device ever holds a whole expert stack: no [E, D, F] / [E, F, D] array in the per-device program
  # (GSPMD alone, without the override, gathers exactly these).
  hlo = compiled.as_text()
  assert not re.search(r"\[(2,)?8,(32,16|16,32)\]", hlo)
  got = compiled(jax.device_put(params, ps), jax.device_put(tokens, rows), jax.device_put(segments, rows))
  _close(got, reference)


def test_generation_prefill_and_decode_equal_one_device(data):
  params, tokens, _, _ = data
  mesh = _mesh(2, 2, 2)
  ps = param_shardings(abstract_params(CFG), param_logical_axes(CFG), mesh, GENERATE_RULES)
  cs = cache_sharding(CFG, mesh, GENERATE_RULES)
  positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (8, 6))

  def prefill_and_decode(params, tokens, cache):
    logits, cache = forward_with_cache(CFG, params, tokens, positions, cache)
    step = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
    logits_1, cache = forward_with_cache(CFG, params, step, jnp.full((8, 1), 6, jnp.int32), cache)
    return logits, logits_1, cache

  cache = init_cache(CFG, 8, 8)
  want = jax.tree.map(np.asarray, jax.jit(prefill_and_decode)(params, tokens, cache))
  fn = jax.jit(ep_lib.with_expert_parallel(prefill_and_decode, CFG, mesh, GENERATE_RULES),
               in_shardings=(ps, batch_sharding(mesh, 2), {"k": cs, "v": cs}))
  got = fn(jax.device_put(params, ps), jax.device_put(tokens, batch_sharding(mesh, 2)),
           jax.device_put(cache, {"k": cs, "v": cs}))
  _close(got, want)


def test_local_assignments_by_hand():
  # experts 2 and 3 are local (first 2, two local): flat assignments n = 2 * token + choice
  #   ids [0, 3, 1, 2, 3, 0] -> local key [pad, 1, pad, 0, 1, pad]; stable sort -> n = 3, 1, 4, then pads
  idx_gk = jnp.array([[0, 3], [1, 2], [3, 0]], jnp.int32)
  order, experts, valid, sizes = ep_lib.local_assignments(idx_gk, 2, 2)
  assert order.tolist() == [3, 1, 4, 0, 2, 5]        # 3 tokens * min(k=2, 2 local) = 6 rows
  assert experts.tolist() == [0, 1, 1, 1, 1, 1]       # pads clipped to the last local expert
  assert valid.tolist() == [True, True, True, False, False, False]
  assert sizes.tolist() == [1, 2]
  # one local expert: 3 * min(2, 1) = 3 rows, the one local assignment first
  order, experts, valid, sizes = ep_lib.local_assignments(idx_gk, 1, 1)
  assert order.tolist()[:1] == [2] and valid.tolist() == [True, False, False] and sizes.tolist() == [1]


def _untraceable(*args):
  raise AssertionError("traced")


def test_noop_for_dense_capacity_and_unsplit_experts():
  mesh = _mesh(2, 4, 1)
  dense = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=48)
  assert ep_lib.with_expert_parallel(_untraceable, dense, mesh, TRAIN_RULES) is _untraceable
  capacity = ModelConfig(**{**_fields(CFG), "moe_capacity_factor": 1.25})
  assert ep_lib.with_expert_parallel(_untraceable, capacity, mesh, TRAIN_RULES) is _untraceable
  unsplit = _with(TRAIN_RULES, expert=None, moe_mlp=None)
  assert ep_lib.with_expert_parallel(_untraceable, CFG, mesh, unsplit) is _untraceable
  assert ep_lib.with_expert_parallel(_untraceable, CFG, mesh, TRAIN_RULES) is not _untraceable


def _fields(cfg):
  return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def _with(rules, **entries):
  return tuple((name, entries.get(name, axes)) for name, axes in rules)


@pytest.mark.parametrize("field, value, shape, rules, message", [
    ("num_experts", 6, (2, 4, 1), TRAIN_RULES, r"model.num_experts=6 .*mesh.fsdp=4 x mesh.data=2"),
    ("num_experts", 6, (2, 4, 1), GENERATE_RULES, r"model.num_experts=6 .*mesh.fsdp=4"),
    ("moe_intermediate_size", 15, (2, 2, 2), TRAIN_RULES, r"model.moe_intermediate_size=15 .*mesh.tensor=2"),
])
def test_indivisible_sizes_fail_before_tracing(field, value, shape, rules, message):
  cfg = ModelConfig(**{**_fields(CFG), field: value})
  with pytest.raises(ValueError, match=message):
    ep_lib.with_expert_parallel(_untraceable, cfg, _mesh(*shape), rules)


@pytest.mark.parametrize("entries, message", [
    ({"expert": "tensor", "moe_mlp": None}, r"rule 'expert' .*\('tensor',\).*batch axes"),
    ({"expert": "fsdp", "moe_mlp": "data"}, r"rule 'moe_mlp' .*\('data',\).*not be batch axes"),
])
def test_expert_axes_must_be_batch_axes(entries, message):
  with pytest.raises(ValueError, match=message):
    ep_lib.with_expert_parallel(_untraceable, CFG, _mesh(2, 2, 2), _with(TRAIN_RULES, **entries))
