"""The phases of a run: initial policy, supervised warm-up, evaluation, and one synchronous RL step.

Each phase is recorded on the run's timeline under the device group that executes it. The host decodes
and scores the responses and places the update's batch: with ``optim.pack_rows`` as packed rows built
from its samples (the reference log-probs, the reward model's scores, a critic's values, the advantage
stage and the critic's update then run on packed rows, the aux models on the aux mesh's copy of them in
hybrid, and nothing comes back); otherwise as padded rows. Bytes put and
fetched per step are in ``queue/link_bytes/*``, each beside its padded equivalent.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rl_fusion_jax import distributed
from rl_fusion_jax import models
from rl_fusion_jax import shared_programs
from rl_fusion_jax.algorithms import dapo
from rl_fusion_jax.orchestration import advantage_stage, data, processes
from rl_fusion_jax.orchestration.programs import Programs
from rl_fusion_jax.orchestration.setup import Setup
from rl_fusion_jax.queue import global_batch
from rl_fusion_jax.rewards.base import pass_at_k, score_batch
from rl_fusion_jax.rollout import workload
from rl_fusion_jax.rollout import engine as engine_lib
from rl_fusion_jax.rollout.engine import Request
from rl_fusion_jax.sharding import mesh as mesh_lib
from rl_fusion_jax.timeline import Timeline
from rl_fusion_jax.train import critic as critic_lib
from rl_fusion_jax.train import packed_step, packing
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.types import Rollout


# The engine's device -> host byte counters a step reports (``Engine._read_rows``), as queue/link_bytes/*.
ENGINE_LINKS = ("engine_to_host", "engine_to_host_padded", "engine_control", "engine_to_host_this_host",
                "engine_rows_between_hosts_this_host")


def init_policy(setup: Setup, programs: Programs):
  """The starting params on the training layout: the HF weights, or a random init seeded by
  ``cfg.policy_seed`` (``warmup.seed``, else ``run.seed``)."""
  cfg = setup.cfg
  if setup.hf_params is not None:
    return distributed.put(setup.hf_params, programs.param_shardings)
  init = shared_programs.jit(_init_params, cfg.model.config, cfg.model.init_std,
                             out_shardings=programs.param_shardings)
  return init(jax.random.key(cfg.policy_seed))


def _init_params(model_cfg, init_std, key):
  return models.init_params(model_cfg, key, init_std=init_std)


def warmup_optimizer(cfg):
  """The warm-up's own AdamW (no learning-rate warm-up) at ``warmup.learning_rate``."""
  return state_lib.make_optimizer(dataclasses.replace(cfg.optim, warmup_steps=0),
                                  learning_rate=cfg.warmup.learning_rate)


def warmup_shardings(cfg, placement) -> state_lib.TrainState:
  return state_lib.state_shardings(warmup_optimizer(cfg), models.abstract_params(cfg.model.config),
                                   placement.param_shardings, placement.mesh)


def warmup(setup: Setup, programs: Programs, params, *, state=None, save=None, guard=None, preemption=None):
  """Supervised warm-up on the task's reference completions; returns the new params.

  ``state``: a restored warm-up TrainState to continue from (its ``step`` says how far it got).
  ``save(step, state)`` is called every ``warmup.checkpoint_every`` steps, after the guard has seen
  every update up to that step. Metrics are fetched every 16 steps (the bounded dispatch queue), and the
  divergence guard reads them then: with ``stop`` the run ends naming the first non-finite step.
  ``preemption`` (``orchestration/preemption.py``): asked after every step; on a signal the step is
  checkpointed (``save`` returns the checkpoint's path) and ``errors.Preempted`` raised.
  """
  cfg = setup.cfg
  if not cfg.warmup.steps:
    return params
  tx = warmup_optimizer(cfg)
  shardings = warmup_shardings(cfg, programs)
  if state is None:
    state = state_lib.create_train_state(params, tx, shardings)
  sft_step = step_lib.make_sft_step(cfg.model.config, tx, 1, programs.mesh, shardings,
                                    programs.deployment.train_rules)
  n, every, pending = cfg.warmup.batch_size, cfg.warmup.checkpoint_every, []
  for step in range(int(state.step), cfg.warmup.steps):
    problems = [setup.warmup_task.problem(step * n + i) for i in range(n)]
    tokens, mask = data.encode_sft(setup.tokenizer, problems, cfg.rollout.seq_len)
    state, m = sft_step(state, data.to_global(programs.mesh, tokens), data.to_global(programs.mesh, mask))
    pending.append(m)
    done = step + 1
    stop = preemption is not None and done < cfg.warmup.steps and preemption.should_stop()
    checkpoint = (every and done % every == 0) or stop
    if done % 16 == 0 or done == cfg.warmup.steps or checkpoint:
      for i, host_m in enumerate(distributed.fetch(pending)):
        if guard is not None:
          guard.check(done - len(pending) + i + 1, host_m)
      logging.info("warm-up step %d/%d loss %.4f", done, cfg.warmup.steps, float(pending[-1]["loss"]))
      pending = []
      if checkpoint and save is not None:
        path = save(done, state)
        if stop:
          raise preemption.stopped("warm-up", done, path)
  return state.params


