"""Conversion between `ModelConfig` and transformers `config.json` dicts (4.x and 5.x layouts).

transformers 4.x writes `rope_theta` and `rope_scaling` at the top level and the weight dtype as
`torch_dtype`; 5.x writes `rope_parameters` (holding `rope_type`, `rope_theta` and the scaling keys) and
`dtype`. Reading accepts either; writing emits both, which 4.x and 5.x each read consistently. Features
the decoder does not implement (sliding windows, o_proj / MLP biases, partial rotary, other activations)
are rejected by name instead of being silently ignored. The one file this module reads is a checkpoint's
`config.json` (`read_config_json`); weights are `models/hf_io.py`'s. It imports nothing but the standard
library, so `rl_fusion_jax.config` can check a checkpoint's architecture without JAX.

Model types: qwen2 and llama (dense), qwen3 (dense with per-head q/k RMSNorm; `attention_bias` would also
bias o_proj, so it is rejected), qwen2_moe (q/k/v biases, a shared expert behind a sigmoid gate) and
qwen3_moe (q/k norm, no shared expert). In the MoE types `intermediate_size` is the MLP width of the dense
layers (`mlp_only_layers`, or off the `decoder_sparse_step` grid) and `moe_intermediate_size` that of each
expert. transformers 5.24 writes Qwen3-MoE's expert count as `num_local_experts`, 4.x as `num_experts`:
both are read, and both written. Qwen2-MoE's `qkv_bias` key is recent (5.24 has it; older versions always
have the biases): it is read (default true) and written.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_TYPES = ("qwen2_moe", "qwen3_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
# Per-model_type defaults of the transformers config classes (as in transformers 5.24), for keys a
# config.json may omit. num_key_value_heads: None means num_attention_heads; head_dim: None means
# hidden_size // num_attention_heads.
_COMMON = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
           "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "head_dim": None}
_MOE_COMMON = {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "router_aux_loss_coef": 0.001}
_DEFAULTS = {
    "qwen2": {**_COMMON, "num_key_value_heads": 32},
    "llama": {**_COMMON, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
              "num_key_value_heads": None},
    "qwen3": {**_COMMON, "num_key_value_heads": 32, "head_dim": 128},
    "qwen2_moe": {**_COMMON, **_MOE_COMMON, "num_key_value_heads": 16, "num_experts": 60,
                  "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {**_COMMON, **_MOE_COMMON, "num_key_value_heads": 4, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768},
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def read_config_json(path: str) -> tuple[str, Any]:
  """(path of config.json, its parsed content) for a checkpoint folder; errors name the file."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: checkpoint folder does not exist")
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path}: missing config.json")
  try:
    with open(config_path, encoding="utf-8") as f:
      return config_path, json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_path}: malformed JSON ({e})") from None


def _require(d: Mapping[str, Any], key: str) -> Any:
  if key not in d:
    raise ValueError(f"config.json: missing key '{key}'")
  return d[key]


def _check_model_type(d: Mapping[str, Any]) -> str:
  model_type = _require(d, "model_type")
  if model_type not in ARCHITECTURES:
    raise ValueError(f"config.json: unsupported model_type {model_type!r} (supported: {sorted(ARCHITECTURES)})")
  archs = d.get("architectures") or [ARCHITECTURES[model_type]]
  if list(archs) != [ARCHITECTURES[model_type]]:
    raise ValueError(f"config.json: unsupported architectures {archs!r} for model_type {model_type!r} "
                     f"(supported: [{ARCHITECTURES[model_type]!r}])")
  return model_type


def _reject_unsupported(d: Mapping[str, Any], model_type: str) -> None:
  if d.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: unsupported hidden_act {d['hidden_act']!r} (only 'silu')")
  if model_type != "llama" and d.get("use_sliding_window", False):
    raise ValueError("config.json: use_sliding_window=true is not supported")
  if any(t != "full_attention" for t in d.get("layer_types") or ()):
    raise ValueError(f"config.json: layer_types {d['layer_types']!r} unsupported (only 'full_attention')")
  for key in {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",),
              "qwen3_moe": ("attention_bias",)}.get(model_type, ()):
    if d.get(key, False):
      raise ValueError(f"config.json: {key}=true is not supported (no o_proj / MLP biases)")
  if model_type == "qwen2_moe" and d.get("shared_expert_intermediate_size", 1) == 0:
    raise ValueError("config.json: shared_expert_intermediate_size=0 is not supported for qwen2_moe "
                     "(transformers keeps a zero-width shared expert and its gate)")
  factor = _rope_dict(d).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
  if factor not in (None, 1, 1.0):
    raise ValueError(f"config.json: partial_rotary_factor={factor} is not supported")


