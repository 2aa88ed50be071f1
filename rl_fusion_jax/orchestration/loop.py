"""The synchronous, co-located GRPO loop: ``run(config, workdir)``.

One mesh over all devices; per step: generate -> reward -> reference log-probs -> advantages -> update.
Every device program is compiled once (fixed shapes, explicit shardings); the host touches a step's
data once, to decode and score the responses. Sections:

  1. validate everything that can be validated before anything is compiled or written;
  2. build the mesh, the policy and the compiled programs;
  3. resume from the latest checkpoint, or warm up (SFT) and evaluate the starting policy;
  4. the RL loop (metrics every step, checkpoints every N steps);
  5. final evaluation and summary.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax import models
from rl_fusion_jax.algorithms import registry
from rl_fusion_jax.checkpointing import Checkpointer
from rl_fusion_jax.config import ExperimentConfig
from rl_fusion_jax.orchestration import data
from rl_fusion_jax.rewards.base import score_batch
from rl_fusion_jax.rewards.registry import make_task
from rl_fusion_jax.rollout.generate import GenerateSpec, Generator
from rl_fusion_jax.rollout.sampling import SamplingParams
from rl_fusion_jax.sharding import mesh as mesh_lib
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.tokenizer import load_tokenizer
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.types import Rollout, TrainBatch


@dataclasses.dataclass
class Setup:
  """What section 1 validated and built on the host (nothing compiled, nothing written)."""
  cfg: ExperimentConfig
  tokenizer: Any
  train_task: Any
  warmup_task: Any
  eval_task: Any
  mesh_sizes: dict
  hf_params: Any = None     # host weights read from config.model.hf_path, if set


def validate(cfg: ExperimentConfig, num_devices: int) -> Setup:
  """Every check that needs no compile: mesh, tokenizer, tasks, vocab, prompt lengths, checkpoint."""
  sizes = cfg.check_devices(num_devices)
  hf_params = None
  if cfg.model.hf_path:
    try:   # weights are read now (host memory), so a broken checkpoint fails before anything is written
      _, hf_params = models.load_hf(cfg.model.hf_path)
    except (OSError, ValueError) as e:
      raise ValueError(f"config.model.hf_path: {e}") from e
  try:
    tokenizer = load_tokenizer(cfg.task.tokenizer, vocab_size=cfg.model.config.vocab_size)
  except ValueError as e:
    raise ValueError(f"config.task.tokenizer / config.model.vocab_size: {e}") from e
  kwargs = dict(cfg.task.kwargs)
  for key in ("seed",):
    if key in kwargs:
      raise ValueError(f"config.task.kwargs.{key}: seeds come from config.run.seed and task.eval_seed")
  tasks = [make_task(cfg.task.name, seed=seed, **kwargs)
           for seed in (cfg.run.seed, cfg.run.seed + 1, cfg.task.eval_seed)]
  # Encode a sample of each stream now, so a prompt that does not fit fails before any compile.
  for task in tasks:
    problems = [task.problem(i) for i in range(32)]
    data.encode_prompts(tokenizer, problems, cfg.rollout.max_prompt_len)
    if task is tasks[1] and cfg.warmup.steps:
      data.encode_sft(tokenizer, problems, cfg.rollout.seq_len)
  return Setup(cfg, tokenizer, tasks[0], tasks[1], tasks[2], sizes, hf_params)


def _write_json_atomic(path: str, obj: Any) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


class Programs:
  """The compiled device programs of a run and the shardings they agree on."""

  def __init__(self, cfg: ExperimentConfig, mesh, tokenizer):
    model_cfg, r = cfg.model.config, cfg.rollout
    self.mesh = mesh
    abstract = jax.eval_shape(lambda: models.init_params(model_cfg, jax.random.key(0)))
    self.param_shardings = param_shardings(abstract, models.param_logical_axes(model_cfg), mesh,
                                           TRAIN_RULES)
    self.tx = state_lib.make_optimizer(cfg.optim)
    self.state_shardings = state_lib.state_shardings(self.tx, abstract, self.param_shardings, mesh)
    sampling = SamplingParams(r.temperature, r.top_k, r.top_p)
    spec = GenerateSpec(model_cfg, sampling, r.max_prompt_len, r.max_new_tokens, tokenizer.eos_id)
    self.generate = Generator(spec, mesh, self.param_shardings)
    self.generate_greedy = Generator(dataclasses.replace(spec, sampling=SamplingParams(0.0)), mesh,
                                     self.param_shardings)
    self.train_step = step_lib.make_rl_step(model_cfg, cfg.algo, sampling.logprob_temperature, self.tx,
                                            cfg.optim.micro_batches, mesh, r.max_new_tokens,
                                            self.state_shardings)
    self.ref_logprobs = step_lib.make_logprob_fn(model_cfg, sampling.logprob_temperature, mesh,
                                                 self.param_shardings)
    self.assemble = jax.jit(
        lambda rollout, rewards_b, ref_logp_bt: assemble_batch(cfg, rollout, rewards_b, ref_logp_bt),
        out_shardings=(step_lib.batch_shardings(mesh), mesh_lib.replicated(mesh)))


def assemble_batch(cfg: ExperimentConfig, rollout: Rollout, rewards_b, ref_logp_bt):
  """Rollout + rewards (+ reference log-probs) -> TrainBatch, with KL-in-reward and advantages."""
  mask_bt = rollout.response_mask()
  algo = cfg.algo
  stats = {}
  if algo.needs_reference:
    kl_b = jnp.sum(registry.get_kl_estimator(algo.kl_estimator)(rollout.logp_bt, ref_logp_bt) * mask_bt, 1)
    stats["kl_seq"] = jnp.mean(kl_b)
    if algo.kl_mode == "reward":
      rewards_b = rewards_b - algo.kl_coef * kl_b
  adv_b = registry.get_advantage_fn(algo.advantage)(rewards_b, cfg.rollout.group_size)
  stats["advantage_abs_mean"] = jnp.mean(jnp.abs(adv_b))
  batch = TrainBatch(tokens_bt=rollout.tokens_bt, mask_bt=mask_bt, advantages_b=adv_b,
                     behaviour_logp_bt=rollout.logp_bt, ref_logp_bt=ref_logp_bt,
                     version_bt=rollout.version_bt)
  return batch, stats


# ----------------------------------------------------------------------------------------------------
# Evaluation and warm-up.
# ----------------------------------------------------------------------------------------------------

def evaluate(setup: Setup, programs: Programs, params) -> dict[str, float]:
  """Greedy accuracy on the held-out problems of ``task.eval_seed``."""
  problems = [setup.eval_task.problem(i) for i in range(setup.cfg.task.eval_problems)]
  prompts, lens = data.encode_prompts(setup.tokenizer, problems, setup.cfg.rollout.max_prompt_len)
  mesh = programs.mesh
  ids = np.arange(len(problems), dtype=np.int32)
  rollout = programs.generate_greedy(params, data.to_global(mesh, prompts), data.to_global(mesh, lens),
                                     data.to_global(mesh, ids), jax.random.key(0), jnp.int32(0))
  host = jax.device_get(rollout)
  texts = data.decode_responses(setup.tokenizer, host.tokens_bt, host.prompt_len_b, host.response_len_b)
  rewards, fmt, correct = score_batch(setup.eval_task, problems, texts)
  return {"accuracy": float(np.mean(correct)), "format_rate": float(np.mean(fmt)),
          "reward": float(np.mean(rewards))}


def warmup(setup: Setup, programs: Programs, params):
  """Supervised warm-up on the task's reference completions; returns the new params."""
  cfg = setup.cfg
  if not cfg.warmup.steps:
    return params
  tx = state_lib.make_optimizer(dataclasses.replace(cfg.optim, warmup_steps=0),
                                learning_rate=cfg.warmup.learning_rate)
  abstract = jax.eval_shape(lambda p: p, params)
  shardings = state_lib.state_shardings(tx, abstract, programs.param_shardings, programs.mesh)
  state = state_lib.create_train_state(params, tx, shardings)
  sft_step = step_lib.make_sft_step(cfg.model.config, tx, 1, programs.mesh, shardings)
  n = cfg.warmup.batch_size
  for step in range(cfg.warmup.steps):
    problems = [setup.warmup_task.problem(step * n + i) for i in range(n)]
    tokens, mask = data.encode_sft(setup.tokenizer, problems, cfg.rollout.seq_len)
    state, m = sft_step(state, data.to_global(programs.mesh, tokens), data.to_global(programs.mesh, mask))
    if step % 16 == 15 or step == cfg.warmup.steps - 1:   # bounded dispatch queue; a log line
      logging.info("warm-up step %d/%d loss %.4f", step + 1, cfg.warmup.steps, float(m["loss"]))
  return state.params


