"""The tiny decoder the unit tests share: 2 layers, width 32, 4 query heads over 2 KV heads, vocabulary 64.

Small enough that a test compiles and runs it in a second on CPU, with grouped-query attention and q/k/v
biases so that every path of the model is exercised. Tests that need other values pass them as overrides.
"""
from __future__ import annotations

from typing import Any

from rl_fusion_jax import models

TINY_MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, qkv_bias=True, max_position_embeddings=64)


def tiny_model_config(**overrides: Any) -> models.ModelConfig:
  """`TINY_MODEL` as a ModelConfig, with any field replaced by ``overrides``."""
  return models.ModelConfig(**(TINY_MODEL | overrides))


def save_tiny_reward_model(path: str, vocab_size: int = 96, hidden: int = 32) -> None:
  """A one-layer learned reward model with random weights (seed 3, init std 0.5), saved at ``path`` as
  ``task.reward_model`` reads it."""
  import jax  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.models import reward_model  # pylint: disable=g-import-not-at-top
  rm_cfg = models.ModelConfig(vocab_size=vocab_size, hidden_size=hidden, num_layers=1, num_heads=2,
                              num_kv_heads=1, intermediate_size=32, qkv_bias=True, max_position_embeddings=32)
  params = reward_model.init_reward_params(rm_cfg, jax.random.key(3), init_std=0.5)
  reward_model.save_reward_model(rm_cfg, params, path)
