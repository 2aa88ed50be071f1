"""Parity of a converted GGUF checkpoint with transformers' own reading of the same GGUF file.

Shared by experiments/gguf_parity_main.py (which runs transformers live, in its own environment, through
experiments/gguf_reference.py) and tests/real_model_test.py (which compares against the committed
`smollm2_reference.json`, written by that binary from a live run, and runs transformers itself only when
$RLFJ_REF_PYTHON names a Python that has it). The weights compared are the GGUF's 4-bit values, dequantized
by both sides: parity says the conversion and the forward are right, not that the model equals its float
original.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from tokenizers import pre_tokenizers

from rl_fusion_jax import models, tokenizer as tokenizer_lib

REFERENCE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_reference.json")
REFERENCE_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "experiments", "gguf_reference.py")
REF_PYTHON_ENV = "RLFJ_REF_PYTHON"
# Unicode (accents, CJK, Greek, Arabic, Devanagari, Hangul, emoji with a modifier, a zero-width space),
# digits (runs, separators, superscripts, fractions), whitespace runs and the chat template's special tokens.
TEXTS = (
    "Hello world",
    "The year 2024 had 366 days; pi is 3.14159 and a million is 1,000,000.",
    "naïve café — 東京 🚀 Ελληνικά ñ ü ß",
    "  leading spaces\n\ttabs and trailing  ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "x123y 45 6789 ²³ ½ 0.5e-3",
    "def f(x):\n    return x ** 2  # comment",
    "<|endoftext|><repo_name>abc<file_sep>",
    "emoji 👍🏽 and zero-width\u200bspace",
    "Ünïcödé ÀÉÎÕÜ 한국어 العربية हिन्दी",
)
CHATS = (
    ({"role": "user", "content": "What is the capital of France?"},),
    ({"role": "system", "content": "You are a concise math tutor."},
     {"role": "user", "content": "What is 12 * 7? End your answer with '#### <number>'."}),
    ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about the numbers 3 and 7."}),
)
TOP_K = 8   # logits stored per position in the committed reference
FORWARD = jax.jit(models.forward, static_argnums=0)


def vocab_texts(tok: tokenizer_lib.HFTokenizer) -> list[str]:
  """The text of every id alone (partial UTF-8 bytes decode to U+FFFD): a text set that runs every merge."""
  return [tok.tokenizer.decode([i], skip_special_tokens=False) for i in range(tok.tokenizer.get_vocab_size())]


def run_reference(ref_python: str, gguf_path: str, texts: Sequence[str], chats: Sequence[Sequence[dict]],
                  batch_texts: Sequence[str] = ()) -> dict[str, Any]:
  """transformers' ids and logits for `texts` / `chats` (experiments/gguf_reference.py under `ref_python`)."""
  with tempfile.TemporaryDirectory(prefix="rlfj_ref_") as tmp:
    inputs, out = os.path.join(tmp, "inputs.json"), os.path.join(tmp, "ref.npz")
    with open(inputs, "w", encoding="utf-8") as f:
      json.dump({"texts": list(texts), "chats": [list(c) for c in chats], "batch_texts": list(batch_texts)}, f)
    result = subprocess.run([ref_python, REFERENCE_SCRIPT, f"--gguf={gguf_path}", f"--inputs={inputs}",
                             f"--out={out}"], capture_output=True, text=True, check=False)
    if result.returncode:
      raise RuntimeError(f"{REFERENCE_SCRIPT} under {ref_python} failed:\n{result.stderr[-3000:]}")
    with np.load(out) as ref:
      data = {k: ref[k] for k in ref.files}
  data["versions"] = json.loads(result.stdout.strip().splitlines()[-1])
  return data


