"""The training loop of every schedule and deployment mode: ``run(config, workdir)``.

One run: a synchronous step (``phases.rl_step``) or a StaleSync step (``stalesync.StaleSync``), with any
registered algorithm (GRPO, PPO with a critic, DAPO options) in the deployment ``fusion.mode`` names
(colocated, full, hybrid; separated runs one process per side through ``separated.run``).

Sections:
  1. validate everything that can be validated before anything is compiled or written, including
     whether this config may continue the run already in the workdir (``resume.inspect``);
  2. restore the newest intact checkpoint (RL, else warm-up), falling back past corrupt ones;
  3. write the workdir (config, tokenizer, outputs truncated to the checkpoint), build the programs;
  4. warm up (SFT, checkpointed) and evaluate the starting policy, unless resumed past that;
  5. the RL loop (metrics and timeline every step, the divergence guard, checkpoints every N steps);
  6. summary (the last step's evaluation is the final one: it runs once).

The workdir is held by one run at a time (``workdir_lock``), taken after the config validated and before
the workdir is read. SIGTERM / SIGINT (``preemption``) end the warm-up or RL step in progress, then a
checkpoint is written and ``errors.Preempted`` raised; a second signal ends the process at once.

Of several processes (docs/multihost.md) every process runs all of this on its own devices:
process 0 alone writes the workdir's files (``distributed.on_writer``; checkpoints are collective),
each step's metrics are reduced across processes (``processes.reduce_metrics``) and the other processes'
timeline phases are gathered into process 0's file (``ProcessTimeline.gather``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from rl_fusion_jax import distributed
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax import models
from rl_fusion_jax.models import value_model
from rl_fusion_jax.checkpointing import abstract_like
from rl_fusion_jax.config import ExperimentConfig
from rl_fusion_jax.errors import ConfigError
from rl_fusion_jax.orchestration import phases, processes, resume, stalesync, workdir_lock
from rl_fusion_jax.orchestration.guard import DivergenceGuard
from rl_fusion_jax.orchestration.preemption import Preemption
from rl_fusion_jax.orchestration.programs import Placement, Programs, make_placement
from rl_fusion_jax.orchestration.setup import Setup, validate, write_json_atomic
from rl_fusion_jax.timeline import Timeline, timeline_path
from rl_fusion_jax.train import state as state_lib


class _Evaluator:
  """Greedy evaluation wrapped in the phase switch (each round uses fresh sample ids)."""

  def __init__(self, setup: Setup, programs: Programs, timeline: Timeline, rounds: int = 0,
               examples_path: str = ""):
    self.setup, self.programs, self.timeline, self.rounds = setup, programs, timeline, rounds
    self.examples_path = examples_path   # process 0 appends task.eval_examples responses per evaluation

  def __call__(self, state, step: int):
    d = self.programs.deployment
    examples = [] if self.examples_path and distributed.is_writer() else None
    with self.timeline.phase("evaluate", group=d.rollout_group, step=step):
      state, gen_params, _ = d.to_generation(state)
      out = phases.evaluate(self.setup, self.programs, gen_params, self.rounds, examples)
      state, _ = d.to_training(state)
    self.rounds += 1
    if examples:
      with open(self.examples_path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps({"step": int(step)} | e, sort_keys=True) + "\n" for e in examples)
    return state, out


def _targets(cfg: ExperimentConfig, placement: Placement):
  """``targets_for(kind, meta)``: abstract restore targets (with shardings) of each checkpoint kind."""
  abstract = models.abstract_params(cfg.model.config)

  def state_targets(tx, shardings):
    like = jax.eval_shape(lambda p: state_lib.TrainState(jnp.int32(0), p, tx.init(p), jnp.int32(0)), abstract)
    return {"params": abstract_like(like.params, shardings.params),
            "opt_state": abstract_like(like.opt_state, shardings.opt_state),
            "counters": abstract_like({"step": like.step, "policy_version": like.policy_version},
                                      {"step": shardings.step, "policy_version": shardings.policy_version})}

  def targets_for(kind: str, meta: dict):
    del meta
    if kind == "warmup":
      return state_targets(phases.warmup_optimizer(cfg), phases.warmup_shardings(cfg, placement))
    out = state_targets(placement.tx, placement.state_shardings)
    if cfg.algo.needs_reference:
      out["ref_params"] = abstract_like(abstract, placement.param_shardings)
    if placement.critic is not None:
      c = placement.critic
      critic = jax.eval_shape(lambda p: state_lib.TrainState(jnp.int32(0), p, c.tx.init(p), jnp.int32(0)),
                              value_model.abstract_value_params(cfg.model.config))
      out["critic"] = {"params": abstract_like(critic.params, c.param_shardings),
                       "opt_state": abstract_like(critic.opt_state, c.state_shardings.opt_state),
                       "step": abstract_like(critic.step, c.state_shardings.step)}
    return out
  return targets_for


def _state_from(items) -> state_lib.TrainState:
  return state_lib.TrainState(step=items["counters"]["step"], params=items["params"],
                              opt_state=items["opt_state"], policy_version=items["counters"]["policy_version"])


def _state_items(state, ref=None, critic=None) -> dict[str, Any]:
  items = {"params": state.params, "opt_state": state.opt_state,
           "counters": {"step": state.step, "policy_version": state.policy_version}}
  if ref is not None:
    items["ref_params"] = ref
  if critic is not None:
    items["critic"] = {"params": critic.params, "opt_state": critic.opt_state, "step": critic.step}
  return items


def _validate(cfg: ExperimentConfig, workdir: str, tensorboard: bool) -> Setup:
  """Section 1: every check of the config that needs neither a compile nor a write (ConfigError)."""
  try:
    setup = validate(cfg, jax.device_count())
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError(str(e)) from e
  if tensorboard and importlib.util.find_spec("tensorboardX") is None:
    raise ConfigError("--tensorboard needs tensorboardX: pip install -e '.[tensorboard]'")
  resume.check_workdir(workdir)
  distributed.check_same_config(resume.plain_config(cfg))
  check_same_precision(cfg.model.config.dtype, cfg.model.config.precision)
  return setup


def check_same_precision(dtype: str, precision: str) -> None:
  """``model.dtype='auto'`` resolves on each process from its own CPU (`model_config.default_precision`):
  processes whose CPUs differ in bfloat16 instructions would compile different programs for one SPMD
  run. Refused at start on every process, naming the field."""
  if dtype != "auto" or distributed.process_count() == 1:
    return
  resolved = distributed.exchange("precision", precision)
  if len(set(resolved)) > 1:
    listing = ", ".join(f"process {p}: {r}" for p, r in enumerate(resolved))
    raise ConfigError(f"config.model.dtype: 'auto' resolved differently on the processes ({listing}; their "
                      "CPUs differ in bfloat16 instructions); set config.model.dtype to one policy")


def local_rows() -> bool:
  """Whether the run's engines keep each process's rows on that process (``Engine.local_rows``): every run
  across processes (every deployment mode, the synchronous step or StaleSync, padded or packed update,
  dynamic sampling included, and the evaluation engines)."""
  return distributed.process_count() > 1


def run(cfg: ExperimentConfig, workdir: str, *, tensorboard: bool = False,
        resume_overrides: Sequence[str] = (), export_hf: str = "") -> dict[str, Any]:
  """Runs (or resumes) the experiment in ``workdir``; returns the summary also written to summary.json.

  ``export_hf``: also write the final policy (after the last RL step; the warmed-up one when
  ``run.steps`` is 0) as a Hugging Face checkpoint folder there (``models.save_hf``), which
  ``model.hf_path`` loads: e.g. one warm-up shared by many RL runs.
  """
  # 1. Validate before anything is compiled or written; hold the workdir; may this config continue it?
  setup = _validate(cfg, workdir, tensorboard)
  with contextlib.ExitStack() as stack:   # closed in reverse: pending saves complete (or fail) first
    stack.enter_context(workdir_lock.hold(workdir))
    prior = resume.inspect(workdir, cfg, resume_overrides)
    preemption = stack.enter_context(Preemption())

    # 2. Restore (reads; a corrupt newer checkpoint is moved aside only once an older one restored).
    placement = make_placement(cfg)
    restored = resume.restore(prior, _targets(cfg, placement))

    # 3. Write the workdir (process 0 writes every file but the checkpoints), build the programs.
    distributed.on_writer("prepare", resume.prepare, prior, cfg, setup.tokenizer, restored)
    programs = Programs(setup, placement)
    stack.callback(programs.verify.close)   # the verify stage's worker threads end with the run
    if programs.aux_stage is not None:
      stack.callback(programs.aux_stage.close)
    d = programs.deployment
    share = processes.Share.of_run()   # host scoring split by sample over the processes
    if local_rows():
      # Each process keeps the responses of the engine shards it reads; scoring follows the rows, and the
      # update's rows come from their holders (phases.train_phase).
      for engine in (programs.engine, programs.eval_engine, programs.sampled_eval_engine):
        if engine is not None:
          engine.local_rows = True
      share = dataclasses.replace(share, readers=programs.engine.readers)
      if programs.aux_stage is not None:   # it fills in the tokens its process's aux devices score
        programs.aux_stage.share = share
    programs.verify.share = share
    logging.info("mode %s: rollout mesh %s, training mesh %s (%s), model.dtype %s%s", d.mode,
                 dict(d.rollout_mesh.shape), dict(d.train_mesh.shape), jax.devices()[0].platform,
                 cfg.model.config.precision, " (auto)" if cfg.model.config.dtype == "auto" else "")
    timeline = processes.ProcessTimeline(timeline_path(workdir), d.groups)
    writer = stack.enter_context(contextlib.closing(
        metrics_lib.make_writer(workdir, tensorboard) if distributed.is_writer() else metrics_lib.MultiWriter([])))
    rl_ckpt, warm_ckpt = resume.checkpointers(workdir, cfg.run.keep_checkpoints, create=True)
    for c in (rl_ckpt, warm_ckpt):
      stack.callback(c.close)
      if c.exists() and c.prune():
        logging.info("resume: pruned %s to the newest %d checkpoints", c.directory, c.keep)
    summary, state = _train(setup, programs, restored, timeline, rl_ckpt, warm_ckpt, writer, preemption,
                            workdir)
    if export_hf:   # every process gathers the params (a collective); process 0 writes them
      distributed.on_writer("export_hf", models.save_hf, cfg.model.config, distributed.fetch(state.params),
                            export_hf)
      logging.info("final policy written to %s", export_hf)
    timeline.gather()
  distributed.on_writer("summary", write_json_atomic, os.path.join(workdir, "summary.json"), summary)
  logging.info("accuracy before RL %.3f -> after RL %.3f", summary["accuracy_before"],
               summary["accuracy_after"])
  return summary


def _train(setup: Setup, programs: Programs, restored, timeline: Timeline, rl_ckpt, warm_ckpt, writer,
           preemption: Preemption, workdir: str):
  """Sections 4-6: warm start or resumed state, the RL loop, the summary."""
  cfg, d = setup.cfg, programs.deployment
  meta = restored.meta if restored is not None and restored.kind == "rl" else {}
  evaluate = _Evaluator(setup, programs, timeline, meta.get("eval_rounds", 0),
                        metrics_lib.eval_examples_path(workdir))
  guard = DivergenceGuard(cfg.run, "RL", **meta.get("guard", {}))
  critic_guard = (DivergenceGuard(cfg.run, "critic", **meta.get("critic_guard", {}))
                  if programs.critic is not None else None)
  host = restored.host if meta else None
  schedule = stalesync.from_state(setup, programs, host) if cfg.stalesync.enabled else None

  # 4. Resume the RL loop, or warm up (continuing a warm-up checkpoint) and evaluate the start.
  if meta:
    state, ref = _state_from(restored.items), restored.items.get("ref_params")
    ref_resting = d.place_aux(ref, programs.ref_param_shardings) if ref is not None else None
    start, before, last_eval = int(meta["step"]), meta["eval_before"], meta.get("last_eval")
    data_position = int(meta["data_position"])
    programs.deployment.publish(state.params)
    if programs.critic is not None:
      c = restored.items["critic"]
      programs.critic.restore(c["params"], c["opt_state"], c["step"])
  else:
    state, ref_resting, before = _warm_start(setup, programs, restored, warm_ckpt, timeline, evaluate,
                                             preemption)
    start, data_position, last_eval = 0, 0, {"step": 0, **before}
    writer.write(0, {f"eval/{k}": v for k, v in before.items()})

  def save(step: int):
    with timeline.phase("checkpoint", group=d.train_group, step=step):
      ref_now = d.fetch_aux(ref_resting, "reference")[0] if ref_resting is not None else None
      critic = programs.critic.state if programs.critic is not None else None
      rl_ckpt.save(step, _state_items(state, ref_now, critic), {
          "kind": "rl", "step": step, "seed": cfg.run.seed, "config": resume.plain_config(cfg),
          "eval_before": before, "last_eval": last_eval, "data_position": data_position,
          "eval_rounds": evaluate.rounds, "guard": guard.state(), "timeline_time": timeline.now(),
          **({"critic_guard": critic_guard.state()} if critic_guard is not None else {})},
          host=schedule.state_dict() if schedule is not None else None)
      if ref_now is not None and ref_now is not ref_resting:
        rl_ckpt.wait()   # a fetched device copy of a host-resident reference is released after the save
        d.release_aux(ref_now, name="reference")

  def stop_if_asked(step: int, saved: bool):
    """After the step: on a signal (any process's), checkpoint it unless just done, and stop."""
    if preemption.should_stop():
      if not saved:
        save(step)
      raise preemption.stopped("RL", step, rl_ckpt.step_path(step))

  if not meta:
    save(0)   # the warmed-up start: a resume never redoes the warm-up or the first evaluation
    stop_if_asked(0, saved=True)

  # 5. The RL loop.
  progress = metrics_lib.Progress(cfg.run.steps, start, cfg.run.progress_every_s)
  for step in range(start, cfg.run.steps):
    if schedule is None:
      state, scalars = phases.rl_step(setup, programs, state, ref_resting, step, timeline, data_position)
      data_position += int(scalars.pop("prompts_drawn"))
    else:
      state, scalars = schedule.step(state, ref_resting, step, timeline)
      data_position = schedule.data_position
    scalars |= guard.scalars(guard.check(step + 1, scalars))
    if critic_guard is not None:   # the critic's own update: the same policy, its own counters
      critic = {k[len("critic/"):]: v for k, v in scalars.items() if k.startswith("critic/")}
      applied = critic_guard.check(step + 1, critic | {"loss": critic["value_loss"]})
      scalars |= {f"critic/{k}": v for k, v in critic_guard.scalars(applied).items()}
    if step + 1 == cfg.run.steps or (cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0):
      state, out = evaluate(state, step + 1)
      scalars |= {f"eval/{k}": v for k, v in out.items()}
      last_eval = {"step": step + 1, **out}
    scalars = processes.reduce_metrics(step + 1, scalars)
    writer.write(step + 1, scalars)
    timeline.gather()
    progress.update(step + 1, scalars)
    periodic = step + 1 == cfg.run.steps or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0)
    if periodic:
      save(step + 1)
    if step + 1 < cfg.run.steps:   # after the last step the run is complete: it ends as usual
      stop_if_asked(step + 1, saved=periodic)

  # 6. Summary: the evaluation of the last step (run once, also when resumed at the end).
  after = {k: v for k, v in last_eval.items() if k != "step"}
  return {"accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
          "format_rate_before": before["format_rate"], "format_rate_after": after["format_rate"],
          "eval_before": before, "eval_after": after,
          "steps": cfg.run.steps, "mode": d.mode, "updates_skipped": guard.skipped}, state


