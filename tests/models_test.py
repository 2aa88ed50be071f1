"""Decoder behaviour that needs no checkpoint: causality, packing, KV cache, param metadata, config checks.

Numerical agreement with transformers is tested in hf_io_test.py; here `forward` (validated there) is
the reference for the cached path.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax import models
from rl_fusion_jax.models import decoder, kv_cache, layers

CFG = models.ModelConfig(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, qkv_bias=True, rope_theta=10000.0)
FORWARD = jax.jit(models.forward, static_argnums=0)
CACHED = jax.jit(models.forward_with_cache, static_argnums=0, donate_argnums=4)
AXIS_NAMES = {"vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "norm", "layers", None}


@pytest.fixture(scope="module")
def params():
  """Random params with biases and norm scales moved off 0 and 1, so every parameter matters."""
  rng = np.random.default_rng(1)  # numpy noise: no per-shape random kernels to compile
  base = models.init_params(CFG, jax.random.key(0), init_std=0.2)
  return jax.tree.map(lambda x: x + jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), base)


def _tokens(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, size=shape), jnp.int32)


def test_forward_is_causal(params):
  tokens = _tokens((2, 10), 0)  # [2, 10] like the full forward of the cache test: one compile
  changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % CFG.vocab_size)
  a, b = np.asarray(FORWARD(CFG, params, tokens)), np.asarray(FORWARD(CFG, params, changed))
  assert a.shape == (2, 10, CFG.vocab_size) and a.dtype == np.float32
  np.testing.assert_array_equal(a[:, :5], b[:, :5])  # earlier positions never see token 5
  assert np.abs(a[:, 5:] - b[:, 5:]).min(axis=-1).max() > 1e-3  # later ones do


def test_segment_ids_isolate_packed_sequences(params):
  seq_a, seq_b = _tokens((5,), 1), _tokens((4,), 2)
  pad = jnp.zeros((1,), jnp.int32)
  # Row 0 packs a|b|pad, row 1 packs b|a|pad; positions restart at 0 per segment, padding is segment 0.
  packed = jnp.stack([jnp.concatenate([seq_a, seq_b, pad]), jnp.concatenate([seq_b, seq_a, pad])])
  positions = jnp.asarray([list(range(5)) + list(range(4)) + [0], list(range(4)) + list(range(5)) + [0]])
  segments = jnp.asarray([[1] * 5 + [2] * 4 + [0], [1] * 4 + [2] * 5 + [0]])
  got = np.asarray(FORWARD(CFG, params, packed, positions_bt=positions, segment_ids_bt=segments))
  # Separately: each sequence alone at the start of a row (trailing tokens cannot affect it: causal).
  # Explicit arange positions and a single segment keep the call signature, so nothing recompiles.
  arange, ones = jnp.broadcast_to(jnp.arange(10), (2, 10)), jnp.ones((2, 10), jnp.int32)
  alone = np.asarray(FORWARD(CFG, params, packed, positions_bt=arange, segment_ids_bt=ones))
  np.testing.assert_allclose(got[0, :5], alone[0, :5], atol=1e-5)
  np.testing.assert_allclose(got[0, 5:9], alone[1, :4], atol=1e-5)
  np.testing.assert_allclose(got[1, :4], alone[1, :4], atol=1e-5)
  np.testing.assert_allclose(got[1, 4:9], alone[0, :5], atol=1e-5)
  # Without segment ids the second sequence would see the first: the mask is what isolates them.
  mixed = np.asarray(FORWARD(CFG, params, packed, positions_bt=positions, segment_ids_bt=ones))
  assert np.abs(mixed[0, 5:9] - alone[1, :4]).max() > 1e-3


def _greedy_with_cache(params, prompt_bp, prompt_len_b, steps, max_len):
  """Prefill then `steps` greedy decode steps; returns generated tokens [B, steps] and logits per step."""
  batch, width = prompt_bp.shape
  cache = models.init_cache(CFG, batch, max_len)
  first_k = cache["k"]
  prefill_bpv, cache = CACHED(CFG, params, prompt_bp, jnp.broadcast_to(jnp.arange(width), (batch, width)), cache)
  assert first_k.is_deleted()  # the cache really was donated
  step_logits = [prefill_bpv[jnp.arange(batch), prompt_len_b - 1]]
  generated = []
  for j in range(steps):
    next_b = jnp.argmax(step_logits[-1], axis=-1).astype(jnp.int32)
    generated.append(next_b)
    logits_b1v, cache = CACHED(CFG, params, next_b[:, None], (prompt_len_b + j)[:, None], cache)
    step_logits.append(logits_b1v[:, 0])
  return np.asarray(prefill_bpv), jnp.stack(generated, axis=1), np.stack(step_logits, axis=1), cache


def test_cache_prefill_and_decode_match_full_forward(params):
  prompt_len_b = jnp.asarray([6, 3], jnp.int32)
  prompt_bp = _tokens((2, 6), 3).at[1, 3:].set(0)  # row 1 is right-padded after 3 tokens
  steps = 4
  prefill_bpv, gen_bn, step_bnv, _ = _greedy_with_cache(params, prompt_bp, prompt_len_b, steps, max_len=16)
  # Full sequences prompt + generated, right-padded to one width (padding after a token cannot affect it).
  rows = [jnp.concatenate([prompt_bp[b, :int(prompt_len_b[b])], gen_bn[b]]) for b in range(2)]
  full_btv = np.asarray(FORWARD(CFG, params, jnp.stack([jnp.pad(r, (0, 6 + steps - len(r))) for r in rows])))
  for b in range(2):
    n = int(prompt_len_b[b])
    np.testing.assert_allclose(prefill_bpv[b, :n], full_btv[b, :n], atol=1e-5)
    # step j's logits belong to position n - 1 + j (j=0: last prompt token, j>0: generated token j-1).
    np.testing.assert_allclose(step_bnv[b], full_btv[b, n - 1:n + steps], atol=1e-5)


def test_cache_writes_out_of_range_positions_nowhere(params):
  cache = models.init_cache(CFG, 2, 16)
  _, cache = CACHED(CFG, params, _tokens((2, 6), 4), jnp.broadcast_to(jnp.arange(6), (2, 6)), cache)
  before = jax.tree.map(np.asarray, cache)
  _, cache = CACHED(CFG, params, _tokens((2, 1), 5), jnp.asarray([[16], [-1]]), cache)
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, cache))


def test_cache_is_written_in_the_layout_attention_reads(params):
  # Token (b, t) at position p lands in cache[l, b, :, p] ([L, B, K, S, H]) and nowhere else.
  positions_bt = jnp.asarray([[0, 1, 2, 3], [5, 7, 9, 11]])
  _, cache = CACHED(CFG, params, _tokens((2, 4), 6), positions_bt, models.init_cache(CFG, 2, 16))
  for name in ("k", "v"):
    written_bs = np.abs(np.asarray(cache[name])).max(axis=(0, 2, 4)) > 0
    expected_bs = np.zeros((2, 16), bool)
    expected_bs[0, :4] = expected_bs[1, [5, 7, 9, 11]] = True
    np.testing.assert_array_equal(written_bs, expected_bs)
  # The newest position's k equals the projection of that token computed without a cache.
  model = decoder.bind(CFG, params)
  layer0 = model.layer(0)
  _, k_btkh, _ = layer0.attn.qkv(layer0.input_norm(model.embed_tokens(_tokens((2, 4), 6))), positions_bt)
  np.testing.assert_allclose(np.asarray(cache["k"][0, 1, :, 11]), np.asarray(k_btkh[1, 3]), atol=1e-6)


def test_init_cache_shape_and_dtype():
  cache = models.init_cache(CFG, 3, 10, dtype=jnp.bfloat16)
  assert set(cache) == {"k", "v"}
  assert cache["k"].shape == (2, 3, 2, 10, 8) and cache["k"].dtype == jnp.bfloat16  # [L, B, K, S, H]
  assert models.init_cache(CFG, 1, 4)["v"].dtype == jnp.float32
  with pytest.raises(ValueError, match="max_len"):
    models.init_cache(CFG, 1, 0)


def test_param_logical_axes_match_params():
  for cfg in (CFG, models.ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                                      intermediate_size=12, tie_word_embeddings=True, model_type="llama")):
    params = models.init_params(cfg, jax.random.key(0))
    axes = models.param_logical_axes(cfg)
    is_axes = lambda x: isinstance(x, tuple)
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(params)
    for names, leaf in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(params)):
      assert len(names) == leaf.ndim and set(names) <= AXIS_NAMES
  axes = models.param_logical_axes(CFG)["layers"]["attn"]
  assert axes["q_proj"]["kernel"] == ("layers", "embed", "q_heads", "head_dim")
  assert axes["k_proj"]["bias"] == ("layers", "kv_heads", "head_dim")
  assert axes["o_proj"]["kernel"] == ("layers", "q_heads", "head_dim", "embed")


def _half_config(dtype, unroll, moe, **kw):
  fields = dict(vocab_size=48, hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1, intermediate_size=24,
                qkv_bias=True, param_dtype="bfloat16", dtype=dtype, scan_unroll=unroll)
  if moe:   # both stacks (layers 1 and 3 sparse), so two runs of the scan and a float32 router-aux carry
    fields.update(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                  shared_expert_intermediate_size=12, decoder_sparse_step=2)
  cfg = models.ModelConfig(**fields, **kw)
  assert any(name == "dense_layers" for name, _ in cfg.layer_stacks) == moe
  return cfg


def _as_words_and_not(monkeypatch, run):
  """run() with half-precision stacks moved as 16-bit words (the CPU default), then with XLA's own float32
  path (`layers.HALF_AS_WORDS = False`). The flag is read while tracing: `run` must jit new functions
  (a new lambda), or jax reuses the first trace."""
  words = run()
  monkeypatch.setattr(layers, "HALF_AS_WORDS", False)
  return words, run()


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("dtype,unroll,moe", [("bfloat16", 1, False), ("bf16_matmul", 2, False),
                                               ("bfloat16", 1, True)])
def test_half_precision_layers_give_the_checkpointed_gradients(monkeypatch, dtype, unroll, moe):
  # bfloat16 layer params under remat='full' take the layer scan's own backward on the CPU (16-bit words,
  # `decoder._scan_full_remat_words`); without words, jax.checkpoint's. The loss and every gradient leaf
  # must be the same, bit for bit.
  cfg = _half_config(dtype, unroll, moe, remat="full")
  params = models.init_params(cfg, jax.random.key(0), init_std=0.3)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 48, size=(3, 10)), jnp.int32)

  def loss(p, tokens):   # tokens traced: the layers' closure holds tracers of the jitted step
    hidden, aux = decoder.hidden_with_aux(cfg, p, tokens)
    return jnp.sum(hidden.astype(jnp.float32) * jnp.arange(16.0)) + sum(jnp.sum(v) for v in aux.values())

  words, plain = _as_words_and_not(
      monkeypatch, lambda: jax.jit(jax.value_and_grad(lambda *args: loss(*args)))(params, tokens))
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(words[1]))
  assert float(jnp.max(jnp.abs(words[1]["layers"]["attn"]["o_proj"]["kernel"]))) > 0
  _assert_trees_equal(words, plain)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_bf16_matmul_residuals_as_words_give_the_same_gradients(monkeypatch, param_dtype):
  # remat='none': JAX stacks every layer's saved matmul inputs (bfloat16 under 'bf16_matmul') over the
  # scan; `layers._mixed` saves them as 16-bit words on the CPU. The same bfloat16 values reach every
  # gradient matmul either way; with bfloat16 params the results are equal bit for bit. With float32
  # params XLA's own path runs some of those matmuls as float32 dots of the bfloat16 values (its
  # float32 copy of the stack), which sum in another order: equal to float32 rounding (measured 3.8e-6
  # relative), where a wrong residual (another layer's, or not rounded) would differ by bfloat16's 4e-3.
  cfg = dataclasses.replace(_half_config("bf16_matmul", 1, False, remat="none"), param_dtype=param_dtype)
  params = models.init_params(cfg, jax.random.key(1), init_std=0.3)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 48, size=(3, 10)), jnp.int32)
  loss = lambda p, t: jnp.sum(decoder.hidden_with_aux(cfg, p, t)[0] * jnp.arange(16.0))
  words, plain = _as_words_and_not(
      monkeypatch, lambda: jax.jit(jax.value_and_grad(lambda *args: loss(*args)))(params, tokens))
  assert float(jnp.max(jnp.abs(words[1]["layers"]["mlp"]["down_proj"]["kernel"]))) > 0
  if param_dtype == "bfloat16":
    _assert_trees_equal(words, plain)
    return
  for x, y in zip(jax.tree.leaves(words), jax.tree.leaves(plain)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-5 * float(jnp.max(jnp.abs(y))))


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16_matmul"])
def test_half_precision_cached_decoding_equals_the_float32_path(monkeypatch, dtype):
  # Prefill and decode steps with bfloat16 params (and under 'bfloat16' a bfloat16 cache): layer params and
  # cache rows read and written as 16-bit words give XLA's own results, logits and cache bit for bit.
  cfg = _half_config(dtype, 1, False)
  params = models.init_params(cfg, jax.random.key(0), init_std=0.3)
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, 48, size=(2, 5)), jnp.int32)

  def run():
    step = jax.jit(lambda *args: models.forward_with_cache(*args), static_argnums=0)   # a new function: traced anew
    cache = models.init_cache(cfg, 2, 8)
    logits, cache = step(cfg, params, prompts, jnp.broadcast_to(jnp.arange(5), (2, 5)), cache)
    out = [logits]
    for t in range(5, 8):
      logits, cache = step(cfg, params, jnp.argmax(logits[:, -1:], -1).astype(jnp.int32), jnp.full((2, 1), t), cache)
      out.append(logits)
    return out, cache

  words, plain = _as_words_and_not(monkeypatch, run)
  assert words[1]["k"].dtype == cfg.compute_dtype and float(jnp.max(jnp.abs(words[1]["k"][:, :, :, 7]))) > 0
  _assert_trees_equal(words, plain)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", ["bf16_matmul", "float32"])
def test_decoding_params_prepare_the_kernels_once_and_change_no_result(monkeypatch, moe, dtype):
  # Float32 weights, every layer unrolled: each layer's projection kernels come out sliced from the stacks,
  # cast to bfloat16 under bf16_matmul (the cast every matmul makes of them) and as stored in float32, the
  # rest as stored; prefill and a decode step give the logits and cache of the layer scan over the stacked
  # params bit for bit.
  cfg = dataclasses.replace(_half_config(dtype, 0, moe), param_dtype="float32")
  low = jnp.bfloat16 if dtype == "bf16_matmul" else jnp.float32
  params = models.init_params(cfg, jax.random.key(1), init_std=0.3)
  prepared = models.decoding_params(cfg, params)
  assert isinstance(prepared, models.DecodeParams) and len(prepared.layers) == cfg.num_layers
  for (name, index), layer in zip(cfg.layer_stacks, prepared.layers):
    paths = []
    for path, x in jax.tree_util.tree_flatten_with_path(layer)[0]:
      stacked = params[name]
      for key in path:
        stacked = stacked[key.key]
      assert path[-1].key == "kernel" and x.dtype == low, (name, path)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(stacked[index].astype(low)))
      paths.append(tuple(k.key for k in path))
    # Every projection (attention, the dense or shared-expert MLP) and nothing else: the router and the
    # routed experts are read from the stacks as before (not every matmul of them casts alike).
    expected = [tuple(k.key for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(params[name])[0]
                if path[-1].key == "kernel"]
    assert sorted(paths) == sorted(expected) and expected
  _assert_trees_equal(prepared.params, params)
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, 48, size=(2, 5)), jnp.int32)

  def run(p):
    step = jax.jit(lambda p, *args: models.forward_with_cache(cfg, p, *args))   # traced anew each time
    logits, cache = step(p, prompts, jnp.broadcast_to(jnp.arange(5), (2, 5)), models.init_cache(cfg, 2, 8))
    logits_1, cache = step(p, jnp.argmax(logits[:, -1:], -1).astype(jnp.int32), jnp.full((2, 1), 5), cache)
    return logits, logits_1, cache

  # Nothing to prepare: bfloat16 compute (a loop would round its intermediates elsewhere), or layers in a
  # loop (a stack read per iteration; the MoE model's stacks alternate, one layer per run, so they are
  # unrolled at any scan_unroll).
  assert models.decoding_params(dataclasses.replace(cfg, dtype="bfloat16"), params) is params
  assert (models.decoding_params(dataclasses.replace(cfg, scan_unroll=1), params) is params) == (not moe)
  prepared_out = run(prepared)
  monkeypatch.setattr(kv_cache, "CAST_ONCE", False)
  assert models.decoding_params(cfg, params) is params
  _assert_trees_equal(prepared_out, run(params))


def test_init_params_shapes_dtypes_and_values():
  cfg = models.ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=12, qkv_bias=True, param_dtype="bfloat16")
  params = models.init_params(cfg, jax.random.key(0), init_std=0.5)
  assert set(params) == {"embed", "layers", "final_norm", "lm_head"}
  attn = params["layers"]["attn"]   # stacked over a leading layer axis
  assert attn["q_proj"]["kernel"].shape == (1, 8, 2, 4) and attn["k_proj"]["kernel"].shape == (1, 8, 1, 4)
  assert attn["o_proj"]["kernel"].shape == (1, 2, 4, 8) and params["lm_head"]["kernel"].shape == (8, 16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  np.testing.assert_array_equal(np.asarray(attn["q_proj"]["bias"], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(params["final_norm"]["scale"], np.float32), 1.0)
  assert 0.4 < float(jnp.std(params["embed"]["embedding"].astype(jnp.float32))) < 0.6
  # 16*8 embed + 8*16 head + 8 final norm + layer: q 8*2*4 + q bias 8 + k, v 8*4 + 4 each + o 2*4*8
  # + 2 norms 8 each + mlp 3*8*12 = 128 + 128 + 8 + (64 + 8 + 36 + 36 + 64 + 16 + 288) = 776
  assert models.num_params(params) == 776


def test_forward_rejects_params_of_another_config(params):
  small = models.ModelConfig(vocab_size=48, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                             intermediate_size=64, qkv_bias=True)
  with pytest.raises(ValueError, match=r"\['layers'\].*expected \(1,"):
    models.forward(small, params, _tokens((1, 3), 6))
  bad = dict(params, lm_head={"kernel": jnp.zeros((32, 47))})
  with pytest.raises(ValueError, match=r"\['lm_head'\]\['kernel'\].*\(32, 47\)"):
    models.forward(CFG, bad, _tokens((1, 3), 6))
  with pytest.raises(ValueError, match="positions_bt"):
    models.forward(CFG, params, _tokens((1, 3), 6), positions_bt=jnp.zeros((1, 4), jnp.int32))


def test_bfloat16_compute_gives_float32_logits_near_float32(params):
  cfg16 = models.ModelConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
  tokens = _tokens((2, 8), 7)
  logits16 = FORWARD(cfg16, params, tokens)
  assert logits16.dtype == jnp.float32
  ref = np.asarray(FORWARD(CFG, params, tokens))
  assert np.abs(np.asarray(logits16) - ref).max() < 0.1 * np.abs(ref).max()


def test_apply_rope_by_hand():
  # head_dim 4, inv_freq (1, 0.5), position 2: angles (2, 1). Pairs are (x0, x2) and (x1, x3):
  # out0 = x0 cos2 - x2 sin2, out2 = x2 cos2 + x0 sin2; out1 = x1 cos1 - x3 sin1, out3 = x3 cos1 + x1 sin1.
  x = jnp.asarray([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
  got = np.asarray(layers.apply_rope(x, jnp.asarray([[2]]), (1.0, 0.5))).reshape(4)
  c2, s2, c1, s1 = np.cos(2.0), np.sin(2.0), np.cos(1.0), np.sin(1.0)
  want = [1 * c2 - 3 * s2, 2 * c1 - 4 * s1, 3 * c2 + 1 * s2, 4 * c1 + 2 * s1]
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_llama3_inv_freq_by_hand():
  # head_dim 4, theta 100: base inv_freq (1, 0.1), wavelengths 2*pi and 20*pi = 62.8. With
  # original_max_position_embeddings 32, low_freq_factor 1, high_freq_factor 4: low_freq_wavelen 32,
  # high_freq_wavelen 8. 2*pi < 8 keeps 1; 62.8 > 32 is divided by factor 8: 0.1 / 8 = 0.0125.
  cfg = models.ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=8, rope_theta=100.0, rope_scaling={
                               "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
  np.testing.assert_allclose(layers.rope_inv_freq(cfg), [1.0, 0.0125], rtol=1e-6)
  # Medium band: theta 10 gives inv_freq (1, 1/sqrt(10)), wavelength 2*pi*sqrt(10) = 19.87 in (8, 32):
  # smooth = (32 / 19.87 - 1) / 3 = 0.2035; inv = (1 - smooth) * f / 8 + smooth * f with f = 0.31623
  # = 0.7965 * 0.039528 + 0.2035 * 0.31623 = 0.031485 + 0.064353 = 0.095838.
  cfg10 = models.ModelConfig(**{**cfg.__dict__, "rope_theta": 10.0})
  np.testing.assert_allclose(layers.rope_inv_freq(cfg10), [1.0, 0.095838], rtol=1e-4)


def test_model_config_resolves_and_normalizes():
  cfg = models.ModelConfig(vocab_size=8, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                           intermediate_size=8, rope_scaling={"rope_type": "default"})
  assert cfg.head_dim == cfg.head_dim_ == 8 and cfg.rope_scaling is None
  scaled = dict(type="llama3", factor=8, low_freq_factor=1, high_freq_factor=4,
                original_max_position_embeddings=64, rope_theta=5.0)
  a = models.ModelConfig(**{**cfg.__dict__, "rope_scaling": scaled})
  b = models.ModelConfig(**{**cfg.__dict__, "rope_scaling": tuple(reversed(list(scaled.items())))})
  assert a == b and hash(a) == hash(b) and dict(a.rope_scaling)["rope_type"] == "llama3"


@pytest.mark.parametrize("change, field", [
    (dict(vocab_size=0), "vocab_size"),
    (dict(hidden_size=-1), "hidden_size"),
    (dict(num_layers=1.5), "num_layers"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(intermediate_size=True), "intermediate_size"),
    (dict(head_dim=7), "head_dim"),
    (dict(hidden_size=30), "head_dim"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_scaling.rope_type"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": -1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}), "rope_scaling.factor"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(qkv_bias="yes"), "qkv_bias"),
    (dict(max_position_embeddings=0), "max_position_embeddings"),
    (dict(model_type="gpt2"), "model_type"),
    (dict(dtype="float16"), "dtype"),
    (dict(param_dtype="int8"), "param_dtype"),
    (dict(eos_token_id=-1), "eos_token_id"),
])
def test_model_config_rejects_bad_fields(change, field):
  fields = dict(vocab_size=8, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=8)
  with pytest.raises(ValueError, match=rf"ModelConfig\.{field}\b"):
    models.ModelConfig(**{**fields, **change})
