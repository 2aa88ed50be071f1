"""Per-token log-probs and entropies of a token sequence under a policy (one forward pass)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_fusion_jax import models


def token_logprobs(model_cfg: models.ModelConfig, params, tokens_bt: jax.Array, temperature: float = 1.0,
                   *, with_entropy: bool = False):
  """logp_bt[b, t] = log pi(tokens[b, t] | tokens[b, :t]) with logits / temperature; 0 at t = 0.

  Returns ``logp_bt`` or ``(logp_bt, entropy_bt)``; entropy_bt[b, t] is the entropy of the distribution
  that token t was drawn from. Both float32 [B, T], aligned with ``tokens_bt``.
  """
  logits_btv = models.forward(model_cfg, params, tokens_bt[:, :-1]) / temperature
  logp_all_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
  logp_bt = jnp.take_along_axis(logp_all_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]
  logp_bt = jnp.pad(logp_bt, ((0, 0), (1, 0)))
  if not with_entropy:
    return logp_bt
  entropy_bt = -jnp.sum(jnp.exp(logp_all_btv) * logp_all_btv, axis=-1)
  return logp_bt, jnp.pad(entropy_bt, ((0, 0), (1, 0)))
