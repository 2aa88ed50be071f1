"""Hugging Face safetensors checkpoints <-> (ModelConfig, params): `load_hf` and `save_hf`.

`HF_NAMES` is the one table mapping our param paths to HF tensor names and layouts; which rows apply
(biases, q/k norms, dense MLP or MoE block, shared expert, untied lm head) follows from the params of
the config. Every error names the file and the tensor or key. Reads and writes go through `safetensors`
with numpy only: this module never imports torch or transformers. `save_hf` writes into a temporary
sibling folder and renames it into place, so a crash never leaves a half-written checkpoint behind.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rl_fusion_jax.distributed import fetch
from rl_fusion_jax.model_config import DTYPES as NP_DTYPES  # weight dtype name -> numpy dtype
from rl_fusion_jax.model_config import ModelConfig, read_config
from rl_fusion_jax.models.decoder import (STACKS, Params, abstract_params, check_params, flatten,
                                          path_str, unflatten)

# (our path, HF name, layout). Paths under "layers" stand for both stacked trees (`decoder.STACKS`:
# `layers`, and `dense_layers` in a model mixing dense and sparse blocks), each stacked over a leading
# layer axis: their HF tensors are one per layer, `{i}` the global (HF) layer index of each stack entry
# (`ModelConfig.layer_stacks`). Expert params are doubly indexed, [L, E, ...]: one HF tensor per layer
# `{i}` and expert `{e}`. Layouts (of one layer's, or one expert's, slice):
#   same:     identical arrays              linear:  ours [in, out]  <-> HF [out, in]
#   in_heads: ours [D, N, H] <-> HF [N*H, D] out_heads: ours [N, H, D] <-> HF [D, N*H]
#   bias:     ours [N, H]    <-> HF [N*H]
_EXPERT = "model.layers.{i}.mlp.experts.{e}"
_SHARED = "model.layers.{i}.mlp.shared_expert"
HF_NAMES = (
    (("embed", "embedding"), "model.embed_tokens.weight", "same"),
    (("layers", "input_norm", "scale"), "model.layers.{i}.input_layernorm.weight", "same"),
    (("layers", "attn", "q_proj", "kernel"), "model.layers.{i}.self_attn.q_proj.weight", "in_heads"),
    (("layers", "attn", "q_proj", "bias"), "model.layers.{i}.self_attn.q_proj.bias", "bias"),
    (("layers", "attn", "k_proj", "kernel"), "model.layers.{i}.self_attn.k_proj.weight", "in_heads"),
    (("layers", "attn", "k_proj", "bias"), "model.layers.{i}.self_attn.k_proj.bias", "bias"),
    (("layers", "attn", "v_proj", "kernel"), "model.layers.{i}.self_attn.v_proj.weight", "in_heads"),
    (("layers", "attn", "v_proj", "bias"), "model.layers.{i}.self_attn.v_proj.bias", "bias"),
    (("layers", "attn", "o_proj", "kernel"), "model.layers.{i}.self_attn.o_proj.weight", "out_heads"),
    (("layers", "attn", "q_norm", "scale"), "model.layers.{i}.self_attn.q_norm.weight", "same"),
    (("layers", "attn", "k_norm", "scale"), "model.layers.{i}.self_attn.k_norm.weight", "same"),
    (("layers", "post_attn_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", "same"),
    (("layers", "mlp", "gate_proj", "kernel"), "model.layers.{i}.mlp.gate_proj.weight", "linear"),
    (("layers", "mlp", "up_proj", "kernel"), "model.layers.{i}.mlp.up_proj.weight", "linear"),
    (("layers", "mlp", "down_proj", "kernel"), "model.layers.{i}.mlp.down_proj.weight", "linear"),
    (("layers", "moe", "router"), "model.layers.{i}.mlp.gate.weight", "linear"),
    (("layers", "moe", "experts", "gate_proj"), _EXPERT + ".gate_proj.weight", "linear"),
    (("layers", "moe", "experts", "up_proj"), _EXPERT + ".up_proj.weight", "linear"),
    (("layers", "moe", "experts", "down_proj"), _EXPERT + ".down_proj.weight", "linear"),
    (("layers", "moe", "shared_expert", "gate_proj", "kernel"), _SHARED + ".gate_proj.weight", "linear"),
    (("layers", "moe", "shared_expert", "up_proj", "kernel"), _SHARED + ".up_proj.weight", "linear"),
    (("layers", "moe", "shared_expert", "down_proj", "kernel"), _SHARED + ".down_proj.weight", "linear"),
    (("layers", "moe", "shared_expert_gate"), "model.layers.{i}.mlp.shared_expert_gate.weight", "linear"),
    (("final_norm", "scale"), "model.norm.weight", "same"),
    (("lm_head", "kernel"), "lm_head.weight", "linear"),
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a derived buffer older checkpoints saved


@dataclasses.dataclass(frozen=True)
class LeafNames:
  """The HF tensors of one of our params: one name; one per layer for a stacked param; one per layer and
  expert (layer-major) for a `per_expert` one. Our array's first `index_dims` axes index the names."""
  hf_names: tuple[str, ...]
  layout: str
  stacked: bool
  per_expert: bool = False

  @property
  def index_dims(self) -> int:
    return int(self.stacked) + int(self.per_expert)