def forced_lengths(cfg) -> Callable[[int], int] | None:
  """sample id -> forced response length under ``rollout.forced_length_*`` (None when off).

  A clipped log-normal draw (``workload.long_tail_lengths``) from a generator seeded with
  (run.seed, sample id): every schedule gives a sample the same length.
  """
  r = cfg.rollout
  if not r.forced_length_median:
    return None

  def length(sample_id: int) -> int:
    rng = np.random.default_rng((cfg.run.seed, sample_id))
    return int(workload.long_tail_lengths(rng, 1, median=r.forced_length_median,
                                          sigma=r.forced_length_sigma, max_len=r.max_new_tokens)[0])
  return length


def requests(tokenizer, problems, width: int, group_size: int, first_id: int, first_group: int, *,
             forced_len: Callable[[int], int] | None = None):
  """``group_size`` requests per problem; ``forced_len(sample_id)`` forces response lengths (None: EOS)."""
  prompts, lens = data.encode_prompts(tokenizer, problems, width)
  ids = [(first_id + i * group_size + g, i) for i in range(len(problems)) for g in range(group_size)]
  return [Request(sample_id=sid, group_id=first_group + i, prompt=prompts[i, :lens[i]],
                  forced_len=None if forced_len is None else forced_len(sid))
          for sid, i in ids]


def by_sample_id(rollout: Rollout) -> Rollout:
  order = np.argsort(rollout.sample_id_b, kind="stable")
  return jax.tree.map(lambda x: x[order], rollout)


# Sample ids of the sampled evaluation start here, above the ids of a run's first 2**30 training samples
# (step * batch), so its random streams do not repeat a training sample's.
SAMPLED_EVAL_FIRST_ID = 2**30


def evaluate(setup: Setup, programs: Programs, gen_params, round_index: int,
             examples: list | None = None) -> dict[str, float]:
  """Held-out metrics on the problems of ``task.eval_seed`` (params in the generation layout).

  ``examples``, when given, receives the greedy responses to the first ``task.eval_examples`` problems
  that this process scored (problem index, prompt, response, answer, correct, reward).

  ``accuracy`` / ``format_rate`` / ``reward``: greedy decoding, one response per problem. With
  ``task.eval_samples`` = n > 0 also ``pass@1`` and ``pass@{task.pass_k}``: n responses per problem under
  the rollout's sampling (temperature, top-k, top-p), the unbiased estimator averaged over problems.
  Each round draws fresh samples (ids from ``SAMPLED_EVAL_FIRST_ID + round * problems * n``).
  """
  t = setup.cfg.task
  n = t.eval_problems
  problems = [setup.eval_task.problem(i) for i in range(n)]
  correct, fmt, rewards = _generate_and_score(setup, programs.eval_engine, gen_params, problems, 1,
                                              round_index * n, programs.verify.share,
                                              examples if t.eval_examples else None)
  if examples is not None:
    del examples[t.eval_examples:]
  out = {"accuracy": float(np.mean(correct)), "format_rate": float(np.mean(fmt)),
         "reward": float(np.mean(rewards))}
  if t.eval_samples:
    k = t.eval_samples
    correct, _, _ = _generate_and_score(setup, programs.sampled_eval_engine, gen_params, problems, k,
                                        SAMPLED_EVAL_FIRST_ID + round_index * n * k, programs.verify.share)
    counts = correct.reshape(n, k).sum(axis=1)
    out["pass@1"] = float(np.mean(pass_at_k(k, counts, 1)))
    out[f"pass@{t.pass_k}"] = float(np.mean(pass_at_k(k, counts, t.pass_k)))
  return out


def _generate_and_score(setup: Setup, engine, gen_params, problems, samples: int, first_id: int,
                        share: processes.Share, examples: list | None = None):
  """(correct, format_ok, rewards) of ``samples`` responses per problem, problem-major (each response its
  own group of one: the engines evaluating have group_size 1). Of several processes (``share``) each
  decodes and scores the samples it owns (those whose responses it holds, under ``Engine.local_rows``)
  and the results are exchanged. ``examples`` (one sample per
  problem only) receives this process's responses in problem order."""
  repeated = [p for p in problems for _ in range(samples)]
  engine.add(requests(setup.tokenizer, repeated, setup.cfg.rollout.max_prompt_len, 1, first_id, first_id))
  rollout = by_sample_id(engine.run(gen_params, 0).rollout)
  if engine.local_rows:    # each process holds the responses of its own engine shards: it scores those
    share = dataclasses.replace(share, readers=dict(engine.readers))
    engine.forget_readers()
  mine = np.flatnonzero(share.owns(rollout.sample_id_b))   # of several processes: score its own samples
  texts = data.decode_responses(setup.tokenizer, rollout.tokens_bt[mine], rollout.prompt_len_b[mine],
                                rollout.response_len_b[mine])
  n = len(repeated)
  correct, fmt, rewards = np.zeros((n,), bool), np.zeros((n,), bool), np.zeros((n,), np.float32)
  rewards[mine], fmt[mine], correct[mine] = score_batch(setup.eval_task, [repeated[i] for i in mine], texts)
  if examples is not None:
    order = np.argsort(mine, kind="stable")
    examples.extend({"problem": int(mine[j]), "prompt": repeated[mine[j]].prompt, "response": texts[j],
                     "answer": repeated[mine[j]].answer, "correct": bool(correct[mine[j]]),
                     "reward": float(rewards[mine[j]])} for j in order)
  return tuple(processes.gather_rows("evaluate", share, rollout.sample_id_b, (correct, fmt, rewards)))


