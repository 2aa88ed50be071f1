"""RL algorithm math as pure array functions: advantages, policy losses (on- and off-policy), KL, entropy,
aggregation.

Nothing in this package calls a model; the train step feeds it log-probs, logits, rewards and masks.
Variants are looked up by name through `registry` so an ablation is a config string.
"""

from rl_fusion_jax.algorithms.advantages import ADVANTAGE_SCALES, group_advantages, rloo_advantages
from rl_fusion_jax.algorithms.losses import (
    AGGREGATION_MODES,
    KL_KINDS,
    LOG_RATIO_CLAMP,
    POLICY_LOSS_STATS,
    aggregate,
    check_aggregation_mode,
    clipped_surrogate,
    entropy_from_logits,
    kl_estimate,
    token_weights,
    weighted_sum,
)
from rl_fusion_jax.algorithms.offpolicy import (
    IS_CAP,
    decoupled_ppo_surrogate,
    tis_seq_loss,
    tis_token_loss,
)
from rl_fusion_jax.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    POLICY_LOSS_KEYWORDS,
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
    "IS_CAP",
    "KL_ESTIMATORS",
    "KL_KINDS",
    "LOG_RATIO_CLAMP",
    "POLICY_LOSSES",
    "POLICY_LOSS_KEYWORDS",
    "POLICY_LOSS_STATS",
    "aggregate",
    "check_aggregation",
    "check_aggregation_mode",
    "clipped_surrogate",
    "decoupled_ppo_surrogate",
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
    "tis_seq_loss",
    "tis_token_loss",
    "token_weights",
    "weighted_sum",
]