def _stack_layers(cfg: ModelConfig) -> dict[str, list[int]]:
  """Stacked tree name -> the global layer index of each of its entries, in stack order."""
  layers: dict[str, list[int]] = {name: [] for name in STACKS}
  for i, (name, _) in enumerate(cfg.layer_stacks):
    layers[name].append(i)
  return layers


def _table_rows(cfg: ModelConfig):
  """(our path, HF names, layout, per_expert) for every row of `HF_NAMES`, per stack for layer rows."""
  stack_layers = _stack_layers(cfg)
  for path, hf_name, layout in HF_NAMES:
    if path[0] != "layers":
      yield path, (hf_name,), layout, False
      continue
    per_expert = "{e}" in hf_name
    for stack in STACKS:
      names = tuple(hf_name.format(i=i, e=e) for i in stack_layers[stack]
                    for e in (range(cfg.num_experts) if per_expert else (0,)))
      yield (stack,) + path[1:], names, layout, per_expert


def name_map(cfg: ModelConfig) -> dict[tuple, LeafNames]:
  """our path -> its HF tensor names and layout, for exactly the params this config has."""
  present = {path for path, _ in flatten(abstract_params(cfg))}
  return {path: LeafNames(names, layout, path[0] in STACKS, per_expert)
          for path, names, layout, per_expert in _table_rows(cfg) if path in present}


def _indices(shape: tuple[int, ...], leaf: LeafNames):
  """Index tuples into our array, one per HF name of `leaf`, in the order of `leaf.hf_names`."""
  return np.ndindex(*shape[:leaf.index_dims])


def export_leaf(x: np.ndarray, leaf: LeafNames, np_dtype) -> dict[str, np.ndarray]:
  """HF name -> contiguous host array in HF layout, for our host array `x` of one param."""
  return {name: np.ascontiguousarray(to_hf_layout(x[index].astype(np_dtype), leaf.layout))
          for name, index in zip(leaf.hf_names, _indices(x.shape, leaf))}


def tensor_shape(file: str, name: str) -> tuple[int, ...]:
  """Shape of tensor `name` in safetensors `file`, from the header alone (no data is read)."""
  with safe_open(file, framework="numpy") as f:
    return tuple(f.get_slice(name).get_shape())