class _AuxCall:
  """One forward pass of an auxiliary model dispatched on the aux mesh without waiting for it.

  ``result()`` blocks, releases the fetched params and records the interval from dispatch to the moment
  the output was ready (observed by a waiter thread) on the timeline under the aux group. ``metrics``:
  the deployment's fetch and release figures (``aux/{name}/fetch/*``, ``.../release/*``; none where the
  model stays on the devices), complete once ``result()`` returned.
  """

  def __init__(self, name: str, programs: Programs, timeline: Timeline, step: int, fn, resting, *args):
    d = programs.deployment
    self.name, self.d, self.timeline, self.step = name, d, timeline, step
    self.start = timeline.now()
    self.params, self.metrics = d.fetch_aux(resting, name)
    self.out = fn(self.params, *args)
    self._ready = _WAITER.submit(lambda out: (jax.block_until_ready(out), timeline.now())[1], self.out)

  def result(self):
    end = self._ready.result()
    self.metrics |= self.d.release_aux(self.params, used_by=self.out, name=self.name)
    self.timeline.record(self.name, self.start, end, group=self.d.aux_group, step=self.step)
    return self.out


_WAITER = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="aux-ready")


def _on_aux(programs: Programs, on_train_mesh, host):
  """``host`` [B, ...] on the aux mesh: ``on_train_mesh`` (its copy on the training mesh, if there is one)
  when the two meshes are the same, else built from ``host``."""
  if programs.aux_mesh is programs.mesh and on_train_mesh is not None:
    return on_train_mesh
  return data.to_global(programs.aux_mesh, host)


def _rows_on_aux(programs: Programs, per_token, per_sample) -> tuple:
  """Packed rows' per-token arrays (split over the batch axes) and per-sample arrays (replicated) on the
  aux mesh: as they are when it is the training mesh, else copied device to device (hybrid)."""
  if programs.aux_mesh is programs.mesh:
    return tuple(per_token) + tuple(per_sample)
  b2, rep = mesh_lib.batch_sharding(programs.aux_mesh, 2), mesh_lib.replicated(programs.aux_mesh)
  return tuple(distributed.put(x, b2) for x in per_token) + tuple(distributed.put(x, rep) for x in per_sample)


def kv_cache_bytes(cfg) -> int:
  """Bytes of the engine's KV cache summed over the rollout devices (each holds an equal, distinct share:
  slots split over data x fsdp, KV heads over tensor), allocated after the switch, freed before training."""
  m, r = cfg.model.config, cfg.rollout
  itemsize = np.dtype(m.compute_dtype).itemsize
  return 2 * m.num_layers * r.slots * r.seq_len * m.num_kv_heads * m.head_dim * itemsize


def generation_phase(programs: Programs, state, step: int, timeline: Timeline, run_engine):
  """Switch to the generation layout, ``run_engine(gen_params)``, switch back -> (state, result, metrics).

  A PPO critic (``programs.critic``) is parked before the switch and back on the devices after it."""
  d, metrics = programs.deployment, {}
  with timeline.phase("switch", group=d.rollout_group, step=step):
    if programs.critic is not None:
      metrics |= programs.critic.park()
    state, gen_params, m = d.to_generation(state)
    metrics |= m
  with timeline.phase("generate", group=d.rollout_group, step=step):
    t0 = time.perf_counter()
    result = run_engine(gen_params)
    generate_s = time.perf_counter() - t0
  with timeline.phase("switch", group=d.train_group, step=step):
    state, m = d.to_training(state)
    metrics |= m
    if programs.critic is not None:
      metrics |= programs.critic.unpark()
  tokens = float(result.stats.get("generated_tokens", 0))
  metrics |= {"generate_s": generate_s, "generate_tokens_per_s": tokens / generate_s,
              # rollout.keep_cache: the KV cache the engine holds through training (0 otherwise).
              "engine/held_cache_bytes": float(programs.engine.held_cache_bytes),
              "engine/generated_tokens": tokens,
              "engine/slot_utilization": float(result.stats.get("slot_utilization", 0.0)),
              "engine/kv_cache_bytes": float(kv_cache_bytes(programs.cfg)),
              "engine/decode_steps": float(result.stats.get("decode_steps", 0)),
              # Decode chunks (one host round trip each), host prefill calls (recomputing the prefixes of
              # samples carried in flight from the previous phase: reprefill_rows), refills inside the
              # chunks (admitting prefill_rows new samples), the rows x width all prefills processed; the
              # simulator's cost fit (rl_fusion_jax/sim/fit.py) reads the chunk, call and refill counts.
              **{f"engine/{k}": float(result.stats.get(k, 0))
                 for k in ("decode_chunks", "prefill_calls", "refill_prefills", "prefill_tokens", "prefill_rows",
                           "reprefill_rows", *engine_lib.CHUNK_MOMENTS)},
              # Bytes the engine's fetches moved device -> host: finished rows packed (and what the same rows
              # padded to seq_len would be), and the per-chunk control numbers (flags, lengths, counters);
              # what this process read from its devices, and received of the other processes' rows.
              **{f"queue/link_bytes/{k}": float(result.stats.get(f"link_bytes/{k}", 0))
                 for k in ENGINE_LINKS}}
  return state, result, metrics


def begin_aux_stage(programs: Programs, ref_resting, timeline: Timeline, step: int) -> None:
  """Hands the aux stage (``programs.aux_stage``, hybrid) this step's reference and reward-model params."""
  stage = programs.aux_stage
  if stage is not None:
    stage.begin(ref_resting if stage.reference else None, timeline, step,
                rm_params=programs.reward_model[1] if stage.reward else None)


