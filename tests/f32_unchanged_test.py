"""The float32 configuration computes what it computed before the layers were scanned and the lm head chunked.

`rl_fusion_jax/testing/hf_fixtures/qwen2_f32/pre_scan_reference.npz` holds the token log-probs, entropies
and gradients of the summed log-probs on the committed qwen2_f32 fixture, computed by the code of commit
72f4449 (one Python loop iteration per layer, float32 [B, T, V] log-softmax) with this module's
`reference_outputs`, which only calls APIs both versions have (`load_hf`, `token_logprobs`, `save_hf`):

  git worktree add /tmp/pre_scan 72f4449
  PYTHONPATH=/tmp/pre_scan python tests/f32_unchanged_test.py     # writes the .npz

With the layers unrolled (scan_unroll >= num_layers, as the experiment configs set for their tiny models)
and the lm head in one chunk, log-probs, entropies and every gradient but those of the q/k projection
biases (<= 1e-6 relative) match bit for bit. A rolled scan (the
ModelConfig default), several lm-head chunks or a remat policy reorder float32 sums: rounding-level
differences only.
"""
import dataclasses
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from rl_fusion_jax import models
from rl_fusion_jax.train.logprobs import token_logprobs

FIXTURE = os.path.join(os.path.dirname(models.__file__), "..", "testing", "hf_fixtures", "qwen2_f32")
# Beside this file's checkout (not the imported package's), so the command above writes into this tree.
REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rl_fusion_jax", "testing",
                         "hf_fixtures", "qwen2_f32", "pre_scan_reference.npz")


def reference_outputs(**overrides):
  """{'logp', 'entropy', 'grad/<HF tensor name>'} on fixed tokens, computed by this checkout's code."""
  cfg, params = models.load_hf(FIXTURE)
  cfg = dataclasses.replace(cfg, **overrides)
  params = jax.tree.map(jnp.asarray, params)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 24)), jnp.int32)
  logp, entropy = jax.jit(lambda p, t: token_logprobs(cfg, p, t, with_entropy=True))(params, tokens)
  grads = jax.jit(jax.grad(lambda p, t: jnp.sum(token_logprobs(cfg, p, t))))(params, tokens)
  with tempfile.TemporaryDirectory() as tmp:
    models.save_hf(cfg, grads, os.path.join(tmp, "grads"))
    tensors = load_file(os.path.join(tmp, "grads", "model.safetensors"))
  return {"logp": np.asarray(logp), "entropy": np.asarray(entropy)} | {f"grad/{k}": v for k, v in tensors.items()}


# The q and k projection biases (whose outputs go through the rotary embedding): their gradients, sums over
# batch and time, come out of a differently fused backward pass.
ROPE_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias")


def test_unrolled_float32_equals_the_pre_scan_code_bit_for_bit():
  # scan_unroll >= num_layers (what the experiment configs set for their tiny models) and the lm head in
  # one chunk (logits_chunk >= tokens): the same arithmetic as before.
  want = np.load(REFERENCE)
  got = reference_outputs(scan_unroll=2)
  assert sorted(got) == sorted(want.files)
  for name in want.files:
    if name.endswith(ROPE_BIASES):   # summed over rows in another order: <= 1e-6 relative
      np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6 * np.abs(want[name]).max())
    else:
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("overrides", [{"scan_unroll": 1}, {"logits_chunk": 7}, {"remat": "full"}, {"remat": "matmuls"}],
                         ids=["rolled_scan", "chunk7", "remat_full", "remat_matmuls"])
def test_rolled_chunked_or_rematerialized_float32_agrees_to_rounding(overrides):
  # A rolled scan sums the stacked layers' gradients in another order, and several lm-head chunks fuse
  # differently: rounding-level differences (measured: <= 1.1e-6 relative), nothing more.
  want = np.load(REFERENCE)
  got = reference_outputs(**overrides)
  assert sorted(got) == sorted(want.files)
  for name in want.files:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5 * np.abs(want[name]).max(),
                               err_msg=name)


if __name__ == "__main__":
  np.savez(REFERENCE, **reference_outputs())
  print("wrote", REFERENCE, file=sys.stderr)