def logits(cfg, params, ids: Sequence[int], pad_to: int = 64) -> np.ndarray:
  """Our float32 logits [T, V] of one sequence. The tokens are padded at the end to a multiple of `pad_to`
  (one compile for prompts of different lengths); attention is causal, so the padding changes no logit of
  the T real positions."""
  width = -(-len(ids) // pad_to) * pad_to
  tokens = np.zeros((1, width), np.int32)
  tokens[0, :len(ids)] = ids
  with jax.default_matmul_precision("highest"):   # a no-op on CPU; keeps GPUs from using TF32 here
    return np.asarray(FORWARD(cfg, params, jnp.asarray(tokens))[0, :len(ids)])


def gpt2_split_ids(tok: tokenizer_lib.HFTokenizer, texts: Sequence[str]) -> list[list[int]]:
  """Ids of `texts` with GPT-2's byte-level split alone, without SmolLM2's digit split first: what
  transformers' GGUF loader builds for `tokenizer.ggml.pre == "smollm"` (it has no entry for it). The two
  differ only where a number character other than 0-9 follows a space (" ²": "ĠÂ" + "²" instead of
  "Ġ" + "Â²"); llama.cpp and SmolLM2's own tokenizer.json split digits first, as ours does."""
  gpt2 = tokenizers.Tokenizer.from_str(tok.tokenizer.to_str())
  gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  return [e.ids for e in gpt2.encode_batch(list(texts), add_special_tokens=False)]


def text_agreement(tok: tokenizer_lib.HFTokenizer, texts: Sequence[str], ref_ids: Sequence[Sequence[int]]):
  """(texts whose ids equal transformers', texts that differ only by SmolLM2's digit split (`gpt2_split_ids`
  gives transformers' ids), texts that differ otherwise): three lists of indices."""
  ours = [e.ids for e in tok.tokenizer.encode_batch(list(texts), add_special_tokens=False)]
  gpt2 = gpt2_split_ids(tok, texts)
  equal = [i for i, ids in enumerate(ours) if list(ids) == list(ref_ids[i])]
  digit_split = [i for i in range(len(texts)) if i not in equal and list(gpt2[i]) == list(ref_ids[i])]
  other = [i for i in range(len(texts)) if i not in equal and i not in digit_split]
  return equal, digit_split, other


def compare_live(folder: str, ref: dict[str, Any], texts: Sequence[str], chats, batch_texts=()) -> dict[str, Any]:
  """Our tokenizer and logits on `folder` against a `run_reference` result: per-text agreement
  (`text_agreement`) and the largest |logit difference| over every position and vocabulary entry of each chat
  prompt (on transformers' ids)."""
  cfg, params = models.load_hf(folder)
  tok = tokenizer_lib.HFTokenizer.from_file(folder)
  equal, digit_split, other = text_agreement(tok, texts, [ref[f"text_ids_{i}"].tolist() for i in range(len(texts))])
  out = {"texts_equal": len(equal), "texts": len(texts), "texts_digit_split": [texts[i] for i in digit_split],
         "texts_other": [texts[i] for i in other]}
  if batch_texts:
    splits = np.split(ref["batch_ids"], np.cumsum(ref["batch_lengths"])[:-1])
    equal, digit_split, other = text_agreement(tok, batch_texts, [s.tolist() for s in splits])
    out.update(vocab_texts_equal=len(equal), vocab_texts=len(batch_texts),
               vocab_texts_digit_split=len(digit_split), vocab_texts_other=[batch_texts[i] for i in other][:20])
  out.update(chat_text_equal=0, chat_ids_equal=0, chats=len(chats), max_abs_logit_diff=[], max_abs_logit=[],
             argmax_equal=[], tokens=[])
  for i, chat in enumerate(chats):
    ref_ids = ref[f"chat_ids_{i}"].tolist()
    out["chat_text_equal"] += tok.apply_chat_template(chat) == str(ref[f"chat_text_{i}"])
    out["chat_ids_equal"] += tok.encode_chat(chat) == ref_ids
    ours, theirs = logits(cfg, params, ref_ids), ref[f"logits_{i}"]
    out["max_abs_logit_diff"].append(float(np.abs(ours - theirs).max()))
    out["max_abs_logit"].append(float(np.abs(theirs).max()))
    out["argmax_equal"].append(float((ours.argmax(-1) == theirs.argmax(-1)).mean()))
    out["tokens"].append(len(ref_ids))
  return out


def reference_record(ref: dict[str, Any], texts: Sequence[str], chats, gguf_sha256: str) -> dict[str, Any]:
  """The committed reference: transformers' ids, rendered chats and top-`TOP_K` logits at every position."""
  record = {"versions": ref["versions"], "gguf_sha256": gguf_sha256, "texts": list(texts),
            "text_ids": [ref[f"text_ids_{i}"].tolist() for i in range(len(texts))], "chats": [list(c) for c in chats],
            "chat_text": [], "chat_ids": [], "top_ids": [], "top_logits": []}
  for i in range(len(chats)):
    theirs = ref[f"logits_{i}"]
    top = np.argsort(-theirs, axis=-1)[:, :TOP_K]
    record["chat_text"].append(str(ref[f"chat_text_{i}"]))
    record["chat_ids"].append(ref[f"chat_ids_{i}"].tolist())
    record["top_ids"].append(top.tolist())
    record["top_logits"].append(np.take_along_axis(theirs, top, -1).astype(float).round(6).tolist())
  return record


def load_reference(path: str = REFERENCE_FILE) -> dict[str, Any]:
  with open(path, encoding="utf-8") as f:
    return json.load(f)
