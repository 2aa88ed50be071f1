"""RL algorithm math as pure array functions: advantages (group-relative and GAE), policy losses (on- and
off-policy), value loss, KL, entropy, aggregation, DAPO's overlong penalty and dynamic-sampling filters.

Nothing in this package calls a model; the train step feeds it log-probs, logits, rewards and masks.
Variants are looked up by name through `registry` so an ablation is a config string.
"""

from rl_fusion_jax.algorithms.advantages import (
    ADVANTAGE_SCALES,
    gae,
    group_advantages,
    outcome_token_rewards,
    rloo_advantages,
)
from rl_fusion_jax.algorithms.dapo import (
    informative_groups,
    informative_sample_mask,
    overlong_penalty,
    select_informative,
)
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
    value_loss,
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
    TOKEN_ADVANTAGE_ESTIMATORS,
    check_aggregation,
    get_advantage_fn,
    get_kl_estimator,
    get_policy_loss,
    get_token_advantage_fn,
    get_token_weights_fn,
    register_advantage,
    register_kl_estimator,
    register_policy_loss,
    register_token_advantage,
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
    "POLICY_LOSS_STATS",
    "TOKEN_ADVANTAGE_ESTIMATORS",
    "aggregate",
    "check_aggregation",
    "check_aggregation_mode",
    "clipped_surrogate",
    "decoupled_ppo_surrogate",
    "entropy_from_logits",
    "gae",
    "get_advantage_fn",
    "get_kl_estimator",
    "get_policy_loss",
    "get_token_advantage_fn",
    "get_token_weights_fn",
    "group_advantages",
    "informative_groups",
    "informative_sample_mask",
    "kl_estimate",
    "outcome_token_rewards",
    "overlong_penalty",
    "register_advantage",
    "register_kl_estimator",
    "register_policy_loss",
    "register_token_advantage",
    "rloo_advantages",
    "select_informative",
    "tis_seq_loss",
    "tis_token_loss",
    "token_weights",
    "value_loss",
    "weighted_sum",
]