def guarded_update(update, *args):
  """``update(*args)`` under ``jax.transfer_guard("disallow")``: every input must already be a device array
  with the update's sharding (put there explicitly, e.g. by ``jax.device_put``, before the call), so a
  hidden host round trip or implicit reshard inside the update raises instead of slowing every step."""
  with jax.transfer_guard("disallow"):
    return update(*args)


def _place_packed(setup: Setup, programs: Programs, rollout: Rollout, ref_logp_bt=None):
  """The host's samples as packed rows on the training mesh (first-fit decreasing into rows of
  ``seq_len``, row count bucketed; ``packed_step.place_rows``) -> (rows, (positions, segment ids, sample
  index, response mask) derived on the device, metrics: the packing and the bytes put against the padded
  update's). ``ref_logp_bt``: host rows of the reference's log-probs, placed in the same stream."""
  lengths = np.asarray(rollout.prompt_len_b) + np.asarray(rollout.response_len_b)
  layout = packing.plan(lengths, setup.cfg.rollout.seq_len, programs.row_buckets,
                        groups=mesh_lib.batch_shards(programs.mesh), micro=programs.plan_micro)
  cfg = setup.cfg
  versions, held_b, between = None, None, {}
  if programs.engine.local_rows:   # the samples of this process's groups' rows, from their holders
    share = programs.verify.share
    rows_p = global_batch.rows_by_process(mesh_lib.batch_sharding(programs.mesh, 1), layout.num_rows,
                                          distributed.process_count())
    need = rows_p[:, np.maximum(layout.row_b, 0)] & (layout.row_b >= 0)
    rollout, crossed = processes.fill_rows(share, rollout, need, vocab_size=cfg.model.config.vocab_size)
    versions = processes.version_range(share, rollout)
    held_b = need[share.index] | share.owns(rollout.sample_id_b)
    between = {"queue/link_bytes/rows_between_hosts_this_host": float(crossed),
               "queue/link_bytes/rows_between_hosts_padded_this_host": float(
                   processes.fill_rows_padded(share, rollout, need))}
  rows, link = packed_step.place_rows(programs.mesh, layout, tokens_bt=rollout.tokens_bt,
                                      behaviour_logp_bt=rollout.logp_bt, version_bt=rollout.version_bt,
                                      prompt_len_b=rollout.prompt_len_b, vocab_size=cfg.model.config.vocab_size,
                                      max_version_span=cfg.stalesync.max_staleness if cfg.stalesync.enabled else 0,
                                      padded_width=batch_width(cfg, lengths), pages=programs.stream_pages,
                                      ref_logp_bt=ref_logp_bt, version_range=versions, held_b=held_b)
  stats = {**between, "pack/rows": float(layout.num_rows), "pack/rows_used": float(layout.rows_used),
           "pack/padding_frac": float(1 - lengths.sum() / (layout.num_rows * layout.width)),
           "pack/stream_bytes": link.pop("stream_bytes"), "pack/stream_used_bytes": link.pop("stream_used_bytes"),
           **{f"queue/link_bytes/{k}": v for k, v in link.items()}}
  return rows, programs.row_layout(rows) + (layout,), stats


def _packed_rows_update(setup: Setup, programs: Programs, state, step: int, rows, row_fields, ref_logp_rw,
                        rewards, values_rw=None, advantages=None):
  """The advantage stage and the update(s) on packed rows -> (state, train metrics, batch stats, the
  critic's returns: None without ``values_rw``, its values of the rows). ``advantages``: the host's
  per-sample advantages (``advantage_stage``), broadcast over the rows; None: computed from the rewards."""
  positions_rw, segment_ids_rw, sample_rw, mask_rw, layout = row_fields
  rewards_b = distributed.put(np.asarray(rewards, np.float32), rows.row_b.sharding)
  returns_rw = None
  if values_rw is None:
    given = () if advantages is None else (distributed.put(np.asarray(advantages, np.float32), rows.row_b.sharding),)
    advantages_rw, batch_stats = programs.packed_advantages(sample_rw, mask_rw, rows.behaviour_logp_rw,
                                                            ref_logp_rw, rewards_b, *given)
  else:
    advantages_rw, batch_stats, returns_rw = programs.packed_gae(sample_rw, mask_rw, rows.behaviour_logp_rw,
                                                                 ref_logp_rw, rewards_b, values_rw)
  batch = packed_step.PackedTrainBatch(
      tokens_rw=rows.tokens_rw, positions_rw=positions_rw, segment_ids_rw=segment_ids_rw, mask_rw=mask_rw,
      advantages_rw=advantages_rw, behaviour_logp_rw=rows.behaviour_logp_rw, ref_logp_rw=ref_logp_rw,
      version_rw=rows.version_rw)
  if not programs.several_updates:
    state, train_metrics = guarded_update(programs.packed_step, state, batch)
    return state, train_metrics, batch_stats, returns_rw
  batch = batch.replace(proximal_logp_rw=programs.policy_packed_logprobs(state.params, rows.tokens_rw, positions_rw,
                                                                         segment_ids_rw))
  seq_len, rep = setup.cfg.rollout.seq_len, rows.row_b.sharding

  def select(indices):
    sub = packing.plan(layout.length_b[indices], seq_len, programs.mini_row_buckets, micro=programs.mini_plan_micro)
    placed = distributed.put(tuple(np.asarray(x, np.int32) for x in (sub.row_b, sub.start_b, indices)), rep)
    return programs.mini_batch_rows(batch, rows.row_b, rows.start_b, rows.length_b, *placed, num_rows=sub.num_rows)

  state, train_metrics = several_updates(setup, programs, state, step, len(layout.length_b), select,
                                         programs.packed_step_prox)
  return state, train_metrics, batch_stats, returns_rw