def init_policy(setup: Setup, programs: Programs):
  """The starting params on the training layout: the HF weights, or a seeded random init."""
  cfg = setup.cfg
  if setup.hf_params is not None:
    return jax.device_put(setup.hf_params, programs.param_shardings)
  init = lambda k: models.init_params(cfg.model.config, k, init_std=cfg.model.init_std)
  return jax.jit(init, out_shardings=programs.param_shardings)(jax.random.key(cfg.run.seed))


# ----------------------------------------------------------------------------------------------------
# One RL step.
# ----------------------------------------------------------------------------------------------------

def rl_step(setup: Setup, programs: Programs, state, ref_params, step: int, rng):
  """Generate -> reward -> reference log-probs -> advantages -> update. Returns (state, metrics)."""
  cfg, mesh, r = setup.cfg, programs.mesh, setup.cfg.rollout
  t0 = time.perf_counter()
  problems = [setup.train_task.problem(step * r.num_prompts + i) for i in range(r.num_prompts)]
  prompts, lens = data.encode_prompts(setup.tokenizer, problems, r.max_prompt_len)
  prompts, lens = np.repeat(prompts, r.group_size, 0), np.repeat(lens, r.group_size, 0)
  sample_ids = (step * r.batch_size + np.arange(r.batch_size)).astype(np.int32)
  rollout = programs.generate(state.params, data.to_global(mesh, prompts), data.to_global(mesh, lens),
                              data.to_global(mesh, sample_ids), jax.random.fold_in(rng, step),
                              state.policy_version)
  host = jax.device_get((rollout.tokens_bt, rollout.prompt_len_b, rollout.response_len_b,
                         rollout.finished_b))
  t1 = time.perf_counter()
  texts = data.decode_responses(setup.tokenizer, *host[:3])
  rewards, fmt, correct = score_batch(setup.train_task, [p for p in problems for _ in range(r.group_size)],
                                      texts)
  t2 = time.perf_counter()
  if cfg.algo.needs_reference:
    ref_logp = programs.ref_logprobs(ref_params, rollout.tokens_bt)
    ref_logp.block_until_ready()
  else:
    ref_logp = jnp.zeros_like(rollout.logp_bt)   # unused by the loss when kl_coef == 0
  t3 = time.perf_counter()
  batch, batch_stats = programs.assemble(rollout, data.to_global(mesh, rewards.astype(np.float32)),
                                         ref_logp)
  state, train_metrics = programs.train_step(state, batch)
  train_metrics = jax.device_get((train_metrics, batch_stats))
  t4 = time.perf_counter()
  resp_len = host[2]
  gen_tokens = float(resp_len.sum())
  out = {**train_metrics[0], **train_metrics[1],
         "reward": float(rewards.mean()), "accuracy": float(correct.mean()),
         "format_rate": float(fmt.mean()), "response_len_mean": float(resp_len.mean()),
         "response_len_max": float(resp_len.max()), "truncated_frac": float(1 - host[3].mean()),
         "generate_s": t1 - t0, "reward_s": t2 - t1, "ref_s": t3 - t2, "train_s": t4 - t3,
         "step_s": t4 - t0, "generate_tokens_per_s": gen_tokens / (t1 - t0),
         "train_tokens_per_s": float(r.batch_size * r.seq_len) / (t4 - t3),
         "policy_version": float(step + 1)}
  return state, out


