"""Qwen2/Llama decoder as pure functions over a params dict, its KV cache, and HF checkpoint import/export.

Params are a plain nested dict of arrays; the NNX modules in `layers` / `decoder` are only the program.
Everything here is placement-agnostic: sharding is decided by `param_logical_axes` plus the rule tables
in `rl_fusion_jax.sharding`. Nothing in this package imports torch or transformers.
"""

from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models.decoder import (
    Params,
    abstract_params,
    forward,
    init_params,
    num_params,
    param_logical_axes,
)
from rl_fusion_jax.models.hf_io import load_hf, save_hf
from rl_fusion_jax.models.kv_cache import (DecodeParams, KVCache, cache_logical_axes, decoding_params,
                                          forward_with_cache, init_cache)

__all__ = [
    "DecodeParams",
    "KVCache",
    "ModelConfig",
    "Params",
    "abstract_params",
    "cache_logical_axes",
    "decoding_params",
    "forward",
    "forward_with_cache",
    "init_cache",
    "init_params",
    "load_hf",
    "num_params",
    "param_logical_axes",
    "save_hf",
]
