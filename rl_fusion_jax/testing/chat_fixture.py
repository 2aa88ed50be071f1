"""A tiny chat checkpoint written at test time: nothing is downloaded.

``make_chat_checkpoint(folder)`` writes what a Hugging Face chat model folder holds, at toy size:

* ``tokenizer.json``: a byte-level BPE trained here on the ChatML renderings of ``PROBLEMS``, with the
  special tokens ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` (ids 0, 1, 2);
* ``tokenizer_config.json``: Qwen2-Instruct's special tokens (eos ``<|im_end|>``, pad ``<|endoftext|>``, no
  bos), its ``added_tokens_decoder`` and its ChatML ``chat_template`` (``QWEN2_CHAT_TEMPLATE``);
* ``generation_config.json``: eos ids [``<|im_end|>``, ``<|endoftext|>``], as Qwen2-Instruct ships;
* ``config.json`` + ``model.safetensors``: a random 2-layer Qwen2 (``rl_fusion_jax.models.save_hf``) whose
  vocabulary covers the tokenizer.

``write_gsm8k`` writes ``PROBLEMS`` as GSM8K-format JSONL. Expected prompts in tests are written out by
hand, never computed with this module's template.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import jax
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rl_fusion_jax.models import init_params, save_hf
from rl_fusion_jax.testing.tiny import tiny_model_config

__all__ = ["PROBLEMS", "QWEN2_CHAT_TEMPLATE", "SPECIAL_TOKENS", "make_chat_checkpoint", "write_gsm8k"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD, IM_START, IM_END = SPECIAL_TOKENS

# Qwen2-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2-*-Instruct), verbatim.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Short GSM8K-format problems, so the rendered prompts stay a few dozen tokens long.
PROBLEMS = (
    {"question": "What is 2 plus 3?", "answer": "2+3=5\n#### 5"},
    {"question": "Sam has 4 apples and eats 1. How many are left?", "answer": "4-1=3\n#### 3"},
    {"question": "What is 6 times 7?", "answer": "6*7=42\n#### 42"},
    {"question": "A box holds 5 pens. How many pens are in 3 boxes?", "answer": "5*3=15\n#### 15"},
    {"question": "What is 10 minus 8?", "answer": "10-8=2\n#### 2"},
    {"question": "Ann has 9 cards and gets 2 more. How many now?", "answer": "9+2=11\n#### 11"},
    {"question": "What is 12 divided by 4?", "answer": "12/4=3\n#### 3"},
    {"question": "What is 1 plus 1?", "answer": "1+1=2\n#### 2"},
)


def write_gsm8k(path: str | os.PathLike, problems: Sequence[Mapping[str, str]] = PROBLEMS) -> str:
  """One ``{"question", "answer"}`` JSON object per line; returns the path."""
  with open(path, "w", encoding="utf-8") as f:
    for problem in problems:
      f.write(json.dumps(dict(problem)) + "\n")
  return os.fspath(path)


def _corpus(problems: Sequence[Mapping[str, str]]) -> list[str]:
  """ChatML-like text of the problems (special tokens excluded: the trainer splits them off)."""
  cue = "\nEnd your answer with '#### <number>'."
  lines = ["system\nYou are a helpful assistant.", "assistant\n", "user\n"]
  return lines + [p["question"] + cue for p in problems] + [p["answer"] for p in problems]


def train_tokenizer(vocab_size: int = 400, problems: Sequence[Mapping[str, str]] = PROBLEMS
                    ) -> tokenizers.Tokenizer:
  """Byte-level BPE: the 3 special tokens (ids 0-2), the 256 byte symbols, then merges up to
  ``vocab_size``; any text encodes, and decode gives the text back exactly."""
  bpe = tokenizers.Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  bpe.train_from_iterator(_corpus(problems), trainer)
  return bpe


def _tokenizer_config(bpe: tokenizers.Tokenizer, chat_template: str | None) -> dict:
  decoder = {str(bpe.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
  config = {"added_tokens_decoder": decoder, "bos_token": None, "eos_token": IM_END, "pad_token": PAD,
            "errors": "replace", "model_max_length": 32768, "tokenizer_class": "Qwen2Tokenizer"}
  if chat_template is not None:
    config["chat_template"] = chat_template
  return config


def make_chat_checkpoint(folder: str | os.PathLike, *, chat_template: str | None = QWEN2_CHAT_TEMPLATE,
                         vocab_size: int = 448, max_position_embeddings: int = 128, seed: int = 0) -> str:
  """Writes the tiny chat checkpoint into ``folder`` (replaced if it exists); returns its path.

  ``chat_template=None`` leaves the template out (a tokenizer folder without one). ``vocab_size`` is the
  model's embedding size, padded above the tokenizer's own 400 tokens.
  """
  folder = os.path.abspath(os.fspath(folder))
  bpe = train_tokenizer()
  ids = {t: bpe.token_to_id(t) for t in SPECIAL_TOKENS}
  cfg = tiny_model_config(vocab_size=vocab_size, tie_word_embeddings=True,
                          max_position_embeddings=max_position_embeddings, eos_token_id=ids[IM_END])
  save_hf(cfg, init_params(cfg, jax.random.key(seed), init_std=0.2), folder)
  bpe.save(os.path.join(folder, "tokenizer.json"))
  files = {"tokenizer_config.json": _tokenizer_config(bpe, chat_template),
           "generation_config.json": {"eos_token_id": [ids[IM_END], ids[PAD]], "pad_token_id": ids[PAD]}}
  for name, content in files.items():
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
      json.dump(content, f, indent=2)
  return folder
