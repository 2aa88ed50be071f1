r"""Parity of a converted GGUF model with transformers' loading of the same GGUF file: logits and tokenizer.

  python experiments/fetch_model_main.py                                # once: the cache folder
  python experiments/gguf_parity_main.py --ref_python=/work/venv_ref/bin/python
  python experiments/gguf_parity_main.py --ref_python=... --write_reference=rl_fusion_jax/testing/smollm2_reference.json

--ref_python (default $RLFJ_REF_PYTHON) is a Python with torch, transformers, gguf and accelerate
(experiments/gguf_reference.py says how to make one). transformers loads the GGUF itself (float32, its own
dequantization and q/k un-permutation) and computes ids and logits; this side loads the converted folder
with `load_hf` and `HFTokenizer` and compares (`rl_fusion_jax.testing.real_model`): the chat template's text
and ids of 3 conversations, the largest |logit difference| over every position and vocabulary entry of each
(float32, on transformers' ids), the ids of 10 texts (unicode, digits, special tokens) and of the text of
every vocabulary entry (49,152 texts). The weights are the GGUF's 4-bit Q4_1 values dequantized, on both
sides. Prints one JSON line, then the result line. --write_reference writes the committed reference that
tests/real_model_test.py compares with when transformers is not installed. About 2 min on 2 CPU cores.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

_NAME = flags.DEFINE_string("name", "smollm2-135m-instruct", "A model of rl_fusion_jax.models.pretrained.MODELS.")
_ROOT = flags.DEFINE_string("root", None, "Cache root of experiments/fetch_model_main.py.")
_REF_PYTHON = flags.DEFINE_string("ref_python", os.environ.get("RLFJ_REF_PYTHON"),
                                  "Python with torch + transformers + gguf + accelerate.")
_VOCAB = flags.DEFINE_bool("vocab_texts", True, "Also compare ids on the text of every vocabulary entry.")
_WRITE = flags.DEFINE_string("write_reference", None, "Write the committed reference JSON here.")


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def main(argv):
  del argv
  from rl_fusion_jax import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.models import pretrained  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.testing import real_model  # pylint: disable=g-import-not-at-top
  if not _REF_PYTHON.value:
    raise app.UsageError("--ref_python (or $RLFJ_REF_PYTHON): a Python with torch and transformers")
  folder, gguf = pretrained.cache_folder(_NAME.value, _ROOT.value), pretrained.gguf_path(_NAME.value, _ROOT.value)
  if not os.path.isdir(folder) or not os.path.isfile(gguf):
    raise app.UsageError(f"{folder} or {gguf} missing: run experiments/fetch_model_main.py first")
  start = time.perf_counter()
  batch = real_model.vocab_texts(tokenizer_lib.HFTokenizer.from_file(folder)) if _VOCAB.value else []
  ref = real_model.run_reference(_REF_PYTHON.value, gguf, real_model.TEXTS, real_model.CHATS, batch)
  reference_s = time.perf_counter() - start
  result = real_model.compare_live(folder, ref, real_model.TEXTS, real_model.CHATS, batch)
  result.update(reference_seconds=round(reference_s, 1), seconds=round(time.perf_counter() - start, 1),
                reference=ref["versions"], weights="GGUF Q4_1 (4-bit) dequantized to float32 on both sides")
  print(json.dumps(result))
  print(f"{_NAME.value} (4-bit Q4_1 GGUF, dequantized, float32): max |logit diff| vs transformers "
        f"{max(result['max_abs_logit_diff']):.2e} over {result['chats']} chat prompts of {result['tokens']} tokens "
        f"(logits up to {max(result['max_abs_logit']):.1f}); tokenizer ids equal on {result['texts_equal']}/"
        f"{result['texts']} texts ({len(result['texts_digit_split'])} more differ only by SmolLM2's digit split, "
        f"which transformers' GGUF tokenizer lacks), {result.get('vocab_texts_equal', 0)}/"
        f"{result.get('vocab_texts', 0)} vocabulary texts, {result['chat_ids_equal']}/{result['chats']} chat prompts")
  if _WRITE.value:
    record = real_model.reference_record(ref, real_model.TEXTS, real_model.CHATS, _sha256(gguf))
    with open(_WRITE.value, "w", encoding="utf-8") as f:
      json.dump(record, f, ensure_ascii=False, separators=(",", ":"))
      f.write("\n")


if __name__ == "__main__":
  app.run(main)
