r"""tiny-grpo: the benchmark configuration (a random-init Qwen2-style model; speed, not learning).

Qwen2-style: vocab 512, hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 688, float32 weights, the main
job's `model.dtype=auto` (bf16_matmul where bfloat16 dots are native, float32 on other CPUs:
docs/models.md, "Precision policy"; `--config.model.dtype=float32` or `=bf16_matmul` to fix it); 16 prompts x 8
samples, prompts padded to 16 tokens, 32 new tokens, temperature 1, one Adam update per batch, a group's
prompt run once in the update (``optim.shared_prompts``: the same loss and gradients up to rounding; the
packed update, ``--config.optim.pack_rows=True``, needs ``--config.optim.shared_prompts=False`` with it).

  python experiments/benchmark_main.py --config=experiments/configs/tiny_grpo.py
  python experiments/benchmark_main.py --config=experiments/configs/tiny_grpo.py --config.mesh.cpu_devices=1

Hardware: 2 CPU cores. Expected result: see BENCHMARKS.md. Variant ``:kl`` adds a reference model
(k3 KL in the loss), which costs one more forward pass per step.
"""
import os
import runpy

# Config files are loaded by path, not imported as a package: the base config is run by path too.
_ARITHMETIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic.py")


def get_config(arg: str = ""):
  arithmetic = runpy.run_path(_ARITHMETIC)
  c = arithmetic["get_config"]()
  c.model = arithmetic["model"](vocab_size=512, hidden=256, layers=4, heads=4, kv_heads=2, mlp=688)
  c.model.tie_word_embeddings = False
  c.task.kwargs = dict(min_digits=1, max_digits=3, ops="+-")
  c.rollout.max_prompt_len = 16
  c.rollout.max_new_tokens = 32
  c.warmup.steps = 0
  # Each group of 8 samples shares its 16-token prompt: the update runs it once per group (4,224 decoder
  # positions a step instead of 6,016; BENCHMARKS.md, "Against TRL (tiny-grpo)").
  c.optim.shared_prompts = True
  c.task.eval_samples = 0           # a step-time benchmark: greedy evaluation only
  c.run.steps = 10
  if arg == "kl":
    c.algo.kl_coef = 0.05
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of tiny_grpo.py; known: kl")
  return c
