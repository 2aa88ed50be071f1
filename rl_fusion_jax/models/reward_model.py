"""A learned reward model: the policy's decoder body with a scalar head read at each row's last real token.

Params are `{"body": decoder params without an LM head, "score": {"kernel": [D, 1]}}`. The body is the
same `models.decoder` program (embedding, blocks, final norm); leaving out the LM head is done by
building it with `tie_word_embeddings=True` (`body_config`), whose only effect is that no `lm_head`
exists. The head matches transformers' `*ForSequenceClassification` with `num_labels=1` (`score.weight`
[1, D], no bias), so checkpoints are written in that format, with `architectures` naming that class.

Rows are right-padded (prompt then response from index 0, as in `types.Rollout`): `score` reads the
hidden state at `lengths_b - 1`, and causal attention makes it independent of the padding. Like the
decoder, this module never places or shards anything, and never imports torch or transformers.

The body pieces (`body_config`, `hidden_states`) and the checkpoint helpers (`hf_tensors`,
`write_checkpoint`, `read_classifier_config`, `read_checkpoint`, driven by a `HeadTensors` table) are
shared with `value_model`, the PPO critic's per-token head.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int
from safetensors.numpy import save_file

from rl_fusion_jax import hf_config
from rl_fusion_jax.distributed import fetch
from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models import decoder, hf_io
from rl_fusion_jax.models.layers import F32

RewardParams = dict[str, Any]

ARCHITECTURES = {"qwen2": "Qwen2ForSequenceClassification", "llama": "LlamaForSequenceClassification"}
SCORE_TENSOR = "score.weight"   # HF name of the head, [num_labels=1, D]


def body_config(cfg: ModelConfig) -> ModelConfig:
  """The decoder config of the body: the same model without an LM head."""
  return dataclasses.replace(cfg, tie_word_embeddings=True)


# ---------------------------------------------------------------------------------------- params


def init_reward_params(cfg: ModelConfig, rng: jax.Array, *, init_std: float = 0.02) -> RewardParams:
  """Random body (as `models.init_params`) and head kernel ~ N(0, init_std), in cfg.param_dtype."""
  body_rng, head_rng = jax.random.split(rng)
  body = decoder.init_params(body_config(cfg), body_rng, init_std=init_std)
  kernel_d1 = jax.random.normal(head_rng, (cfg.hidden_size, 1), F32) * init_std
  return {"body": body, "score": {"kernel": kernel_d1.astype(cfg.weight_dtype)}}


def reward_logical_axes(cfg: ModelConfig) -> dict[str, Any]:
  """Logical axis names per param (same structure as `init_reward_params`); the head's output is unsharded."""
  return {"body": decoder.param_logical_axes(body_config(cfg)), "score": {"kernel": ("embed", None)}}


def abstract_reward_params(cfg: ModelConfig) -> RewardParams:
  """`jax.ShapeDtypeStruct` per param, allocating nothing."""
  head = jax.ShapeDtypeStruct((cfg.hidden_size, 1), cfg.weight_dtype)
  return {"body": decoder.abstract_params(body_config(cfg)), "score": {"kernel": head}}


def check_reward_params(cfg: ModelConfig, params: RewardParams) -> None:
  """Raises ValueError naming the first missing, unexpected or wrongly shaped entry."""
  if not isinstance(params, Mapping) or set(params) != {"body", "score"}:
    keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
    raise ValueError(f"params: expected keys ['body', 'score'], got {keys}")
  try:
    decoder.check_params(body_config(cfg), params["body"])
  except ValueError as e:
    raise ValueError(f"params['body']: {e}") from None
  head = params["score"]
  if not isinstance(head, Mapping) or set(head) != {"kernel"}:
    raise ValueError(f"params['score']: expected {{'kernel': [D, 1]}}, got {head!r:.80}")
  if tuple(jnp.shape(head["kernel"])) != (cfg.hidden_size, 1):
    raise ValueError(f"params['score']['kernel']: shape {tuple(jnp.shape(head['kernel']))}, "
                     f"expected {(cfg.hidden_size, 1)}")


