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


def response_window(mask_bt: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
  """(start_b, outside): the lm head window of ``token_logprobs`` that holds each row's masked tokens.

  ``start_b`` [B] int32: the target index (token index - 1) of each row's first token with mask > 0 (0
  for a row without one), so the window covers tokens ``start_b + 1 .. start_b + length``. ``outside``:
  int32 scalar, the number of masked tokens past their row's window (0 whenever every row's masked
  tokens span at most ``length`` positions, e.g. responses of at most ``rollout.max_new_tokens``).
  """
  used_bt = mask_bt[:, 1:] > 0
  start_b = jnp.argmax(used_bt, axis=1).astype(jnp.int32)
  t = jnp.arange(used_bt.shape[1], dtype=jnp.int32)[None, :]
  inside = (t >= start_b[:, None]) & (t < start_b[:, None] + length)
  return start_b, jnp.sum(used_bt & ~inside, dtype=jnp.int32)


def token_logprobs(model_cfg: models.ModelConfig, params, tokens_bt: jax.Array, temperature: float = 1.0,
                   *, with_entropy: bool = False, with_aux: bool = False,
                   head_window: tuple[jax.Array, int] | None = None):
  """logp_bt[b, t] = log pi(tokens[b, t] | tokens[b, :t]) with logits / temperature; 0 at t = 0.

  Returns ``logp_bt`` or ``(logp_bt, entropy_bt)``; entropy_bt[b, t] is the entropy of the distribution
  that token t was drawn from. Both float32 [B, T], aligned with ``tokens_bt``. The lm head runs
  ``model_cfg.logits_chunk`` tokens at a time (`head_logprobs`). With ``with_aux`` the MoE router aux
  (`decoder.hidden_with_aux`; {} for a dense model) is appended to the returned tuple.

  ``head_window = (start_b, L)`` (``response_window``): the lm head runs only on tokens ``start_b + 1 ..
  start_b + L`` of each row (a response, where the loss reads), B x L positions instead of B x (T - 1);
  the other entries of both outputs are 0. Each computed entry equals the full computation's up to
  float32 rounding (the head's matmuls run over other rows; `tests/train_step_test.py`).
  """
  hidden_btd, aux = decoder.hidden_with_aux(model_cfg, params, tokens_bt[:, :-1])
  targets_bt = tokens_bt[:, 1:]

  def head(h, t):   # always a tuple: (logp,) or (logp, entropy)
    out = head_logprobs(model_cfg, params, h, t, temperature, with_entropy=with_entropy)
    return out if with_entropy else (out,)

  if head_window is None:
    outs = head(hidden_btd, targets_bt)
  else:
    start_b, length = head_window
    width = targets_bt.shape[1]
    index_bl = start_b[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
    clipped_bl = jnp.minimum(index_bl, width - 1)      # past the row's end: computed, then dropped
    outs = head(jnp.take_along_axis(hidden_btd, clipped_bl[:, :, None], axis=1),
                jnp.take_along_axis(targets_bt, clipped_bl, axis=1))
    rows_bl = jnp.broadcast_to(jnp.arange(index_bl.shape[0])[:, None], index_bl.shape)
    outs = tuple(jnp.zeros(targets_bt.shape, x.dtype).at[rows_bl, index_bl].set(x, mode="drop") for x in outs)
  outs = tuple(jnp.pad(x_bt, ((0, 0), (1, 0))) for x_bt in outs)
  outs += (aux,) if with_aux else ()
  return outs if len(outs) > 1 else outs[0]
