"""Start-up validation: everything that can be checked before a compile or a write, in one place.

``validate`` raises a ValueError naming the config field (or the file path) for a bad mesh, batch,
tokenizer, task, prompt length, rule table, HF checkpoint, reward-model or value-model checkpoint; it reads
checkpoints into host memory so the run never discovers a broken file after the workdir exists.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
from absl import logging

from rl_fusion_jax import chat, models
from rl_fusion_jax.config import ExperimentConfig
from rl_fusion_jax.distributed import fetch
from rl_fusion_jax.fusion.deployment import check_rules
from rl_fusion_jax.models import reward_model, value_model
from rl_fusion_jax.orchestration import data
from rl_fusion_jax.rewards.registry import make_task
from rl_fusion_jax.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer


@dataclasses.dataclass
class Setup:
  """What validation built on the host (nothing compiled, nothing written)."""
  cfg: ExperimentConfig
  tokenizer: Any
  train_task: Any
  warmup_task: Any
  eval_task: Any
  hf_params: Any = None       # host weights of config.model.hf_path, if set
  reward_model: Any = None    # (ModelConfig, host numpy params) of config.task.reward_model, if set
  critic_params: Any = None   # host params of config.critic.init, if set


def _read_critic(cfg: ExperimentConfig):
  """Host params of ``config.critic.init`` (a value model whose shapes match the policy's), or None."""
  if not cfg.critic.init:
    return None
  try:
    _, params = value_model.load_value_model(cfg.critic.init)
    value_model.check_value_params(cfg.model.config, params)
  except (OSError, ValueError) as e:
    raise ValueError(f"config.critic.init: {e} (the value model must have the policy's shapes)") from e
  return params


def _read_checkpoints(cfg: ExperimentConfig):
  hf_params = rm = None
  if cfg.model.hf_path:
    try:
      _, hf_params = models.load_hf(cfg.model.hf_path)
    except (OSError, ValueError) as e:
      raise ValueError(f"config.model.hf_path: {e}") from e
  if cfg.task.reward_model:
    try:
      rm = reward_model.load_reward_model(cfg.task.reward_model)
    except (OSError, ValueError) as e:
      raise ValueError(f"config.task.reward_model: {e}") from e
    if rm[0].vocab_size < cfg.model.config.vocab_size:
      raise ValueError(f"config.task.reward_model: vocab_size {rm[0].vocab_size} < the policy's "
                       f"{cfg.model.config.vocab_size}")
    rm = (rm[0], _to_host(rm[1]))
  return hf_params, rm


def _to_host(params):
  """``params`` as host numpy arrays, their device buffers deleted: the run places them from the host
  straight to where they rest (``Deployment.place_aux``: host memory in ``full``)."""
  host = fetch(params)
  for x in jax.tree.leaves(params):
    if isinstance(x, jax.Array):
      x.delete()
  return host


def _make_tasks(cfg: ExperimentConfig):
  kwargs = dict(cfg.task.kwargs)
  if "seed" in kwargs:
    raise ValueError("config.task.kwargs.seed: seeds come from config.run.seed, warmup.seed and task.eval_seed")
  # RL problems from even seeds, warm-up problems from odd ones: the two streams never coincide, whatever
  # run.seed and warmup.seed are; the held-out stream must differ from both.
  if cfg.task.eval_seed in (2 * cfg.run.seed, 2 * cfg.policy_seed + 1):
    raise ValueError(f"config.task.eval_seed={cfg.task.eval_seed}: the held-out problems would be the RL or "
                     f"warm-up problems (seeds 2 * run.seed and 2 * warmup.seed + 1); pick another")
  try:
    return [make_task(cfg.task.name, seed=seed, **kwargs)
            for seed in (2 * cfg.run.seed, 2 * cfg.policy_seed + 1, cfg.task.eval_seed)]
  except ValueError as e:
    raise ValueError(f"config.task: {e}") from e


def _chat_prompts(cfg: ExperimentConfig, tokenizer, tasks):
  """task.prompt_format='chat': the tokenizer's chat form (``HFTokenizer.for_chat``) and the tasks with
  prompts rendered by its template; a template that fails to render fails in ``_check_lengths``."""
  if not isinstance(tokenizer, HFTokenizer):
    raise ValueError(f"config.task.prompt_format='chat': needs a Hugging Face tokenizer with a chat "
                     f"template; config.task.tokenizer={cfg.task.tokenizer!r} is a character tokenizer")
  try:
    tokenizer = tokenizer.for_chat()
  except ValueError as e:
    raise ValueError(f"config.task.prompt_format='chat': {e}") from e
  stop = tokenizer.tokenizer.id_to_token(tokenizer.eos_id)
  logging.info("chat prompts: template from %s; generation stops at id %d (%r)",
               tokenizer.chat_template_source, tokenizer.eos_id, stop)
  return tokenizer, [chat.chat_task(t, tokenizer.apply_chat_template, cfg.task.system_prompt) for t in tasks]


def _check_lengths(cfg: ExperimentConfig, tokenizer, tasks) -> None:
  """Every prompt (and warm-up target) of the run fits, checked before any compile.

  Exact in the cases that matter here: a task with a finite problem set (GSM8K) has every problem
  encoded; a procedural task states character bounds (``max_lengths``), exact for the character
  tokenizer. Otherwise a sample of 256 problems per stream is encoded.
  """
  r, bos = cfg.rollout, int(tokenizer.bos_id is not None)
  for task in tasks:
    bounds = getattr(task, "max_lengths", None)
    if bounds is not None and isinstance(tokenizer, CharTokenizer):
      prompt, target = bounds()
      if bos + prompt > r.max_prompt_len:
        raise ValueError(f"config.rollout.max_prompt_len={r.max_prompt_len}: task {cfg.task.name!r} has "
                         f"prompts of up to {bos + prompt} tokens")
      if task is tasks[1] and cfg.warmup.steps and bos + prompt + target + 1 > r.seq_len:
        raise ValueError(f"config.rollout.max_new_tokens={r.max_new_tokens}: warm-up rows of task "
                         f"{cfg.task.name!r} need up to {bos + prompt + target + 1} tokens > max_prompt_len + "
                         f"max_new_tokens = {r.seq_len}")
      continue
    count = len(task) if hasattr(task, "__len__") else 256
    problems = [task.problem(i) for i in range(count)]
    data.encode_prompts(tokenizer, problems, r.max_prompt_len)
    if task is tasks[1] and cfg.warmup.steps:
      data.encode_sft(tokenizer, problems, r.seq_len)


def tokenizer_and_tasks(cfg: ExperimentConfig):
  """(tokenizer, train task, warm-up task, held-out task) as the run builds them: the tokenizer of
  ``task.tokenizer`` (or of ``model.hf_path``) and, with ``task.prompt_format='chat'``, its chat form and
  the tasks' prompts rendered by its template."""
  if not (cfg.task.tokenizer or cfg.model.hf_path):
    raise ValueError("config.task.tokenizer: '' means the tokenizer in config.model.hf_path, which is empty")
  try:
    tokenizer = load_tokenizer(cfg.task.tokenizer or cfg.model.hf_path,
                               vocab_size=cfg.model.config.vocab_size)
  except ValueError as e:
    raise ValueError(f"config.task.tokenizer / config.model.vocab_size: {e}") from e
  tasks = _make_tasks(cfg)
  if cfg.task.prompt_format == "chat":
    tokenizer, tasks = _chat_prompts(cfg, tokenizer, tasks)
  return (tokenizer, *tasks)


def validate(cfg: ExperimentConfig, num_devices: int, *, per_process: bool = True) -> Setup:
  """Every check that needs no compile: devices, rules, tokenizer, tasks, prompt lengths, checkpoints.
  ``per_process``: as in ``make_deployment``."""
  cfg.check_devices(num_devices)
  check_rules(cfg, num_devices, per_process=per_process)
  tokenizer, *tasks = tokenizer_and_tasks(cfg)
  _check_lengths(cfg, tokenizer, tasks)
  hf_params, rm = _read_checkpoints(cfg)
  return Setup(cfg, tokenizer, *tasks, hf_params=hf_params, reward_model=rm, critic_params=_read_critic(cfg))


def write_json_atomic(path: str, obj: Any) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
