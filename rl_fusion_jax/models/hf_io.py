"""Hugging Face safetensors checkpoints <-> (ModelConfig, params): `load_hf` and `save_hf`.

`HF_NAMES` is the one table mapping our param paths to HF tensor names and layouts; which rows apply
(biases, untied lm head) follows from the params of the config. Every error names the file and the
tensor or key. Reads and writes go through `safetensors` with numpy only: this module never imports
torch or transformers. `save_hf` writes into a temporary sibling folder and renames it into place, so
a crash never leaves a half-written checkpoint behind.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rl_fusion_jax.models.config import ModelConfig
from rl_fusion_jax.models.decoder import (Params, abstract_params, check_params, flatten, path_str,
                                          unflatten)

# (our path, HF name, layout). `{i}` is the layer index. Layouts:
#   same:     identical arrays              linear:  ours [in, out]  <-> HF [out, in]
#   in_heads: ours [D, N, H] <-> HF [N*H, D] out_heads: ours [N, H, D] <-> HF [D, N*H]
#   bias:     ours [N, H]    <-> HF [N*H]
HF_NAMES = (
    (("embed", "embedding"), "model.embed_tokens.weight", "same"),
    (("layers_{i}", "input_norm", "scale"), "model.layers.{i}.input_layernorm.weight", "same"),
    (("layers_{i}", "attn", "q_proj", "kernel"), "model.layers.{i}.self_attn.q_proj.weight", "in_heads"),
    (("layers_{i}", "attn", "q_proj", "bias"), "model.layers.{i}.self_attn.q_proj.bias", "bias"),
    (("layers_{i}", "attn", "k_proj", "kernel"), "model.layers.{i}.self_attn.k_proj.weight", "in_heads"),
    (("layers_{i}", "attn", "k_proj", "bias"), "model.layers.{i}.self_attn.k_proj.bias", "bias"),
    (("layers_{i}", "attn", "v_proj", "kernel"), "model.layers.{i}.self_attn.v_proj.weight", "in_heads"),
    (("layers_{i}", "attn", "v_proj", "bias"), "model.layers.{i}.self_attn.v_proj.bias", "bias"),
    (("layers_{i}", "attn", "o_proj", "kernel"), "model.layers.{i}.self_attn.o_proj.weight", "out_heads"),
    (("layers_{i}", "post_attn_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", "same"),
    (("layers_{i}", "mlp", "gate_proj", "kernel"), "model.layers.{i}.mlp.gate_proj.weight", "linear"),
    (("layers_{i}", "mlp", "up_proj", "kernel"), "model.layers.{i}.mlp.up_proj.weight", "linear"),
    (("layers_{i}", "mlp", "down_proj", "kernel"), "model.layers.{i}.mlp.down_proj.weight", "linear"),
    (("final_norm", "scale"), "model.norm.weight", "same"),
    (("lm_head", "kernel"), "lm_head.weight", "linear"),
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a derived buffer older checkpoints saved
NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def name_map(cfg: ModelConfig) -> dict[tuple, tuple[str, str]]:
  """our path -> (HF name, layout), for exactly the params this config has."""
  present = {path for path, _ in flatten(abstract_params(cfg))}
  rows = {}
  for path, hf_name, layout in HF_NAMES:
    for i in range(cfg.num_layers) if "{i}" in hf_name else [None]:
      ours = tuple(p.format(i=i) for p in path)
      if ours in present:
        rows[ours] = (hf_name.format(i=i), layout)
  return rows


def to_hf_layout(x: np.ndarray, layout: str) -> np.ndarray:
  if layout == "linear":
    return x.T
  if layout == "in_heads":  # [D, N, H] -> [N*H, D]
    return x.reshape(x.shape[0], -1).T
  if layout == "out_heads":  # [N, H, D] -> [D, N*H]
    return x.reshape(-1, x.shape[-1]).T
  if layout == "bias":
    return x.reshape(-1)
  return x


def from_hf_layout(x: np.ndarray, layout: str, shape: tuple[int, ...]) -> np.ndarray:
  """Inverse of `to_hf_layout` for our `shape`; the caller checked x against `hf_shape(layout, shape)`."""
  if layout == "linear":
    return x.T
  if layout in ("in_heads", "out_heads"):  # [N*H, D] -> [D, N, H]; [D, N*H] -> [N, H, D]
    return x.T.reshape(shape)
  if layout == "bias":
    return x.reshape(shape)
  return x


def hf_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  return to_hf_layout(np.empty(shape, np.int8), layout).shape


# ----------------------------------------------------------------------------------------------- loading


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


def read_config(path: str) -> ModelConfig:
  """`ModelConfig` of the checkpoint folder `path`; errors name the folder or config.json and the key."""
  config_path, d = read_config_json(path)
  try:
    return ModelConfig.from_hf_dict(d)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{config_path}: {e}") from None


def weight_files(path: str) -> list[str]:
  index_path = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index_path):
    try:
      with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index_path}: malformed index, needs a 'weight_map' object ({e!r})") from None
    files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    for file in files:
      if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: listed in {index_path} but missing")
    return files
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"{path}: no *.safetensors files")
  return files


def tensor_locations(files: list[str]) -> dict[str, str]:
  """HF name -> file holding it; a name stored twice is an error."""
  where = {}
  for file in files:
    try:
      with safe_open(file, framework="numpy") as f:
        names = list(f.keys())
    except Exception as e:  # safetensors raises its own error types for corrupt headers
      raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    for name in names:
      if name in where:
        raise ValueError(f"{file}: tensor '{name}' also stored in {where[name]}")
      where[name] = file
  return where


def read_tensor(file: str, name: str) -> np.ndarray:
  with safe_open(file, framework="numpy") as f:
    return f.get_tensor(name)


def _check_leftovers(cfg: ModelConfig, where: dict[str, str], used: set[str]) -> None:
  """Fails on stored tensors the model has no place for (before anything large is read)."""
  extra = sorted(n for n in where.keys() - used if not n.endswith(IGNORED_SUFFIXES))
  if cfg.tie_word_embeddings and "lm_head.weight" in extra and "model.embed_tokens.weight" in where:
    # Some exporters keep a tied head; accept it only when it really is the embedding.
    head = read_tensor(where["lm_head.weight"], "lm_head.weight")
    embed = read_tensor(where["model.embed_tokens.weight"], "model.embed_tokens.weight")
    if head.shape == embed.shape and np.array_equal(head.astype(np.float32), embed.astype(np.float32)):
      extra.remove("lm_head.weight")
  if extra:
    raise ValueError(f"{where[extra[0]]}: unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''} "
                     f"({len(extra)} in total) for model_type {cfg.model_type!r}")


def load_hf(path: str | os.PathLike) -> tuple[ModelConfig, Params]:
  """Reads config.json and all safetensors (single or sharded) into (cfg, params in cfg.param_dtype).

  Arrays are returned on the default device; place them with the phase shardings afterwards.
  """
  path = os.fspath(path)
  cfg = read_config(path)
  where = tensor_locations(weight_files(path))
  names = name_map(cfg)
  _check_leftovers(cfg, where, {hf_name for hf_name, _ in names.values()})
  shapes = dict(flatten(abstract_params(cfg)))
  flat = {}
  for ours, (hf_name, layout) in names.items():
    if hf_name not in where:
      raise ValueError(f"{path}: missing tensor '{hf_name}' (for {path_str(ours)})")
    x = read_tensor(where[hf_name], hf_name)
    want = hf_shape(layout, shapes[ours].shape)
    if x.shape != want:
      raise ValueError(f"{where[hf_name]}: tensor '{hf_name}' has shape {x.shape}, expected {want} "
                       f"from {os.path.join(path, 'config.json')}")
    flat[ours] = from_hf_layout(x, layout, shapes[ours].shape).astype(NP_DTYPES[cfg.param_dtype])
  return cfg, unflatten({k: jnp.asarray(v) for k, v in flat.items()})


# ----------------------------------------------------------------------------------------------- saving


def save_hf(cfg: ModelConfig, params: Params, path: str | os.PathLike, *, dtype: str | None = None) -> None:
  """Writes config.json and model.safetensors (weights in `dtype`, default cfg.param_dtype) to `path`.

  An existing folder at `path` is replaced only after the new one is complete.
  """
  path = os.path.abspath(os.fspath(path))
  check_params(cfg, params)
  hf_config = cfg.to_hf_dict(dtype=dtype)
  np_dtype = NP_DTYPES[hf_config["dtype"]]
  tensors = {}
  given = dict(flatten(params))
  for ours, (hf_name, layout) in name_map(cfg).items():
    x = np.asarray(jax.device_get(given[ours])).astype(np_dtype)
    tensors[hf_name] = np.ascontiguousarray(to_hf_layout(x, layout))
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
  try:
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint folder should not be
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
    replace_dir(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def replace_dir(src: str, dst: str) -> None:
  """Renames `src` to `dst`; an existing `dst` is moved aside first and deleted after the swap."""
  if not os.path.exists(dst):
    os.rename(src, dst)
    return
  old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
  os.rmdir(old)
  os.rename(dst, old)
  os.rename(src, dst)
  shutil.rmtree(old, ignore_errors=True)
