r"""Writes the tiny Hugging Face parity fixtures under rl_fusion_jax/testing/hf_fixtures/.

  python experiments/make_hf_fixtures.py [--out_dir=rl_fusion_jax/testing/hf_fixtures] [--only=NAME,...]

Needs torch and transformers (CPU is enough, ~20 s); the package and the default tests never import
them. Each fixture folder holds a random tiny model saved with `save_pretrained` (safetensors) plus
`reference.npz` (`tokens` [B, T] int32, `logits` [B, T, V] float32). The reference logits come from
RELOADING the saved folder in float32 with eager attention, never from the live model: converting a
live model to bfloat16 also rounds its rotary `inv_freq` buffer, an error no fresh load has.
Weights are drawn with std 0.2 and biases / norm weights moved away from 0 / 1, so a wrong layout,
a missing bias or a misplaced norm changes the logits by far more than the 1e-4 the tests allow.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

FIXTURES = {
    # Qwen2, untied head, float32, GQA 4:2.
    "qwen2_f32": dict(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        dtype="float32",
    ),
    # Qwen2, tied head, bfloat16 weights, multi-query (one kv head), large rope_theta.
    "qwen2_tied_bf16": dict(
        model_type="qwen2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        dtype="bfloat16",
    ),
    # Llama (no biases), untied, GQA 4:2, head_dim 16 != hidden_size / heads = 8.
    "llama_gqa_f32": dict(
        model_type="llama",
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    ),
    # Llama with llama3 rope scaling; original_max_position_embeddings=64 puts the 8 frequencies of
    # head_dim 16 in all three bands (kept, interpolated, divided by factor).
    "llama3_rope": dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        dtype="float32",
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    # Qwen3 (dense): per-head q/k RMSNorm, no biases, GQA 4:2, head_dim 16 != hidden_size / heads = 8.
    "qwen3_f32": dict(
        model_type="qwen3",
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        dtype="float32",
    ),
    # Qwen2-MoE: 8 experts, top-2, no renormalisation, shared expert behind its sigmoid gate, q/k/v biases.
    # mlp_only_layers=[2] makes layer 2 a dense MLP (intermediate_size), so both of our stacks exist and
    # global layer 3 is index 2 of `layers`.
    "qwen2_moe_f32": dict(
        model_type="qwen2_moe",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        dtype="float32",
    ),
    # Qwen3-MoE: bfloat16 weights, 4 experts, top-2 renormalised, no shared expert, q/k norm, tied head;
    # every layer sparse (as in the Hub's Qwen3-MoE models).
    "qwen3_moe_bf16": dict(
        model_type="qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        dtype="bfloat16",
    ),
}
REFERENCE_SHAPE = (2, 20)  # (batch, tokens) of the reference inputs

FLAGS = flags.FLAGS
DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rl_fusion_jax",
                               "testing", "hf_fixtures")


def define_flags() -> None:
  """The binary's flags; defined only when it runs, since tests load this file by path (more than one
  test module may, in one process, and absl refuses a flag defined twice)."""
  flags.DEFINE_string("out_dir", DEFAULT_OUT_DIR, "Where the fixture folders go (default: the repository's "
                      "rl_fusion_jax/testing/hf_fixtures, wherever the binary is run from).")
  flags.DEFINE_list("only", [], "Names of FIXTURES to (re)build; all when empty.")


def _dtype_kwarg(torch_dtype) -> dict:
  """`dtype=` on transformers 5, `torch_dtype=` on 4.x."""
  import transformers  # pylint: disable=import-outside-toplevel

  major = int(transformers.__version__.split(".")[0])
  return {"dtype": torch_dtype} if major >= 5 else {"torch_dtype": torch_dtype}


def _implementation_kwargs(model_type: str) -> dict:
  """Eager attention; for MoE models on transformers 5 also the eager expert loop (one expert at a time,
  the plainest reference) instead of the default grouped matmul."""
  import transformers  # pylint: disable=import-outside-toplevel

  kwargs = {"attn_implementation": "eager"}
  if model_type.endswith("_moe") and int(transformers.__version__.split(".")[0]) >= 5:
    kwargs["experts_implementation"] = "eager"
  return kwargs


def build_model(spec: dict, seed: int):
  """A random float32 transformers model for `spec` (a FIXTURES entry), weights perturbed as described."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  spec = {k: v for k, v in spec.items() if k != "dtype"}
  config = transformers.AutoConfig.for_model(**spec, **_implementation_kwargs(spec["model_type"]))
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, **_dtype_kwarg(torch.float32))
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn(param.shape, generator=gen)
      if "norm" in name:
        param.copy_(1.0 + 0.3 * noise)  # norm weights around 1 but clearly not 1
      elif name.endswith(".bias"):
        param.copy_(0.3 * noise)  # biases clearly not 0
      else:
        param.copy_(0.2 * noise)
  return model.eval()


def reference_logits(folder: str, tokens: np.ndarray) -> np.ndarray:
  """Float32 logits of the checkpoint in `folder`, reloaded from disk in float32 with eager attention."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
    model_type = json.load(f)["model_type"]
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, **_implementation_kwargs(model_type), **_dtype_kwarg(torch.float32)
  ).eval()
  with torch.no_grad():
    return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def write_fixture(spec: dict, folder: str, seed: int = 0, shape: tuple[int, int] = REFERENCE_SHAPE) -> None:
  """Saves the model for `spec` to `folder` (in spec['dtype']) and its reference.npz."""
  import torch  # pylint: disable=import-outside-toplevel

  model = build_model(spec, seed)
  if spec["dtype"] == "bfloat16":
    model = model.to(torch.bfloat16)  # only for saving; the reference reloads from disk
  model.save_pretrained(folder, safe_serialization=True)
  tokens = np.random.default_rng(seed).integers(0, spec["vocab_size"], size=shape).astype(np.int32)
  np.savez(
      os.path.join(folder, "reference.npz"),
      tokens=tokens,
      logits=reference_logits(folder, tokens).astype(np.float32),
  )


def main(argv):
  del argv
  names = FLAGS.only or list(FIXTURES)
  unknown = [n for n in names if n not in FIXTURES]
  if unknown:
    raise app.UsageError(f"--only: unknown fixture(s) {unknown}; known: {sorted(FIXTURES)}")
  try:   # before any folder is made
    import torch  # pylint: disable=import-outside-toplevel,unused-import
    import transformers  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise SystemExit(f"make_hf_fixtures.py needs torch and transformers ({e}), which the package never "
                     "imports: pip install -e '.[fixtures]'")
  for name in names:
    folder = os.path.join(FLAGS.out_dir, name)
    os.makedirs(folder, exist_ok=True)
    write_fixture(FIXTURES[name], folder)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"{folder}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
  define_flags()
  app.run(main)
