"""rl_fusion_jax: JAX-native RL post-training of LLMs (GRPO, PPO) with co-located training and generation."""

__version__ = "0.1.0"
