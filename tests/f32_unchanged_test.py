"""The float32 configuration computes what it computed before the layers were scanned and the lm head chunked.

The reference is the code before that change (commit 72f4449), restated here and run in the same process
as the code under test: one block per layer bound to that layer's own parameters (separate leaves, as the
unstacked model held them, so each layer's gradients are their own), a Python loop over the blocks, the
final norm and lm head as one [B, T, D] x [D, V] einsum, and a float32 log-softmax over the whole [B, T, V]
logits. The parts that the change left alone (the embedding gather, the block, the norm) are shared; what
it introduced (stacked parameters, `lax.scan`, the chunked `head_logprobs`) is only on the tested side.

With the layers unrolled (scan_unroll >= num_layers, as the experiment configs set for their tiny models)
and the lm head in one chunk, log-probs, entropies and every gradient but those of the q/k projection
biases (<= 1e-6 relative) match bit for bit. A rolled scan (scan_unroll=1, the default off the CPU),
several lm-head chunks or a remat policy reorder float32 sums: rounding-level differences only.

Why not stored values: this file used to compare against an .npz that the old code wrote on one machine.
XLA:CPU picks its kernels by the processor's features (AVX2, AVX-512, AMX), so the same float32 program
gives results ~1e-6 relative apart on another CPU: 58 of 96 stored log-probs differed, by up to 1.9e-6 on
an Intel Xeon (AVX-512, AMX) and 3.8e-6 on an AMD EPYC (AVX2). A stored number is an oracle
only for the processor that wrote it; a reference computed in the same run keeps the claim about the
arithmetic on any CPU.
"""
import dataclasses
import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from rl_fusion_jax import models
from rl_fusion_jax.models import decoder
from rl_fusion_jax.testing import USER_COMPILER_OPTIONS
from rl_fusion_jax.train.logprobs import token_logprobs

# Compiled as users compile them (rl_fusion_jax/testing: the suite otherwise uses other fusion emitters).
_jit = functools.partial(jax.jit, compiler_options=USER_COMPILER_OPTIONS)

FIXTURE = os.path.join(os.path.dirname(models.__file__), "..", "testing", "hf_fixtures", "qwen2_f32")


@functools.lru_cache(maxsize=None)
def _fixture():
  """(cfg, params, tokens): the committed qwen2_f32 fixture (2 layers, q/k/v biases) and fixed tokens."""
  cfg, params = models.load_hf(FIXTURE)
  params = jax.tree.map(jnp.asarray, params)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 24)), jnp.int32)
  return cfg, params, tokens


def _as_outputs(cfg, logp, entropy, grads) -> dict[str, np.ndarray]:
  """{'logp', 'entropy', 'grad/<HF tensor name>'}: gradients named as `save_hf` writes them."""
  with tempfile.TemporaryDirectory() as tmp:
    models.save_hf(cfg, grads, os.path.join(tmp, "grads"))
    tensors = load_file(os.path.join(tmp, "grads", "model.safetensors"))
  return {"logp": np.asarray(logp), "entropy": np.asarray(entropy)} | {f"grad/{k}": v for k, v in tensors.items()}


def scanned_outputs(**overrides) -> dict[str, np.ndarray]:
  """The code under test: `token_logprobs` (scanned layers, chunked lm head) under `overrides`."""
  cfg, params, tokens = _fixture()
  cfg = dataclasses.replace(cfg, **overrides)
  logp, entropy = _jit(lambda p, t: token_logprobs(cfg, p, t, with_entropy=True))(params, tokens)
  grads = _jit(jax.grad(lambda p, t: jnp.sum(token_logprobs(cfg, p, t))))(params, tokens)
  return _as_outputs(cfg, logp, entropy, grads)


