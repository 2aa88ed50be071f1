"""Hugging Face tokenizer files from the tokenizer a GGUF file describes in its metadata.

A GGUF checkpoint carries no tokenizer.json: llama.cpp stores the vocabulary, the BPE merges, each token's
type and the special token ids as metadata (`tokenizer.ggml.*`), and the chat template as
`tokenizer.chat_template`. `tokenizer_files` turns those into the files `tokenizer.HFTokenizer.from_file`
reads (tokenizer.json, tokenizer_config.json, chat_template.jinja), so a converted GGUF folder is read
like any Hugging Face checkpoint.

Supported: byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`), with the pre-tokenizers of
`PRE_TOKENIZERS` (`tokenizer.ggml.pre`). Tokens of type CONTROL (3) become special added tokens and those
of type USER_DEFINED (4) plain added tokens, matched whole in the text, as transformers' GGUF loader adds
them. Anything else fails naming the metadata key and its value before a tokenizer is built.

This module takes the metadata as a plain mapping: it reads no files and imports neither gguf nor jax
(`models/gguf_io.py` reads the GGUF).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

__all__ = ["PRE_TOKENIZERS", "bytes_to_unicode", "build_tokenizer", "check_tokenizer_metadata",
           "tokenizer_files"]

TOKENIZER_MODELS = ("gpt2",)
CONTROL, USER_DEFINED = 3, 4   # llama.cpp's token types (llama_token_type)
# tokenizer_config.json's name of each special token -> the GGUF key of its id.
SPECIAL_TOKEN_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                      "unk_token": "tokenizer.ggml.unknown_token_id",
                      "pad_token": "tokenizer.ggml.padding_token_id"}
REQUIRED_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                 "tokenizer.ggml.eos_token_id")


def _byte_level(add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, trim_offsets=True, use_regex=True)


def _digits_then_byte_level(add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level(add_prefix_space)])


# tokenizer.ggml.pre -> the pre-tokenizer of the model's own tokenizer.json, given add_space_prefix.
# "smollm" (SmolLM / SmolLM2): every number character its own piece, then GPT-2's byte-level split, as in
# SmolLM2's tokenizer.json and llama.cpp (which splits on \p{N} first). transformers' GGUF loader has no
# entry for "smollm" and uses GPT-2's split alone: its ids differ where a number character other than 0-9
# follows a space (" ²" -> "ĠÂ", "²" there, "Ġ", "Â²" here); the SmolLM2 vocabulary has no token joining an
# ASCII digit to anything, so plain digits agree.
PRE_TOKENIZERS = {"smollm": _digits_then_byte_level, "gpt-2": _byte_level, "default": _byte_level}


def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's printable spelling of each byte: byte-level BPE vocabularies are written in it."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  spelled = {b: chr(b) for b in printable}
  extra = (b for b in range(256) if b not in spelled)
  spelled.update({b: chr(256 + n) for n, b in enumerate(extra)})
  return dict(sorted(spelled.items()))


def _get(metadata: Mapping[str, Any], key: str, where: str) -> Any:
  if key not in metadata:
    raise ValueError(f"{where}: missing tokenizer metadata '{key}'")
  return metadata[key]


def check_tokenizer_metadata(metadata: Mapping[str, Any], where: str) -> None:
  """Raises naming the key when the tokenizer metadata is missing, unsupported or inconsistent."""
  for key in REQUIRED_KEYS:
    _get(metadata, key, where)
  model = metadata["tokenizer.ggml.model"]
  if model not in TOKENIZER_MODELS:
    raise ValueError(f"{where}: tokenizer.ggml.model={model!r} is not supported (supported: {TOKENIZER_MODELS})")
  pre = metadata.get("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise ValueError(f"{where}: tokenizer.ggml.pre={pre!r} is not supported (supported: {sorted(PRE_TOKENIZERS)})")
  tokens = metadata["tokenizer.ggml.tokens"]
  types = metadata.get("tokenizer.ggml.token_type")
  if types is not None and len(types) != len(tokens):
    raise ValueError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
  for name, key in SPECIAL_TOKEN_KEYS.items():
    token_id = metadata.get(key)
    if token_id is not None and not 0 <= int(token_id) < len(tokens):
      raise ValueError(f"{where}: {key}={token_id} outside the {len(tokens)} tokens")


def _vocab(tokens: Sequence[str], where: str) -> dict[str, int]:
  """token -> id, each token in the byte alphabet; a token spelled otherwise (llama.cpp writes a few in
  plain text) is respelled from its UTF-8 bytes, as transformers does."""
  spelling = bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab: dict[str, int] = {}
  for token_id, token in enumerate(tokens):
    if not set(token) <= alphabet:
      token = "".join(spelling[b] for b in token.encode("utf-8"))
    if token in vocab:
      raise ValueError(f"{where}: tokenizer.ggml.tokens holds {token!r} twice (ids {vocab[token]} and {token_id})")
    vocab[token] = token_id
  return vocab


def _merges(merges: Sequence[str], where: str) -> list[tuple[str, str]]:
  pairs = [tuple(m.split(" ")) for m in merges]
  for i, pair in enumerate(pairs):
    if len(pair) != 2:
      raise ValueError(f"{where}: tokenizer.ggml.merges[{i}]={merges[i]!r} is not two tokens joined by a space")
  return pairs


def _added_tokens(metadata: Mapping[str, Any]) -> tuple[list[tokenizers.AddedToken], list[tokenizers.AddedToken]]:
  """(special, plain) added tokens: the CONTROL and the USER_DEFINED tokens spelled in the byte alphabet (one
  spelled otherwise is a llama.cpp mislabel, skipped as transformers skips it)."""
  tokens = metadata["tokenizer.ggml.tokens"]
  types = metadata.get("tokenizer.ggml.token_type") or ()
  alphabet = set(bytes_to_unicode().values())
  special = [tokenizers.AddedToken(t, special=True, normalized=False)
             for t, kind in zip(tokens, types) if kind == CONTROL and set(t) <= alphabet]
  plain = [tokenizers.AddedToken(t, special=False, normalized=False)
           for t, kind in zip(tokens, types) if kind == USER_DEFINED and set(t) <= alphabet]
  return special, plain


def build_tokenizer(metadata: Mapping[str, Any], where: str) -> tokenizers.Tokenizer:
  """The `tokenizers.Tokenizer` the metadata describes (checked first); ids are the GGUF's token ids."""
  check_tokenizer_metadata(metadata, where)
  vocab = _vocab(metadata["tokenizer.ggml.tokens"], where)
  try:
    bpe = models.BPE(vocab=vocab, merges=_merges(metadata["tokenizer.ggml.merges"], where), fuse_unk=False)
  except Exception as e:  # the Rust binding raises a bare Exception, e.g. for a merge of unknown tokens
    raise ValueError(f"{where}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})") from None
  tokenizer = tokenizers.Tokenizer(bpe)
  prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
  tokenizer.pre_tokenizer = PRE_TOKENIZERS[metadata.get("tokenizer.ggml.pre", "default")](prefix)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
  special, plain = _added_tokens(metadata)
  tokenizer.add_special_tokens(special)
  tokenizer.add_tokens(plain)
  for added in special + plain:
    if tokenizer.token_to_id(added.content) != vocab[added.content]:
      raise ValueError(f"{where}: added token {added.content!r} did not keep its id {vocab[added.content]}")
  return tokenizer


def tokenizer_files(metadata: Mapping[str, Any], where: str) -> dict[str, str]:
  """File name -> text: tokenizer.json, tokenizer_config.json (special tokens, bos / eos flags) and, when
  the metadata has one, chat_template.jinja. `where` (the GGUF's path) is named in every error."""
  tokenizer = build_tokenizer(metadata, where)
  tokens = metadata["tokenizer.ggml.tokens"]
  config: dict[str, Any] = {name: tokens[int(metadata[key])] for name, key in SPECIAL_TOKEN_KEYS.items()
                            if metadata.get(key) is not None}
  config.update(add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
                tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False)
  files = {"tokenizer.json": tokenizer.to_str(pretty=True),
           "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False)}
  template = metadata.get("tokenizer.chat_template")
  if template is not None:
    if not isinstance(template, str) or not template:
      raise ValueError(f"{where}: tokenizer.chat_template must be a non-empty string")
    files["chat_template.jinja"] = template
  return files
