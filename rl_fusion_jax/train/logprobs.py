"""Per-token log-probs and entropies of a token sequence under a policy, without [B, T, V] tensors.

The decoder runs up to its final norm once; the lm head then runs `model_cfg.logits_chunk` tokens at a
time (`lax.map` over chunks, each rematerialized in the backward pass), so the largest vocabulary-sized
tensor alive, forward or backward, is one chunk's float32 [chunk, V] logits. Gradients are those of the
unchunked computation (the chunks are independent rows).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_fusion_jax import models
from rl_fusion_jax.models import decoder


def head_logprobs(model_cfg: models.ModelConfig, params, hidden_nd: jax.Array, targets_n: jax.Array,
                  temperature: float = 1.0, *, with_entropy: bool = False):
  """log pi(targets[i]) (and the entropy) of the lm head at final-norm hidden states, chunk by chunk.

  ``hidden_nd`` [..., D] and ``targets_n`` [...] (same leading shape). Returns float32 ``logp`` (and
  ``entropy``) of that leading shape. Rows are processed ``model_cfg.logits_chunk`` at a time; the last
  chunk is padded with zero rows whose results are dropped.
  """
  lead, d = targets_n.shape, hidden_nd.shape[-1]
  if hidden_nd.shape[:-1] != lead:
    raise ValueError(f"hidden_nd: leading shape {hidden_nd.shape[:-1]} must equal targets_n shape {lead}")
  model = decoder.bind(model_cfg, params)
  h_md, t_m = hidden_nd.reshape(-1, d), targets_n.reshape(-1)
  m = h_md.shape[0]
  chunk = min(model_cfg.logits_chunk, max(m, 1))
  num_chunks = -(-m // chunk)

  def one(h_cd, t_c):
    # The unchunked formulas, row for row (log_softmax, then the target's entry; -sum p log p), so a
    # float32 model computes bit for bit what it did before the lm head was chunked.
    logp_cv = jax.nn.log_softmax(model.head(h_cd) / temperature, axis=-1)
    logp_c = jnp.take_along_axis(logp_cv, t_c[:, None], axis=-1)[:, 0]
    if not with_entropy:
      return (logp_c,)
    return logp_c, -jnp.sum(jnp.exp(logp_cv) * logp_cv, axis=-1)

  if num_chunks == 1:
    outs = one(h_md, t_m)
  else:
    pad = num_chunks * chunk - m
    h_kcd = jnp.pad(h_md, ((0, pad), (0, 0))).reshape(num_chunks, chunk, d)
    t_kc = jnp.pad(t_m, (0, pad)).reshape(num_chunks, chunk)
    # Each chunk's logits are recomputed in the backward pass instead of being kept for it.
    one_remat = jax.checkpoint(one, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    outs = jax.lax.map(lambda xs: one_remat(*xs), (h_kcd, t_kc))
    outs = tuple(x.reshape(-1)[:m] for x in outs)
  outs = tuple(x.reshape(lead) for x in outs)
  return outs if with_entropy else outs[0]


def token_logprobs(model_cfg: models.ModelConfig, params, tokens_bt: jax.Array, temperature: float = 1.0,
                   *, with_entropy: bool = False, with_aux: bool = False):
  """logp_bt[b, t] = log pi(tokens[b, t] | tokens[b, :t]) with logits / temperature; 0 at t = 0.

  Returns ``logp_bt`` or ``(logp_bt, entropy_bt)``; entropy_bt[b, t] is the entropy of the distribution
  that token t was drawn from. Both float32 [B, T], aligned with ``tokens_bt``. The lm head runs
  ``model_cfg.logits_chunk`` tokens at a time (`head_logprobs`). With ``with_aux`` the MoE router aux
  (`decoder.hidden_with_aux`; {} for a dense model) is appended to the returned tuple.
  """
  hidden_btd, aux = decoder.hidden_with_aux(model_cfg, params, tokens_bt[:, :-1])
  outs = head_logprobs(model_cfg, params, hidden_btd, tokens_bt[:, 1:], temperature, with_entropy=with_entropy)
  pad = lambda x_bt: jnp.pad(x_bt, ((0, 0), (1, 0)))
  outs = (pad(outs[0]), pad(outs[1])) if with_entropy else (pad(outs),)
  outs += (aux,) if with_aux else ()
  return outs if len(outs) > 1 else outs[0]
