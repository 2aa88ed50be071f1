"""The phases of a run: initial policy, supervised warm-up, evaluation, and one synchronous RL step.

Each phase is recorded on the run's timeline under the device group that executes it. The host touches
a step's data once, to decode and score the responses; everything else stays on the devices.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rl_fusion_jax import models
from rl_fusion_jax.orchestration import data
from rl_fusion_jax.orchestration.programs import Programs
from rl_fusion_jax.orchestration.setup import Setup
from rl_fusion_jax.rewards.base import score_batch
from rl_fusion_jax.rollout.engine import Request
from rl_fusion_jax.timeline import Timeline
from rl_fusion_jax.train import packed_step, packing
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.types import Rollout


def init_policy(setup: Setup, programs: Programs):
  """The starting params on the training layout: the HF weights, or a seeded random init."""
  cfg = setup.cfg
  if setup.hf_params is not None:
    return jax.device_put(setup.hf_params, programs.param_shardings)
  init = lambda k: models.init_params(cfg.model.config, k, init_std=cfg.model.init_std)
  return jax.jit(init, out_shardings=programs.param_shardings)(jax.random.key(cfg.run.seed))


def warmup_optimizer(cfg):
  """The warm-up's own AdamW (no learning-rate warm-up) at ``warmup.learning_rate``."""
  return state_lib.make_optimizer(dataclasses.replace(cfg.optim, warmup_steps=0),
                                  learning_rate=cfg.warmup.learning_rate)


def warmup_shardings(cfg, placement) -> state_lib.TrainState:
  return state_lib.state_shardings(warmup_optimizer(cfg), models.abstract_params(cfg.model.config),
                                   placement.param_shardings, placement.mesh)


def warmup(setup: Setup, programs: Programs, params, *, state=None, save=None, guard=None):
  """Supervised warm-up on the task's reference completions; returns the new params.

  ``state``: a restored warm-up TrainState to continue from (its ``step`` says how far it got).
  ``save(step, state)`` is called every ``warmup.checkpoint_every`` steps, after the guard has seen
  every update up to that step. Metrics are fetched every 16 steps (the bounded dispatch queue), and the
  divergence guard reads them then: with ``stop`` the run ends naming the first non-finite step.
  """
  cfg = setup.cfg
  if not cfg.warmup.steps:
    return params
  tx = warmup_optimizer(cfg)
  shardings = warmup_shardings(cfg, programs)
  if state is None:
    state = state_lib.create_train_state(params, tx, shardings)
  sft_step = step_lib.make_sft_step(cfg.model.config, tx, 1, programs.mesh, shardings)
  n, every, pending = cfg.warmup.batch_size, cfg.warmup.checkpoint_every, []
  for step in range(int(state.step), cfg.warmup.steps):
    problems = [setup.warmup_task.problem(step * n + i) for i in range(n)]
    tokens, mask = data.encode_sft(setup.tokenizer, problems, cfg.rollout.seq_len)
    state, m = sft_step(state, data.to_global(programs.mesh, tokens), data.to_global(programs.mesh, mask))
    pending.append(m)
    done = step + 1
    checkpoint = every and done % every == 0
    if done % 16 == 0 or done == cfg.warmup.steps or checkpoint:
      for i, host_m in enumerate(jax.device_get(pending)):
        if guard is not None:
          guard.check(done - len(pending) + i + 1, host_m)
      logging.info("warm-up step %d/%d loss %.4f", done, cfg.warmup.steps, float(pending[-1]["loss"]))
      pending = []
      if checkpoint and save is not None:
        save(done, state)
  return state.params


def requests(tokenizer, problems, width: int, group_size: int, first_id: int, first_group: int):
  prompts, lens = data.encode_prompts(tokenizer, problems, width)
  return [Request(sample_id=first_id + i * group_size + g, group_id=first_group + i,
                  prompt=prompts[i, :lens[i]])
          for i in range(len(problems)) for g in range(group_size)]


def by_sample_id(rollout: Rollout) -> Rollout:
  order = np.argsort(rollout.sample_id_b, kind="stable")
  return jax.tree.map(lambda x: x[order], rollout)


