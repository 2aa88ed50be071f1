"""MoE decoder blocks against a per-token numpy reference: routing, experts, shared expert, router aux
losses computed by hand; dropless implementations agree; capacity routing drops what it should; mixed
dense/sparse stacks; Qwen3 q/k norm; bad configs fail naming the field."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models import decoder, moe


def moe_cfg(**over):
  base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, model_type="qwen2_moe",
              qkv_bias=True, shared_expert_intermediate_size=24)
  base.update(over)
  return ModelConfig(**base)


def _silu(x):
  return x / (1.0 + np.exp(-x))


def reference_block(p, x_td, k, renormalize, capacity=None):
  """One sparse block in numpy, token by token: the HF formulas written out."""
  out = np.zeros_like(x_td)
  counts = np.zeros(p["router"].shape[1], int)
  kept = np.ones((x_td.shape[0], k), bool)
  choices = []
  for t, x in enumerate(x_td):
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    top = np.argsort(-probs, kind="stable")[:k]
    w = probs[top] / (probs[top].sum() if renormalize else 1.0)
    choices.append((top, w))
  order = [(j, t) for j in range(k) for t in range(len(x_td))]     # top-1 choices first, then top-2
  for j, t in order:
    e = choices[t][0][j]
    if capacity is not None and counts[e] >= capacity:
      kept[t, j] = False
      continue
    counts[e] += 1
    x = x_td[t]
    ex = p["experts"]
    h = _silu(x @ ex["gate_proj"][e]) * (x @ ex["up_proj"][e])
    out[t] += choices[t][1][j] * (h @ ex["down_proj"][e])
  if "shared_expert" in p:
    se = p["shared_expert"]
    h = _silu(x_td @ se["gate_proj"]["kernel"]) * (x_td @ se["up_proj"]["kernel"])
    gate = 1.0 / (1.0 + np.exp(-(x_td @ p["shared_expert_gate"])))
    out += gate * (h @ se["down_proj"]["kernel"])
  return out, kept


def _block(cfg, seed=0):
  params = decoder.init_params(cfg, jax.random.key(seed), init_std=0.3)
  model = decoder.bind(cfg, params)
  host = jax.tree.map(lambda a: np.asarray(a[0], np.float64), params["layers"]["moe"])
  return model.layer(0).moe, host


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot"])
@pytest.mark.parametrize("renormalize,shared", [(False, 24), (True, 0)])
def test_dropless_block_matches_the_per_token_reference(impl, renormalize, shared):
  cfg = moe_cfg(moe_impl=impl, norm_topk_prob=renormalize, shared_expert_intermediate_size=shared)
  block, host = _block(cfg)
  x_btd = jax.random.normal(jax.random.key(1), (2, 9, 32))
  y_btd, aux = jax.jit(lambda x: block(x))(x_btd)
  want, _ = reference_block(host, np.asarray(x_btd, np.float64).reshape(18, 32), 2, renormalize)
  np.testing.assert_allclose(np.asarray(y_btd).reshape(18, 32), want, rtol=2e-5, atol=2e-5)
  assert float(aux["dropped_fraction"]) == 0.0


def test_router_aux_by_hand():
  """Two tokens, four experts, top-1: the load-balance and z losses and the per-expert load, by hand."""
  logits_te = jnp.array([[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]])
  _, idx_tk = moe.route(logits_te, 1, False)
  aux = moe.router_aux(logits_te, idx_tk, None, jnp.ones((2,)))
  p0 = np.exp([2.0, 0, 0, 0]) / np.exp([2.0, 0, 0, 0]).sum()
  p1 = np.exp([0, 0, 3.0, 0]) / np.exp([0, 0, 3.0, 0]).sum()
  frac = np.array([0.5, 0.0, 0.5, 0.0])            # expert 0 takes token 0, expert 2 token 1
  mean_p = (p0 + p1) / 2
  np.testing.assert_allclose(float(aux["load_balance_loss"]), 4 * np.sum(frac * mean_p), rtol=1e-6)
  z = (np.log(np.exp([2.0, 0, 0, 0]).sum()) ** 2 + np.log(np.exp([0, 0, 3.0, 0]).sum()) ** 2) / 2
  np.testing.assert_allclose(float(aux["router_z_loss"]), z, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(aux["expert_load"]), frac, rtol=1e-6)
  # A padding token (valid 0) changes nothing.
  logits3 = jnp.concatenate([logits_te, jnp.array([[0.0, 9.0, 0.0, 0.0]])])
  _, idx3 = moe.route(logits3, 1, False)
  aux3 = moe.router_aux(logits3, idx3, None, jnp.array([1.0, 1.0, 0.0]))
  for key in ("load_balance_loss", "router_z_loss", "expert_load"):
    np.testing.assert_allclose(np.asarray(aux3[key]), np.asarray(aux[key]), rtol=1e-6)


def test_uniform_router_gives_the_balanced_load_balance_loss():
  """All logits equal and every expert chosen equally often: E * sum_e (k/E) * (1/E) = k."""
  logits_te = jnp.zeros((8, 4))
  idx_tk = jnp.array([[0, 1], [2, 3]] * 4)
  aux = moe.router_aux(logits_te, idx_tk, None, jnp.ones((8,)))
  np.testing.assert_allclose(float(aux["load_balance_loss"]), 2.0, rtol=1e-6)


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_routing_drops_beyond_capacity_like_the_reference(factor):
  cfg = moe_cfg(moe_capacity_factor=factor, shared_expert_intermediate_size=0)
  block, host = _block(cfg, seed=3)
  x_btd = jax.random.normal(jax.random.key(2), (1, 16, 32))
  y_btd, aux = jax.jit(lambda x: block(x))(x_btd)
  cap = moe.capacity(16, 2, 8, factor)
  want, kept = reference_block(host, np.asarray(x_btd[0], np.float64), 2, False, capacity=cap)
  np.testing.assert_allclose(np.asarray(y_btd[0]), want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(float(aux["dropped_fraction"]), 1.0 - kept.mean(), rtol=1e-6)
  assert factor > 0.9 or kept.mean() < 1.0, "the check would be vacuous: nothing was dropped"


def test_large_capacity_equals_dropless_and_implementations_agree_in_gradients():
  cfg = moe_cfg(num_layers=2)
  params = decoder.init_params(cfg, jax.random.key(0), init_std=0.2)
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 64)

  def loss(c):
    def f(p):
      h, aux = decoder.hidden_with_aux(c, p, tokens)
      return jnp.sum(h ** 2) * 1e-2 + aux["load_balance_loss"] + aux["router_z_loss"]
    return jax.jit(jax.value_and_grad(f))(params)

  runs = {name: loss(dataclasses.replace(cfg, **over)) for name, over in {
      "blocked": dict(moe_impl="blocked"), "ragged": dict(moe_impl="ragged_dot"),
      "capacity": dict(moe_capacity_factor=8.0)}.items()}
  ref_value, ref_grads = runs["blocked"]
  for name in ("ragged", "capacity"):
    value, grads = runs[name]
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
      scale = float(jnp.max(jnp.abs(r))) + 1e-6
      assert float(jnp.max(jnp.abs(g - r))) <= 1e-4 * scale, (name, jax.tree_util.keystr(path))


def test_mixed_dense_and_sparse_layers_follow_the_hf_rule():
  cfg = moe_cfg(num_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
  assert cfg.layer_kinds == ("dense", "moe", "dense", "dense")
  assert cfg.layer_stacks == (("dense_layers", 0), ("layers", 0), ("dense_layers", 1), ("dense_layers", 2))
  shapes = jax.tree.map(lambda a: a.shape, decoder.abstract_params(cfg))
  assert shapes["layers"]["moe"]["experts"]["gate_proj"] == (1, 8, 32, 16)
  assert shapes["dense_layers"]["mlp"]["gate_proj"]["kernel"] == (3, 32, 48)
  # The scanned model equals running block by block in HF order.
  params = decoder.init_params(cfg, jax.random.key(0), init_std=0.2)
  tokens = jax.random.randint(jax.random.key(1), (1, 7), 0, 64)
  model = decoder.bind(cfg, params)
  positions = jnp.arange(7)[None]
  mask = decoder.attention_mask(positions, None)
  x = model.embed_tokens(tokens)
  for i in range(4):
    x = model.layer(i)(x, positions, mask)
  np.testing.assert_allclose(np.asarray(decoder.hidden(cfg, params, tokens)),
                             np.asarray(model.final_norm(x)), rtol=1e-5, atol=1e-6)


def test_qk_norm_normalises_each_head_before_rope():
  cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=32, model_type="qwen3", qk_norm=True)
  params = decoder.init_params(cfg, jax.random.key(0), init_std=0.3)
  params["layers"]["attn"]["q_norm"]["scale"] = jnp.full((1, 8), 2.0)
  attn = decoder.bind(cfg, params).layer(0).attn
  x = jax.random.normal(jax.random.key(1), (1, 3, 16))
  q, _, _ = attn.qkv(x, jnp.zeros((1, 3), jnp.int32))     # position 0: RoPE is the identity
  raw = np.einsum("btd,dnh->btnh", np.asarray(x), np.asarray(params["layers"]["attn"]["q_proj"]["kernel"][0]))
  want = 2.0 * raw / np.sqrt(np.mean(raw ** 2, axis=-1, keepdims=True) + cfg.rms_norm_eps)
  np.testing.assert_allclose(np.asarray(q), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("over,field", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(moe_capacity_factor=0.0), "moe_capacity_factor"),
    (dict(moe_capacity_factor=-1.0), "moe_capacity_factor"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(mlp_only_layers=(5,)), "mlp_only_layers"),
    (dict(moe_impl="megablocks"), "moe_impl"),
    (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef"),
])
def test_bad_moe_config_names_the_field(over, field):
  with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
    moe_cfg(**over)


def test_blocked_block_size_stays_in_range():
  assert moe.block_size(1, 8) == 8
  assert moe.block_size(4096, 16) == 128
  assert moe.block_size(1 << 20, 4) == 256
