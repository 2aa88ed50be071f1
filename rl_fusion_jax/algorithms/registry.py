"""Name -> function tables, so that an algorithm ablation is a config string.

A config names its advantage estimator ("grpo", "dr_grpo", "rloo"; with a critic, a token advantage
estimator: "gae"), policy loss ("ppo_clip", and for stale tokens "decoupled_ppo", "tis_token", "tis_seq"),
KL estimator ("k1", "k2", "k3") and aggregation mode; the train step looks the functions up here once,
before tracing. A fork adds a variant with a decorator instead of editing the core:

    @register_advantage("my_adv")
    def my_adv(rewards_b, group_size):
        ...

Call conventions of the tables:
    ADVANTAGE_ESTIMATORS[name](rewards_b, group_size) -> adv_b
    TOKEN_ADVANTAGE_ESTIMATORS[name](token_rewards_bt, values_bt, mask_bt, *, gamma, lam)
        -> (adv_bt, returns_bt)
    POLICY_LOSSES[name](logp_bt, old_logp_bt, adv, **hparams) -> (loss_bt, stats)
    KL_ESTIMATORS[name](logp_bt, ref_logp_bt) -> kl_bt
    AGGREGATIONS[name](mask_bt, *, norm_len=None) -> weights_bt

Policy losses: every registered loss accepts the keywords POLICY_LOSS_KEYWORDS (clip_low, clip_high,
dual_clip, is_cap, proximal_logp_bt, mask_bt, log_ratio_clamp), so the train step can pass the same
ones whatever the name; a loss documents the ones it ignores or rejects (the TIS losses reject a
dual_clip, ppo_clip a proximal_logp_bt, tis_seq requires mask_bt). `old_logp_bt` is the behaviour
log-probs. `stats` holds exactly the keys `losses.POLICY_LOSS_STATS`, each a float [B, T] array.

Token advantage estimators ("gae") serve a learned critic: per-token rewards (e.g.
`advantages.outcome_token_rewards`) and values over the rows' response tokens give per-token advantages
and the critic's regression targets, both exactly 0 outside mask_bt; gamma and lam are static floats in
[0, 1]. The policy losses accept the resulting adv_bt as they accept adv_b.

Importing this module only defines the tables: it registers nothing elsewhere and runs no JAX code.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

from rl_fusion_jax.algorithms import advantages, losses, offpolicy

F = TypeVar("F", bound=Callable)

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "grpo": functools.partial(advantages.group_advantages, scale="std"),
    "dr_grpo": functools.partial(advantages.group_advantages, scale="none"),
    "rloo": advantages.rloo_advantages,
}
TOKEN_ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": advantages.gae,
}
POLICY_LOSSES: dict[str, Callable] = {
    "ppo_clip": losses.clipped_surrogate,
    "decoupled_ppo": offpolicy.decoupled_ppo_surrogate,
    "tis_token": offpolicy.tis_token_loss,
    "tis_seq": offpolicy.tis_seq_loss,
    "uncorrected": offpolicy.uncorrected_surrogate,
}
POLICY_LOSS_KEYWORDS = (
    "clip_low", "clip_high", "dual_clip", "is_cap", "proximal_logp_bt", "mask_bt", "log_ratio_clamp"
)
KL_ESTIMATORS: dict[str, Callable] = {
    kind: functools.partial(losses.kl_estimate, kind=kind) for kind in losses.KL_KINDS
}
AGGREGATIONS: dict[str, Callable] = {
    mode: functools.partial(losses.token_weights, mode=mode) for mode in losses.AGGREGATION_MODES
}


def _lookup(table: dict[str, Callable], what: str, name: str) -> Callable:
  if name not in table:
    raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}")
  return table[name]


def _register(table: dict[str, Callable], what: str, name: str) -> Callable[[F], F]:
  """Decorator factory adding a function to `table`; re-using a name is an error, not an override."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"{what} name must be a non-empty string, got {name!r}")

  def decorator(fn: F) -> F:
    if name in table:
      raise ValueError(f"{what} {name!r} is already registered")
    table[name] = fn
    return fn

  return decorator


def get_advantage_fn(name: str) -> Callable:
  """Returns the advantage estimator `fn(rewards_b, group_size) -> adv_b` registered as `name`."""
  return _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_token_advantage_fn(name: str) -> Callable:
  """Returns `fn(token_rewards_bt, values_bt, mask_bt, *, gamma, lam) -> (adv_bt, returns_bt)` for `name`."""
  return _lookup(TOKEN_ADVANTAGE_ESTIMATORS, "token advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
  """Returns the per-token policy loss `fn(logp_bt, old_logp_bt, adv, **hparams) -> (loss_bt, stats)`."""
  return _lookup(POLICY_LOSSES, "policy loss", name)


def get_kl_estimator(name: str) -> Callable:
  """Returns the per-token KL estimator `fn(logp_bt, ref_logp_bt) -> kl_bt` registered as `name`."""
  return _lookup(KL_ESTIMATORS, "KL estimator", name)


def get_token_weights_fn(name: str) -> Callable:
  """Returns `fn(mask_bt, *, norm_len=None) -> weights_bt` for the aggregation mode `name`."""
  return _lookup(AGGREGATIONS, "aggregation", name)


def check_aggregation(name: str) -> str:
  """Returns `name` if it is a known aggregation mode, else raises ValueError listing the known ones."""
  _lookup(AGGREGATIONS, "aggregation", name)
  return name


def register_advantage(name: str) -> Callable[[F], F]:
  """Decorator registering `fn(rewards_b, group_size) -> adv_b` under `name`."""
  return _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def register_token_advantage(name: str) -> Callable[[F], F]:
  """Decorator registering `fn(token_rewards_bt, values_bt, mask_bt, *, gamma, lam) -> (adv_bt, returns_bt)`."""
  return _register(TOKEN_ADVANTAGE_ESTIMATORS, "token advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[F], F]:
  """Decorator registering `fn(logp_bt, old_logp_bt, adv, **hparams) -> (loss_bt, stats)` under `name`.

  `fn` must accept the POLICY_LOSS_KEYWORDS and return the `losses.POLICY_LOSS_STATS` keys (see above).
  """
  return _register(POLICY_LOSSES, "policy loss", name)


def register_kl_estimator(name: str) -> Callable[[F], F]:
  """Decorator registering `fn(logp_bt, ref_logp_bt) -> kl_bt` under `name`."""
  return _register(KL_ESTIMATORS, "KL estimator", name)
