"""CISPO as a plugin: a policy loss registered in one file, loaded with ``--config.algo.plugins``.

CISPO (MiniMax-M1, Chen et al. 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
Attention") keeps every token's gradient and clips the importance-sampling weight instead of the update:

    loss_t = -sg(min(r_t, 1 + eps_high)) * A * log pi_theta(y_t),   r_t = pi_theta(y_t) / pi_old(y_t)

with ``sg`` the stop-gradient, so a token with r_t above 1 + eps_high still contributes, with a capped
weight (PPO's clip would zero it). ``pi_old`` is the proximal policy when a batch takes several updates
(``algo.ppo_epochs`` / ``algo.mini_batches``), else the behaviour policy. The value of ``loss_t`` is
written ``-w * A * exp(logp - sg(logp))`` (value -w * A, gradient -w * A * d logp).

    python experiments/grpo_main.py --config=experiments/configs/arithmetic.py --workdir=/tmp/cispo \\
      --config.algo.plugins=experiments/cispo_loss.py --config.algo.policy_loss=cispo \\
      --config.algo.loss_kwargs=eps_high=0.28

Nothing in the package imports this file: the plugin mechanism (algorithms/registry.py) does.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rl_fusion_jax.algorithms import losses, registry


@dataclasses.dataclass(frozen=True)
class CISPOParams:
  eps_high: float = 0.28     # the weight is capped at 1 + eps_high

  def __post_init__(self):
    if not self.eps_high > 0:
      raise ValueError(f"eps_high must be > 0, got {self.eps_high!r}")


@registry.register_policy_loss("cispo", params=CISPOParams)
def cispo_loss(logp_bt, old_logp_bt, adv, *, eps_high: float, mask_bt=None, proximal_logp_bt=None):
  """Per-token CISPO loss and the registry's stats (``losses.POLICY_LOSS_STATS``)."""
  del mask_bt   # token-level: every position is its own term
  logp_bt = jnp.asarray(logp_bt, jnp.float32)
  anchor_bt = jax.lax.stop_gradient(jnp.asarray(old_logp_bt if proximal_logp_bt is None else proximal_logp_bt,
                                                jnp.float32))
  adv_bt = jnp.broadcast_to(adv[:, None] if jnp.ndim(adv) == 1 else adv, logp_bt.shape)
  log_ratio_bt = jax.lax.stop_gradient(logp_bt) - anchor_bt
  clamped_bt = (jnp.abs(log_ratio_bt) > losses.LOG_RATIO_CLAMP).astype(jnp.float32)
  ratio_bt = jnp.exp(jnp.clip(log_ratio_bt, -losses.LOG_RATIO_CLAMP, losses.LOG_RATIO_CLAMP))
  weight_bt = jnp.minimum(ratio_bt, 1.0 + eps_high)
  loss_bt = -weight_bt * adv_bt * jnp.exp(logp_bt - jax.lax.stop_gradient(logp_bt))
  zeros_bt = jnp.zeros_like(logp_bt)
  return loss_bt, {"ratio": ratio_bt, "clipped": (ratio_bt > 1.0 + eps_high).astype(jnp.float32),
                   "dual_clipped": zeros_bt, "is_weight": jnp.ones_like(logp_bt), "is_truncated": zeros_bt,
                   "log_ratio_clamped": clamped_bt}
