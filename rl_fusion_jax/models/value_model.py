"""A PPO critic: the policy's decoder body with a per-token scalar head (a value per state).

Params are `{"body": decoder params without an LM head, "score": {"kernel": [D, 1], "bias": [1]}}`. The
body is `reward_model`'s (the same `models.decoder` program built by `reward_model.body_config`); the
head matches transformers' `*ForTokenClassification` with `num_labels=1` (`score.weight` [1, D] and
`score.bias` [1]), so checkpoints are written in that format with `architectures` naming that class.

Values are aligned like token log-probs (`train.logprobs`): values_bt[:, t] = head(h[:, t - 1]) is the
value of the state that token t was drawn from (tokens < t), and values_bt[:, 0] = 0. Like the decoder,
this module never places or shards anything, and never imports torch or transformers.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rl_fusion_jax import hf_config
from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models import decoder, hf_io
from rl_fusion_jax.models import reward_model as rm
from rl_fusion_jax.models.layers import F32

ValueParams = dict[str, Any]

ARCHITECTURES = {"qwen2": "Qwen2ForTokenClassification", "llama": "LlamaForTokenClassification"}
SCORE_BIAS_TENSOR = "score.bias"   # HF name of the head's bias, [num_labels=1]


def _head_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  return {"kernel": (cfg.hidden_size, 1), "bias": (1,)}


# ---------------------------------------------------------------------------------------- params


def init_value_params(cfg: ModelConfig, rng: jax.Array, *, init_std: float = 0.02) -> ValueParams:
  """Random body (as `models.init_params`), head kernel ~ N(0, init_std) and bias 0, in cfg.param_dtype."""
  params = rm.init_reward_params(cfg, rng, init_std=init_std)
  params["score"]["bias"] = jnp.zeros((1,), cfg.weight_dtype)
  return params


def value_params_from_policy(cfg: ModelConfig, policy_params: decoder.Params) -> ValueParams:
  """A critic initialised from the policy: its body (every param but `lm_head`), head kernel and bias 0.

  The body arrays are copies in cfg.param_dtype (on the policy arrays' devices and shardings), so donating
  or updating either model never touches the other; the head is created on the default device. The
  initial values are all 0. `policy_params` must match `cfg` (with or without an LM head).
  """
  try:
    decoder.check_params(cfg, policy_params)
  except ValueError as e:
    raise ValueError(f"policy_params: {e}") from None
  dtype = cfg.weight_dtype
  body = {k: jax.tree.map(lambda x: jnp.array(x, dtype=dtype, copy=True), v)
          for k, v in policy_params.items() if k != "lm_head"}
  head = {name: jnp.zeros(shape, dtype) for name, shape in _head_shapes(cfg).items()}
  return {"body": body, "score": head}


def value_logical_axes(cfg: ModelConfig) -> dict[str, Any]:
  """Logical axis names per param (same structure as `init_value_params`); the head's output is unsharded."""
  axes = rm.reward_logical_axes(cfg)
  axes["score"]["bias"] = (None,)
  return axes


def abstract_value_params(cfg: ModelConfig) -> ValueParams:
  """`jax.ShapeDtypeStruct` per param, allocating nothing."""
  head = {name: jax.ShapeDtypeStruct(shape, cfg.weight_dtype) for name, shape in _head_shapes(cfg).items()}
  return {"body": decoder.abstract_params(rm.body_config(cfg)), "score": head}


def check_value_params(cfg: ModelConfig, params: ValueParams) -> None:
  """Raises ValueError naming the first missing, unexpected or wrongly shaped entry."""
  if not isinstance(params, Mapping) or set(params) != {"body", "score"}:
    keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
    raise ValueError(f"params: expected keys ['body', 'score'], got {keys}")
  try:
    decoder.check_params(rm.body_config(cfg), params["body"])
  except ValueError as e:
    raise ValueError(f"params['body']: {e}") from None
  head, shapes = params["score"], _head_shapes(cfg)
  if not isinstance(head, Mapping) or set(head) != set(shapes):
    got = sorted(head) if isinstance(head, Mapping) else type(head).__name__
    raise ValueError(f"params['score']: expected keys ['bias', 'kernel'] (kernel [D, 1], bias [1]), got {got}")
  for name, shape in shapes.items():
    if tuple(jnp.shape(head[name])) != shape:
      raise ValueError(f"params['score'][{name!r}]: shape {tuple(jnp.shape(head[name]))}, expected {shape}")


# --------------------------------------------------------------------------------------- forward


def values(cfg: ModelConfig, params: ValueParams, tokens_bt: Int[Array, "B T"]) -> Float[Array, "B T"]:
  """Float32 values [B, T]: values_bt[:, t] = head(h[:, t - 1]) (the state before token t), 0 at t = 0.

  Jit with `cfg` static. The head runs in the compute dtype with float32 accumulation (as
  `reward_model.score`); the bias is added in float32. Value t depends only on tokens < t.
  """
  if jnp.ndim(tokens_bt) != 2 or not jnp.issubdtype(jnp.result_type(tokens_bt), jnp.integer):
    raise ValueError(f"tokens_bt: expected integer tokens of shape [B, T], got {jnp.shape(tokens_bt)} "
                     f"{jnp.result_type(tokens_bt)}")
  check_value_params(cfg, params)
  b, t = tokens_bt.shape
  if t < 2:   # no state has a predecessor token: all values are the t = 0 padding
    return jnp.zeros((b, t), F32)
  hidden_btd = rm.hidden_states(cfg, params, tokens_bt[:, :-1])
  kernel_d1 = params["score"]["kernel"].astype(cfg.compute_dtype)
  values_bt = jnp.einsum("BTD,DO->BTO", hidden_btd, kernel_d1, preferred_element_type=F32)[..., 0]
  values_bt = values_bt + params["score"]["bias"].astype(F32)
  return jnp.pad(values_bt, ((0, 0), (1, 0)))


def packed_values(cfg: ModelConfig, params: ValueParams, tokens_rw: Int[Array, "R W"],
                  positions_rw: Int[Array, "R W"], segment_ids_rw: Int[Array, "R W"]) -> Float[Array, "R W"]:
  """``values`` of samples packed several to a row (``train/packing.py``: positions restart per sample,
  attention stays within a segment): values_rw[:, w] = head(h[:, w - 1]) within the sample, 0 where a
  sample starts (position 0) and on padding, as each sample's values on its own padded row."""
  check_value_params(cfg, params)
  r, w = tokens_rw.shape
  if w < 2:
    return jnp.zeros((r, w), F32)
  model = decoder.bind(rm.body_config(cfg), params["body"])
  pos, seg = positions_rw[:, :-1], segment_ids_rw[:, :-1]
  hidden_rwd = model.hidden(tokens_rw[:, :-1], pos, decoder.attention_mask(pos, seg))
  kernel_d1 = params["score"]["kernel"].astype(cfg.compute_dtype)
  values_rw = jnp.einsum("RWD,DO->RWO", hidden_rwd, kernel_d1, preferred_element_type=F32)[..., 0]
  values_rw = jnp.pad(values_rw + params["score"]["bias"].astype(F32), ((0, 0), (1, 0)))
  return jnp.where(positions_rw == 0, 0.0, values_rw)


# ------------------------------------------------------------------------------------ checkpoints


def head_tensors(cfg: ModelConfig) -> rm.HeadTensors:
  """The value head's HF tensors: `score.weight` [1, D] and `score.bias` [1]."""
  return {**rm.head_tensors(cfg), SCORE_BIAS_TENSOR: ("bias", "bias", (1,))}


def value_hf_dict(cfg: ModelConfig, *, dtype: str | None = None) -> dict[str, Any]:
  """config.json of a transformers `*ForTokenClassification` with one label (num_labels=1)."""
  return rm.classifier_hf_dict(cfg, ARCHITECTURES[cfg.model_type], dtype=dtype)


def save_value_model(cfg: ModelConfig, params: ValueParams, path: str | os.PathLike, *,
                     dtype: str | None = None) -> None:
  """Writes config.json and model.safetensors (weights in `dtype`, default cfg.param_dtype) to `path`.

  Written into a temporary sibling folder first; an existing `path` is replaced only once it is complete.
  """
  check_value_params(cfg, params)
  config = value_hf_dict(cfg, dtype=dtype)
  rm.write_checkpoint(path, config, rm.hf_tensors(cfg, params, head_tensors(cfg), hf_io.NP_DTYPES[config["dtype"]]))


def read_value_config(path: str) -> ModelConfig:
  """The decoder config of a value checkpoint folder; errors name config.json and the key.

  A reward model (`*ForSequenceClassification`: one score per sequence, no bias) is refused with a
  message saying so, rather than read as a value head.
  """
  config_path, d = hf_config.read_config_json(path)
  arch = d.get("architectures") if isinstance(d, Mapping) else None
  if isinstance(arch, list) and len(arch) == 1 and arch[0] in rm.ARCHITECTURES.values():
    raise ValueError(f"{config_path}: architectures {arch} is a reward model (one score per sequence), not a "
                     f"value model (one value per token, expected one of {sorted(ARCHITECTURES.values())}); "
                     "load it with models.reward_model.load_reward_model")
  return rm.read_classifier_config(path, ARCHITECTURES, "value model")


def load_value_model(path: str | os.PathLike) -> tuple[ModelConfig, ValueParams]:
  """Reads a checkpoint written by `save_value_model` (or transformers, single or sharded).

  Returns (cfg, params in cfg.param_dtype) as host numpy arrays. A tensor whose shape does not match
  config.json, a missing tensor or an unexpected one raises ValueError naming the file and tensor.
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: checkpoint folder does not exist")
  cfg = read_value_config(path)
  return cfg, rm.read_checkpoint(path, cfg, head_tensors(cfg))