# --------------------------------------------------------------------------------------- forward


def hidden_states(cfg: ModelConfig, params: RewardParams, tokens_bt: Int[Array, "B T"]) -> Float[Array, "B T D"]:
  """The body's final-norm hidden states [B, T, D] in the compute dtype (what the head reads)."""
  model = decoder.bind(body_config(cfg), params["body"])
  positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
  return model.hidden(tokens_bt, positions_bt, decoder.attention_mask(positions_bt, None))


def last_token(x_btd: jax.Array, lengths_b: jax.Array) -> jax.Array:
  """x_btd[b, lengths_b[b] - 1]; a length outside [1, T] gives NaN (under jit nothing can raise)."""
  t = x_btd.shape[1]
  valid_b = (lengths_b >= 1) & (lengths_b <= t)
  index_b = jnp.where(valid_b, lengths_b - 1, t)   # t is out of bounds: filled with NaN
  return jnp.take_along_axis(x_btd, index_b[:, None, None], axis=1, mode="fill", fill_value=jnp.nan)[:, 0]


def _check_inputs(tokens_bt, lengths_b) -> None:
  if jnp.ndim(tokens_bt) != 2 or not jnp.issubdtype(jnp.result_type(tokens_bt), jnp.integer):
    raise ValueError(f"tokens_bt: expected integer tokens of shape [B, T], got {jnp.shape(tokens_bt)} "
                     f"{jnp.result_type(tokens_bt)}")
  if jnp.shape(lengths_b) != jnp.shape(tokens_bt)[:1] or not jnp.issubdtype(jnp.result_type(lengths_b),
                                                                            jnp.integer):
    raise ValueError(f"lengths_b: expected integer shape {jnp.shape(tokens_bt)[:1]}, got "
                     f"{jnp.shape(lengths_b)} {jnp.result_type(lengths_b)}")
  if not isinstance(lengths_b, jax.core.Tracer):   # values are only known outside jit
    lengths = np.asarray(lengths_b)
    t = jnp.shape(tokens_bt)[1]
    if lengths.size and (lengths.min() < 1 or lengths.max() > t):
      raise ValueError(f"lengths_b: every length must be in [1, T={t}], got min {lengths.min()} "
                       f"max {lengths.max()}")


def score(cfg: ModelConfig, params: RewardParams, tokens_bt: Int[Array, "B T"],
          lengths_b: Int[Array, "B"]) -> Float[Array, "B"]:
  """Float32 reward [B]: the head applied to the hidden state of token `lengths_b - 1` of each row.

  Jit with `cfg` static. Tokens at or after a row's length do not change its score. Outside jit a
  length outside [1, T] raises; inside jit it gives NaN for that row.
  """
  _check_inputs(tokens_bt, lengths_b)
  check_reward_params(cfg, params)
  last_bd = last_token(hidden_states(cfg, params, tokens_bt), lengths_b)
  kernel_d1 = params["score"]["kernel"].astype(cfg.compute_dtype)
  return jnp.einsum("BD,DO->BO", last_bd, kernel_d1, preferred_element_type=F32)[:, 0]


