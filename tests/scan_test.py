"""Scanned layers, remat policies and chunked log-probs equal the plain computations they replace.

References are written here, independently of the code under test: an unrolled Python loop over the
layers (each block bound to its own slice of the stacked params) and a full-vocabulary log-softmax.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax import models
from rl_fusion_jax.models import decoder
from rl_fusion_jax.testing import USER_COMPILER_OPTIONS
from rl_fusion_jax.train.logprobs import token_logprobs

# Compiled as users compile them (rl_fusion_jax/testing: the suite otherwise uses other fusion emitters).
_jit = functools.partial(jax.jit, compiler_options=USER_COMPILER_OPTIONS)

CFG = models.ModelConfig(vocab_size=48, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, qkv_bias=True)


@pytest.fixture(scope="module")
def params():
  rng = np.random.default_rng(1)
  base = models.init_params(CFG, jax.random.key(0), init_std=0.2)
  return jax.tree.map(lambda x: x + jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), base)


def _tokens(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, size=shape), jnp.int32)


def _unrolled_logits(cfg, params, tokens_bt):
  """Embedding, a Python loop over the blocks (layer i bound to params['layers'][..][i]), norm, head."""
  model = decoder.bind(cfg, params)
  positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
  mask_btt = decoder.attention_mask(positions_bt, None)
  x_btd = model.embed_tokens(tokens_bt)
  for i in range(cfg.num_layers):
    x_btd = model.layer(i)(x_btd, positions_bt, mask_btt)
  return model.logits(x_btd)


def test_scanned_forward_equals_the_unrolled_loop(params):
  tokens = _tokens((2, 9))
  want = np.asarray(_jit(_unrolled_logits, static_argnums=0)(CFG, params, tokens))
  for unroll in (1, 2, CFG.num_layers):
    got = _jit(models.forward, static_argnums=0)(dataclasses.replace(CFG, scan_unroll=unroll), params, tokens)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  # The layers are really distinct: running layer 0 three times gives other logits.
  same = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), params["layers"])
  other = np.asarray(_jit(models.forward, static_argnums=0)(CFG, dict(params, layers=same), tokens))
  assert np.abs(other - want).max() > 1e-2


def _loss(cfg, params, tokens):
  return jnp.sum(token_logprobs(cfg, params, tokens) * jnp.arange(tokens.shape[1]))


@pytest.mark.parametrize("remat", ["full", "matmuls"])
def test_remat_policies_give_the_gradients_of_no_remat(params, remat):
  tokens = _tokens((2, 8), 1)
  grad = _jit(jax.grad(_loss, argnums=1), static_argnums=0)
  want = grad(CFG, params, tokens)
  got = grad(dataclasses.replace(CFG, remat=remat), params, tokens)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
               got, want)


def test_full_remat_recomputes_the_layer(params):
  # Under remat='full' the backward pass reruns each layer's forward: more dots in the compiled grad.
  tokens = _tokens((2, 8), 1)
  def dots(cfg):
    hlo = _jit(jax.grad(_loss, argnums=1), static_argnums=0).lower(cfg, params, tokens).as_text()
    return hlo.count("dot_general")
  assert dots(dataclasses.replace(CFG, remat="full")) > dots(CFG)


def _reference_logprobs(cfg, params, tokens_bt, temperature):
  logits = models.forward(cfg, params, tokens_bt[:, :-1]) / temperature
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, tokens_bt[:, 1:, None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return jnp.pad(logp, ((0, 0), (1, 0))), jnp.pad(entropy, ((0, 0), (1, 0)))


@pytest.mark.parametrize("chunk", [5, 13, 4096])   # 5 and 13 do not divide the 2 x 10 targets
def test_chunked_logprobs_values_and_gradients_equal_the_full_softmax(params, chunk):
  tokens = _tokens((2, 11), 2)
  cfg = dataclasses.replace(CFG, logits_chunk=chunk)
  got = _jit(lambda p: token_logprobs(cfg, p, tokens, 0.7, with_entropy=True))(params)
  want = _jit(lambda p: _reference_logprobs(CFG, p, tokens, 0.7))(params)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

  weights = jnp.asarray(np.random.default_rng(3).standard_normal((2, 11)), jnp.float32)
  def objective(fn):
    return lambda p: jnp.sum(fn(p)[0] * weights) + 0.3 * jnp.sum(fn(p)[1] * weights)
  g_got = _jit(jax.grad(objective(lambda p: token_logprobs(cfg, p, tokens, 0.7, with_entropy=True))))(params)
  g_want = _jit(jax.grad(objective(lambda p: _reference_logprobs(CFG, p, tokens, 0.7))))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
               g_got, g_want)


def test_chunked_update_holds_no_full_logits(params):
  # The compiled gradient holds one chunk of float32 logits at a time: with 16 chunks of 64 tokens its
  # temporaries (mostly vocabulary-sized parameter gradients, 0.5 MB each) stay well under the [B*T, V]
  # logits alone, while the unchunked pass keeps at least those.
  tokens = jnp.zeros((32, 33), jnp.int32)        # 1,024 targets, short rows (little attention)
  big = dataclasses.replace(CFG, vocab_size=4096, remat="full", scan_unroll=1)   # activations out of the way
  p = models.abstract_params(big)
  def temp_bytes(chunk):
    fn = _jit(jax.grad(lambda q: jnp.sum(token_logprobs(dataclasses.replace(big, logits_chunk=chunk), q,
                                                              tokens))))
    return fn.lower(p).compile().memory_analysis().temp_size_in_bytes
  full_logits = 1024 * 4096 * 4
  assert temp_bytes(4096) > full_logits            # unchunked: the whole [B*T, V] log-softmax kept
  assert temp_bytes(64) < full_logits / 2          # chunked: about one [64, V] chunk at a time


def test_model_config_fields_and_errors():
  d = CFG.to_hf_dict()
  cfg = models.ModelConfig.from_hf_dict(d, remat="full", logits_chunk=512)
  assert (cfg.remat, cfg.logits_chunk) == ("full", 512)
  with pytest.raises(ValueError, match=r"ModelConfig.remat: must be one of \('none', 'full', 'matmuls'\)"):
    dataclasses.replace(CFG, remat="dots")
  with pytest.raises(ValueError, match="ModelConfig.logits_chunk: must be a positive int"):
    dataclasses.replace(CFG, logits_chunk=0)
  with pytest.raises(ValueError, match=r"ModelConfig.scan_unroll: must be an int >= 0"):
    dataclasses.replace(CFG, scan_unroll=-1)