def _rope_dict(d: Mapping[str, Any]) -> dict:
  """The RoPE parameters as one dict: 4.x `rope_scaling` wins over 5.x `rope_parameters` (as in 5.x)."""
  rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
  if not isinstance(rope, Mapping):
    raise ValueError(f"config.json: rope_scaling / rope_parameters must be an object, got {rope!r}")
  if any(isinstance(v, Mapping) for v in rope.values()):
    raise ValueError("config.json: per-layer-type rope_parameters are not supported")
  return dict(rope)


def _weight_dtype(d: Mapping[str, Any]) -> str:
  """bfloat16 checkpoints stay bfloat16; float32, float16 (exactly representable) and unset load as float32."""
  name = d.get("dtype") or d.get("torch_dtype") or "float32"
  if name not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"config.json: unsupported dtype {name!r} (float32, bfloat16 or float16)")
  return "bfloat16" if name == "bfloat16" else "float32"


def _token_id(value: Any) -> int | None:
  # Some checkpoints list several eos ids; the config keeps the first (the canonical one).
  if isinstance(value, (list, tuple)):
    return value[0] if value else None
  return value


def from_hf_dict(cls, d: Mapping[str, Any], **overrides):
  """Builds `cls` (ModelConfig) from a config.json dict; `overrides` replace fields (e.g. dtype=...)."""
  if not isinstance(d, Mapping):
    raise ValueError(f"config.json: expected a JSON object, got {type(d).__name__}")
  model_type = _check_model_type(d)
  for key in _REQUIRED:
    _require(d, key)
  _reject_unsupported(d, model_type)
  defaults = _DEFAULTS[model_type]
  rope = _rope_dict(d)
  get = lambda key: d[key] if d.get(key) is not None else defaults[key]
  fields = dict(
      vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_layers=d["num_hidden_layers"],
      num_heads=d["num_attention_heads"],
      # An absent key takes the class default; an explicit null means one kv head per query head.
      num_kv_heads=d.get("num_key_value_heads", defaults["num_key_value_heads"]) or d["num_attention_heads"],
      intermediate_size=d["intermediate_size"], head_dim=d.get("head_dim", defaults["head_dim"]),
      rope_theta=float(rope.get("rope_theta") or d.get("rope_theta") or defaults["rope_theta"]),
      rope_scaling=rope or None, rms_norm_eps=float(get("rms_norm_eps")),
      qkv_bias=_qkv_bias(d, model_type), qk_norm=model_type in QK_NORM_TYPES,
      tie_word_embeddings=bool(get("tie_word_embeddings")),
      max_position_embeddings=get("max_position_embeddings"), model_type=model_type,
      dtype="float32", param_dtype=_weight_dtype(d),
      bos_token_id=_token_id(d.get("bos_token_id", defaults["bos_token_id"])),
      eos_token_id=_token_id(d.get("eos_token_id", defaults["eos_token_id"])))
  if model_type in MOE_TYPES:
    fields.update(_moe_fields(d, model_type, get))
  fields.update(overrides)
  return cls(**fields)


def _qkv_bias(d: Mapping[str, Any], model_type: str) -> bool:
  # HF Qwen2 always has q/k/v biases, Qwen2-MoE unless its (5.x) `qkv_bias` is false; HF Llama and Qwen3
  # never (their attention_bias=true is rejected above).
  if model_type == "qwen2_moe":
    return bool(d.get("qkv_bias", True))
  return model_type == "qwen2"


