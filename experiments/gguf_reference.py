r"""transformers' reading of a GGUF file: the independent reference of experiments/gguf_parity_main.py.

Runs with the Python of a separate environment holding torch, transformers and gguf (never the project's
own, which never imports torch or transformers):

  python -m venv /work/venv_ref
  /work/venv_ref/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
  /work/venv_ref/bin/pip install transformers gguf accelerate   # transformers reads GGUF through accelerate
  /work/venv_ref/bin/python experiments/gguf_reference.py --gguf=FILE.gguf --inputs=IN.json --out=OUT.npz

IN.json holds {"texts": [str, ...], "chats": [[{"role", "content"}, ...], ...], "batch_texts": [str, ...]}.
transformers loads the model (`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...,
dtype=torch.float32)`, eager attention) and the tokenizer (`AutoTokenizer.from_pretrained(folder,
gguf_file=...)`) from the GGUF alone, and OUT.npz receives, as int32 / float32 arrays:
  text_ids_{i}:  the ids of texts[i] (`encode(..., add_special_tokens=False)`);
  batch_ids, batch_lengths: the ids of all batch_texts (one batched call), back to back, and their counts;
  chat_text_{i}: chats[i] rendered by the GGUF's chat template with the generation prompt (a str array);
  chat_ids_{i}:  `apply_chat_template(chats[i], tokenize=True, add_generation_prompt=True)`;
  logits_{i}:    the model's float32 logits [T, V] on chat_ids_{i};
  load_seconds:  how long loading the model took.
Nothing of the project is imported.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import transformers


def _ids(x) -> list[int]:
  # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list.
  return list(x["input_ids"] if hasattr(x, "keys") else x)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gguf", required=True)
  parser.add_argument("--inputs", required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  folder, name = os.path.split(os.path.abspath(args.gguf))
  with open(args.inputs, encoding="utf-8") as f:
    inputs = json.load(f)
  torch.set_grad_enabled(False)
  start = time.perf_counter()
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager").eval()
  load_seconds = time.perf_counter() - start
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  out = {"load_seconds": np.float64(load_seconds)}
  for i, text in enumerate(inputs["texts"]):
    out[f"text_ids_{i}"] = np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
  texts = inputs.get("batch_texts") or []
  batch = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
  out["batch_ids"] = np.asarray([i for ids in batch for i in ids], np.int32)
  out["batch_lengths"] = np.asarray([len(ids) for ids in batch], np.int64)
  for i, chat in enumerate(inputs["chats"]):
    out[f"chat_text_{i}"] = np.asarray(tokenizer.apply_chat_template(chat, tokenize=False,
                                                                     add_generation_prompt=True))
    ids = _ids(tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True))
    out[f"chat_ids_{i}"] = np.asarray(ids, np.int32)
    logits = model(torch.tensor([ids])).logits[0]
    out[f"logits_{i}"] = logits.to(torch.float32).numpy()
  np.savez(args.out, **out)
  print(json.dumps({"load_seconds": round(load_seconds, 2), "texts": len(inputs["texts"]),
                    "chats": len(inputs["chats"]), "transformers": transformers.__version__,
                    "torch": torch.__version__}))


if __name__ == "__main__":
  main()