def _pre_scan_logprobs(cfg, rest, layers, tokens_bt):
  """(logp_bt, entropy_bt) as commit 72f4449 computed them; `layers` holds one param dict per layer."""
  model = decoder.bind(cfg, dict(rest, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *layers)))
  graphdef, abstract = nnx.split(model.layer(0))   # the program of one block; its params come from `layers`
  inputs_bt = tokens_bt[:, :-1]
  positions_bt = jnp.broadcast_to(jnp.arange(inputs_bt.shape[1], dtype=jnp.int32), inputs_bt.shape)
  mask_btt = decoder.attention_mask(positions_bt, None)
  x_btd = model.embed_tokens(inputs_bt)
  for layer_params in layers:
    state = jax.tree.map(lambda v: v, abstract)
    nnx.replace_by_pure_dict(state, layer_params)
    x_btd = nnx.merge(graphdef, state)(x_btd, positions_bt, mask_btt)
  x_btd = model.final_norm(x_btd)
  logits_btv = jnp.einsum("BTD,DV->BTV", x_btd, model.lm_head.kernel[...].astype(model.dtype),
                          preferred_element_type=jnp.float32) / 1.0   # temperature 1, divided as before
  logp_all_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
  logp_bt = jnp.take_along_axis(logp_all_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]
  entropy_bt = -jnp.sum(jnp.exp(logp_all_btv) * logp_all_btv, axis=-1)
  return jnp.pad(logp_bt, ((0, 0), (1, 0))), jnp.pad(entropy_bt, ((0, 0), (1, 0)))


@functools.lru_cache(maxsize=None)
def pre_scan_outputs() -> dict[str, np.ndarray]:
  """The reference: the pre-scan computation (`_pre_scan_logprobs`), in this process, on this CPU."""
  cfg, params, tokens = _fixture()
  assert not cfg.tie_word_embeddings and cfg.layer_stacks == (("layers", 0), ("layers", 1))
  rest = {k: v for k, v in params.items() if k != "layers"}
  layers = [jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(cfg.num_layers)]
  fn = functools.partial(_pre_scan_logprobs, cfg)
  logp, entropy = _jit(fn)(rest, layers, tokens)
  grad_rest, grad_layers = _jit(jax.grad(lambda r, l, t: jnp.sum(fn(r, l, t)[0]), argnums=(0, 1)))(
      rest, layers, tokens)
  grads = dict(grad_rest, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *grad_layers))
  return _as_outputs(cfg, logp, entropy, grads)


# The q and k projection biases (whose outputs go through the rotary embedding): their gradients, sums over
# batch and time, come out of a differently fused backward pass (measured: <= 3e-7 relative).
ROPE_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias")


def test_unrolled_float32_equals_the_pre_scan_code_bit_for_bit():
  # scan_unroll >= num_layers (what the experiment configs set for their tiny models) and the lm head in
  # one chunk (logits_chunk >= tokens): the same arithmetic as before.
  want = pre_scan_outputs()
  got = scanned_outputs(scan_unroll=2)
  assert sorted(got) == sorted(want) and sum(name.endswith(ROPE_BIASES) for name in want) == 4
  for name in want:
    if name.endswith(ROPE_BIASES):
      np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6 * np.abs(want[name]).max(),
                                 err_msg=name)
    else:
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("overrides", [{"scan_unroll": 1}, {"logits_chunk": 7}, {"remat": "full"}, {"remat": "matmuls"}],
                         ids=["rolled_scan", "chunk7", "remat_full", "remat_matmuls"])
def test_rolled_chunked_or_rematerialized_float32_agrees_to_rounding(overrides):
  # A rolled scan sums the stacked layers' gradients in another order, and several lm-head chunks fuse
  # differently: rounding-level differences (measured: <= 4e-7 relative), nothing more.
  want = pre_scan_outputs()
  got = scanned_outputs(**overrides)
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5 * np.abs(want[name]).max(),
                               err_msg=name)


def test_the_reference_sees_every_layer_and_the_whole_vocabulary():
  # Control: the reference is not vacuous. Its layers are distinct (reusing layer 0's params changes
  # the log-probs) and its log-probs are normalized over the whole vocabulary.
  cfg, params, tokens = _fixture()
  want = pre_scan_outputs()
  rest = {k: v for k, v in params.items() if k != "layers"}
  layer0 = jax.tree.map(lambda x: x[0], params["layers"])
  same, _ = _jit(functools.partial(_pre_scan_logprobs, cfg))(rest, [layer0, layer0], tokens)
  assert np.abs(np.asarray(same) - want["logp"]).max() > 1e-3
  assert (want["logp"][:, 1:] < 0).all() and (want["entropy"][:, 1:] > 0).all()
  assert want["entropy"][:, 1:].max() <= np.log(cfg.vocab_size) + 1e-5