def check_leaf(where: dict[str, str], leaf: LeafNames, shape: tuple[int, ...], path: str,
               ours: str) -> None:
  """Raises naming the file and tensor when one of `leaf`'s tensors is missing or mis-shaped."""
  want = hf_shape(leaf.layout, shape[leaf.index_dims:])
  for hf_name in leaf.hf_names:
    if hf_name not in where:
      raise ValueError(f"{path}: missing tensor '{hf_name}' (for {ours})")
    got = tensor_shape(where[hf_name], hf_name)
    if got != want:
      raise ValueError(f"{where[hf_name]}: tensor '{hf_name}' has shape {got}, expected {want} "
                       f"from {os.path.join(path, 'config.json')}")


def import_leaf(where: dict[str, str], leaf: LeafNames, shape: tuple[int, ...], np_dtype) -> np.ndarray:
  """Our host array (`shape`, `np_dtype`) of one param, read tensor by tensor (shapes already checked)."""
  if not leaf.index_dims:
    x = read_tensor(where[leaf.hf_names[0]], leaf.hf_names[0])
    return from_hf_layout(x, leaf.layout, shape).astype(np_dtype)
  out = np.empty(shape, np_dtype)
  # One layer (or one expert of one layer) at a time: never a second stacked copy.
  for index, hf_name in zip(_indices(shape, leaf), leaf.hf_names):
    out[index] = from_hf_layout(read_tensor(where[hf_name], hf_name), leaf.layout, shape[leaf.index_dims:])
  return out


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


def check_checkpoint(path: str | os.PathLike) -> ModelConfig:
  """Validates folder `path` from config.json and the safetensors headers alone (no tensor data read).

  Returns its `ModelConfig`; a missing, unexpected or mis-shaped tensor raises naming the file and tensor.
  """
  path = os.fspath(path)
  cfg = read_config(path)
  _checked_locations(cfg, path)
  return cfg


def _checked_locations(cfg: ModelConfig, path: str) -> dict[str, str]:
  where = tensor_locations(weight_files(path))
  names = name_map(cfg)
  _check_leftovers(cfg, where, {n for leaf in names.values() for n in leaf.hf_names})
  shapes = dict(flatten(abstract_params(cfg)))
  for ours, leaf in names.items():
    check_leaf(where, leaf, shapes[ours].shape, path, path_str(ours))
  return where


def load_hf(path: str | os.PathLike, shardings: Any = None) -> tuple[ModelConfig, Params]:
  """Reads config.json and all safetensors (single or sharded) into (cfg, params in cfg.param_dtype).

  Every tensor's name and shape is checked from the file headers before any data is read. Then params
  are read one at a time (a stacked layer param one layer, an expert param one layer's expert, at a time
  into its host array). Without
  `shardings` they are returned as host numpy arrays. With `shardings` (a `NamedSharding` per param,
  same structure as the params) each host array goes straight to its sharding, every device receiving
  only its own shard, and is dropped before the next is read: the devices never hold more than the
  placed params, and the host one param.
  """
  path = os.fspath(path)
  cfg = read_config(path)
  where = _checked_locations(cfg, path)
  shapes = dict(flatten(abstract_params(cfg)))
  targets = None
  if shardings is not None:
    targets = dict(flatten(shardings))
    if targets.keys() != shapes.keys():
      raise ValueError(f"shardings: structure differs from the params of {path}/config.json")
  from rl_fusion_jax.sharding import reshard  # deferred: sharding imports the model package
  flat = {}
  for ours, leaf in name_map(cfg).items():
    host = import_leaf(where, leaf, shapes[ours].shape, NP_DTYPES[cfg.param_dtype])
    if targets is None:
      flat[ours] = host
    else:   # one leaf is one bucket: each device receives only its shard of it
      (flat[ours],), _ = reshard.move([host], [targets[ours]], bucket_bytes=max(host.nbytes, 1), name=path_str(ours))
    del host
  return cfg, unflatten({p: flat[p] for p in shapes})


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
  for ours, leaf in name_map(cfg).items():
    tensors.update(export_leaf(np.asarray(fetch(given[ours])), leaf, np_dtype))
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