def evaluate(setup: Setup, programs: Programs, gen_params, round_index: int) -> dict[str, float]:
  """Greedy accuracy on the held-out problems of ``task.eval_seed`` (params in the generation layout)."""
  n = setup.cfg.task.eval_problems
  problems = [setup.eval_task.problem(i) for i in range(n)]
  engine = programs.eval_engine
  engine.add(requests(setup.tokenizer, problems, setup.cfg.rollout.max_prompt_len, 1,
                       round_index * n, round_index * n))
  rollout = by_sample_id(engine.run(gen_params, 0).rollout)
  texts = data.decode_responses(setup.tokenizer, rollout.tokens_bt, rollout.prompt_len_b,
                                rollout.response_len_b)
  rewards, fmt, correct = score_batch(setup.eval_task, problems, texts)
  return {"accuracy": float(np.mean(correct)), "format_rate": float(np.mean(fmt)),
          "reward": float(np.mean(rewards))}


def _rewards(setup: Setup, programs: Programs, problems, rollout: Rollout, tokens_bt, timeline, step):
  """Verifier rewards on the host, plus the learned reward model's score when one is configured."""
  g = setup.cfg.rollout.group_size
  texts = data.decode_responses(setup.tokenizer, rollout.tokens_bt, rollout.prompt_len_b,
                                rollout.response_len_b)
  rewards, fmt, correct = score_batch(setup.train_task, [p for p in problems for _ in range(g)], texts)
  out = {"accuracy": float(correct.mean()), "format_rate": float(fmt.mean())}
  if programs.reward_model is not None:
    score_fn, resting = programs.reward_model
    with timeline.phase("reward_model", group=programs.deployment.train_group, step=step):
      params = programs.deployment.fetch_aux(resting)
      lengths = rollout.prompt_len_b + rollout.response_len_b
      rm_b = np.asarray(score_fn(params, tokens_bt, data.to_global(programs.mesh, lengths)))
      programs.deployment.release_aux(params)
    rewards = rewards + setup.cfg.task.reward_model_weight * rm_b
    out["reward_model_score"] = float(rm_b.mean())
  out["reward"] = float(rewards.mean())
  return rewards.astype(np.float32), out


def kv_cache_bytes(cfg) -> int:
  """Bytes of the engine's KV cache (all devices), allocated after the switch and freed before training."""
  m, r = cfg.model.config, cfg.rollout
  itemsize = np.dtype(m.compute_dtype).itemsize
  return 2 * m.num_layers * r.slots * r.seq_len * m.num_kv_heads * m.head_dim * itemsize


def generation_phase(programs: Programs, state, step: int, timeline: Timeline, run_engine):
  """Switch to the generation layout, ``run_engine(gen_params)``, switch back -> (state, result, metrics)."""
  d, metrics = programs.deployment, {}
  with timeline.phase("switch", group=d.rollout_group, step=step):
    state, gen_params, m = d.to_generation(state)
    metrics |= m
  with timeline.phase("generate", group=d.rollout_group, step=step):
    t0 = time.perf_counter()
    result = run_engine(gen_params)
    generate_s = time.perf_counter() - t0
  with timeline.phase("switch", group=d.train_group, step=step):
    state, m = d.to_training(state)
    metrics |= m
  tokens = float(result.stats.get("generated_tokens", 0))
  metrics |= {"generate_s": generate_s, "generate_tokens_per_s": tokens / generate_s,
              "engine/generated_tokens": tokens,
              "engine/slot_utilization": float(result.stats.get("slot_utilization", 0.0)),
              "engine/kv_cache_bytes": float(kv_cache_bytes(programs.cfg)),
              "engine/decode_steps": float(result.stats.get("decode_steps", 0))}
  return state, result, metrics


