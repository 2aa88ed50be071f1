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
on one, so no expected result is given here. ``:cpu`` picks the settings that are fast on a CPU backend
(`model.dtype=auto`, no remat, the layers unrolled, one device: see the variant's comment); no RL run of it has been
measured yet. tests/chat_test.py runs this config end to end for 2 steps on
a tiny random checkpoint (rl_fusion_jax/testing/chat_fixture.py) on CPU.
"""
import os
import runpy

from rl_fusion_jax import config as config_lib

# Config files are loaded by path, not imported as a package: the base config is run by path too.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ARITHMETIC = os.path.join(_HERE, "arithmetic.py")
SAMPLE = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "rl_fusion_jax", "testing",
                      "gsm8k_sample.jsonl")


def get_config(arg: str = ""):
  if arg not in ("", "cpu"):
    raise ValueError(f"unknown variant {arg!r} of gsm8k_chat.py; known: cpu")
  c = runpy.run_path(_ARITHMETIC)["get_config"]()
  # The architecture comes from DIR/config.json (the model fields left None are not given); only the
  # runtime fields are chosen here: bfloat16 compute over float32 master weights (generation on the
  # switch's bfloat16 copy), each layer rematerialized in the backward pass, the lm head 1,024 tokens at
  # a time.
  c.model = config_lib.default_config_dict().model
  c.model.update(dtype="bfloat16", remat="full", scan_unroll=1, logits_chunk=1024)
  c.task.kwargs = dict(path=SAMPLE)    # replaces arithmetic's (update() would merge them)
  c.task.update(name="gsm8k", tokenizer="", prompt_format="chat", eval_problems=64, eval_samples=0, pass_k=1)
  c.rollout.update(max_prompt_len=384, max_new_tokens=512, chunk_steps=32)
  # A group's 4 samples share their prompt: the update runs it once per group (optim.shared_prompts).
  c.optim.update(learning_rate=1e-6, warmup_steps=10, shared_prompts=True)
  c.warmup.steps = 0
  c.run.update(steps=200, checkpoint_every=50, progress_every_s=30.0, eval_every=50)
  if arg == "cpu":
    # The settings that are fast on a CPU (BENCHMARKS.md, "GRPO against TRL on SmolLM2-135M-Instruct" and
    # "Real-model decode on CPU and the stacked layer tree"): model.dtype=auto, so bf16_matmul where the CPU
    # has native bfloat16 dots (a SmolLM2-135M step 1.6x faster than float32 with AVX512-BF16) and float32
    # elsewhere (bfloat16 decoded 3.2x slower than float32 on a 2-core AMD EPYC without them), no remat, the layers unrolled (the CPU
    # default, scan_unroll=0: a SmolLM2-135M GRPO step's update took 22.2 s unrolled against 25.1 s rolled,
    # its generation 10.7 against 9.8 s, and since float32 decode chunks take each layer's kernels sliced once
    # a decode step at batch 32 144 against 156 ms; under bf16_matmul 13.8 against 15.6 and 6.3 against 6.7), and one
    # device (two would each read every weight for half the rows). Unrolled, the first step compiles longer
    # (65 against 48 s in float32, its programs not yet in the compilation cache).
    c.model.update(dtype="auto", remat="none", scan_unroll=0)
    c.mesh.cpu_devices = 1
    # The optimizer state stays put while generating: on a CPU "host memory" is the same RAM, so moving it
    # there and back only copies it (1.08 GB of AdamW state for SmolLM2-135M, twice a step; BENCHMARKS.md,
    # "GRPO against TRL on SmolLM2-135M-Instruct").
    c.fusion.offload_optimizer = False
  return c