def several_updates(setup: Setup, programs: Programs, state, step: int, num_samples: int, select, update):
  """``algo.ppo_epochs`` epochs of ``algo.mini_batches`` updates each on one batch -> (state, metrics).

  Each epoch draws a permutation of the samples (seeded by run.seed, the step and the epoch) and splits
  it into equal mini-batches (each in sample order); ``select(indices)`` builds a mini-batch on the
  devices (it carries the proximal log-probs), ``update`` takes it. The updates leave the policy version
  alone; it advances by one after the last. Metrics: every update metric averaged over the updates (the
  divergence guard's ``nonfinite``: the first non-zero code), and per epoch ``ppo/epoch{e}/clip_frac``,
  ``ppo/epoch{e}/kl_proximal`` (KL to the proximal policy, k3 per token) and ``ppo/epoch{e}/loss`` (the
  loss each update computed before it stepped: with one mini-batch, epoch e + 1's is the same batch's loss
  after epoch e's update, lower when the update improved the objective).
  """
  a = setup.cfg.algo
  outs = []
  for epoch in range(a.ppo_epochs):
    order = np.random.default_rng([setup.cfg.run.seed, step, epoch]).permutation(num_samples)
    for part in np.split(order, a.mini_batches):
      state, m = guarded_update(update, state, select(np.sort(part)))
      outs.append((epoch, m))
  state = programs.bump_version(state)
  fetched = distributed.fetch([m for _, m in outs])
  combine = lambda k, values: max(values) if k.startswith(step_lib.MAX_PREFIX) else float(np.mean(values))
  metrics = {k: combine(k, [float(m[k]) for m in fetched]) for k in fetched[0] if k != "nonfinite"}
  metrics["nonfinite"] = next((float(m["nonfinite"]) for m in fetched if float(m["nonfinite"])), 0.0)
  for epoch in range(a.ppo_epochs):
    ms = [m for (e, _), m in zip(outs, fetched) if e == epoch]
    for key in ("clip_frac", "kl_proximal", "loss"):
      metrics[f"ppo/epoch{epoch}/{key}"] = float(np.mean([float(m[key]) for m in ms]))
  return state, metrics


def _padded_updates(setup: Setup, programs: Programs, state, step: int, batch):
  """Several updates on a padded batch (``several_updates``): the proximal log-probs of the whole batch
  first, then mini-batches of its rows."""
  batch = batch.replace(proximal_logp_bt=programs.policy_logprobs(state.params, batch.tokens_bt))
  rep = mesh_lib.replicated(programs.mesh)
  select = lambda indices: programs.take_rows(batch, distributed.put(np.asarray(indices, np.int32), rep))
  return several_updates(setup, programs, state, step, batch.tokens_bt.shape[0], select, programs.train_step_prox)


def batch_width(cfg, length_b) -> int:
  """The row width the padded update runs at: ``rollout.seq_len`` (one program shape per run), or with
  ``optim.width_buckets`` the longest sample (prompt + response, ``length_b``) rounded up to a width
  bucket (``step.train_width``); the positions past it are padding in every row."""
  if not cfg.optim.width_buckets:
    return cfg.rollout.seq_len
  return step_lib.train_width(int(np.max(length_b, initial=0)), cfg.rollout.seq_len)


def cut_width(rollout: Rollout, width: int) -> Rollout:
  """``rollout`` (host or device arrays) with its per-token fields (tokens, behaviour log-probs, versions)
  cut to their first ``width`` positions; as it is when already that wide."""
  if rollout.tokens_bt.shape[1] == width:
    return rollout
  if rollout.tokens_bt.shape[1] < width:
    raise ValueError(f"rows of {rollout.tokens_bt.shape[1]} tokens cannot widen to {width}")
  cut = lambda x_bt: x_bt[:, :width]
  return rollout.replace(tokens_bt=cut(rollout.tokens_bt), logp_bt=cut(rollout.logp_bt),
                         version_bt=cut(rollout.version_bt))


def shape_rewards(cfg, rollout: Rollout, rewards):
  """The verifier's rewards with DAPO's overlong penalty added (``algo.overlong_buffer`` > 0) -> (rewards,
  metrics); as they are otherwise (``advantage_stage.shaped_rewards``)."""
  return advantage_stage.shaped_rewards(cfg, rollout.response_len_b, rewards)


def score(setup: Setup, programs: Programs, rollout: Rollout, problems):
  """(rewards, format_ok, correct, metrics) of a host rollout in sample-id order: the verifier's scores
  (most taken from the background verify stage) with the reward shaping of ``shape_rewards``."""
  rewards, fmt, correct, m = programs.verify.scores(rollout, problems)
  rewards, shaped = shape_rewards(setup.cfg, rollout, rewards)
  return rewards, fmt, correct, m | shaped


