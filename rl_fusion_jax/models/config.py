"""`ModelConfig` moved to `rl_fusion_jax/model_config.py` (below both `rl_fusion_jax.config` and this
package, so that defining configs needs no JAX). This name stays for callers not yet switched
(experiments/benchmark_moe_main.py); new code imports `rl_fusion_jax.model_config`."""
from rl_fusion_jax.model_config import ModelConfig

__all__ = ["ModelConfig"]
