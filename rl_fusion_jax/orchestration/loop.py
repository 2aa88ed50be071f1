"""The synchronous GRPO loop: ``run(config, workdir)``.

Sections:
  1. validate everything that can be validated before anything is compiled or written;
  2. build the deployment (meshes, layouts) and the compiled programs;
  3. resume from the latest checkpoint, or warm up (SFT) and evaluate the starting policy;
  4. the RL loop (metrics and timeline every step, checkpoints every N steps);
  5. final evaluation and summary.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax import models
from rl_fusion_jax.checkpointing import Checkpointer
from rl_fusion_jax.config import ExperimentConfig
from rl_fusion_jax.orchestration import phases
from rl_fusion_jax.orchestration.programs import Programs
from rl_fusion_jax.orchestration.setup import Setup, validate, write_json_atomic
from rl_fusion_jax.timeline import Timeline, timeline_path
from rl_fusion_jax.train import state as state_lib


class _Evaluator:
  """Greedy evaluation wrapped in the phase switch (each round uses fresh sample ids)."""

  def __init__(self, setup: Setup, programs: Programs, timeline: Timeline):
    self.setup, self.programs, self.timeline, self.rounds = setup, programs, timeline, 0

  def __call__(self, state, step: int):
    d = self.programs.deployment
    with self.timeline.phase("evaluate", group=d.rollout_group, step=step):
      state, gen_params, _ = d.to_generation(state)
      out = phases.evaluate(self.setup, self.programs, gen_params, self.rounds)
      state, _ = d.to_training(state)
    self.rounds += 1
    return state, out


def _start(setup: Setup, programs: Programs, ckpt: Checkpointer, evaluate: _Evaluator, writer):
  """Resumes from the latest checkpoint, or warms up and evaluates. -> (state, ref, start, before)."""
  cfg = setup.cfg
  abstract = models.abstract_params(cfg.model.config)
  needs_ref = cfg.algo.needs_reference
  latest = ckpt.latest_step()
  if latest is not None:
    like = jax.eval_shape(lambda p: state_lib.TrainState(jnp.int32(0), p, programs.tx.init(p),
                                                         jnp.int32(0)), abstract)
    state, meta, ref = ckpt.restore(latest, like, programs.state_shardings,
                                    ref_like=abstract if needs_ref else None)
    if meta.get("seed") != cfg.run.seed:
      raise ValueError(f"{ckpt.directory}: checkpoint was written with seed {meta.get('seed')}, "
                       f"config.run.seed is {cfg.run.seed}")
    logging.info("resumed from step %d (%s)", meta["step"], ckpt.directory)
    programs.deployment.publish(state.params)
    return state, ref, int(meta["step"]), meta["eval_before"]
  params = phases.warmup(setup, programs, phases.init_policy(setup, programs))
  ref = jax.tree.map(jnp.copy, params) if needs_ref else None
  state = state_lib.create_train_state(params, programs.tx, programs.state_shardings)
  programs.deployment.publish(state.params)
  state, before = evaluate(state, 0)
  logging.info("before RL: accuracy %.3f format %.3f", before["accuracy"], before["format_rate"])
  writer.write(0, {f"eval/{k}": v for k, v in before.items()})
  return state, ref, 0, before


def run(cfg: ExperimentConfig, workdir: str, *, tensorboard: bool = False) -> dict[str, Any]:
  """Runs (or resumes) the experiment in ``workdir``; returns the summary also written to summary.json."""
  # 1. Validate before anything is compiled or written.
  setup = validate(cfg, jax.device_count())
  if tensorboard and importlib.util.find_spec("tensorboardX") is None:
    raise ValueError("--tensorboard needs tensorboardX: pip install -e '.[tensorboard]'")
  os.makedirs(workdir, exist_ok=True)
  write_json_atomic(os.path.join(workdir, "config.json"), config_lib.as_dict(cfg))
  if hasattr(setup.tokenizer, "to_json"):
    with open(os.path.join(workdir, "tokenizer.json"), "w", encoding="utf-8") as f:
      f.write(setup.tokenizer.to_json())

  # 2. Deployment and programs.
  programs = Programs(setup)
  d = programs.deployment
  logging.info("mode %s: rollout mesh %s, training mesh %s (%s)", d.mode, dict(d.rollout_mesh.shape),
               dict(d.train_mesh.shape), jax.devices()[0].platform)
  timeline = Timeline(timeline_path(workdir))
  for name, ids in d.groups.items():
    timeline.add_group(name, ids)
  ckpt = Checkpointer(workdir, keep=cfg.run.keep_checkpoints)
  writer = metrics_lib.make_writer(workdir, tensorboard)
  evaluate = _Evaluator(setup, programs, timeline)

  # 3. Resume, or warm up and evaluate the starting point.
  state, ref, start, before = _start(setup, programs, ckpt, evaluate, writer)
  ref_resting = d.place_aux(ref) if ref is not None else None

  # 4. The RL loop.
  progress = metrics_lib.Progress(cfg.run.steps, start, cfg.run.progress_every_s)
  for step in range(start, cfg.run.steps):
    state, scalars = phases.rl_step(setup, programs, state, ref_resting, step, timeline)
    if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0:
      state, out = evaluate(state, step + 1)
      scalars |= {f"eval/{k}": v for k, v in out.items()}
    writer.write(step + 1, scalars)
    progress.update(step + 1, scalars)
    if step + 1 == cfg.run.steps or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
      ref_now = d.fetch_aux(ref_resting) if ref_resting is not None else None
      ckpt.save(step + 1, state, {"step": step + 1, "seed": cfg.run.seed, "eval_before": before,
                                  "data_position": (step + 1) * cfg.rollout.num_prompts},
                ref_params=ref_now)
      if ref_now is not None and ref_now is not ref_resting:
        ckpt.wait()   # a fetched device copy of a host-resident reference is released after the save
        d.release_aux(ref_now)

  # 5. Final evaluation and summary.
  state, after = evaluate(state, cfg.run.steps)
  writer.write(cfg.run.steps, {f"eval/{k}": v for k, v in after.items()})
  ckpt.close()
  writer.close()
  summary = {"accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
             "format_rate_before": before["format_rate"], "format_rate_after": after["format_rate"],
             "steps": cfg.run.steps, "mode": d.mode}
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  logging.info("accuracy before RL %.3f -> after RL %.3f", before["accuracy"], after["accuracy"])
  return summary
