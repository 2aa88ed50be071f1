r"""transformers' `generate` on a Hugging Face folder: the peer of experiments/benchmark_real_generate.py.

Runs with the Python of a separate environment holding torch and transformers (never the project's own):

  /work/venv_ref/bin/python experiments/hf_generate_reference.py --hf_path=DIR --batch=8 --new_tokens=96

Renders ``--batch`` one-turn chats ("What is a + b? Answer with a number.", a and b varying) with DIR's
chat template, left-pads them, and times ``model.generate`` sampling at temperature 1 with no top-k / top-p
and exactly ``--new_tokens`` new tokens per sequence (``min_new_tokens`` = ``max_new_tokens``), after one
warm-up call, ``--repeats`` times, in float32 and in bfloat16 (torch's threads: its default). Prints one
JSON line per dtype: median seconds, tokens/s and ms per decode step. Nothing of the project is imported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--hf_path", required=True)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--new_tokens", type=int, default=96)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  torch.manual_seed(0)
  tok = AutoTokenizer.from_pretrained(args.hf_path)
  tok.padding_side = "left"
  chats = [[{"role": "user", "content": f"What is {17 + i} + {25 + i}? Answer with a number."}]
           for i in range(args.batch)]
  enc = tok([tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats],
            return_tensors="pt", padding=True)
  n = args.new_tokens
  for dtype in (torch.float32, torch.bfloat16):
    model = AutoModelForCausalLM.from_pretrained(args.hf_path, dtype=dtype).eval()
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    with torch.no_grad():
      model.generate(**enc, max_new_tokens=8, min_new_tokens=8, **kw)
      times = []
      for _ in range(args.repeats):
        t0 = time.perf_counter()
        model.generate(**enc, max_new_tokens=n, min_new_tokens=n, **kw)
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    print(json.dumps({"who": "transformers", "dtype": str(dtype).split(".")[-1], "threads": torch.get_num_threads(),
                      "batch": args.batch, "new_tokens": n, "seconds": round(s, 3),
                      "tokens_per_s": round(args.batch * n / s, 1), "ms_per_step": round(1000 * s / n, 1)}),
          flush=True)


if __name__ == "__main__":
  main()
