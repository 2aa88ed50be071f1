"""GGUF checkpoints (llama.cpp's format) -> a Hugging Face folder that `load_hf` reads: `convert_gguf`.

A GGUF file holds the model's config and tokenizer as metadata and its weights in llama.cpp's names, most
of them quantized (e.g. 4-bit Q4_1 blocks). `convert_gguf` checks everything it can from the header first
(architecture, the metadata keys the config needs, each tensor's name, quant type and shape, the tokenizer
metadata), so an unsupported file fails naming the key or tensor before any weight is dequantized. Then it
dequantizes one tensor at a time with `gguf.quants.dequantize` into float32 (or rounds to bfloat16) and
writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and chat_template.jinja
(`gguf_tokenizer`) into a temporary sibling folder renamed into place, plus gguf_source.json saying which
file and quant types the weights came from. The weights stay what the quantization left: a 4-bit file's
weights converted to float32 are the 4-bit values, exactly.

Why convert once rather than read GGUF at every load: everything downstream (`load_hf` with per-shard
placement, `--config.model.hf_path`, `HFTokenizer`, `check_checkpoint`) then has one checkpoint format, the
dequantization cost is paid once, and transformers reads the same folder.

llama.cpp's converter permutes the rows of each q and k projection (within every head it interleaves the two
rotary halves, for its RoPE kernel); `unpermute_rows` undoes it, as transformers' GGUF loader does. Only the
Llama architecture is read. `gguf` (an optional extra, `pip install 'rl_fusion_jax[gguf]'`) is imported
inside the functions that read a file; nothing here imports torch or transformers.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from rl_fusion_jax import gguf_tokenizer
from rl_fusion_jax.model_config import DTYPES, ModelConfig
from rl_fusion_jax.models import hf_io
from rl_fusion_jax.models.decoder import abstract_params, flatten

ARCHITECTURES = ("llama",)
# Quant types read (dequantized by gguf.quants), each one written and read back by tests/gguf_io_test.py.
# The rest are refused by name: K-quants (Q4_K, ...: gguf dequantizes them but cannot write them, so no test
# here could), IQ*, TQ*, MXFP4, ...
QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# GGUF tensor name -> HF tensor name; "{i}" is the layer. q / k rows are un-permuted (module docstring).
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# Llama keys no config field holds: refused rather than silently dropped.
UNSUPPORTED_KEYS = ("rope.scaling.type", "rope.scaling.factor", "expert_count", "attention.sliding_window")
SOURCE_FILE = "gguf_source.json"


def _gguf():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError("reading GGUF files needs the 'gguf' package: pip install 'rl_fusion_jax[gguf]'") from None
  return gguf


def read_gguf(path: str):
  """(metadata dict, the file's tensors as `gguf.ReaderTensor`s): the header only, tensor data memory-mapped."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: GGUF file not found")
  try:
    reader = _gguf().GGUFReader(path)
  except (ValueError, OSError) as e:   # gguf raises ValueError for a wrong magic or version
    raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
  metadata = {key: field.contents() for key, field in reader.fields.items()}
  return metadata, list(reader.tensors)


# ------------------------------------------------------------------------------------------------ config


def _key(metadata: Mapping[str, Any], key: str, where: str) -> Any:
  if key not in metadata:
    raise ValueError(f"{where}: missing metadata '{key}'")
  value = metadata[key]
  if isinstance(value, list):
    raise ValueError(f"{where}: metadata '{key}' is a per-layer list {value!r:.60}; only one value is supported")
  return value


def hf_config_dict(metadata: Mapping[str, Any], tensor_names: set[str], where: str) -> dict[str, Any]:
  """The transformers config.json dict of a Llama GGUF's metadata; errors name the key."""
  arch = _key(metadata, "general.architecture", where)
  if arch not in ARCHITECTURES:
    raise ValueError(f"{where}: general.architecture={arch!r} is not supported (supported: {ARCHITECTURES})")
  get = lambda name: _key(metadata, f"{arch}.{name}", where)
  opt = lambda name, default: get(name) if f"{arch}.{name}" in metadata else default
  for name in UNSUPPORTED_KEYS:
    if f"{arch}.{name}" in metadata and metadata[f"{arch}.{name}"] not in ("none", 0, 1, 1.0):
      raise ValueError(f"{where}: {arch}.{name}={metadata[f'{arch}.{name}']!r} is not supported")
  if "rope_freqs.weight" in tensor_names:
    raise ValueError(f"{where}: tensor 'rope_freqs.weight' (per-frequency RoPE factors) is not supported")
  heads, hidden = get("attention.head_count"), get("embedding_length")
  head_dim = opt("attention.key_length", hidden // heads)
  for name in ("attention.value_length", "rope.dimension_count"):
    if opt(name, head_dim) != head_dim:
      raise ValueError(f"{where}: {arch}.{name}={get(name)} differs from the head size {head_dim} (not supported)")
  if "tokenizer.ggml.tokens" not in metadata:
    raise ValueError(f"{where}: missing metadata 'tokenizer.ggml.tokens'")
  tokens = metadata["tokenizer.ggml.tokens"]
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": int(opt("vocab_size", len(tokens))), "hidden_size": int(hidden),
      "intermediate_size": int(get("feed_forward_length")), "num_hidden_layers": int(get("block_count")),
      "num_attention_heads": int(heads), "num_key_value_heads": int(opt("attention.head_count_kv", heads)),
      "head_dim": int(head_dim), "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
      "rope_theta": float(opt("rope.freq_base", 10000.0)),
      "max_position_embeddings": int(opt("context_length", 2048)),
      # llama.cpp writes output.weight only when the head is not the embedding.
      "tie_word_embeddings": "output.weight" not in tensor_names,
      "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
      "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "dtype": "float32",
  }


# ------------------------------------------------------------------------------------------------ tensors


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q / k permutation of the rows (`[num_heads * head_dim, ...]`, HF layout).

  llama.cpp stores row `h*D + 2*j + r` of head h what HF stores at row `h*D + r*D/2 + j` (j < D/2, r in
  {0, 1}): per head, rows [2, D/2] -> [D/2, 2].
  """
  half = w.shape[0] // num_heads // 2
  return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
  """GGUF name -> (HF name, HF shape) of every tensor a file of `cfg` must hold."""
  shapes = {name: hf_io.hf_shape(leaf.layout, shape[leaf.index_dims:])
            for name, leaf, shape in _hf_leaves(cfg)}
  out = {}
  for gguf_name, hf_name in TENSOR_NAMES.items():
    for i in range(cfg.num_layers) if "{i}" in gguf_name else (None,):
      name = hf_name.format(i=i)
      if name in shapes:
        out[gguf_name.format(i=i)] = (name, shapes[name])
  return out


def _hf_leaves(cfg: ModelConfig):
  """(HF name, its `LeafNames`, our param's shape) for every HF tensor of `cfg`."""
  shapes = dict(flatten(abstract_params(cfg)))
  for path, leaf in hf_io.name_map(cfg).items():
    for name in leaf.hf_names:
      yield name, leaf, shapes[path].shape


def check_tensors(cfg: ModelConfig, tensors, where: str) -> dict[str, tuple[str, tuple[int, ...]]]:
  """Raises naming the tensor when one is unknown, missing, of an unsupported quant type or mis-shaped;
  returns `expected_tensors(cfg)`. Reads the header only."""
  expected = expected_tensors(cfg)
  seen = {t.name for t in tensors}
  unknown = sorted(seen - expected.keys())
  if unknown:
    raise ValueError(f"{where}: unexpected tensors {unknown[:5]} ({len(unknown)} in total) for a Llama model")
  missing = sorted(expected.keys() - seen)
  if missing:
    raise ValueError(f"{where}: missing tensors {missing[:5]} ({len(missing)} in total)")
  for t in tensors:
    if t.tensor_type.name not in QUANT_TYPES:
      raise ValueError(f"{where}: tensor '{t.name}' has quant type {t.tensor_type.name}, which is not supported "
                       f"(supported: {', '.join(QUANT_TYPES)})")
    shape = tuple(int(n) for n in reversed(t.shape))   # GGUF lists dimensions innermost first
    if shape != expected[t.name][1]:
      raise ValueError(f"{where}: tensor '{t.name}' has shape {shape} (HF order), expected {expected[t.name][1]} "
                       f"from the metadata")
  return expected


def hf_tensor(t, cfg: ModelConfig, np_dtype) -> np.ndarray:
  """Tensor `t` of the file, dequantized, in HF layout and `np_dtype` (reads its data)."""
  w = np.asarray(_gguf().quants.dequantize(t.data, t.tensor_type), np.float32)
  w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
  if ".attn_q." in t.name:
    w = unpermute_rows(w, cfg.num_heads)
  elif ".attn_k." in t.name:
    w = unpermute_rows(w, cfg.num_kv_heads)
  return np.ascontiguousarray(w.astype(np_dtype))


# ------------------------------------------------------------------------------------------------ convert


def convert_gguf(gguf_path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "float32") -> ModelConfig:
  """Writes the HF folder `out` (replacing one there only once complete) for GGUF file `gguf_path`.

  `dtype`: the weight dtype written, 'float32' (the dequantized values exactly) or 'bfloat16'.
  Returns the model's `ModelConfig`. Every check runs on the header before a weight is dequantized.
  """
  gguf_path, out = os.path.abspath(os.fspath(gguf_path)), os.path.abspath(os.fspath(out))
  if dtype not in DTYPES:
    raise ValueError(f"dtype: must be one of {tuple(DTYPES)}, got {dtype!r}")
  metadata, tensors = read_gguf(gguf_path)
  hf_dict = hf_config_dict(metadata, {t.name for t in tensors}, gguf_path)
  try:
    cfg = ModelConfig.from_hf_dict(hf_dict, param_dtype=dtype)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{gguf_path}: {e}") from None
  expected = check_tensors(cfg, tensors, gguf_path)
  files = gguf_tokenizer.tokenizer_files(metadata, gguf_path)
  if len(metadata["tokenizer.ggml.tokens"]) > cfg.vocab_size:
    raise ValueError(f"{gguf_path}: {len(metadata['tokenizer.ggml.tokens'])} tokens for an embedding of "
                     f"{cfg.vocab_size} rows")
  weights = {expected[t.name][0]: hf_tensor(t, cfg, DTYPES[dtype]) for t in tensors}
  files["config.json"] = json.dumps(cfg.to_hf_dict(dtype=dtype), indent=2, sort_keys=True)
  files[SOURCE_FILE] = json.dumps(_source_record(gguf_path, metadata, tensors, dtype), indent=2)
  _write_folder(out, weights, files)
  return cfg


def _source_record(gguf_path: str, metadata: Mapping[str, Any], tensors, dtype: str) -> dict[str, Any]:
  """What the folder was converted from: the file, its sha256, its quant types and the dtype written."""
  digest = hashlib.sha256()
  with open(gguf_path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  types = collections.Counter(t.tensor_type.name for t in tensors)
  return {"gguf_file": os.path.basename(gguf_path), "sha256": digest.hexdigest(),
          "name": metadata.get("general.name"), "license": metadata.get("general.license"),
          "tensor_types": dict(sorted(types.items())), "dtype": dtype,
          "note": f"weights dequantized from the quant types above to {dtype}"}


def _write_folder(out: str, weights: Mapping[str, np.ndarray], files: Mapping[str, str]) -> None:
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
  try:
    os.chmod(tmp, 0o755)
    save_file(dict(weights), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    for name, text in files.items():
      with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
        f.write(text)
    for name in os.listdir(tmp):   # safetensors writes its file private; a cache folder is for every user
      os.chmod(os.path.join(tmp, name), 0o644)
    hf_io.replace_dir(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
