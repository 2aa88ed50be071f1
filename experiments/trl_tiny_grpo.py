r"""TRL's GRPOTrainer on a workload file written by experiments/benchmark_vs_trl.py: per-step seconds.

Runs with the Python of a separate environment holding torch, transformers and trl (never the
project's own; see BENCHMARKS.md, "Against TRL (tiny-grpo)", for the versions):

  python experiments/benchmark_vs_trl.py --write_workload=/tmp/tiny_grpo_workload.json
  /work/trl_venv/bin/python experiments/trl_tiny_grpo.py --workload=/tmp/tiny_grpo_workload.json --steps=3
  /work/trl_venv/bin/python experiments/trl_tiny_grpo.py --workload=/tmp/tiny_grpo_workload.json --matmul

The workload file holds the model (a checkpoint folder, or the experiment config's architecture as a
Hugging Face config dict with the char tokenizer's alphabet and special ids), the rollout / loss /
optimizer settings and the prompts with their answers (in the order the project's loop draws them; chat
prompts as their messages with the project's token ids). From it this script builds, with no hub access:
the folder's float32 model and tokenizer, or a randomly initialised float32 model and a
PreTrainedTokenizerFast with one token per character and a bos token prepended; checks that every prompt
tokenizes to the project's ids (chat: rendered here by the folder's template) or count (plain text); the
task's verifier, reimplemented below (nothing of the project is imported: the arithmetic task's integer
answer, or the word-problem / GSM8K "#### <number>"); and a GRPOTrainer with one optimizer update per
generated batch. It runs one first step, --warmup_steps unmeasured ones and --steps measured
ones, and prints one JSON line: median seconds of the step and of its phases:
  * generate: GRPOTrainer._generate (prompt tokenization, transformers' generate, decoding), of which
    hf_generate is model.generate alone;
  * reward: GRPOTrainer._calculate_rewards;
  * prepare: the rest of _generate_and_score_completions (padding, advantages, metrics);
  * update: from the end of _prepare_inputs to the end of the optimizer step (forward, backward,
    gradient clipping, AdamW);
  * other: the rest of the trainer loop's iteration (fetching the batch, logging).
With --turn_steps=N it takes turns with the project's benchmark (experiments/turns.py). --matmul prints
torch's float32 matmul rate at the workload's shapes instead and exits.
"""
from __future__ import annotations

import argparse
import fractions
import importlib.util
import json
import os
import re
import statistics
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_turns():
  """experiments/turns.py by path (standard library only): this environment has no project package."""
  spec = importlib.util.spec_from_file_location("turns", os.path.join(HERE, "turns.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# ---------------------------------------------------------------------------------------------------
# Workload: tokenizer, model, reward.


def build_tokenizer(tok: dict):
  """The workload's tokenizer: a checkpoint folder's own (``kind='hf'``), or the char tokenizer.

  Char: one token per character (ids as in rl_fusion_jax/tokenizer.py::CharTokenizer), bos prepended.
  Ids past the alphabet (the model's padded vocabulary) decode to '<unused_N>', text no verifier accepts,
  as CharTokenizer decodes them to U+FFFD.
  """
  from transformers import AutoTokenizer, PreTrainedTokenizerFast
  if tok["kind"] == "hf":
    tokenizer = AutoTokenizer.from_pretrained(tok["path"], padding_side="left")
    if tokenizer.pad_token_id != tok["pad_id"] or tokenizer.eos_token_id != tok["eos_id"]:
      raise ValueError(f"{tok['path']}: pad / eos ids {tokenizer.pad_token_id} / {tokenizer.eos_token_id} "
                       f"here, {tok['pad_id']} / {tok['eos_id']} in the project")
    return tokenizer
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
  specials = {"<pad>": tok["pad_id"], "<bos>": tok["bos_id"], "<eos>": tok["eos_id"]}
  first = len(specials)
  vocab = dict(specials) | {ch: first + i for i, ch in enumerate(tok["alphabet"])}
  vocab |= {f"<unused_{i}>": i for i in range(len(vocab), tok["vocab_size"])}
  backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
  backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  backend.decoder = decoders.Fuse()
  backend.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                         special_tokens=[("<bos>", tok["bos_id"])])
  backend.add_special_tokens(list(specials))
  return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                 eos_token="<eos>", padding_side="left")


