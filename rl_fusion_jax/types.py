"""Pytrees shared by every stage: what generation produces and what the learner consumes.

Token fields are laid out one row per sample, prompt then response back to back, zero after the end
(``tokens_bt[b, :prompt_len_b]`` is the prompt, the next ``response_len_b`` tokens the response). Every
generated token carries the policy version that produced it and its behaviour log-prob, so later stages
(staleness admission, off-policy correction) need no other bookkeeping.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Rollout:
  tokens_bt: jax.Array          # int32 [B, T]
  prompt_len_b: jax.Array       # int32 [B]
  response_len_b: jax.Array     # int32 [B], includes the EOS token when one was sampled
  logp_bt: jax.Array            # float32 [B, T], behaviour log-prob of token t (0 outside the response)
  version_bt: jax.Array         # int32 [B, T], policy version that produced token t (-1 outside)
  finished_b: jax.Array         # bool [B], True when EOS was sampled (False: truncated at max length)
  sample_id_b: jax.Array        # int32 [B], the sample's global id (its random stream)

  def response_mask(self) -> jax.Array:
    """float32 [B, T]: 1 on response tokens."""
    t = jnp.arange(self.tokens_bt.shape[1])[None, :]
    start = self.prompt_len_b[:, None]
    return ((t >= start) & (t < start + self.response_len_b[:, None])).astype(jnp.float32)


@flax.struct.dataclass
class TrainBatch:
  """What one update consumes. ``mask_bt`` marks the response tokens the loss is taken over."""
  tokens_bt: jax.Array          # int32 [B, T]
  mask_bt: jax.Array            # float32 [B, T]
  advantages_bt: jax.Array      # float32 [B, T], per token (0 outside the response)
  behaviour_logp_bt: jax.Array  # float32 [B, T]
  ref_logp_bt: jax.Array        # float32 [B, T] (zeros when no reference model is used)
  version_bt: jax.Array         # int32 [B, T]
  # float32 [B, T]: log-probs under the parameters before the batch's first update (the proximal policy),
  # when a batch takes several updates (algo.ppo_epochs / algo.mini_batches); None: the current parameters.
  proximal_logp_bt: jax.Array | None = None
