r"""GSM8K-format word problems from a JSONL file: supervised warm-up on the reference solutions, then GRPO.

Command (CPU, 2 cores), on the 10-problem sample that ships with the package:

  python experiments/grpo_main.py --config=experiments/configs/gsm8k.py --workdir=/tmp/gsm8k

On a real GSM8K file (one ``{"question": ..., "answer": "... #### 42"}`` object per line, as in the
GSM8K release's ``train.jsonl``; the held-out problems come from ``task.eval_seed``'s permutation of the
same file, so point ``eval_problems`` at a count that fits your split):

  python experiments/grpo_main.py --config=experiments/configs/gsm8k.py --workdir=/tmp/gsm8k_full \
      --config.task.kwargs.path=/data/gsm8k/train.jsonl --config.rollout.max_prompt_len=512 \
      --config.rollout.max_new_tokens=512 --config.model.max_position_embeddings=1024

The start-up check encodes every problem of the file and names the length field that is too small.
The char-level 4-layer model of arithmetic.py is a plumbing check here, not a GSM8K solver: expect a
runtime of a few minutes and accuracy near zero. For a real run start from a Hugging Face checkpoint
(``--config.model.hf_path=DIR --config.task.tokenizer=DIR``).
"""
import os
import runpy

# Config files are loaded by path, not imported as a package: the base config is run by path too.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ARITHMETIC = os.path.join(_HERE, "arithmetic.py")
SAMPLE = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "rl_fusion_jax", "testing",
                      "gsm8k_sample.jsonl")


def get_config(arg: str = ""):
  c = runpy.run_path(_ARITHMETIC)["get_config"](arg)
  c.task.name = "gsm8k"
  c.task.kwargs = dict(path=SAMPLE)
  c.task.eval_problems = 16
  c.rollout.num_prompts = 8
  c.rollout.group_size = 4
  c.rollout.max_prompt_len = 160     # BOS + the longest question of the sample + the answer cue
  c.rollout.max_new_tokens = 160     # the longest reference solution + EOS
  c.model.max_position_embeddings = 320
  c.warmup.steps = 200
  c.warmup.batch_size = 16
  c.warmup.checkpoint_every = 100
  c.run.steps = 20
  c.run.checkpoint_every = 10
  c.run.eval_every = 0
  return c