def packed_score(cfg: ModelConfig, params: RewardParams, tokens_rw: Int[Array, "R W"],
                 positions_rw: Int[Array, "R W"], segment_ids_rw: Int[Array, "R W"], row_b: Int[Array, "B"],
                 start_b: Int[Array, "B"], length_b: Int[Array, "B"]) -> Float[Array, "B"]:
  """``score`` of samples packed several to a row (``train/packing.py``: sample b at row ``row_b[b]``,
  columns ``start_b[b]`` to ``start_b[b] + length_b[b]``; positions restart per sample and attention stays
  within a segment): the head applied to each sample's last token. A sample of length 0 or without a row
  gives NaN."""
  check_reward_params(cfg, params)
  model = decoder.bind(body_config(cfg), params["body"])
  hidden_rwd = model.hidden(tokens_rw, positions_rw, decoder.attention_mask(positions_rw, segment_ids_rw))
  valid_b = (row_b >= 0) & (length_b >= 1)
  last_bd = hidden_rwd[jnp.maximum(row_b, 0), jnp.maximum(start_b + length_b - 1, 0)]
  kernel_d1 = params["score"]["kernel"].astype(cfg.compute_dtype)
  score_b = jnp.einsum("BD,DO->BO", last_bd, kernel_d1, preferred_element_type=F32)[:, 0]
  return jnp.where(valid_b, score_b, jnp.nan)


# ------------------------------------------------------------------------------------ checkpoints
# Shared with `value_model` (a `*ForTokenClassification` head): both are a decoder body without LM head
# plus `params["score"]`, whose HF tensors are described by a `HeadTensors` table.

# HF name -> (key in params["score"], hf_io layout, our shape).
HeadTensors = dict[str, tuple[str, str, tuple[int, ...]]]


def head_tensors(cfg: ModelConfig) -> HeadTensors:
  """The reward head's HF tensors: `score.weight` [1, D], no bias."""
  return {SCORE_TENSOR: ("kernel", "linear", (cfg.hidden_size, 1))}