def train_phase(setup: Setup, programs: Programs, state, ref_resting, step: int, timeline: Timeline,
                problems, rollout: Rollout, device_rollout: Rollout | None = None, scored=None, advantages=None,
                ref_logp=None, rm_scores=None):
  """Reward -> reference -> advantages -> update -> publish on a host batch sorted by sample id.

  The reference and reward-model forward passes are dispatched first, on the aux mesh, and run while
  the host verifies the responses (most of them already verified during generation by
  ``programs.verify``); the update waits for both. ``device_rollout``: the same batch already on the
  training mesh (e.g. read from the queue per data-parallel group); default: built from ``rollout``.
  Both are cut to ``batch_width`` first (if wider), so the reference, the reward model, the batch assembly
  and the update all run on that width; every loss value is the full-width one. ``scored``: the result of
  ``score`` when the caller already scored the rollout (dynamic sampling).

  Where ``advantage_stage.on_host`` holds, the advantages are the host's (``advantages``: read from the
  StaleSync queue, where its advantage stage wrote them; else computed here from the final rewards) and
  the update's program takes them as given. ``ref_logp``: the reference's log-probs read from the
  StaleSync queue (hybrid: its ``ref_logp`` field), as the device batch's rows [B, width] on the training
  mesh, or host rows [B, width] that the packed update sends in its rows' stream; None: computed here.
  ``rm_scores``: the reward model's scores read from the queue (hybrid: ``rm_score``; host [B]).

  With a critic (``programs.critic``, PPO + GAE): its values of the batch are dispatched with the
  reference, the batch assembly computes GAE advantages and returns from them, and after the policy
  update the critic takes one regression step on those returns (timeline phase ``critic``).
  """
  cfg, d = setup.cfg, programs.deployment
  length_b = np.asarray(rollout.prompt_len_b) + np.asarray(rollout.response_len_b)
  width = batch_width(cfg, length_b)
  rollout = cut_width(rollout, width)
  metrics = {"sample_len_max": float(length_b.max(initial=0))}   # what optim.width_buckets would cut to
  t0 = time.perf_counter()
  ref_call = rm_call = rows = None
  queued_ref, ref_logp = ref_logp, None
  if programs.packed_inputs:     # packed rows straight from the host's samples (no padded batch)
    rows, row_fields, pack_stats = _place_packed(setup, programs, rollout, queued_ref)
    metrics |= pack_stats
    aux_rows = functools.cache(lambda: _rows_on_aux(programs, (rows.tokens_rw,) + row_fields[:2],
                                                    (rows.row_b, rows.start_b, rows.length_b)))
    ref_args = lambda: (programs.packed_ref_logprobs, ref_resting) + aux_rows()[:3]
    rm_args = lambda: (programs.packed_reward_score, programs.reward_model[1]) + aux_rows()
  else:
    if device_rollout is None:
      if programs.engine.local_rows:   # the responses this process's devices train on, from their holders
        need = global_batch.rows_by_process(mesh_lib.batch_sharding(programs.mesh, 1), len(length_b),
                                            distributed.process_count())
        rollout, crossed = processes.fill_rows(programs.verify.share, rollout, need,
                                               vocab_size=cfg.model.config.vocab_size)
        metrics["queue/link_bytes/rows_between_hosts_this_host"] = float(crossed)
        metrics["queue/link_bytes/rows_between_hosts_padded_this_host"] = float(
            processes.fill_rows_padded(programs.verify.share, rollout, need))
      device_rollout = jax.tree.map(lambda x: data.to_global(programs.mesh, x), rollout)
    device_rollout = cut_width(device_rollout, width)
    aux_tokens = functools.cache(lambda: _on_aux(programs, device_rollout.tokens_bt, rollout.tokens_bt))
    ref_args = lambda: (programs.ref_logprobs, ref_resting, aux_tokens())
    rm_args = lambda: programs.reward_model + (
        aux_tokens(), _on_aux(programs, None, rollout.prompt_len_b + rollout.response_len_b))
  stage = programs.aux_stage
  if cfg.algo.needs_reference and not (stage is not None and stage.reference):
    ref_call = _AuxCall("reference", programs, timeline, step, *ref_args())
  if programs.reward_model is not None and not (stage is not None and stage.reward):
    rm_call = _AuxCall("reward_model", programs, timeline, step, *rm_args())
  stage_ref = stage_rm = None
  if stage is not None:    # scored on the aux devices as the samples finished (the rest now)
    with timeline.phase("aux_gather", group=d.aux_group, step=step):
      stage_ref, stage_rm, m = stage.take(rollout, row_fields[-1] if rows is not None else None, width,
                                          reference=queued_ref is None, reward=rm_scores is None)
    metrics |= m
  critic = programs.critic
  if critic is None:
    values = None
  elif rows is not None:
    values = critic.packed_values(rows.tokens_rw, *row_fields[:2])
  else:
    values = critic.values(device_rollout.tokens_bt)
  with timeline.phase("reward", group=d.train_group, step=step):
    rewards, fmt, correct, m = scored if scored is not None else score(setup, programs, rollout, problems)
    metrics |= m | {"accuracy": float(correct.mean()), "format_rate": float(fmt.mean())}
    if rm_call is not None or stage_rm is not None or rm_scores is not None:
      rm_b = (np.asarray(rm_scores) if rm_scores is not None else
              np.asarray(rm_call.result() if rm_call is not None else distributed.fetch(stage_rm)))
      rewards = advantage_stage.with_reward_model(cfg, rewards, rm_b)
      metrics |= (rm_call.metrics if rm_call is not None else {}) | {"reward_model_score": float(rm_b.mean())}
    metrics["reward"] = float(rewards.mean())
    if programs.host_advantages and advantages is None:
      advantages = advantage_stage.advantages(cfg.algo, cfg.rollout.group_size, rewards)
  reward_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  if queued_ref is not None:    # from the queue: in the packed rows' stream, or the device batch's rows
    ref_logp = rows.ref_logp_rw if rows is not None else queued_ref
  elif ref_call is not None or stage_ref is not None:
    if stage_ref is not None:
      ref_logp = stage_ref
    else:
      ref_logp, m = ref_call.result(), ref_call.metrics
      metrics |= m
    if programs.aux_mesh is not programs.mesh:
      ref_logp = distributed.put(ref_logp, (rows.behaviour_logp_rw if rows is not None else device_rollout.logp_bt
                                            ).sharding)
  else:    # unused when kl_coef == 0
    ref_logp = jnp.zeros_like(rows.behaviour_logp_rw if rows is not None else device_rollout.logp_bt)
  ref_s = time.perf_counter() - t0
  with timeline.phase("train", group=d.train_group, step=step):
    t0 = time.perf_counter()
    if rows is not None:
      state, train_metrics, batch_stats, returns = _packed_rows_update(setup, programs, state, step, rows,
                                                                       row_fields, ref_logp, rewards, values,
                                                                       advantages)
      for key in ("host_to_device", "host_to_device_padded", "host_to_device_per_device",
                  "host_to_device_this_host"):   # the rewards, [B]
        metrics[f"queue/link_bytes/{key}"] += np.asarray(rewards, np.float32).nbytes
    else:
      rewards_dev = data.to_global(programs.mesh, rewards)
      if critic is None:
        given = () if advantages is None else (data.to_global(programs.mesh, np.asarray(advantages, np.float32)),)
        batch, batch_stats = programs.assemble(device_rollout, rewards_dev, ref_logp, *given)
      else:
        batch, batch_stats, returns = programs.assemble(device_rollout, rewards_dev, ref_logp, values)
      if programs.several_updates:
        state, train_metrics = _padded_updates(setup, programs, state, step, batch)
      else:
        state, train_metrics = guarded_update(programs.train_step, state, batch)
    train_metrics, batch_stats = distributed.fetch((train_metrics, batch_stats))
    train_s = time.perf_counter() - t0
  if critic is not None:
    with timeline.phase("critic", group=d.train_group, step=step):
      t0 = time.perf_counter()
      if rows is not None:
        positions_rw, segment_ids_rw, _, mask_rw, _ = row_fields
        critic_batch = critic_lib.PackedCriticBatch(rows.tokens_rw, mask_rw, values, returns, positions_rw,
                                                    segment_ids_rw)
      else:
        critic_batch = critic_lib.CriticBatch(batch.tokens_bt, batch.mask_bt, values, returns)
      critic_metrics = distributed.fetch(guarded_update(critic.update, critic_batch))
      metrics |= {k: float(v) for k, v in critic_metrics.items()}
      metrics["critic_s"] = time.perf_counter() - t0
  with timeline.phase("publish", group=d.train_group, step=step):
    metrics |= d.publish(state.params)
  resp = rollout.response_len_b
  real_tokens = float((rollout.prompt_len_b + resp).sum())
  metrics |= {k: float(v) for k, v in {**train_metrics, **batch_stats}.items()}
  metrics |= mismatch_metrics(metrics)
  metrics["is_weight_std"] = float(np.sqrt(max(metrics["is_weight_sq"] - metrics["is_weight"] ** 2, 0.0)))
  metrics |= {
      "response_len_mean": float(resp.mean()), "response_len_max": float(resp.max()),
      "truncated_frac": float(1 - rollout.finished_b.mean()),
      "reward_s": reward_s, "ref_s": ref_s, "train_s": train_s,
      "train_tokens": real_tokens, "train_tokens_per_s": real_tokens / train_s, "train_width": float(width),
      "policy_version": float(step + 1)}
  return state, metrics


