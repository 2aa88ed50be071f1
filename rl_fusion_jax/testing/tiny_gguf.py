"""A tiny Llama GGUF written at test time by `gguf`'s own writer, laid out as llama.cpp's converter lays out
SmolLM2-135M-Instruct.Q4_1.gguf: the same metadata keys, Q4_1 projections, a Q8_0 embedding, float32 norms,
q / k rows permuted for llama.cpp's RoPE, and a byte-level BPE vocabulary ("smollm" pre-tokenizer) with
control tokens and SmolLM2's chat template.

`write_tiny_gguf` returns what the import must produce: every tensor in HF names and layout, computed as
`dequantize(quantize(w))` of the HF-layout weights `w` with no permutation at all. Quantization works on
whole rows, so permuting rows before quantizing (what the file holds) and un-permuting after dequantizing
gives exactly these values; an import that skips the un-permute does not, since every head's rows differ.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rl_fusion_jax.gguf_tokenizer import CONTROL, USER_DEFINED, bytes_to_unicode

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_TOKEN = "<tool>"
# (left, right) merges in priority order. "1 2" and "Ġ 1" exist so that the digit split of the "smollm"
# pre-tokenizer shows: with it, "12" and " 1" never merge.
MERGES = (("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"),
          ("Ġwor", "l"), ("Ġworl", "d"), ("1", "2"), ("Ġ", "1"))
CHAT_TEMPLATE = (  # SmolLM2-135M-Instruct's, as its GGUF stores it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Model shape: GQA 4:2, head_dim 16; every quantized row length is a multiple of the 32-value blocks.
SHAPE = dict(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2)


def tokens() -> list[str]:
  """Control tokens, the 256 byte tokens, one token per merge, then one user-defined token."""
  return [*SPECIALS, *bytes_to_unicode().values(), *(a + b for a, b in MERGES), USER_TOKEN]


def token_types() -> list[int]:
  return [CONTROL] * len(SPECIALS) + [1] * (256 + len(MERGES)) + [USER_DEFINED]


def metadata(vocab_size: int) -> dict[str, tuple[Any, str]]:
  """key -> (value, GGUF value type name) of every key the tiny file has (SmolLM2's key set)."""
  s = SHAPE
  return {
      "general.type": ("model", "STRING"), "general.name": ("Tiny Llama", "STRING"),
      "general.license": ("apache-2.0", "STRING"), "general.file_type": (3, "UINT32"),
      "general.quantization_version": (2, "UINT32"),
      "llama.block_count": (s["layers"], "UINT32"), "llama.context_length": (128, "UINT32"),
      "llama.embedding_length": (s["hidden"], "UINT32"), "llama.feed_forward_length": (s["intermediate"], "UINT32"),
      "llama.attention.head_count": (s["heads"], "UINT32"), "llama.attention.head_count_kv": (s["kv_heads"], "UINT32"),
      "llama.rope.freq_base": (100000.0, "FLOAT32"), "llama.attention.layer_norm_rms_epsilon": (1e-5, "FLOAT32"),
      "llama.vocab_size": (vocab_size, "UINT32"), "llama.rope.dimension_count": (s["hidden"] // s["heads"], "UINT32"),
      "tokenizer.ggml.add_space_prefix": (False, "BOOL"), "tokenizer.ggml.add_bos_token": (False, "BOOL"),
      "tokenizer.ggml.model": ("gpt2", "STRING"), "tokenizer.ggml.pre": ("smollm", "STRING"),
      "tokenizer.ggml.tokens": (tokens(), "STRING"), "tokenizer.ggml.token_type": (token_types(), "INT32"),
      "tokenizer.ggml.merges": ([f"{a} {b}" for a, b in MERGES], "STRING"),
      "tokenizer.ggml.bos_token_id": (1, "UINT32"), "tokenizer.ggml.eos_token_id": (2, "UINT32"),
      "tokenizer.ggml.unknown_token_id": (0, "UINT32"), "tokenizer.ggml.padding_token_id": (2, "UINT32"),
      "tokenizer.chat_template": (CHAT_TEMPLATE, "STRING"),
  }


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's q / k row permutation (convert_hf_to_gguf.py, `LlamaModel.permute`), HF -> GGUF."""
  return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(vocab_size: int, tied: bool, seed: int) -> dict[str, tuple[str, np.ndarray, str]]:
  """HF name -> (GGUF name, HF-layout float32 weight, quant type name)."""
  s, rng = SHAPE, np.random.default_rng(seed)
  head_dim = s["hidden"] // s["heads"]
  normal = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)
  norm = lambda: (1.0 + 0.3 * rng.standard_normal(s["hidden"])).astype(np.float32)
  out = {"model.embed_tokens.weight": ("token_embd.weight", normal(vocab_size, s["hidden"]), "Q8_0"),
         "model.norm.weight": ("output_norm.weight", norm(), "F32")}
  if not tied:
    out["lm_head.weight"] = ("output.weight", normal(vocab_size, s["hidden"]), "Q8_0")
  for i in range(s["layers"]):
    hf, g = f"model.layers.{i}.", f"blk.{i}."
    out.update({
        hf + "input_layernorm.weight": (g + "attn_norm.weight", norm(), "F32"),
        hf + "self_attn.q_proj.weight": (g + "attn_q.weight", normal(s["heads"] * head_dim, s["hidden"]), "Q4_1"),
        hf + "self_attn.k_proj.weight": (g + "attn_k.weight", normal(s["kv_heads"] * head_dim, s["hidden"]), "Q4_1"),
        hf + "self_attn.v_proj.weight": (g + "attn_v.weight", normal(s["kv_heads"] * head_dim, s["hidden"]), "Q4_1"),
        hf + "self_attn.o_proj.weight": (g + "attn_output.weight", normal(s["hidden"], s["heads"] * head_dim), "Q4_1"),
        hf + "post_attention_layernorm.weight": (g + "ffn_norm.weight", norm(), "F32"),
        hf + "mlp.gate_proj.weight": (g + "ffn_gate.weight", normal(s["intermediate"], s["hidden"]), "Q4_1"),
        hf + "mlp.up_proj.weight": (g + "ffn_up.weight", normal(s["intermediate"], s["hidden"]), "Q4_1"),
        hf + "mlp.down_proj.weight": (g + "ffn_down.weight", normal(s["hidden"], s["intermediate"]), "Q4_1"),
    })
  return out


def write_tiny_gguf(path: str, *, tied: bool = True, seed: int = 0, arch: str = "llama",
                    metadata_overrides: Mapping[str, tuple[Any, str] | None] | None = None,
                    quant_types: Mapping[str, str] | None = None,
                    extra_tensors: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
  """Writes the tiny GGUF to `path`; returns HF name -> the float32 tensor the import must give.

  `metadata_overrides`: key -> (value, type name), or None to leave the key out. `quant_types`: GGUF tensor
  name -> quant type name replacing the default (a type gguf cannot quantize is written as zero bytes of
  the right size). `extra_tensors`: GGUF name -> float32 array written as F32.
  """
  import gguf  # pylint: disable=import-outside-toplevel
  vocab_size = len(tokens())
  writer = gguf.GGUFWriter(path, arch)
  for key, entry in {**metadata(vocab_size), **(metadata_overrides or {})}.items():
    if entry is not None:
      value, kind = entry
      sub = gguf.GGUFValueType[kind]
      if isinstance(value, list):
        writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
      else:
        writer.add_key_value(key, value, sub)
  expected = {}
  for hf_name, (name, w, qtype) in hf_weights(vocab_size, tied, seed).items():
    qtype = gguf.GGMLQuantizationType[(quant_types or {}).get(name, qtype)]
    stored = w
    if ".attn_q." in name:
      stored = permute_rows(w, SHAPE["heads"])
    elif ".attn_k." in name:
      stored = permute_rows(w, SHAPE["kv_heads"])
    try:
      data = gguf.quants.quantize(stored, qtype)
      expected[hf_name] = np.asarray(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype), np.float32)
    except NotImplementedError:   # a type gguf cannot write: its bytes, zeroed (the import must refuse it)
      data = np.zeros(gguf.quants.quant_shape_to_byte_shape(stored.shape, qtype), np.uint8)
    writer.add_tensor(name, data, raw_dtype=None if qtype.name in ("F32", "F16") else qtype)
  for name, w in (extra_tensors or {}).items():
    writer.add_tensor(name, np.asarray(w, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return expected
