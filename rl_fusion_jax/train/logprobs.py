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
from rl_fusion_jax.models import decoder, layers


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


def shared_prompt_logprobs(model_cfg: models.ModelConfig, params, tokens_bt: jax.Array, mask_bt: jax.Array,
                           group: int, length: int, temperature: float = 1.0, *, with_entropy: bool = False):
  """``token_logprobs`` with ``head_window`` for rows in groups of ``group`` that share one prompt, the
  prompt's positions run once per group instead of once per row.

  Rows ``g * group .. g * group + group - 1`` are one group (a GRPO group: the same prompt, ``group``
  responses). Each group becomes one sequence: its first row whole (``T - 1`` input positions), then the
  other rows' responses, ``length - 1`` input positions each (``length``: the window, at least the longest
  response). A response attends to the first row's prompt positions and, causally, to itself; the first
  row attends causally to itself as in ``token_logprobs`` (``layers.SharedPrompt``, scores computed part by
  part). The first target of every row is predicted from
  the prompt's last position, which all rows of the group share. So the decoder runs ``T - 1 + (group - 1)
  * (length - 1)`` positions a group instead of ``group * (T - 1)``, and each entry equals
  ``token_logprobs``' up to float32 rounding (other sequence shapes; `tests/shared_prompts_test.py`).

  A group's prompt ends where its rows' masked tokens start (the latest first masked token of its rows,
  ``response_window``). Returns ``(logp_bt, entropy_bt or None, outside, mismatched)``: float32 [B, T]
  aligned with ``tokens_bt`` (0 outside each row's window), the masked tokens past their group's window,
  and the prompt tokens of rows that differ from their group's first row (both int32 scalars, 0 when the
  rows are grouped as assumed; the RL update withholds itself otherwise). Dense decoders only: an MoE
  router's losses count every position it routes, and shared prompt positions are routed once.
  """
  b, t = tokens_bt.shape
  if group < 2 or b % group:
    raise ValueError(f"shared prompts: {b} rows do not form groups of {group} (group must be >= 2)")
  if not 1 < length < t:
    raise ValueError(f"shared prompts: the window {length} must be in (1, {t}) (rollout.max_new_tokens)")
  if model_cfg.num_experts:
    raise ValueError("shared prompts: an MoE policy's router losses count every routed position; dense only")
  g, width, tail = b // group, t - 1, length - 1
  start_b, _ = response_window(mask_bt, length)
  start_g = jnp.max(start_b.reshape(g, group), axis=1)          # the prompt's last position (input index)
  tokens_gkt = tokens_bt.reshape(g, group, t)

  # The group's sequence: row 0's inputs, then rows 1.. (group - 1)'s responses (input positions
  # start + 1 .. start + length - 1, clipped to the row: what lies past it is computed, then dropped).
  resp_l = start_g[:, None] + 1 + jnp.arange(tail, dtype=jnp.int32)[None, :]          # [g, L - 1]
  resp_l = jnp.minimum(resp_l, width - 1)
  others_gkl = jnp.take_along_axis(tokens_gkt[:, 1:, :width], resp_l[:, None, :].repeat(group - 1, 1), axis=2)
  seq_gw = jnp.concatenate([tokens_gkt[:, 0, :width], others_gkl.reshape(g, -1)], axis=1)
  pos_gw = jnp.concatenate([jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (g, width)),
                            jnp.tile(resp_l, (1, group - 1))], axis=1)
  layout = layers.SharedPrompt(start_g, width, group, tail)
  hidden_gwd = decoder.bind(model_cfg, params).hidden(seq_gw, pos_gw, layout)

  # Each row's window: input positions start .. start + length - 1 of its own row. Row 0 reads them from
  # its part; row j >= 1 reads its first from the prompt's last position, the rest from its part.
  i_l = jnp.arange(length, dtype=jnp.int32)[None, None, :]
  j_k = jnp.arange(group, dtype=jnp.int32)[None, :, None]
  index_gkl = jnp.where(j_k == 0, jnp.minimum(start_g[:, None, None] + i_l, width - 1),
                        jnp.where(i_l == 0, start_g[:, None, None], width + (j_k - 1) * tail + i_l - 1))
  h_bld = jnp.take_along_axis(hidden_gwd, index_gkl.reshape(g, -1)[:, :, None], axis=1).reshape(b, length, -1)
  target_index_bl = (start_g[:, None, None] + i_l).repeat(group, 1).reshape(b, length)   # target t: token t + 1
  targets_bl = jnp.take_along_axis(tokens_bt[:, 1:], jnp.minimum(target_index_bl, width - 1), axis=1)
  outs = head_logprobs(model_cfg, params, h_bld, targets_bl, temperature, with_entropy=with_entropy)
  outs = outs if with_entropy else (outs,)
  rows_bl = jnp.broadcast_to(jnp.arange(b)[:, None], (b, length))
  outs = [jnp.pad(jnp.zeros((b, width), x.dtype).at[rows_bl, target_index_bl].set(x, mode="drop"), ((0, 0), (1, 0)))
          for x in outs]

  start_row = jnp.repeat(start_g, group)
  used_bt = mask_bt[:, 1:] > 0
  target_t = jnp.arange(width, dtype=jnp.int32)[None, :]
  outside = jnp.sum(used_bt & ((target_t < start_row[:, None]) | (target_t >= start_row[:, None] + length)),
                    dtype=jnp.int32)
  in_prompt_gt = jnp.arange(t, dtype=jnp.int32)[None, :] <= start_g[:, None]
  mismatched = jnp.sum((tokens_gkt != tokens_gkt[:, :1]) & in_prompt_gt[:, None, :], dtype=jnp.int32)
  return outs[0], (outs[1] if with_entropy else None), outside, mismatched