def _warm_start(setup: Setup, programs: Programs, restored, warm_ckpt, timeline: Timeline,
                evaluate: _Evaluator, preemption: Preemption):
  """Warm-up (continued from its checkpoint when there is one) and the evaluation of the start ->
  (state, resting reference or None, evaluation)."""
  cfg, d = setup.cfg, programs.deployment
  guard = DivergenceGuard(cfg.run, "warm-up", **(restored.meta.get("guard", {}) if restored else {}))
  warm_state = _state_from(restored.items) if restored is not None else None

  def save(step: int, state) -> str:
    warm_ckpt.save(step, _state_items(state), {
        "kind": "warmup", "step": step, "seed": cfg.run.seed, "config": resume.plain_config(cfg),
        "guard": guard.state(), "timeline_time": timeline.now()})
    return warm_ckpt.step_path(step)

  with timeline.phase("warmup", group=d.train_group):
    params = phases.init_policy(setup, programs) if warm_state is None else None
    params = phases.warmup(setup, programs, params, state=warm_state, save=save, guard=guard,
                           preemption=preemption)
  # The reference: a copy of the warmed-up policy made bucket by bucket where it rests (host memory in
  # ``full``, the aux mesh in ``hybrid``), never a whole device copy first.
  ref = (d.place_aux(params, programs.ref_param_shardings, keep_source=True) if cfg.algo.needs_reference
         else None)
  if programs.critic is not None:
    programs.critic.start(params, setup.critic_params)   # the warmed-up body with a zero head, or critic.init
  state = state_lib.create_train_state(params, programs.tx, programs.state_shardings)
  d.publish(state.params)
  state, before = evaluate(state, 0)
  logging.info("before RL: accuracy %.3f format %.3f", before["accuracy"], before["format_rate"])
  return state, ref, before
