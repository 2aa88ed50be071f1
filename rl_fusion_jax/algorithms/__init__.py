"""RL algorithm math as pure array functions: advantages, policy losses, KL, entropy, aggregation.

Nothing in this package calls a model; the train step feeds it log-probs, logits, rewards and masks.
Variants are looked up by name through `registry` so an ablation is a config string.
"""

from rl_fusion_jax.algorithms.advantages import ADVANTAGE_SCALES, group_advantages, rloo_advantages
from rl_fusion_jax.algorithms.losses import (
    AGGREGATION_MODES,
    KL_KINDS,
    aggregate,
    check_aggregation_mode,
    clipped_surrogate,
    entropy_from_logits,
    kl_estimate,
    token_weights,
    weighted_sum,
)
from rl_fusion_jax.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    check_aggregation,
    get_advantage_fn,
    get_kl_estimator,
    get_policy_loss,
    get_token_weights_fn,
    register_advantage,
    register_kl_estimator,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "KL_KINDS",
    "POLICY_LOSSES",
    "aggregate",
    "check_aggregation",
    "check_aggregation_mode",
    "clipped_surrogate",
    "entropy_from_logits",
    "get_advantage_fn",
    "get_kl_estimator",
    "get_policy_loss",
    "get_token_weights_fn",
    "group_advantages",
    "kl_estimate",
    "register_advantage",
    "register_kl_estimator",
    "register_policy_loss",
    "rloo_advantages",
    "token_weights",
    "weighted_sum",
]
