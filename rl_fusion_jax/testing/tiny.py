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
