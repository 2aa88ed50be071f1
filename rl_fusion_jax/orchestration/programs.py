"""The compiled device programs of a run and the placement they agree on.

Built once per run from a validated Setup: the deployment (meshes, layouts, residency), the generation
engines (sampling, greedy evaluation and, with ``task.eval_samples``, sampled evaluation) on the rollout
mesh, on the training mesh the RL update, the batch assembly and, for PPO with a critic, the critic's
programs (``critic_stage``), and on the aux mesh (the training mesh unless ``fusion.mode=hybrid``) the reference
log-probs and the reward-model score. Every program has explicit shardings and a few fixed shapes, so each
compiles once per shape: the train-side programs once per run at ``rollout.seq_len`` (once per row
width with ``optim.width_buckets``: ``step.train_width``), the packed update once per row bucket (once
per run with ``optim.fixed_row_count``). The host stage that verifies finished samples during
generation (``verify``) is attached to the sampling engine here. The jitted functions come from shared
factories (``shared_programs``): a later run in the same process with equal settings reuses them, compiled.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax

from rl_fusion_jax import models, shared_programs
from rl_fusion_jax.algorithms import batch as algo_batch
from rl_fusion_jax.config import AlgoConfig, ExperimentConfig
from rl_fusion_jax.fusion.deployment import make_deployment
from rl_fusion_jax.models import reward_model
from rl_fusion_jax.orchestration import advantage_stage, aux_stage, critic_stage
from rl_fusion_jax.orchestration.host_stages import VerifyStage
from rl_fusion_jax.orchestration.setup import Setup
from rl_fusion_jax.rollout.engine import Engine, EngineConfig
from rl_fusion_jax.rollout.decode import GenerateSpec
from rl_fusion_jax.rollout.sampling import SamplingParams
from rl_fusion_jax.sharding import mesh as mesh_lib
from rl_fusion_jax.train import packed_step, packing
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.types import Rollout


def assemble_batch(a: AlgoConfig, group_size: int, rollout: Rollout, rewards_b, ref_logp_bt, advantages_b=None):
  """Rollout + rewards (+ reference log-probs; + the host's advantages) -> TrainBatch (the advantage stage,
  algorithms/batch.py)."""
  return algo_batch.train_batch(rollout, rewards_b, ref_logp_bt, advantage=a.advantage,
                                group_size=group_size, kl_coef=a.kl_coef,
                                kl_estimator=a.kl_estimator, kl_mode=a.kl_mode,
                                advantage_hparams=a.advantage_hparams, advantages_b=advantages_b)


def assemble_gae_batch(a: AlgoConfig, rollout: Rollout, rewards_b, ref_logp_bt, values_bt):
  """Rollout + rewards + critic values (+ reference log-probs) -> (TrainBatch, stats, returns_bt)."""
  return algo_batch.train_batch_gae(rollout, rewards_b, ref_logp_bt, values_bt, advantage=a.advantage,
                                    kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, kl_mode=a.kl_mode,
                                    advantage_hparams=a.advantage_hparams)


def packed_gae_batch(a: AlgoConfig, sample_rw, mask_rw, behaviour_logp_rw, ref_logp_rw, rewards_b, values_rw):
  """The GAE advantage stage on packed rows (``algorithms/batch.py``'s ``packed_train_batch_gae``)."""
  return algo_batch.packed_train_batch_gae(sample_rw, mask_rw, behaviour_logp_rw, ref_logp_rw, rewards_b, values_rw,
                                           advantage=a.advantage, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                                           kl_mode=a.kl_mode, advantage_hparams=a.advantage_hparams)


def packed_advantages(a: AlgoConfig, group_size: int, sample_rw, mask_rw, behaviour_logp_rw, ref_logp_rw,
                      rewards_b, advantages_b=None):
  """The advantage stage on packed rows (``algorithms/batch.py``'s ``packed_train_batch``)."""
  return algo_batch.packed_train_batch(sample_rw, mask_rw, behaviour_logp_rw, ref_logp_rw, rewards_b,
                                       advantage=a.advantage, group_size=group_size,
                                       kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, kl_mode=a.kl_mode,
                                       advantage_hparams=a.advantage_hparams, advantages_b=advantages_b)


@dataclasses.dataclass
class Placement:
  """Optimizer, deployment and state shardings: everything a restore needs, built without compiling."""
  tx: optax.GradientTransformation
  deployment: Any
  state_shardings: state_lib.TrainState
  critic: critic_stage.CriticPlacement | None = None   # with algo.advantage='gae'

  @property
  def mesh(self):
    return self.deployment.train_mesh

  @property
  def param_shardings(self):
    return self.deployment.train_param_shardings


def make_placement(cfg: ExperimentConfig, *, per_process: bool = True) -> Placement:
  """``per_process``: sub-meshes take a share of every process's devices (``split_devices``)."""
  abstract = models.abstract_params(cfg.model.config)
  tx = state_lib.make_optimizer(cfg.optim)
  d = make_deployment(cfg, abstract, models.param_logical_axes(cfg.model.config), tx, per_process=per_process)
  critic = critic_stage.make_critic_placement(cfg, d) if cfg.algo.uses_critic else None
  return Placement(tx, d, state_lib.state_shardings(tx, abstract, d.train_param_shardings, d.train_mesh), critic)


class Programs:
  """Deployment + compiled programs for one ExperimentConfig (pass the run's Placement to reuse it)."""

  def __init__(self, setup: Setup, placement: Placement | None = None):
    cfg = setup.cfg
    model_cfg, r = cfg.model.config, cfg.rollout
    self.cfg = cfg
    placement = placement or make_placement(cfg)
    self.tx, self.deployment = placement.tx, placement.deployment
    self.state_shardings = placement.state_shardings
    d = self.deployment
    self.mesh = d.train_mesh
    self.param_shardings = d.train_param_shardings
    sampling = SamplingParams(r.temperature, r.top_k, r.top_p)
    spec = GenerateSpec(model_cfg, sampling, r.max_prompt_len, r.max_new_tokens, setup.tokenizer.eos_id)
    engine_cfg = EngineConfig(spec=spec, num_slots=r.slots, chunk_steps=r.chunk_steps,
                              prefill_rows=r.prefill_rows, group_size=r.group_size, seed=cfg.run.seed,
                              keep_cache=r.keep_cache, narrow_refills=r.narrow_refills)
    self.engine = Engine(engine_cfg, d.rollout_mesh, d.rollout_param_shardings, d.generate_rules)
    greedy = dataclasses.replace(spec, sampling=SamplingParams(0.0))
    self.eval_engine = Engine(dataclasses.replace(engine_cfg, spec=greedy, num_slots=_eval_slots(cfg),
                                                  group_size=1),
                              d.rollout_mesh, d.rollout_param_shardings, d.generate_rules)
    # pass@k: task.eval_samples samples of each held-out problem under the rollout's sampling.
    self.sampled_eval_engine = None
    if cfg.task.eval_samples:
      self.sampled_eval_engine = Engine(
          dataclasses.replace(engine_cfg, num_slots=_eval_slots(cfg), group_size=1),
          d.rollout_mesh, d.rollout_param_shardings, d.generate_rules)
    temperature = sampling.logprob_temperature
    # The micro-batch count follows each batch's shape (width bucket, row bucket): see OptimConfig.
    self.micro = step_lib.MicroBatching.from_optim(cfg.optim, self.mesh.devices.flat[0].platform)
    shared_prompts = r.group_size if cfg.optim.shared_prompts else 0
    self.train_step = step_lib.make_rl_step(model_cfg, cfg.algo, temperature, self.tx, self.micro, self.mesh,
                                            r.max_new_tokens, self.state_shardings, d.train_rules,
                                            max_response_len=r.max_new_tokens, shared_prompts=shared_prompts)
    self.packed_step, self.row_buckets, self.plan_micro, self.stream_pages = None, (), 1, None
    fixed = cfg.optim.fixed_row_count
    if cfg.optim.pack_rows:
      self.packed_step = packed_step.make_packed_rl_step(
          model_cfg, cfg.algo, temperature, self.tx, self.micro, self.mesh, r.max_new_tokens,
          self.state_shardings, pipeline_micro=cfg.optim.pipeline_micro_batches, rules=d.train_rules,
          skip_empty=fixed)
      # With pipeline stages every micro-batch also splits into whole pipeline pieces on every batch shard.
      stages = mesh_lib.num_stages(self.mesh)
      pieces = (cfg.optim.pipeline_micro_batches or stages) if stages > 1 else 1
      # Rows also split over the aux mesh's batch shards (hybrid: the reference and reward model read them there).
      shards = math.lcm(mesh_lib.batch_shards(self.mesh) * pieces, mesh_lib.batch_shards(d.aux_mesh))
      self._row_multiple = packing.row_multiple(shards, cfg.optim.micro_batches)
      self.row_buckets = packing.row_buckets(r.batch_size, self._row_multiple, per_doubling=2)
      if fixed:   # one row count (the largest bucket holds any batch); rows laid out for the update's skips
        self.row_buckets = self.row_buckets[-1:]
        self.plan_micro = self.micro.num_micro(self.row_buckets[0], r.seq_len, mesh_lib.batch_shards(self.mesh))
        # The streams cross as pages into one buffer: the rows are rebuilt by one program at every length.
        # Under StaleSync in hybrid the reference log-probs cross in the stream too (the queue's ref_logp).
        ref_in_stream = d.mode == "hybrid" and cfg.algo.needs_reference and cfg.stalesync.enabled
        self.stream_pages = packed_step.StreamPages(self.mesh, self.row_buckets[0], r.seq_len,
                                                    packing.value_bytes(model_cfg.vocab_size),
                                                    ref_logp=ref_in_stream)
    # Reference and reward models run on the deployment's aux mesh (the training mesh unless hybrid).
    self.aux_mesh = d.aux_mesh
    self.ref_param_shardings = (self.param_shardings if d.aux_mesh is self.mesh else
                                d.aux_param_shardings(models.abstract_params(model_cfg),
                                                      models.param_logical_axes(model_cfg)))
    self.ref_logprobs = step_lib.make_logprob_fn(model_cfg, temperature, d.aux_mesh, self.ref_param_shardings,
                                                 d.train_rules)
    # The packed update takes its rows straight from the host's samples (``packed_step.place_rows``): the
    # reference log-probs, the reward model's scores and the advantage stage run on the packed rows (on the
    # aux mesh in hybrid: the rows are copied there device to device), a critic's values and GAE too; no
    # padded batch is assembled.
    self.packed_inputs = self.packed_step is not None
    # Per-sample advantages computed on the host, a group at a time (``advantage_stage``); the update's
    # programs take them as given.
    self.host_advantages = advantage_stage.on_host(cfg.algo)
    # In hybrid the reference (and a reward model) score finished samples on their own devices while the
    # actor's generate.
    hybrid = d.mode == "hybrid"
    stage = hybrid and cfg.algo.needs_reference
    if self.packed_inputs or stage:
      self.packed_ref_logprobs = packed_step.make_packed_logprob_fn(
          model_cfg, temperature, d.aux_mesh, self.ref_param_shardings, d.train_rules,
          skip_micro=self.plan_micro if d.aux_mesh is self.mesh else 1)
    if self.packed_inputs:
      self.row_layout = packed_step.make_row_layout(self.mesh)
      b2 = mesh_lib.batch_sharding(self.mesh, 2)
      self.packed_advantages = shared_programs.jit(packed_advantages, cfg.algo, r.group_size,
                                                   out_shardings=(b2, mesh_lib.replicated(self.mesh)))
      self.packed_gae = shared_programs.jit(packed_gae_batch, cfg.algo,
                                            out_shardings=(b2, mesh_lib.replicated(self.mesh), b2))
    self._several_updates(cfg, model_cfg, temperature, d)
    self.critic = None
    if cfg.algo.uses_critic:
      self.assemble = shared_programs.jit(assemble_gae_batch, cfg.algo,
                                          out_shardings=(step_lib.batch_shardings(self.mesh),
                                                         mesh_lib.replicated(self.mesh),
                                                         mesh_lib.batch_sharding(self.mesh, 2)))
      self.critic = critic_stage.CriticStage(cfg, d, placement.critic, self.micro)
    else:
      self.assemble = shared_programs.jit(assemble_batch, cfg.algo, r.group_size,
                                          out_shardings=(step_lib.batch_shardings(self.mesh),
                                                         mesh_lib.replicated(self.mesh)))
    self.reward_model = self._reward_model(setup)
    self.aux_stage = (aux_stage.AuxStage(cfg, self, d.aux_group, 2 * (r.slots + r.batch_size), reference=stage,
                                         reward=hybrid and self.reward_model is not None,
                                         engine_shards=mesh_lib.batch_shards(d.rollout_mesh))
                      if stage or (hybrid and self.reward_model is not None) else None)
    self.verify = VerifyStage(setup.train_task, setup.tokenizer, r.group_size, cfg.task.verify_workers)
    self.engine.on_finished = self.verify.submit
    if self.aux_stage is not None:
      stages = (self.verify.submit, self.aux_stage.submit)
      self.engine.on_finished = lambda *finished: [f(*finished) for f in stages]

  def _several_updates(self, cfg: ExperimentConfig, model_cfg, temperature: float, d) -> None:
    """With ``algo.ppo_epochs`` / ``algo.mini_batches`` (several updates per batch): the update variants
    that take the proximal log-probs and leave the policy version alone, the policy's log-prob program
    (the proximal policy), the mini-batch selection and the version bump after the last update."""
    a, r = cfg.algo, cfg.rollout
    self.several_updates = a.updates_per_batch > 1
    if not self.several_updates:
      return
    shards, rows = mesh_lib.batch_shards(self.mesh), r.batch_size // a.mini_batches
    if rows % shards:
      raise ValueError(f"config.algo.mini_batches={a.mini_batches}: mini-batches of {rows} samples do not "
                       f"split over the {shards} batch shards (data x fsdp)")
    self.policy_logprobs = step_lib.make_logprob_fn(model_cfg, temperature, self.mesh, self.param_shardings,
                                                    d.train_rules)
    self.bump_version = shared_programs.jit(step_lib.bump_policy_version, donate_argnums=(0,),
                                            out_shardings=self.state_shardings)
    if self.packed_step is None:
      self.train_step_prox = step_lib.make_rl_step(model_cfg, a, temperature, self.tx, self.micro, self.mesh,
                                                   r.max_new_tokens, self.state_shardings, d.train_rules,
                                                   proximal=True, max_response_len=r.max_new_tokens,
                                                   shared_prompts=r.group_size if cfg.optim.shared_prompts else 0)
      self.take_rows = shared_programs.jit(_take_rows,
                                           out_shardings=step_lib.batch_shardings(self.mesh, proximal=True))
    else:
      fixed = cfg.optim.fixed_row_count
      self.packed_step_prox = packed_step.make_packed_rl_step(
          model_cfg, a, temperature, self.tx, self.micro, self.mesh, r.max_new_tokens, self.state_shardings,
          pipeline_micro=cfg.optim.pipeline_micro_batches, rules=d.train_rules, proximal=True, skip_empty=fixed)
      self.policy_packed_logprobs = packed_step.make_packed_logprob_fn(
          model_cfg, temperature, self.mesh, self.param_shardings, d.train_rules, skip_micro=self.plan_micro)
      self.mini_batch_rows = packed_step.make_mini_batch_rows(self.mesh)
      self.mini_row_buckets = packing.row_buckets(rows, self._row_multiple, per_doubling=2)
      self.mini_plan_micro = 1
      if fixed:
        self.mini_row_buckets = self.mini_row_buckets[-1:]
        self.mini_plan_micro = self.micro.num_micro(self.mini_row_buckets[0], r.seq_len, shards)

  def _reward_model(self, setup: Setup):
    """(score fn, resting params) of the learned reward model on the aux mesh, or None. The host params
    go straight to where they rest (``place_aux``: host memory in ``full``, never first on the devices)."""
    if setup.reward_model is None:
      return None
    rm_cfg, host_params = setup.reward_model
    d = self.deployment
    shardings = d.aux_param_shardings(reward_model.abstract_reward_params(rm_cfg),
                                      reward_model.reward_logical_axes(rm_cfg))
    b1, b2 = mesh_lib.batch_sharding(d.aux_mesh, 1), mesh_lib.batch_sharding(d.aux_mesh, 2)
    fn = shared_programs.jit(reward_model.score, rm_cfg, in_shardings=(shardings, b2, b1), out_shardings=b1)
    rep = mesh_lib.replicated(d.aux_mesh)
    self.packed_reward_score = shared_programs.jit(reward_model.packed_score, rm_cfg,
                                                   in_shardings=(shardings, b2, b2, b2, rep, rep, rep),
                                                   out_shardings=rep)
    return fn, d.place_aux(host_params, shardings)


def _take_rows(batch, idx):
  return jax.tree.map(lambda x: x[idx], batch)


def _eval_slots(cfg: ExperimentConfig) -> int:
  return cfg.task.eval_problems
