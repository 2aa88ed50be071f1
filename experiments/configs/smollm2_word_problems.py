r"""GRPO on one-step arithmetic word problems from SmolLM2-135M-Instruct, in its chat template, on a CPU.

Commands (the first fetches the model once into the cache folder; docs/models.md, "A real model"):

  pip install -e '.[gguf]' && python experiments/fetch_model_main.py
  python experiments/grpo_main.py --config=experiments/configs/smollm2_word_problems.py \
      --workdir=/tmp/smollm2_word_problems

What it does: the policy starts from the converted checkpoint (``model.hf_path``, default the cache folder
``experiments/fetch_model_main.py`` writes: $RLFJ_MODEL_CACHE/smollm2-135m-instruct, else
~/.cache/rl_fusion_jax/models/smollm2-135m-instruct); no supervised warm-up. The task is
``word_problems`` (rl_fusion_jax/rewards/word_problems.py): "Mia has 17 stickers. She gets 5 more. ..."
with ``+`` and ``-`` on numbers 2-20, followed by GSM8K's cue "End your answer with '#### <number>'."; each question is one user message in the model's own chat template (its default system
message included). Reward 0.1 for a ``#### <number>`` answer, +1 when the number is right. Held-out
accuracy is greedy, on problems of another seed.

Settings: the CPU ones of gsm8k_chat.py's cpu variant (BENCHMARKS.md, "GRPO against TRL on
SmolLM2-135M-Instruct"): ``model.dtype=auto``, no remat, the layers unrolled (the CPU default), one device,
the optimizer state left in place while generating (on a CPU, host memory is the same RAM). ``auto`` computes
in bf16_matmul on a CPU with native bfloat16 dots (AVX512-BF16 or AMX), where it trains and generates about
1.6x faster than float32 (a step 20.1 against 33.1 s on a 2-core AMD EPYC, layers unrolled), and in float32
on other CPUs, where bf16_matmul decoded at float32's speed and all-bfloat16 3.2x slower (BENCHMARKS.md,
"SmolLM2-135M-Instruct learns word problems"). The learning result there ran in float32
(``--config.model.dtype=float32`` fixes it). On a GPU, ``:gpu`` picks bfloat16 compute over float32 master
weights with each layer rematerialized (not measured here).

The weights are the GGUF's 4-bit Q4_1 values dequantized: a trained model, not its float original.
Measured result: BENCHMARKS.md, "SmolLM2-135M-Instruct learns word problems".
"""
import os
import runpy

from rl_fusion_jax.models import pretrained

_HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(arg: str = ""):
  if arg not in ("", "gpu"):
    raise ValueError(f"unknown variant {arg!r} of smollm2_word_problems.py; known: gpu")
  c = runpy.run_path(os.path.join(_HERE, "gsm8k_chat.py"))["get_config"]("" if arg == "gpu" else "cpu")
  c.model.hf_path = pretrained.cache_folder("smollm2-135m-instruct")
  # Sums and differences of numbers 2-20: the model often computes these right and then does not write
  # the "#### <number>" that the verifier reads (greedy accuracy 0.05 before RL, format rate 0.6).
  c.task.kwargs = dict(ops="+-", min_value=2, max_value=20)
  c.task.update(name="word_problems", eval_problems=128, eval_samples=0, pass_k=1)
  # 8 prompts x 4 samples a step at temperature 0.7 (the loss differentiates the tempered policy);
  # prompts render to 61-69 tokens in SmolLM2's template.
  c.rollout.update(num_prompts=8, group_size=4, max_prompt_len=72, max_new_tokens=64, chunk_steps=16,
                   temperature=0.7)
  c.optim.update(learning_rate=1e-5, warmup_steps=3)
  c.run.update(steps=60, checkpoint_every=30, eval_every=15, progress_every_s=30.0)
  return c