def mismatch_metrics(metrics: dict) -> dict:
  """The update's sampler/trainer agreement sums (``step.rl_loss_from_logprobs``; removed from
  ``metrics``) -> ``mismatch/logp_abs_max``, ``mismatch/logp_abs_mean``, ``mismatch/kl`` (means over the
  response tokens sampled by the parameters the update started from) and ``mismatch/tokens_frac`` (their
  share of the response tokens; 0: none, and the three are 0)."""
  if "mismatch/current_frac" not in metrics:
    return {}
  frac = metrics.pop("mismatch/current_frac")
  mean = lambda key: metrics.pop(key) / frac if frac else 0.0 * metrics.pop(key)
  return {"mismatch/logp_abs_max": metrics.pop(step_lib.MAX_PREFIX + "mismatch/logp_abs"),
          "mismatch/logp_abs_mean": mean("mismatch/logp_abs_weighted"), "mismatch/kl": mean("mismatch/kl_weighted"),
          "mismatch/tokens_frac": frac}


def rl_step(setup: Setup, programs: Programs, state, ref_resting, step: int, timeline: Timeline,
            data_position: int | None = None):
  """The synchronous step: switch -> generate every sample -> switch -> train_phase.

  ``data_position``: index of the step's first problem (default ``step * num_prompts``); sample and
  group ids derive from it, so a run resumed with another batch size never draws a problem twice. The
  metrics carry ``prompts_drawn``, how far the data position advances (``num_prompts``, more with
  ``algo.dynamic_sampling``: see ``_dynamic_batch``).
  """
  r = setup.cfg.rollout
  t_start = time.perf_counter()
  first = step * r.num_prompts if data_position is None else data_position
  programs.engine.forget_readers()   # the previous step's samples (every round of a dynamic batch is this one's)
  begin_aux_stage(programs, ref_resting, timeline, step)
  if setup.cfg.algo.dynamic_sampling:
    state, problems, rollout, scored, metrics = _dynamic_batch(setup, programs, state, step, timeline, first)
    state, m = train_phase(setup, programs, state, ref_resting, step, timeline, problems, rollout, scored=scored)
    return state, metrics | m | {"step_s": time.perf_counter() - t_start}
  problems, (state, result), metrics = _generate_round(setup, programs, state, step, timeline, first)
  state, m = train_phase(setup, programs, state, ref_resting, step, timeline, problems,
                         by_sample_id(result.rollout))
  return state, metrics | m | {"step_s": time.perf_counter() - t_start, "prompts_drawn": r.num_prompts}