def classifier_hf_dict(cfg: ModelConfig, architecture: str, *, dtype: str | None = None) -> dict[str, Any]:
  """config.json of a transformers classifier class `architecture` with one label, holding this decoder."""
  d = cfg.to_hf_dict(dtype=dtype)
  d.update(architectures=[architecture], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
  return d


def reward_hf_dict(cfg: ModelConfig, *, dtype: str | None = None) -> dict[str, Any]:
  """config.json of a transformers `*ForSequenceClassification` with one label, holding this decoder."""
  return classifier_hf_dict(cfg, ARCHITECTURES[cfg.model_type], dtype=dtype)


def hf_tensors(cfg: ModelConfig, params: dict[str, Any], heads: HeadTensors, np_dtype) -> dict[str, np.ndarray]:
  """HF name -> host array in HF layout and `np_dtype`, for the body and the `heads` entries of the score."""
  body = dict(decoder.flatten(params["body"]))
  tensors = {}
  for ours, leaf in hf_io.name_map(body_config(cfg)).items():
    tensors.update(hf_io.export_leaf(np.asarray(fetch(body[ours])), leaf, np_dtype))
  for hf_name, (key, layout, _) in heads.items():
    x = np.asarray(fetch(params["score"][key])).astype(np_dtype)
    tensors[hf_name] = np.ascontiguousarray(hf_io.to_hf_layout(x, layout))
  return tensors


def write_checkpoint(path: str | os.PathLike, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
  """Writes config.json and model.safetensors to `path`.

  Written into a temporary sibling folder first; an existing `path` is replaced only once it is complete.
  """
  path = os.path.abspath(os.fspath(path))
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
  try:
    os.chmod(tmp, 0o755)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, sort_keys=True)
    hf_io.replace_dir(tmp, path)  # pylint: disable=protected-access
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def save_reward_model(cfg: ModelConfig, params: RewardParams, path: str | os.PathLike, *,
                      dtype: str | None = None) -> None:
  """Writes config.json and model.safetensors (weights in `dtype`, default cfg.param_dtype) to `path`.

  Written into a temporary sibling folder first; an existing `path` is replaced only once it is complete.
  """
  check_reward_params(cfg, params)
  config = reward_hf_dict(cfg, dtype=dtype)
  write_checkpoint(path, config, hf_tensors(cfg, params, head_tensors(cfg), hf_io.NP_DTYPES[config["dtype"]]))


def read_classifier_config(path: str, architectures: Mapping[str, str], kind: str) -> ModelConfig:
  """The decoder config of a one-label classifier folder whose class is `architectures[model_type]`.

  `kind` ('reward model', ...) names what was expected; errors name config.json and the key.
  """
  config_path, d = hf_config.read_config_json(path)
  model_type = d.get("model_type") if isinstance(d, Mapping) else None
  if model_type not in architectures or d.get("architectures") != [architectures[model_type]]:
    raise ValueError(f"{config_path}: architectures {d.get('architectures') if isinstance(d, Mapping) else d!r}"
                     f" is not a {kind} (expected one of {sorted(architectures.values())})")
  if len(d.get("id2label") or {"0": None}) != 1:
    raise ValueError(f"{config_path}: id2label has {len(d['id2label'])} labels, a {kind} has 1")
  if d.get("num_labels", 1) != 1:
    raise ValueError(f"{config_path}: num_labels is {d['num_labels']!r}, a {kind} has 1")
  try:   # the decoder fields are the causal LM's; only the class name differs
    return ModelConfig.from_hf_dict({**d, "architectures": [hf_config.ARCHITECTURES[model_type]]})
  except (ValueError, TypeError) as e:
    raise ValueError(f"{config_path}: {e}") from None


def read_reward_config(path: str) -> ModelConfig:
  """The decoder config of a reward checkpoint folder; errors name config.json and the key."""
  return read_classifier_config(path, ARCHITECTURES, "reward model")


def read_checkpoint(path: str, cfg: ModelConfig, heads: HeadTensors) -> dict[str, Any]:
  """`{"body": ..., "score": {...}}` in cfg.param_dtype (host numpy) from the weight files of folder `path`.

  Names and shapes are checked from the file headers before any data is read: a tensor whose shape does
  not match `cfg`, a missing tensor or an unexpected one raises ValueError naming the file and tensor.
  """
  where = hf_io.tensor_locations(hf_io.weight_files(path))
  body_names = hf_io.name_map(body_config(cfg))
  expected = {n for leaf in body_names.values() for n in leaf.hf_names} | set(heads)
  extra = sorted(n for n in where.keys() - expected if not n.endswith(hf_io.IGNORED_SUFFIXES))
  if extra:
    raise ValueError(f"{where[extra[0]]}: unexpected tensors {extra[:5]} ({len(extra)} in total)")
  shapes = {p: leaf.shape for p, leaf in decoder.flatten(decoder.abstract_params(body_config(cfg)))}
  head_leaves = {key: (hf_io.LeafNames((hf_name,), layout, False), shape)
                 for hf_name, (key, layout, shape) in heads.items()}
  for ours, leaf in body_names.items():
    hf_io.check_leaf(where, leaf, shapes[ours], path, decoder.path_str(ours))
  for key, (leaf, shape) in head_leaves.items():
    hf_io.check_leaf(where, leaf, shape, path, f"params['score'][{key!r}]")
  np_dtype = hf_io.NP_DTYPES[cfg.param_dtype]
  body = {ours: hf_io.import_leaf(where, leaf, shapes[ours], np_dtype) for ours, leaf in body_names.items()}
  head = {key: hf_io.import_leaf(where, leaf, shape, np_dtype) for key, (leaf, shape) in head_leaves.items()}
  return {"body": decoder.unflatten(body), "score": head}


def load_reward_model(path: str | os.PathLike) -> tuple[ModelConfig, RewardParams]:
  """Reads a checkpoint written by `save_reward_model` (or transformers, single or sharded).

  Returns (cfg, params in cfg.param_dtype) as host numpy arrays. A tensor whose shape does not match
  config.json, a missing tensor or an unexpected one raises ValueError naming the file and tensor.
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: checkpoint folder does not exist")
  cfg = read_reward_config(path)
  return cfg, read_checkpoint(path, cfg, head_tensors(cfg))