def _packed_update(setup: Setup, programs: Programs, state, rollout: Rollout, batch):
  """The update on packed rows: the assembled batch is fetched, packed on the host by the samples' real
  lengths (first-fit decreasing into rows of ``seq_len``, row count bucketed) and sent shard by shard."""
  host = jax.device_get(batch)
  lengths = np.asarray(rollout.prompt_len_b) + np.asarray(rollout.response_len_b)
  layout = packing.plan(lengths, setup.cfg.rollout.seq_len, programs.row_buckets)
  packed = packing.pack_batch(layout, tokens_bt=host.tokens_bt, mask_bt=host.mask_bt,
                              advantages_b=host.advantages_b, behaviour_logp_bt=host.behaviour_logp_bt,
                              ref_logp_bt=host.ref_logp_bt, version_bt=host.version_bt)
  state, train_metrics = programs.packed_step(state, packed_step.device_batch(programs.mesh, packed))
  stats = {"pack/rows": float(layout.num_rows), "pack/rows_used": float(layout.rows_used),
           "pack/padding_frac": float(1 - lengths.sum() / (layout.num_rows * layout.width))}
  return state, train_metrics, stats


def train_phase(setup: Setup, programs: Programs, state, ref_resting, step: int, timeline: Timeline,
                problems, rollout: Rollout):
  """Reward -> reference -> advantages -> update -> publish on a host batch sorted by sample id."""
  cfg, d = setup.cfg, programs.deployment
  device_rollout = jax.tree.map(lambda x: data.to_global(programs.mesh, x), rollout)
  metrics = {}
  with timeline.phase("reward", group=d.train_group, step=step):
    t0 = time.perf_counter()
    rewards, m = _rewards(setup, programs, problems, rollout, device_rollout.tokens_bt, timeline, step)
    metrics |= m
    reward_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  if cfg.algo.needs_reference:
    with timeline.phase("reference", group=d.train_group, step=step):
      ref_params = d.fetch_aux(ref_resting)
      ref_logp = programs.ref_logprobs(ref_params, device_rollout.tokens_bt).block_until_ready()
      d.release_aux(ref_params)
  else:
    ref_logp = jnp.zeros_like(device_rollout.logp_bt)   # unused when kl_coef == 0
  ref_s = time.perf_counter() - t0
  with timeline.phase("train", group=d.train_group, step=step):
    t0 = time.perf_counter()
    batch, batch_stats = programs.assemble(device_rollout, data.to_global(programs.mesh, rewards), ref_logp)
    if programs.packed_step is None:
      state, train_metrics = programs.train_step(state, batch)
    else:
      state, train_metrics, pack_stats = _packed_update(setup, programs, state, rollout, batch)
      metrics |= pack_stats
    train_metrics, batch_stats = jax.device_get((train_metrics, batch_stats))
    train_s = time.perf_counter() - t0
  with timeline.phase("publish", group=d.train_group, step=step):
    metrics |= d.publish(state.params)
  resp = rollout.response_len_b
  real_tokens = float((rollout.prompt_len_b + resp).sum())
  metrics |= {k: float(v) for k, v in {**train_metrics, **batch_stats}.items()}
  metrics["is_weight_std"] = float(np.sqrt(max(metrics["is_weight_sq"] - metrics["is_weight"] ** 2, 0.0)))
  metrics |= {
      "response_len_mean": float(resp.mean()), "response_len_max": float(resp.max()),
      "truncated_frac": float(1 - rollout.finished_b.mean()),
      "reward_s": reward_s, "ref_s": ref_s, "train_s": train_s,
      "train_tokens": real_tokens, "train_tokens_per_s": real_tokens / train_s,
      "policy_version": float(step + 1)}
  return state, metrics


def rl_step(setup: Setup, programs: Programs, state, ref_resting, step: int, timeline: Timeline,
            data_position: int | None = None):
  """The synchronous step: switch -> generate every sample -> switch -> train_phase.

  ``data_position``: index of the step's first problem (default ``step * num_prompts``); sample and
  group ids derive from it, so a run resumed with another batch size never draws a problem twice.
  """
  r = setup.cfg.rollout
  t_start = time.perf_counter()
  first = step * r.num_prompts if data_position is None else data_position
  problems = [setup.train_task.problem(first + i) for i in range(r.num_prompts)]
  programs.engine.add(requests(setup.tokenizer, problems, r.max_prompt_len, r.group_size,
                               first * r.group_size, first))
  state, result, metrics = generation_phase(programs, state, step, timeline,
                                            lambda params: programs.engine.run(params, step))
  state, m = train_phase(setup, programs, state, ref_resting, step, timeline, problems,
                         by_sample_id(result.rollout))
  return state, metrics | m | {"step_s": time.perf_counter() - t_start}