SUMMED_OVER_ROUNDS = ("generate_s", "engine/generated_tokens", "engine/decode_steps", "engine/decode_chunks",
                      "engine/prefill_calls", "engine/refill_prefills", "engine/prefill_tokens",
                      "engine/prefill_rows", "engine/reprefill_rows",
                      *(f"queue/link_bytes/{k}" for k in ENGINE_LINKS),
                      *(f"engine/{k}" for k in engine_lib.CHUNK_MOMENTS))


def _generate_round(setup: Setup, programs: Programs, state, step: int, timeline: Timeline, first: int):
  """Generates ``group_size`` samples of the ``num_prompts`` problems from index ``first`` ->
  (problems, (state, engine result), metrics)."""
  r = setup.cfg.rollout
  problems = [setup.train_task.problem(first + i) for i in range(r.num_prompts)]
  programs.engine.add(requests(setup.tokenizer, problems, r.max_prompt_len, r.group_size,
                               first * r.group_size, first, forced_len=forced_lengths(setup.cfg)))
  state, result, metrics = generation_phase(programs, state, step, timeline,
                                            lambda params: programs.engine.run(params, step))
  return problems, (state, result), metrics


def _dynamic_batch(setup: Setup, programs: Programs, state, step: int, timeline: Timeline, first: int):
  """DAPO's dynamic sampling: rounds of ``num_prompts`` problems are generated and scored until
  ``num_prompts`` groups whose rewards are not all equal (``dapo.select_informative``) are found, or
  ``algo.dynamic_sampling_rounds`` extra rounds are spent; the batch keeps the first ``num_prompts``
  informative groups in draw order, and a batch still short is topped up with the first dropped groups
  (counted in ``dynamic_sampling/short_batches`` and logged), so every update has the same size.

  Returns (state, problems, host rollout, scored, metrics) with the rollout in group order.
  """
  cfg = setup.cfg
  r, a = cfg.rollout, cfg.algo
  keep, dropped, rounds, metrics = [], [], 0, {}
  while True:
    problems, (state, result), m = _generate_round(setup, programs, state, step, timeline,
                                                   first + rounds * r.num_prompts)
    rounds += 1
    for k, v in m.items():   # seconds and token counts add up over the rounds; the rest is the last round's
      metrics[k] = metrics.get(k, 0.0) + v if k in SUMMED_OVER_ROUNDS else v
    rollout = by_sample_id(result.rollout)
    with timeline.phase("reward", group=programs.deployment.train_group, step=step):
      scored = score(setup, programs, rollout, problems)
    informative = set(dapo.select_informative(scored[0], r.group_size).tolist())
    for g, problem in enumerate(problems):
      (keep if g in informative else dropped).append((problem, rollout, scored, g))
    if len(keep) >= r.num_prompts or rounds > a.dynamic_sampling_rounds:
      break
  short = len(keep) < r.num_prompts
  if short:
    logging.warning("dynamic sampling: %d informative groups of %d after %d rounds; the batch is topped up "
                    "with %d groups of equal rewards", len(keep), r.num_prompts, rounds,
                    r.num_prompts - len(keep))
  chosen = (keep + dropped)[:r.num_prompts]
  rows = lambda g: slice(g * r.group_size, (g + 1) * r.group_size)
  batch_rollout = jax.tree.map(lambda *xs: np.concatenate(xs),
                               *[jax.tree.map(lambda x, g=g: np.asarray(x)[rows(g)], ro) for _, ro, _, g in chosen])
  scored = tuple(np.concatenate([np.asarray(sc[i])[rows(g)] for _, _, sc, g in chosen]) for i in range(3))
  # Verify-stage metrics: the mean over the rounds the batch's groups came from; the reward-shaping ones
  # are recomputed on the batch itself.
  score_metrics = {k: float(np.mean([sc[3][k] for _, _, sc, _ in chosen])) for k in chosen[0][2][3]}
  score_metrics |= shape_rewards(cfg, batch_rollout, np.zeros_like(scored[0]))[1]
  metrics |= {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/groups_filtered": float(len(dropped)),
              "dynamic_sampling/informative_frac": len(keep) / (rounds * r.num_prompts),
              "dynamic_sampling/short_batches": float(short), "prompts_drawn": rounds * r.num_prompts,
              "generate_tokens_per_s": metrics["engine/generated_tokens"] / max(metrics["generate_s"], 1e-9)}
  return state, [p for p, _, _, _ in chosen], batch_rollout, (*scored, score_metrics), metrics