def build_model(model_spec: dict, tok: dict, seed: int):
  """A float32 causal LM: the checkpoint folder's weights (``hf_path``), or a random normal(0, init_std)
  init of the config dict (``hf_config``); generation stops at the project's eos and pads with its pad."""
  import transformers
  if "hf_path" in model_spec:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_spec["hf_path"], dtype=torch.float32)
  else:
    config = transformers.AutoConfig.for_model(**model_spec["hf_config"])
    config.initializer_range = model_spec["init_std"]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (tok["bos_id"], tok["eos_id"],
                                                                     tok["pad_id"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.bos_token_id = tok["bos_id"]
  model.generation_config.eos_token_id = tok["eos_id"]
  model.generation_config.pad_token_id = tok["pad_id"]
  return model


_INTEGER = re.compile(r"-?[0-9]+")
_MARKED = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def _integer_score(text: str, want: str) -> tuple[bool, bool]:
  """rl_fusion_jax/rewards/arithmetic.py::ArithmeticTask.score: format = the stripped completion is an
  integer, correct = its value is the answer (at most 64 characters compared)."""
  text = text.strip()
  format_ok = _INTEGER.fullmatch(text) is not None
  return format_ok, format_ok and len(text) <= 64 and int(text) == int(want)


def _marked_number_score(text: str, want: str) -> tuple[bool, bool]:
  """rl_fusion_jax/rewards/gsm8k.py (GSM8K and word problems): format = the completion holds
  ``#### <number>`` (the first one counts; commas ignored, at most 64 characters), correct = its value is
  the answer."""
  match = _MARKED.search(text)
  if match is None or len(match.group(1)) > 64:
    return False, False
  return True, fractions.Fraction(match.group(1).replace(",", "")) == fractions.Fraction(want)


def make_reward(kind: str, format_reward: float, correct_reward: float):
  """The project's verifier of the workload's task, reimplemented; reward = format_reward * format_ok +
  correct_reward * correct. Chat completions arrive as [{"role": "assistant", "content": text}]."""
  score = {"integer": _integer_score, "marked_number": _marked_number_score}[kind]

  def task_reward(completions, answer, **_):
    rewards = []
    for completion, want in zip(completions, answer):
      text = completion if isinstance(completion, str) else completion[-1]["content"]
      format_ok, correct = score(text, want)
      rewards.append(format_reward * format_ok + correct_reward * correct)
    return rewards
  return task_reward


def check_prompts(tokenizer, problems: list[dict]) -> None:
  """Each prompt tokenizes here as in the project: the same ids for chat prompts (rendered by the
  folder's chat template here, by the project's renderer there), the same count otherwise."""
  for p in problems:
    if "messages" in p:
      ids = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
      if list(ids) != p["prompt_ids"]:
        raise ValueError(f"prompt {p['messages']!r}: ids differ from the project's ({len(ids)} vs "
                         f"{len(p['prompt_ids'])} tokens)")
      continue
    n = len(tokenizer(p["prompt"])["input_ids"])
    if n != p["prompt_tokens"]:
      raise ValueError(f"prompt {p['prompt']!r}: {n} tokens here, {p['prompt_tokens']} in the project")


def grpo_config(w: dict, total_steps: int, output_dir: str, bf16: bool = False):
  """GRPOConfig matching the project's run: one generated batch per optimizer step, one update on it."""
  from trl import GRPOConfig
  r, a, o = w["rollout"], w["algo"], w["optim"]
  losses = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
  scales = {"grpo": "group", "dr_grpo": "none"}
  if a["policy_loss"] != "ppo_clip" or a["aggregation"] not in losses or a["advantage"] not in scales:
    raise ValueError(f"no TRL equivalent set up for algo {a}")
  if a["kl_coef"]:
    # GRPOTrainer loads its reference model from the policy's hub id or path; not set up here.
    raise ValueError("algo.kl_coef != 0: the TRL side runs without a reference model only")
  return GRPOConfig(
      output_dir=output_dir, use_cpu=True, bf16=bf16, fp16=False, gradient_checkpointing=False,
      seed=w["seed"], data_seed=w["seed"], shuffle_dataset=False, dataloader_num_workers=0,
      per_device_train_batch_size=r["num_prompts"] * r["group_size"], gradient_accumulation_steps=1,
      num_generations=r["group_size"], max_completion_length=r["max_new_tokens"],
      temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"],
      num_iterations=1, beta=a["kl_coef"], epsilon=a["clip_low"], epsilon_high=a["clip_high"],
      loss_type=losses[a["aggregation"]], scale_rewards=scales[a["advantage"]],
      learning_rate=o["learning_rate"], adam_beta1=o["b1"], adam_beta2=o["b2"],
      weight_decay=o["weight_decay"], max_grad_norm=o["grad_clip"] or 0.0,
      lr_scheduler_type="constant_with_warmup" if o["warmup_steps"] else "constant",
      warmup_steps=o["warmup_steps"], max_steps=total_steps,
      save_strategy="no", report_to="none", disable_tqdm=True)


# ---------------------------------------------------------------------------------------------------
# Timing.


class PhaseClock:
  """Seconds per phase of the current step, from wrapped trainer and model methods."""

  def __init__(self):
    self.current: dict[str, float] = {}
    self.prepared_at = 0.0

  def wrap(self, owner, name: str, phase: str, *, mark_end: bool = False, record=None) -> None:
    """Times ``owner.name`` as ``phase``; ``record(output)`` -> more figures of the step."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
      t0 = time.perf_counter()
      out = inner(*args, **kwargs)
      t1 = time.perf_counter()
      self.current[phase] = self.current.get(phase, 0.0) + t1 - t0
      if mark_end:
        self.prepared_at = t1
      if record is not None:
        self.current.update(record(out))
      return out
    setattr(owner, name, timed)


def step_callback(clock: PhaseClock, warmup: int, turn_steps: int, rows: list[dict], first: dict | None = None):
  """A TrainerCallback that closes each step's row at the end of its optimizer step (and takes turns);
  ``first["step_s"]``: the first step's seconds, from the start of training to its end."""
  from transformers import TrainerCallback
  turns = _load_turns() if turn_steps else None

  class StepRows(TrainerCallback):
    last = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
      StepRows.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
      now = time.perf_counter()
      c = clock.current
      row = {"step_s": now - StepRows.last, "update_s": now - clock.prepared_at,
             "generate_s": c.get("generate", 0.0), "hf_generate_s": c.get("hf_generate", 0.0),
             "reward_s": c.get("reward", 0.0), "response_len_mean": c.get("response_len_mean", 0.0),
             "prepare_s": c.get("score", 0.0) - c.get("generate", 0.0) - c.get("reward", 0.0)}
      row["other_s"] = row["step_s"] - c.get("prepare_inputs", 0.0) - row["update_s"]
      clock.current = {}
      done = state.global_step - 1           # the first step is not counted
      if done == 0 and first is not None:
        first["step_s"] = row["step_s"]
      if done > warmup:
        rows.append(row)
      if turns is not None and done >= warmup and (done - warmup) % turn_steps == 0:
        turns.end_turn({"steps": rows[len(rows) - turn_steps:] if done > warmup else []})
      StepRows.last = time.perf_counter()

  return StepRows()


def matmul_rates(shapes: list[list[int]], repeats: int = 20) -> list[dict]:
  """Median GFLOP/s of a float32 [M, K] x [K, N] matmul per shape."""
  out = []
  for m, k, n in shapes:
    a, b = torch.randn(m, k), torch.randn(k, n)
    with torch.no_grad():
      for _ in range(3):
        a @ b
      times = []
      for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    out.append({"shape": [m, k, n], "gflop_per_s": round(2 * m * k * n / statistics.median(times) / 1e9, 1)})
  return out


# ---------------------------------------------------------------------------------------------------


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workload", required=True, help="JSON written by benchmark_vs_trl.py.")
  parser.add_argument("--steps", type=int, default=5, help="Measured steps.")
  parser.add_argument("--warmup_steps", type=int, default=2, help="Unmeasured steps after the first one.")
  parser.add_argument("--turn_steps", type=int, default=0,
                      help="Take turns every N measured steps (0: never).")
  parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: one per CPU).")
  parser.add_argument("--bf16", action="store_true",
                      help="GRPOConfig(bf16=True): torch autocast to bfloat16 (float32 weights and optimizer).")
  parser.add_argument("--matmul", action="store_true", help="Print matmul rates at the workload's shapes.")
  parser.add_argument("--check", action="store_true",
                      help="Only check the workload against this side (prompt ids, the verifier's rewards on "
                      "the workload's reward_checks) and exit; needs transformers, not trl.")
  args = parser.parse_args()
  torch.set_num_threads(args.threads or os.cpu_count() or 1)
  with open(args.workload) as f:
    w = json.load(f)
  if args.matmul:
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "matmul": matmul_rates(w["matmul_shapes"])}, sort_keys=True), flush=True)
    return

  if args.check:
    check_prompts(build_tokenizer(w["tokenizer"]), w["problems"])
    reward = make_reward(**w["reward"])
    checks = w["reward_checks"]
    got = reward([c["completion"] for c in checks], [c["answer"] for c in checks])
    wrong = [(c["completion"], c["reward"], r) for c, r in zip(checks, got) if abs(r - c["reward"]) > 1e-9]
    if wrong:
      raise ValueError(f"rewards differ from the project's (completion, project, here): {wrong}")
    print(json.dumps({"checked_prompts": len(w["problems"]), "checked_rewards": len(checks)}), flush=True)
    return

  import datasets
  import transformers
  import trl
  t_start = time.perf_counter()
  total = 1 + args.warmup_steps + args.steps
  per_step = w["rollout"]["num_prompts"]
  problems = w["problems"][:total * per_step]
  if len(problems) < total * per_step:
    raise ValueError(f"the workload holds {len(w['problems'])} prompts; {total} steps need "
                     f"{total * per_step}")
  tokenizer = build_tokenizer(w["tokenizer"])
  check_prompts(tokenizer, problems)
  model = build_model(w["model"], w["tokenizer"], w["seed"])
  dataset = datasets.Dataset.from_list([{"prompt": p.get("messages", p["prompt"]), "answer": p["answer"]}
                                        for p in problems])
  clock, rows, first = PhaseClock(), [], {}
  with tempfile.TemporaryDirectory(prefix="trl_tiny_grpo_") as output_dir:
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=make_reward(**w["reward"]),
        args=grpo_config(w, total, output_dir, args.bf16),
        train_dataset=dataset, processing_class=tokenizer,
        callbacks=[step_callback(clock, args.warmup_steps, args.turn_steps, rows, first)])
    # _generate returns (prompt_ids, completion_ids, ...); completion ids end at the first eos.
    clock.wrap(trainer, "_generate", "generate",
               record=lambda out: {"response_len_mean": statistics.fmean(len(c) for c in out[1])})
    clock.wrap(trainer, "_calculate_rewards", "reward")
    clock.wrap(trainer, "_generate_and_score_completions", "score")
    clock.wrap(trainer, "_prepare_inputs", "prepare_inputs", mark_end=True)
    clock.wrap(model, "generate", "hf_generate")
    if trainer.args.gradient_checkpointing or trainer.ref_model is not None:
      raise RuntimeError("activation checkpointing or a reference model is on: not the project's workload")
    attention = model.config._attn_implementation  # pylint: disable=protected-access
    setup = {"optim": str(trainer.args.optim), "attention": attention,
             "dtype": str(model.dtype), "bf16_autocast": bool(trainer.args.bf16),
             "loss_type": trainer.args.loss_type,
             "generation_batch_size": trainer.args.generation_batch_size,
             "steps_per_generation": trainer.args.steps_per_generation, "threads": torch.get_num_threads()}
    startup_s = time.perf_counter() - t_start
    trainer.train()
  med = lambda k: round(statistics.median(r[k] for r in rows), 4)
  out = {"steps": len(rows), "startup_s": round(startup_s, 3), "setup": setup,
         "median_step_s": med("step_s"), "first_step_s": round(first.get("step_s", float("nan")), 3),
         **{k: med(k) for k in ("generate_s", "hf_generate_s", "reward_s", "prepare_s", "update_s", "other_s",
                                "response_len_mean")},
         "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                      "trl": trl.__version__, "datasets": datasets.__version__}}
  print(json.dumps(out, sort_keys=True), flush=True)


if __name__ == "__main__":
  main()
