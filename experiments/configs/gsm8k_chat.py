r"""GRPO on GSM8K-format word problems from a Hugging Face chat checkpoint, prompts in its chat template.

Command (DIR: a Hugging Face checkpoint folder holding config.json, *.safetensors, tokenizer.json and
tokenizer_config.json with a chat_template, or chat_template.jinja; e.g. a local copy of
Qwen2.5-0.5B-Instruct):

  python experiments/grpo_main.py --config=experiments/configs/gsm8k_chat.py --workdir=/tmp/gsm8k_chat \
      --config.model.hf_path=DIR --config.task.kwargs.path=/data/gsm8k/train.jsonl

What it does: the policy (and the reference, when algo.kl_coef > 0) start from DIR's weights, the tokenizer
is DIR's (``task.tokenizer=''`` means "the folder of model.hf_path"); no supervised warm-up. Each problem
becomes one user message, ``question + "\nEnd your answer with '#### <number>'."`` (after a system message
when ``task.system_prompt`` is set; otherwise the template's own default, if it has one), rendered by DIR's
chat template with the generation prompt, as transformers' ``apply_chat_template`` renders it; the rendered
text is the whole prompt (bos only where the template writes it). Generation stops at the eos token that
ends an assistant turn in the template (``<|im_end|>`` for Qwen). Reward: 0.1 for a ``#### <number>``
answer, +1 when that number is right (rewards/gsm8k.py). Without ``--config.model.hf_path`` the run stops
at start with an error saying to pass it; a template that does not render, a prompt longer than
``rollout.max_prompt_len`` (every problem of the file is rendered and encoded at start) and a folder
without a chat template all fail before anything compiles, naming the file or field.

Hardware and runtime: meant for one GPU (or more: raise ``mesh.data`` / ``mesh.fsdp``); not yet measured
on one, so no expected result is given here. tests/chat_test.py runs this config end to end for 2 steps on
a tiny random checkpoint (rl_fusion_jax/testing/chat_fixture.py) on CPU.
"""
import os
import runpy

import ml_collections

# Config files are loaded by path, not imported as a package: the base config is run by path too.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ARITHMETIC = os.path.join(_HERE, "arithmetic.py")
SAMPLE = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "rl_fusion_jax", "testing",
                      "gsm8k_sample.jsonl")


def get_config(arg: str = ""):
  if arg:
    raise ValueError(f"gsm8k_chat.py has no variants; got {arg!r}")
  c = runpy.run_path(_ARITHMETIC)["get_config"]()
  # The architecture comes from DIR/config.json; only the runtime fields are chosen here: bfloat16
  # compute over float32 master weights (generation on the switch's bfloat16 copy), each layer
  # rematerialized in the backward pass, the lm head 1,024 tokens at a time.
  c.model = ml_collections.ConfigDict(dict(hf_path="", init_std=0.02, dtype="bfloat16", remat="full",
                                           scan_unroll=1, logits_chunk=1024))
  c.task = ml_collections.ConfigDict(dict(
      name="gsm8k", kwargs=dict(path=SAMPLE), tokenizer="", prompt_format="chat", system_prompt="",
      eval_seed=10_000, eval_problems=64, eval_samples=0, pass_k=1, reward_model="", reward_model_weight=1.0,
      verify_workers=1))
  c.rollout = ml_collections.ConfigDict(dict(
      num_prompts=16, group_size=8, max_prompt_len=384, max_new_tokens=512, temperature=1.0, top_k=0,
      top_p=1.0, num_slots=0, chunk_steps=32, prefill_rows=0, keep_cache=False))
  c.algo.kl_coef = 0.0
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=1e-6, b1=0.9, b2=0.99, weight_decay=0.0, grad_clip=1.0, warmup_steps=10,
      micro_batches=1, tokens_per_micro_batch=0, pack_rows=False))
  c.warmup.steps = 0
  c.run = ml_collections.ConfigDict(dict(
      steps=200, seed=0, checkpoint_every=50, keep_checkpoints=2, progress_every_s=30.0, eval_every=50,
      on_nonfinite="stop", max_consecutive_skips=3))
  return c