def _moe_fields(d: Mapping[str, Any], model_type: str, get) -> dict[str, Any]:
  """The ModelConfig MoE fields of a qwen2_moe / qwen3_moe config.json."""
  num_experts = d.get("num_experts", d.get("num_local_experts"))
  if "num_experts" in d and "num_local_experts" in d and d["num_experts"] != d["num_local_experts"]:
    raise ValueError(f"config.json: num_experts={d['num_experts']!r} disagrees with "
                     f"num_local_experts={d['num_local_experts']!r}")
  mlp_only = get("mlp_only_layers")
  if not isinstance(mlp_only, (list, tuple)):
    raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
  fields = dict(
      num_experts=num_experts if num_experts is not None else _DEFAULTS[model_type]["num_experts"],
      num_experts_per_tok=get("num_experts_per_tok"), moe_intermediate_size=get("moe_intermediate_size"),
      norm_topk_prob=get("norm_topk_prob"), decoder_sparse_step=get("decoder_sparse_step"),
      mlp_only_layers=tuple(mlp_only), router_aux_loss_coef=float(get("router_aux_loss_coef")))
  if model_type == "qwen2_moe":
    fields["shared_expert_intermediate_size"] = get("shared_expert_intermediate_size")
  return fields


def _check_exportable(cfg) -> None:
  if cfg.model_type == "qwen2" and not cfg.qkv_bias:
    raise ValueError("ModelConfig.qkv_bias: HF Qwen2 always has q/k/v biases; qkv_bias=False cannot be "
                     "exported as model_type 'qwen2' (use model_type='llama')")
  if cfg.model_type in ("llama", "qwen3", "qwen3_moe") and cfg.qkv_bias:
    raise ValueError(f"ModelConfig.qkv_bias: HF {ARCHITECTURES[cfg.model_type]} biases include o_proj; "
                     f"qkv_bias=True cannot be exported as model_type {cfg.model_type!r}")
  if cfg.qk_norm != (cfg.model_type in QK_NORM_TYPES):
    raise ValueError(f"ModelConfig.qk_norm: HF {ARCHITECTURES[cfg.model_type]} has q/k norms iff its model "
                     f"type is one of {QK_NORM_TYPES}; qk_norm={cfg.qk_norm} cannot be exported as "
                     f"model_type {cfg.model_type!r}")
  if cfg.num_experts and cfg.model_type not in MOE_TYPES:
    raise ValueError(f"ModelConfig.num_experts: {cfg.num_experts} experts cannot be exported as model_type "
                     f"{cfg.model_type!r} (use one of {MOE_TYPES})")
  shared = cfg.shared_expert_intermediate_size
  if (cfg.model_type == "qwen2_moe" and not shared) or (cfg.model_type == "qwen3_moe" and shared):
    raise ValueError(f"ModelConfig.shared_expert_intermediate_size: HF Qwen2-MoE always has a shared expert, "
                     f"Qwen3-MoE never; {shared} cannot be exported as model_type {cfg.model_type!r}")


def to_hf_dict(cfg, *, dtype: str | None = None) -> dict[str, Any]:
  """A config.json dict that transformers 4.x and 5.x both load as the same model."""
  _check_exportable(cfg)
  dtype = dtype or cfg.param_dtype
  if dtype not in ("float32", "bfloat16"):
    raise ValueError(f"dtype: must be 'float32' or 'bfloat16', got {dtype!r}")
  scaling = cfg.rope_scaling_dict
  d = {
      "architectures": [ARCHITECTURES[cfg.model_type]], "model_type": cfg.model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **(scaling or {})},
      "tie_word_embeddings": cfg.tie_word_embeddings, "attention_dropout": 0.0,
      "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
      "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
  }
  if cfg.model_type == "llama":
    d.update(attention_bias=False, mlp_bias=False)
  else:
    d.update(use_sliding_window=False, sliding_window=None)
  if cfg.model_type in ("qwen2", "qwen3", "qwen2_moe"):
    d.update(max_window_layers=cfg.num_layers)
  if cfg.model_type in QK_NORM_TYPES:
    d.update(attention_bias=False)
  if cfg.model_type in MOE_TYPES:
    d.update(_moe_hf_keys(cfg))
  return d


def _moe_hf_keys(cfg) -> dict[str, Any]:
  d = {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
       "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
       "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": list(cfg.mlp_only_layers),
       "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False}
  if cfg.model_type == "qwen2_moe":
    d.update(shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, qkv_bias=cfg.qkv_bias)
  else:
    d.update(num_local_experts=cfg.num_experts)
  return d
