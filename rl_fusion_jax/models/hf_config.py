"""Conversion between `ModelConfig` and transformers `config.json` dicts (4.x and 5.x layouts).

transformers 4.x writes `rope_theta` and `rope_scaling` at the top level and the weight dtype as
`torch_dtype`; 5.x writes `rope_parameters` (holding `rope_type`, `rope_theta` and the scaling keys) and
`dtype`. Reading accepts either; writing emits both, which 4.x and 5.x each read consistently. Features
the decoder does not implement (sliding windows, o_proj / MLP biases, partial rotary, other activations)
are rejected by name instead of being silently ignored. This module never reads files.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
# Per-model_type defaults of the transformers config classes, for keys a config.json may omit.
_DEFAULTS = {
    "qwen2": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None},
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


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
  if model_type == "qwen2" and d.get("use_sliding_window", False):
    raise ValueError("config.json: use_sliding_window=true is not supported")
  if any(t != "full_attention" for t in d.get("layer_types") or ()):
    raise ValueError(f"config.json: layer_types {d['layer_types']!r} unsupported (only 'full_attention')")
  if model_type == "llama":
    for key in ("attention_bias", "mlp_bias"):
      if d.get(key, False):
        raise ValueError(f"config.json: {key}=true is not supported (no o_proj / MLP biases)")
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
      num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
      intermediate_size=d["intermediate_size"], head_dim=d.get("head_dim"),
      rope_theta=float(rope.get("rope_theta") or d.get("rope_theta") or defaults["rope_theta"]),
      rope_scaling=rope or None, rms_norm_eps=float(get("rms_norm_eps")),
      qkv_bias=model_type == "qwen2",  # HF Qwen2 always has q/k/v biases; HF Llama (attention_bias=false) never
      tie_word_embeddings=bool(get("tie_word_embeddings")),
      max_position_embeddings=get("max_position_embeddings"), model_type=model_type,
      dtype="float32", param_dtype=_weight_dtype(d),
      bos_token_id=_token_id(d.get("bos_token_id", defaults["bos_token_id"])),
      eos_token_id=_token_id(d.get("eos_token_id", defaults["eos_token_id"])))
  fields.update(overrides)
  return cls(**fields)


def _check_exportable(cfg) -> None:
  if cfg.model_type == "qwen2" and not cfg.qkv_bias:
    raise ValueError("ModelConfig.qkv_bias: HF Qwen2 always has q/k/v biases; qkv_bias=False cannot be "
                     "exported as model_type 'qwen2' (use model_type='llama')")
  if cfg.model_type == "llama" and cfg.qkv_bias:
    raise ValueError("ModelConfig.qkv_bias: HF Llama biases include o_proj; qkv_bias=True cannot be "
                     "exported as model_type 'llama' (use model_type='qwen2')")


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
  if cfg.model_type == "qwen2":
    d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
  else:
    d.update(attention_bias=False, mlp_bias=False)
  return d