# ----------------------------------------------------------------------------------------------------
# The driver.
# ----------------------------------------------------------------------------------------------------

def run(cfg: ExperimentConfig, workdir: str, *, tensorboard: bool = False) -> dict[str, Any]:
  """Runs (or resumes) the experiment in ``workdir``; returns the summary also written to summary.json."""
  # 1. Validate before anything is compiled or written.
  setup = validate(cfg, jax.device_count())
  os.makedirs(workdir, exist_ok=True)
  _write_json_atomic(os.path.join(workdir, "config.json"), config_lib.as_dict(cfg))
  with open(os.path.join(workdir, "tokenizer.json"), "w", encoding="utf-8") as f:
    f.write(setup.tokenizer.to_json() if hasattr(setup.tokenizer, "to_json") else "{}")

  # 2. Mesh, programs, policy.
  mesh = mesh_lib.make_mesh(cfg.mesh)
  logging.info("mesh %s over %d devices (%s)", dict(mesh.shape), mesh.size, jax.devices()[0].platform)
  programs = Programs(cfg, mesh, setup.tokenizer)
  ckpt = Checkpointer(workdir, keep=cfg.run.keep_checkpoints)
  rng = jax.random.key(cfg.run.seed)
  writer = metrics_lib.make_writer(workdir, tensorboard)

  # 3. Resume, or warm up and evaluate the starting point.
  latest = ckpt.latest_step()
  if latest is not None:
    abstract = jax.eval_shape(lambda: models.init_params(cfg.model.config, jax.random.key(0)))
    like = jax.eval_shape(lambda p: state_lib.TrainState(jnp.int32(0), p, programs.tx.init(p),
                                                         jnp.int32(0)), abstract)
    state, meta, ref_params = ckpt.restore(latest, like, programs.state_shardings,
                                           ref_like=abstract if cfg.algo.needs_reference else None)
    if meta.get("seed") != cfg.run.seed:
      raise ValueError(f"{ckpt.directory}: checkpoint was written with seed {meta.get('seed')}, "
                       f"config.run.seed is {cfg.run.seed}")
    start, before = int(meta["step"]), meta["eval_before"]
    logging.info("resumed from step %d (%s)", start, ckpt.directory)
  else:
    params = warmup(setup, programs, init_policy(setup, programs))
    before = evaluate(setup, programs, params)
    logging.info("before RL: accuracy %.3f format %.3f", before["accuracy"], before["format_rate"])
    writer.write(0, {f"eval/{k}": v for k, v in before.items()})
    ref_params = (jax.tree.map(jnp.copy, params) if cfg.algo.needs_reference else None)
    state = state_lib.create_train_state(params, programs.tx, programs.state_shardings)
    start = 0

  # 4. The RL loop.
  progress = metrics_lib.Progress(cfg.run.steps, start, cfg.run.progress_every_s)
  for step in range(start, cfg.run.steps):
    state, scalars = rl_step(setup, programs, state, ref_params, step, rng)
    if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0:
      scalars.update({f"eval/{k}": v for k, v in evaluate(setup, programs, state.params).items()})
    writer.write(step + 1, scalars)
    progress.update(step + 1, scalars)
    last = step + 1 == cfg.run.steps
    if last or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
      ckpt.save(step + 1, state, {"step": step + 1, "seed": cfg.run.seed, "eval_before": before,
                                  "data_position": (step + 1) * cfg.rollout.num_prompts},
                ref_params=ref_params)

  # 5. Final evaluation and summary.
  after = evaluate(setup, programs, state.params)
  writer.write(cfg.run.steps, {f"eval/{k}": v for k, v in after.items()})
  ckpt.close()
  writer.close()
  summary = {"accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
             "format_rate_before": before["format_rate"], "format_rate_after": after["format_rate"],
             "steps": cfg.run.steps}
  _write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  logging.info("accuracy before RL %.3f -> after RL %.3f", before["accuracy"], after["accuracy"])
  return summary
