"""`ModelConfig`: the one frozen, hashable description of a decoder (Qwen2 / Llama family).

It is the static argument of every jitted model function, so it must stay hashable: `rope_scaling` is kept
as a sorted tuple of `(key, value)` pairs (a dict passed in is converted). Validation happens here, once,
with errors (`ModelConfigError`, a `ConfigError`) that name the field. Conversion to and from Hugging Face
`config.json` dicts lives in `rl_fusion_jax/hf_config.py`; `read_config` reads a checkpoint's config.json
and nothing else.

This module sits below `rl_fusion_jax.config` and `rl_fusion_jax.models`, so it must never import JAX,
Flax or anything of `models/`: it imports the standard library, numpy and ml_dtypes (the dtype
properties are numpy dtypes, equal to the JAX dtypes of the same name) and the leaves `errors` and
`hf_config`.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from rl_fusion_jax import hf_config
from rl_fusion_jax.errors import ConfigError

MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen2_moe", "qwen3_moe")
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# The precision policies `ModelConfig.dtype` names: (activation dtype, matmul input dtype). Matmuls always
# accumulate in float32 when their inputs are bfloat16 under 'bf16_matmul'; see layers.Projection.
PRECISIONS = {"float32": ("float32", "float32"), "bf16_matmul": ("float32", "bfloat16"),
              "bfloat16": ("bfloat16", "bfloat16")}
# `ModelConfig.dtype='auto'`: the policy `default_precision` picks for the backend the program runs on.
AUTO = "auto"
# x86 CPU flags (Linux /proc/cpuinfo) of instructions that compute bfloat16 dot products natively. Without
# them XLA:CPU's bfloat16 dots ran at about half float32's rate at tiny-grpo's shapes, so 'bf16_matmul' is slower:
# tiny-grpo's step took 1.39-1.52x float32's and the main job's 1.07-1.18x on a 2-core AMD EPYC without them, where
# with AVX512-BF16 'bf16_matmul' was the faster policy (BENCHMARKS.md, "Precision policy by CPU").
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
ROPE_TYPES = ("default", "llama3")
# `ModelConfig.remat`: what the backward pass keeps of each scanned layer's forward. 'none' keeps every
# activation the backward needs; 'full' keeps only each layer's input and recomputes the rest; 'matmuls'
# keeps the outputs of the projection matmuls (tagged "proj" in layers.Projection) and recomputes the cheap
# element-wise work and attention between them.
REMAT_POLICIES = ("none", "full", "matmuls")
# Fields that change how the model is computed, not which model it is: a config may set them when it
# loads a checkpoint (everything else must agree with the checkpoint's config.json).
RUNTIME_FIELDS = ("dtype", "remat", "logits_chunk", "scan_unroll", "moe_impl", "moe_capacity_factor",
                  "router_aux_loss_coef", "router_z_loss_coef")
# `ModelConfig.moe_impl`: how routed tokens meet their experts (models/moe.py). 'ragged_dot' groups the
# sorted tokens with `jax.lax.ragged_dot`; 'blocked' pads each expert's group to whole blocks and runs one
# matmul per block (XLA:CPU lowers ragged_dot to a dense masked product over every expert); 'auto' picks
# 'blocked' on the CPU backend and 'ragged_dot' elsewhere. All three are dropless; with
# `moe_capacity_factor` set, each expert takes at most ceil(factor * tokens * top_k / experts) tokens
# instead (the rest are dropped from that expert, as in Switch / GShard).
MOE_IMPLS = ("auto", "ragged_dot", "blocked")
# Keys the llama3 frequency formula reads (transformers `_compute_llama3_parameters`).
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ModelConfigError(ConfigError):
  """A bad `ModelConfig` field. `field` is its name (or a path inside it, 'rope_scaling.factor'), so that
  the config layer can report it as `config.model.<field>`; a `ValueError`, as `ConfigError` is."""

  def __init__(self, field: str, reason: str):
    super().__init__(f"ModelConfig.{field}: {reason}")
    self.field, self.reason = field, reason


def _fail(field: str, message: str, value: Any) -> ModelConfigError:
  return ModelConfigError(field, f"{message}, got {value!r}")


def _check_positive_int(field: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise _fail(field, "must be a positive int", value)


def _check_optional_token(field: str, value: Any) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
    raise _fail(field, "must be None or a non-negative int", value)


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
  """The host CPU's feature flags (the first processor's ``flags`` line of ``path``); empty where the file
  is missing or has none (not Linux, not x86)."""
  try:
    with open(path) as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.partition(":")[2].split())
  except OSError:
    pass
  return frozenset()


@functools.cache
def default_precision() -> str:
  """The policy ``dtype='auto'`` computes in: 'bf16_matmul' on an accelerator, and on the CPU backend where
  the CPU computes bfloat16 dot products natively (`NATIVE_BF16_CPU_FLAGS`); 'float32' on other CPUs.
  It asks JAX for its backend, which starts the backend: resolve after `jax.distributed.initialize` and
  the XLA flags (the binaries resolve in `loop.run`; validating a config does not resolve)."""
  import jax  # pylint: disable=import-outside-toplevel  (the config layer imports no JAX otherwise)
  if jax.default_backend() != "cpu":
    return "bf16_matmul"
  return "bf16_matmul" if cpu_flags() & set(NATIVE_BF16_CPU_FLAGS) else "float32"


def normalize_rope_scaling(value: Any) -> tuple | None:
  """Returns `rope_scaling` as a sorted tuple of pairs, or None for plain RoPE; raises on unknown types.

  Accepts None, a mapping, or a tuple of pairs. The legacy key `type` is read as `rope_type`, and
  `rope_theta` is dropped here because it is its own field. `rope_type='default'` normalizes to None so
  that equal models compare (and hash) equal.
  """
  if value is None:
    return None
  if isinstance(value, Mapping):
    items = dict(value)
  else:
    try:
      items = dict(value)
    except (TypeError, ValueError):
      raise _fail("rope_scaling", "must be None, a dict or a tuple of (key, value) pairs", value) from None
  if "type" in items:
    items.setdefault("rope_type", items.pop("type"))
  items.pop("rope_theta", None)
  rope_type = items.get("rope_type", "default")
  if rope_type not in ROPE_TYPES:
    raise _fail("rope_scaling.rope_type", f"unsupported (supported: {', '.join(ROPE_TYPES)})", rope_type)
  if rope_type == "default":
    return None
  return _normalize_llama3(items)


def _normalize_llama3(items: dict) -> tuple:
  missing = [k for k in LLAMA3_ROPE_KEYS if k not in items]
  if missing:
    raise _fail("rope_scaling", f"rope_type 'llama3' needs keys {missing}", items)
  for key in LLAMA3_ROPE_KEYS:
    if isinstance(items[key], bool) or not isinstance(items[key], (int, float)) or items[key] <= 0:
      raise _fail(f"rope_scaling.{key}", "must be a positive number", items[key])
  if items["high_freq_factor"] <= items["low_freq_factor"]:
    raise _fail("rope_scaling.high_freq_factor", "must exceed low_freq_factor", items["high_freq_factor"])
  # Only what the formula reads is kept; extra keys (e.g. a repeated rope_theta) would break equality.
  kept = {k: items[k] for k in LLAMA3_ROPE_KEYS}
  kept["factor"] = float(kept["factor"])
  kept["low_freq_factor"] = float(kept["low_freq_factor"])
  kept["high_freq_factor"] = float(kept["high_freq_factor"])
  kept["original_max_position_embeddings"] = int(kept["original_max_position_embeddings"])
  kept["rope_type"] = "llama3"
  return tuple(sorted(kept.items()))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static shape and numerics of a Qwen2/Llama decoder.

  `head_dim=None` is resolved in `__post_init__` to `hidden_size // num_heads`, so `cfg.head_dim` is
  always an int afterwards (`cfg.head_dim_` is the same value, kept as an alias).
  `dtype` is the precision policy of the computation (`PRECISIONS`): 'float32' (everything float32),
  'bf16_matmul' (projection and lm-head matmuls take bfloat16 inputs and accumulate in float32, forward
  and backward; activations, residual stream and everything else stay float32) or 'bfloat16' (activations
  and matmuls in bfloat16); 'auto' computes in the policy `default_precision` picks where the program
  runs ('bf16_matmul' on an accelerator or a CPU with native bfloat16 dot products, else 'float32';
  `precision` is the resolved name). `param_dtype` is the storage dtype of parameters. Attention softmax,
  RMSNorm statistics and logits are always float32.

  The `num_layers` blocks are one stacked parameter tree (`params['layers']`, leading axis 'layers') run
  by `lax.scan`; `remat` (`REMAT_POLICIES`) says what the backward pass keeps of each layer, and
  `scan_unroll` how many layers one loop iteration runs (1: compile time independent of depth;
  `num_layers` or more: fully unrolled, which the tiny experiment configs use on CPU; compile times of
  both in BENCHMARKS.md, "Compile time against depth"; 0, the default: unrolled on the CPU backend, 1
  elsewhere and wherever `remat` is not 'none', which unrolled layers would defeat). Log-probs
  (`train.logprobs`) compute the lm head `logits_chunk` tokens at a time, so no float32 [B, T, V] tensor
  exists in the update: a positive number of tokens per chunk.
  """
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  intermediate_size: int
  head_dim: int | None = None
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 2048
  model_type: str = "qwen2"
  dtype: str = "float32"
  param_dtype: str = "float32"
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  remat: str = "none"
  # 0 (default): every layer unrolled on the CPU backend, 1 elsewhere and under remat (which unrolled layers
  # defeat: decoder._default_unroll). On CPU meshes of several devices,
  # XLA:CPU's in-process collectives inside a rolled layer scan deadlocked intermittently (README, Known
  # limits; docs/models.md); tiny CPU models also run faster unrolled.
  scan_unroll: int = 0
  logits_chunk: int = 1024
  # Mixture of experts (Qwen2-MoE / Qwen3-MoE): num_experts=0 is a dense model. Layer i is sparse iff
  # num_experts > 0, i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (HF's rule).
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  shared_expert_intermediate_size: int = 0    # 0: no shared expert (Qwen3-MoE)
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple = ()
  # Qwen3 attention: RMSNorm over head_dim on every q and k head, before RoPE.
  qk_norm: bool = False
  moe_impl: str = "auto"
  moe_capacity_factor: float | None = None
  router_aux_loss_coef: float = 0.001
  router_z_loss_coef: float = 0.0

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "intermediate_size", "max_position_embeddings", "logits_chunk"):
      _check_positive_int(name, getattr(self, name))
    if self.num_heads % self.num_kv_heads:
      raise _fail("num_kv_heads", f"must divide num_heads={self.num_heads}", self.num_kv_heads)
    self._resolve_head_dim()
    for name in ("rope_theta", "rms_norm_eps"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _fail(name, "must be a positive number", value)
    object.__setattr__(self, "rope_scaling", normalize_rope_scaling(self.rope_scaling))
    for name in ("qkv_bias", "tie_word_embeddings", "qk_norm", "norm_topk_prob"):
      if not isinstance(getattr(self, name), bool):
        raise _fail(name, "must be a bool", getattr(self, name))
    for name, choices in (("model_type", MODEL_TYPES), ("dtype", (*PRECISIONS, AUTO)),
                          ("remat", REMAT_POLICIES), ("param_dtype", tuple(DTYPES)), ("moe_impl", MOE_IMPLS)):
      if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
        raise _fail(name, f"must be one of {choices}", getattr(self, name))
    if isinstance(self.scan_unroll, bool) or not isinstance(self.scan_unroll, int) or self.scan_unroll < 0:
      raise _fail("scan_unroll", "must be an int >= 0 (0: unrolled on CPU, 1 elsewhere)", self.scan_unroll)
    _check_optional_token("bos_token_id", self.bos_token_id)
    _check_optional_token("eos_token_id", self.eos_token_id)
    self._check_moe()

  def _check_moe(self) -> None:
    """The MoE fields' types and ranges (also in a dense model, where they must keep their defaults' kind),
    then what a sparse model needs."""
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(name, "must be an int >= 0", value)
    _check_positive_int("decoder_sparse_step", self.decoder_sparse_step)
    self._check_mlp_only_layers()
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise _fail(name, "must be a number >= 0", value)
    cf = self.moe_capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0):
      raise _fail("moe_capacity_factor", "must be None (dropless) or a number > 0", cf)
    if self.num_experts == 0:
      return
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise _fail("num_experts_per_tok", f"must be in [1, num_experts={self.num_experts}]",
                  self.num_experts_per_tok)
    _check_positive_int("moe_intermediate_size", self.moe_intermediate_size)

  def _check_mlp_only_layers(self) -> None:
    layers = self.mlp_only_layers
    message = f"must be a sequence of layer indices in [0, {self.num_layers})"
    if isinstance(layers, (str, bytes, Mapping)) or not hasattr(layers, "__iter__"):
      raise _fail("mlp_only_layers", message, layers)
    layers = tuple(layers)
    object.__setattr__(self, "mlp_only_layers", layers)
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers for i in layers):
      raise _fail("mlp_only_layers", message, layers)

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0 and "moe" in self.layer_kinds

  @property
  def layer_kinds(self) -> tuple[str, ...]:
    """'moe' or 'dense' per layer, by HF's rule (see the field comments)."""
    def kind(i):
      sparse = (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)
      return "moe" if sparse else "dense"
    return tuple(kind(i) for i in range(self.num_layers))

  @property
  def layer_stacks(self) -> tuple[tuple[str, int], ...]:
    """Per layer, (stacked param tree, index in it): 'layers' holds every layer of the first kind;
    a model mixing dense and sparse layers keeps its dense ones in 'dense_layers'."""
    kinds = self.layer_kinds
    main = kinds[0] if len(set(kinds)) == 1 else "moe"
    counts = {"layers": 0, "dense_layers": 0}
    out = []
    for k in kinds:
      name = "layers" if k == main else "dense_layers"
      out.append((name, counts[name]))
      counts[name] += 1
    return tuple(out)

  def _resolve_head_dim(self) -> None:
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise _fail("head_dim", f"is None and num_heads={self.num_heads} does not divide hidden_size "
                    f"={self.hidden_size}; set head_dim", self.head_dim)
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    _check_positive_int("head_dim", self.head_dim)
    if self.head_dim % 2:
      raise _fail("head_dim", "must be even (RoPE rotates halves)", self.head_dim)

  @property
  def head_dim_(self) -> int:
    """Resolved head dimension (alias of `head_dim`, which `__post_init__` already resolved)."""
    return self.head_dim

  @property
  def precision(self) -> str:
    """The precision policy the model computes in: `dtype`, or for 'auto' the one `default_precision`
    picks for the backend JAX runs on."""
    return default_precision() if self.dtype == AUTO else self.dtype

  @property
  def compute_dtype(self) -> np.dtype:
    """The activations' dtype (residual stream, attention, KV cache) under the precision policy."""
    return DTYPES[PRECISIONS[self.precision][0]]

  @property
  def matmul_dtype(self) -> np.dtype:
    """The input dtype of projection and lm-head matmuls under the precision policy."""
    return DTYPES[PRECISIONS[self.precision][1]]

  @property
  def weight_dtype(self) -> np.dtype:
    return DTYPES[self.param_dtype]

  @property
  def generation_dtype(self) -> np.dtype:
    """The dtype generation holds the weights in: the compute dtype where it is narrower than the
    param dtype ('bfloat16' compute over float32 master weights), else the param dtype. Under 'bfloat16'
    every weight is cast to the compute dtype before use, so a bfloat16 copy computes exactly what the
    master weights do, in half the memory; 'bf16_matmul' keeps norms, biases and embeddings in float32,
    so its generation weights stay float32."""
    compute, weights = self.compute_dtype, self.weight_dtype
    return compute if compute.itemsize < weights.itemsize else weights

  @property
  def rope_scaling_dict(self) -> dict | None:
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  @classmethod
  def from_hf_dict(cls, d: Mapping[str, Any], **overrides) -> "ModelConfig":
    """Builds a config from a transformers `config.json` dict (4.x or 5.x layout); see `hf_config`."""
    return hf_config.from_hf_dict(cls, d, **overrides)

  def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
    """A transformers-loadable `config.json` dict; `dtype` is the saved weight dtype (default param_dtype)."""
    return hf_config.to_hf_dict(self, dtype=dtype)


def read_config(path: str) -> ModelConfig:
  """`ModelConfig` of the checkpoint folder `path`; errors name the folder or config.json and the key."""
  config_path, d = hf_config.read_config_json(path)
  try:
    return ModelConfig.from_hf_dict(d)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{config_path}: {e}") from None
