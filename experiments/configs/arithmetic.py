r"""The main job: supervised warm-up of a tiny Qwen2-style model on 1-2 digit arithmetic, then GRPO.

Command (CPU, 2 cores; one virtual device per core):

  python experiments/grpo_main.py --config=experiments/configs/arithmetic.py --workdir=/tmp/rlfj_arithmetic

Recipe: a 4-layer model (hidden 128, char tokenizer, `model.dtype=auto`) warmed up with 2,500 supervised steps
(batch 64, lr 2e-3) on "a+b=" / "a-b=" with 1-2 digit operands, then 300 GRPO steps (16 prompts x 8
samples at temperature 1, lr 1e-4). Evaluated on 512 held-out problems before RL, every 100 steps and at
the end: greedy accuracy, and pass@1 / pass@8 over 8 samples per problem at temperature 1.

Runtime: 158 s on a 2-core AMD EPYC with AVX-512 with a warm compilation cache (machine C of
BENCHMARKS.md), where it printed
  accuracy before RL: 0.760  after RL: 0.900  pass@1 0.647 -> 0.798  pass@8 0.939 -> 0.980  (300 RL steps)
Other machines give other float results and so another warmed-up policy: a 2-core AMD EPYC without
AVX-512 prints 0.385 -> 0.471 with the same code (docs/main_job.md: the seed spread and the curves).

Variants in this file: ``--config=...arithmetic.py:ppo`` (PPO: a critic initialised from the warmed-up
policy and GAE, gamma = lambda = 1), ``:dapo`` (dynamic sampling, clip-higher 0.28, soft overlong
penalty over the last 2 tokens), ``:drgrpo`` (Dr. GRPO advantages and aggregation), ``:kl`` (k3 KL
penalty against the warm-up policy), ``:stalesync`` (StaleSync with max_staleness 1 and
train_fraction 0.5: 32 groups outstanding, 16 trained per update, decoupled-PPO off-policy correction),
``:steps`` (the ``arithmetic_steps`` task: chained one-digit + and - answered with the running result
after each operation, 2-12 operands on a geometric tail, so response lengths vary with the problem; the
update on packed rows), ``:steps_long`` (the same task with a heavier tail: 2-20 operands, a geometric
mean of 3 extra), ``:moe`` (a Qwen3-MoE-style policy: 8 experts of hidden 96, top-2 with renormalised weights, q/k norm,
load-balance loss 0.01 and z-loss 1e-3; experts over data x fsdp while training and over fsdp while
generating, so on the 2-device CPU default each device holds 4 experts in training and all 8 while
generating). Append ``,stalesync`` (``:moe,stalesync``) to combine it with the StaleSync variant.
``:moe`` on the 2-core AMD EPYC (run.seed 0, 479 s, the same recipe): accuracy before RL 0.807, after RL
0.963; pass@1 0.734 -> 0.908, pass@8 0.939 -> 0.994; the load-balance loss went 2.29 -> 2.20 (2 is
perfect balance) with every expert taking 9.4-18.3% of the assignments at the last step.
"""
from rl_fusion_jax import config as config_lib


def model(vocab_size=128, hidden=128, layers=4, heads=4, kv_heads=2, mlp=384):
  """The main job's Qwen2-style model (every field not set here at its ModelConfig default)."""
  m = config_lib.default_config_dict().model
  m.update(vocab_size=vocab_size, hidden_size=hidden, num_layers=layers, num_heads=heads,
           num_kv_heads=kv_heads, intermediate_size=mlp, qkv_bias=True, tie_word_embeddings=True,
           max_position_embeddings=64,
           # bf16_matmul where bfloat16 dots are native (accelerators, CPUs with AVX512-BF16 / AMX),
           # float32 on other CPUs, where bf16_matmul is the slower policy (BENCHMARKS.md).
           dtype="auto",
           # A tiny model on CPU: layers fully unrolled (faster than a rolled scan here, and compile time
           # is small at 4 layers), no remat (the default), one lm-head chunk per micro-batch.
           scan_unroll=layers, logits_chunk=8192)
  return m


def moe_model(**over):
  """The main job's model with every MLP a mixture of 8 experts (top-2, 2 x 96 active hidden units)."""
  m = model(**over)
  m.update(model_type="qwen3_moe", qkv_bias=False, qk_norm=True, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=96, norm_topk_prob=True, router_aux_loss_coef=0.01, router_z_loss_coef=1e-3)
  return m


def get_config(arg: str = ""):
  c = config_lib.default_config_dict()
  variants = [a for a in arg.split(",") if a]
  moe = "moe" in variants
  arg = ",".join(a for a in variants if a != "moe")
  c.model = moe_model() if moe else model()
  c.task.kwargs = dict(min_digits=1, max_digits=2, ops="+-")
  c.task.eval_problems, c.task.eval_samples, c.task.pass_k = 512, 8, 8
  c.rollout.max_prompt_len, c.rollout.max_new_tokens = 8, 6
  c.optim.learning_rate, c.optim.b2 = 1e-4, 0.99
  # warmup.seed fixed: every run.seed starts RL from the same warmed-up policy (one SFT checkpoint).
  c.warmup.update(steps=2500, learning_rate=2e-3, checkpoint_every=250, seed=0)
  c.run.update(steps=300, checkpoint_every=100, eval_every=100)
  if arg == "drgrpo":
    c.algo.advantage = "dr_grpo"
    c.algo.aggregation = "seq-mean-token-sum-norm"
  elif arg == "ppo":
    c.algo.advantage = "gae"           # PPO: a critic (the warmed-up body + a value head) and GAE
  elif arg == "dapo":
    c.algo.dynamic_sampling = True     # drop groups of equal rewards, refill from the next problems
    c.algo.clip_high = 0.28            # clip-higher
    c.algo.overlong_buffer = 2         # soft penalty over the last 2 of the 6 new tokens
  elif arg == "kl":
    c.algo.kl_coef = 0.05
  elif arg == "stalesync":
    c.stalesync.enabled, c.stalesync.max_staleness, c.stalesync.train_fraction = True, 1, 0.5
    c.rollout.num_slots = 256          # every outstanding sample has a slot, so long tails stay in flight
    c.algo.policy_loss = "decoupled_ppo"
  elif arg in ("steps", "steps_long"):
    # Chained one-digit + and - with the running result written after each operation
    # (rewards/arithmetic_steps.py): response lengths set by the problem, with a tail (2-12 operands).
    c.task.name = "arithmetic_steps"
    c.task.kwargs = dict(min_terms=2, max_terms=12, tail=2.0)
    c.rollout.max_prompt_len, c.rollout.max_new_tokens = 25, 44   # a BOS token + 24 characters; 43 + EOS
    c.model.max_position_embeddings = 72
    # The update on packed rows: its cost follows the responses' real tokens (mean ~8 characters), not
    # the 69-column padded width that the longest response of a batch sets. One row count for the whole
    # run (the update compiles once; its micro-batches of padding rows are skipped).
    c.optim.pack_rows = True
    c.optim.fixed_row_count = True
    if arg == "steps_long":
      # A heavier tail (2-20 operands, geometric mean 3 extra): responses of ~12 characters on average, the
      # longest of an update ~60 (at most 75).
      c.task.kwargs = dict(min_terms=2, max_terms=20, tail=3.0)
      c.rollout.max_prompt_len, c.rollout.max_new_tokens = 41, 76   # a BOS token + 40 characters; 75 + EOS
      c.model.max_position_embeddings = 120
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of arithmetic.py; known: drgrpo, ppo, dapo, kl, stalesync, steps, "
                     "steps_long")
  return c
