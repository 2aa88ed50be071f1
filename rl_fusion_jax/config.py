"""Typed, frozen configuration for every subsystem, and the one conversion from ml_collections.

Library code only ever sees these dataclasses (validated in ``__post_init__``); the experiment binaries
convert the user's ``ConfigDict`` once with :func:`experiment_from_dict`, which rejects unknown keys by their
full path (``config.rollout.temprature``) before anything is compiled or written. The shipped config files
start from :func:`default_config_dict` (every field at its dataclass default) and set only what they change,
so every field can be overridden from the command line and no default is restated by hand.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from rl_fusion_jax import model_config
from rl_fusion_jax.errors import ConfigError
from rl_fusion_jax.model_config import RUNTIME_FIELDS, ModelConfig


def _require(cond: bool, field: str, msg: str) -> None:
  if not cond:
    raise ConfigError(f"config.{field}: {msg}")


def closest(name: str, known) -> str:
  """' (did you mean X?)' for the closest of ``known`` to a mistyped ``name``, or ''."""
  match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
  return f" (did you mean {match[0]!r}?)" if match else ""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes over all devices; -1 on one axis means 'whatever is left'.

  ``stage`` > 1 is pipeline parallelism in the update (``sharding/pipeline.py``): each stage holds
  num_layers / stage consecutive layers, and a batch splits over data x fsdp only (every stage sees it).
  """
  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  stage: int = 1
  # Virtual devices when running on CPU (0: one per core). Read by the binaries before JAX starts.
  cpu_devices: int = 0

  def _sizes(self) -> dict[str, int]:
    return {"stage": self.stage, "data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}

  def __post_init__(self):
    _require(self.cpu_devices >= 0, "mesh.cpu_devices", f"must be >= 0, got {self.cpu_devices}")
    sizes = self._sizes()
    for name, size in sizes.items():
      _require(size == -1 or size >= 1, f"mesh.{name}", f"must be -1 or >= 1, got {size}")
    _require(list(sizes.values()).count(-1) <= 1, "mesh", "at most one axis may be -1")

  def resolve(self, num_devices: int) -> dict[str, int]:
    """Axis name -> size for ``num_devices`` devices; raises if the sizes do not divide them."""
    sizes = self._sizes()
    fixed = 1
    for size in sizes.values():
      fixed *= size if size > 0 else 1
    if num_devices % fixed:
      raise ConfigError(f"config.mesh: axis sizes {sizes} (product {fixed}) do not divide the "
                       f"{num_devices} devices")
    for name, size in sizes.items():
      if size == -1:
        sizes[name] = num_devices // fixed
    product = math.prod(sizes.values())
    if product != num_devices:
      raise ConfigError(f"config.mesh: axis sizes {sizes} use {product} devices but {num_devices} "
                       "are present; set one axis to -1 or make the product match")
    return sizes


def pipeline_problem(model: ModelConfig, stages: int, pieces: int) -> str | None:
  """Why ``model`` cannot run as a ``stages``-stage pipeline of ``pieces`` micro-batches
  (``sharding/pipeline.py``), naming the fields; None when it can."""
  if model.num_layers % stages:
    return (f"model.num_layers={model.num_layers} does not divide over mesh.stage={stages} pipeline stages "
            "(each stage holds num_layers / stage consecutive layers)")
  if len(set(model.layer_kinds)) > 1:
    return (f"model.mlp_only_layers={model.mlp_only_layers} / model.decoder_sparse_step="
            f"{model.decoder_sparse_step} mix dense and sparse layers (two stacked trees); pipeline "
            f"parallelism (mesh.stage={stages}) splits one stack: use mesh.stage=1")
  if pieces < stages:
    return (f"optim.pipeline_micro_batches={pieces} is fewer than mesh.stage={stages}: each stage needs a "
            "micro-batch of its own")
  return None


@dataclasses.dataclass(frozen=True)
class FusionConfig:
  """How training and generation share devices (RL Fusion) and how a phase switch moves state.

  mode: ``colocated`` (actor training and generation on all devices, parameters resharded between a
  training and a generation layout), ``full`` (colocated, plus reference and reward models on the same
  devices, each on device only while it is used), ``separated`` (a rollout sub-mesh and a training
  sub-mesh; new weights are sent to the rollout side after each update — the baseline), ``hybrid`` (the
  actor colocated on all but ``aux_devices`` devices; the reference and reward models on those).
  """
  mode: str = "colocated"
  rollout_device_fraction: float = 0.5    # separated: share of the devices given to generation
  aux_devices: int = 1              # hybrid: devices of the reference / reward-model group
  bucket_bytes: int = 64 << 20      # reshard / offload bucket size
  offload_optimizer: bool = True    # optimizer state to pinned_host while generating
  # Live-memory sampling inside the parameter moves (the */peak_*, transient_* and *_kind_bytes_* metrics
  # of switch/*, sync/*, aux/*, critic/*park/*): on the first move of each kind and every `memory_every`-th
  # one after; 0 (default): never, so the loop pays nothing. Each sample walks every live array (about
  # 0.01 s a switch for tiny-grpo on 2 CPU cores); tests and memory benchmarks turn it on.
  memory_every: int = 0
  # Overrides of single entries of the rule tables, e.g. (("embed", "fsdp"),) or (("mlp", None),).
  train_rules: tuple = ()
  generate_rules: tuple = ()

  def __post_init__(self):
    _require(self.mode in ("colocated", "separated", "full", "hybrid"), "fusion.mode",
             f"must be 'colocated', 'separated', 'full' or 'hybrid', got {self.mode!r}")
    _require(isinstance(self.aux_devices, int) and self.aux_devices >= 1, "fusion.aux_devices",
             f"must be an int >= 1, got {self.aux_devices!r}")
    _require(0 < self.rollout_device_fraction < 1, "fusion.rollout_device_fraction",
             f"must be in (0, 1), got {self.rollout_device_fraction}")
    _require(isinstance(self.bucket_bytes, int) and self.bucket_bytes > 0, "fusion.bucket_bytes",
             f"must be a positive int, got {self.bucket_bytes!r}")
    _require(isinstance(self.memory_every, int) and not isinstance(self.memory_every, bool)
             and self.memory_every >= 0, "fusion.memory_every",
             f"must be an int >= 0, got {self.memory_every!r}")
    for name in ("train_rules", "generate_rules"):
      for rule in getattr(self, name):
        _require(isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str),
                 f"fusion.{name}", f"each rule is (logical_axis, mesh_axes), got {rule!r}")

  def split(self, num_devices: int) -> tuple[int, int]:
    """(rollout devices, training devices) in separated mode; raises if a side would be empty."""
    rollout = int(round(num_devices * self.rollout_device_fraction))
    if not 0 < rollout < num_devices:
      raise ConfigError(f"config.fusion.rollout_device_fraction={self.rollout_device_fraction} leaves a "
                        f"side empty with {num_devices} devices ({rollout} rollout, {num_devices - rollout} "
                        "train)")
    return rollout, num_devices - rollout

  def aux_split(self, num_devices: int) -> int:
    """Devices of the aux group in hybrid mode; raises if the actor would have none."""
    if not self.aux_devices < num_devices:
      raise ConfigError(f"config.fusion.aux_devices={self.aux_devices} leaves no device for the actor "
                        f"with {num_devices} devices")
    return self.aux_devices


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where the policy comes from: a Hugging Face folder, or random init of ``config``."""
  config: ModelConfig
  hf_path: str = ""       # when set, load_hf(hf_path) replaces random init (config must then match it)
  init_std: float = 0.02

  def __post_init__(self):
    _require(self.init_std > 0, "model.init_std", f"must be > 0, got {self.init_std}")


PROMPT_FORMATS = ("plain", "chat")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """The verifiable task and its tokenizer."""
  name: str = "arithmetic"
  kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  tokenizer: str = "char"     # 'char', a path to tokenizer.json / a folder holding one, '' = model.hf_path
  eval_seed: int = 10_000     # the held-out problems come from a task built with this seed
  eval_problems: int = 128
  # Sampled evaluation: eval_samples responses per held-out problem at the rollout's temperature (top_k,
  # top_p), scored as pass@1 and pass@{pass_k} with the unbiased estimator (rewards/base.py::pass_at_k);
  # 0 turns it off (greedy accuracy only).
  eval_samples: int = 0
  pass_k: int = 1
  # The greedy responses to the first eval_examples held-out problems (all of them when there are fewer),
  # written at every evaluation to WORKDIR/eval_examples.jsonl (step, prompt, response, answer, correct,
  # reward); 0 writes none.
  eval_examples: int = 8
  # A learned reward model (rl_fusion_jax.models.reward_model checkpoint); its score, times the weight,
  # is added to the verifier's reward. Accuracy metrics always come from the verifier.
  reward_model: str = ""
  reward_model_weight: float = 1.0
  # Threads that decode and verify finished samples while generation goes on (0: all in the train phase).
  verify_workers: int = 1
  # 'plain': bos (if the tokenizer has one) + the task's prompt text. 'chat': the prompt text as one user
  # message (after a system message when system_prompt is set) rendered by the tokenizer's chat template,
  # with the generation prompt (rl_fusion_jax/chat.py); generation then stops where an assistant turn ends.
  prompt_format: str = "plain"
  system_prompt: str = ""

  def __post_init__(self):
    _require(isinstance(self.name, str) and bool(self.name), "task.name",
             f"must be a task name, got {self.name!r}")
    _require(self.prompt_format in PROMPT_FORMATS, "task.prompt_format",
             f"must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
    _require(self.prompt_format != "chat" or self.tokenizer != "char", "task.prompt_format",
             "'chat' renders prompts with a Hugging Face chat template, and task.tokenizer='char' has none; "
             "set task.tokenizer to a checkpoint folder (or '' for model.hf_path)")
    _require(isinstance(self.system_prompt, str)
             and (self.prompt_format == "chat" or not self.system_prompt), "task.system_prompt",
             f"must be a str, used only with task.prompt_format='chat', got {self.system_prompt!r:.60} "
             f"with prompt_format={self.prompt_format!r}")
    _require(self.eval_problems >= 1, "task.eval_problems", f"must be >= 1, got {self.eval_problems}")
    _require(isinstance(self.eval_samples, int) and self.eval_samples >= 0, "task.eval_samples",
             f"must be an int >= 0 (0: no sampled evaluation), got {self.eval_samples!r}")
    _require(isinstance(self.pass_k, int) and self.pass_k >= 1, "task.pass_k",
             f"must be an int >= 1, got {self.pass_k!r}")
    _require(self.eval_samples == 0 or self.pass_k <= self.eval_samples, "task.pass_k",
             f"pass@{self.pass_k} needs at least {self.pass_k} samples per problem, but task.eval_samples "
             f"= {self.eval_samples}")
    _require(isinstance(self.eval_examples, int) and not isinstance(self.eval_examples, bool)
             and self.eval_examples >= 0, "task.eval_examples",
             f"must be an int >= 0 (0: none written), got {self.eval_examples!r}")
    _require(isinstance(self.verify_workers, int) and self.verify_workers >= 0, "task.verify_workers",
             f"must be an int >= 0, got {self.verify_workers!r}")
    _require(math.isfinite(self.reward_model_weight), "task.reward_model_weight",
             f"must be finite, got {self.reward_model_weight}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Generation: prompts per step, samples per prompt (the GRPO group) and sampling."""
  num_prompts: int = 16
  group_size: int = 8
  max_prompt_len: int = 16
  max_new_tokens: int = 32
  temperature: float = 1.0
  top_k: int = 0            # 0 disables
  top_p: float = 1.0        # 1.0 disables
  num_slots: int = 0        # engine slots sharing the KV cache (0: one per sample of a step)
  chunk_steps: int = 16     # decode steps per engine call (slots refill on the device within one)
  prefill_rows: int = 0     # rows a refill admits at once (0: a quarter of the slots)
  # Samples carried into the next rollout phase keep their KV cache (computed under the weights they
  # were sampled with) instead of having their prefix recomputed; the cache is then held through training.
  keep_cache: bool = False
  # Refills inside a decode chunk prefill at the narrowest width that holds their prompts instead of the
  # prompt width: less prefill for short prompts, one more forward per width to compile in the chunk
  # (rollout/slots.refill_widths).
  narrow_refills: bool = False
  # Benchmarks only: > 0 forces each training sample's response length (EOS ignored) to a clipped
  # log-normal draw with this median and sigma, seeded by (run.seed, sample id); 0 disables.
  forced_length_median: int = 0
  forced_length_sigma: float = 0.8

  def __post_init__(self):
    _require(self.num_slots >= 0, "rollout.num_slots", f"must be >= 0, got {self.num_slots}")
    _require(self.prefill_rows >= 0, "rollout.prefill_rows", f"must be >= 0, got {self.prefill_rows}")
    _require(self.num_slots % self.group_size == 0, "rollout.num_slots",
             f"{self.num_slots} is not a multiple of group_size {self.group_size}")
    for name in ("num_prompts", "group_size", "max_prompt_len", "max_new_tokens", "chunk_steps"):
      _require(getattr(self, name) >= 1, f"rollout.{name}", f"must be >= 1, got {getattr(self, name)}")
    _require(self.temperature >= 0, "rollout.temperature", f"must be >= 0, got {self.temperature}")
    _require(self.top_k >= 0, "rollout.top_k", f"must be >= 0, got {self.top_k}")
    _require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
    for name in ("keep_cache", "narrow_refills"):
      _require(isinstance(getattr(self, name), bool), f"rollout.{name}", f"must be a bool, got {getattr(self, name)!r}")
    median, sigma = self.forced_length_median, self.forced_length_sigma
    _require(isinstance(median, int) and not isinstance(median, bool) and median >= 0,
             "rollout.forced_length_median", f"must be an int >= 0 (0: off), got {median!r}")
    _require(isinstance(sigma, (int, float)) and not isinstance(sigma, bool) and math.isfinite(sigma)
             and sigma >= 0, "rollout.forced_length_sigma", f"must be a finite number >= 0, got {sigma!r}")

  @property
  def batch_size(self) -> int:
    return self.num_prompts * self.group_size

  @property
  def seq_len(self) -> int:
    return self.max_prompt_len + self.max_new_tokens

  @property
  def slots(self) -> int:
    return self.num_slots or self.batch_size


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """The RL objective; names resolve through rl_fusion_jax.algorithms.registry."""
  advantage: str = "grpo"
  policy_loss: str = "ppo_clip"
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float | None = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_mode: str = "loss"          # 'loss': a loss term; 'reward': subtracted from the sequence reward
  entropy_coef: float = 0.0
  aggregation: str = "token-mean"
  is_cap: float = 5.0            # truncation of behaviour importance weights (decoupled_ppo, tis_*)
  # GAE (advantage='gae': PPO with the learned critic of config.critic): discount and trace decay.
  gamma: float = 1.0
  lam: float = 1.0
  # DAPO's soft overlong punishment: responses longer than max_new_tokens - overlong_buffer lose up to
  # overlong_factor of reward, linearly over the buffer (algorithms/dapo.py); 0 turns it off.
  overlong_buffer: int = 0
  overlong_factor: float = 1.0
  # DAPO's dynamic sampling: groups whose rewards are all equal are dropped and the step draws more
  # prompts (at most dynamic_sampling_rounds extra rounds of num_prompts) until num_prompts informative
  # groups fill the batch; a batch still short is topped up with dropped groups and counted.
  dynamic_sampling: bool = False
  dynamic_sampling_rounds: int = 4
  # Several optimizer updates per rollout batch (PPO epochs, verl's ppo_epochs / ppo_mini_batch_size, TRL's
  # num_iterations): the batch's log-probs under the parameters before the first update are recorded as
  # the proximal policy; each of ppo_epochs epochs shuffles the samples (seeded by run.seed and the step)
  # and takes mini_batches updates on equal shares. The clip acts against the proximal policy, the
  # behaviour weights against the sampling log-probs. 1 and 1: one update per batch, as without them.
  ppo_epochs: int = 1
  mini_batches: int = 1
  # A fork's algorithm in one file: plugins (comma-separated modules or .py paths) are imported before the
  # names above are checked, so what they register can be named; loss_kwargs / advantage_kwargs
  # ("name=value,...") set the registered loss's / estimator's hyperparameters, validated by its
  # dataclass (algorithms/registry.py). A hyperparameter named like a field above takes that field's value
  # unless set here.
  plugins: str = ""
  loss_kwargs: str = ""
  advantage_kwargs: str = ""

  def __post_init__(self):
    from rl_fusion_jax.algorithms import registry  # deferred: registry imports jax
    try:
      registry.load_plugins(self.plugins)
    except ValueError as e:
      raise ConfigError(f"config.{e}") from e
    known_advantages = {**registry.ADVANTAGE_ESTIMATORS, **registry.TOKEN_ADVANTAGE_ESTIMATORS}
    for field, known in (("advantage", known_advantages),
                         ("policy_loss", registry.POLICY_LOSSES),
                         ("kl_estimator", registry.KL_ESTIMATORS),
                         ("aggregation", registry.AGGREGATIONS)):
      name = getattr(self, field)
      _require(name in known, f"algo.{field}", f"unknown name {name!r}; known: {sorted(known)}")
    _require(self.kl_mode in ("loss", "reward"), "algo.kl_mode",
             f"must be 'loss' or 'reward', got {self.kl_mode!r}")
    _require(self.kl_coef >= 0, "algo.kl_coef", f"must be >= 0, got {self.kl_coef}")
    _require(0 <= self.clip_low < 1, "algo.clip_low", f"must be in [0, 1), got {self.clip_low}")
    _require(self.clip_high >= 0, "algo.clip_high", f"must be >= 0, got {self.clip_high}")
    _require(self.dual_clip is None or self.dual_clip > 1, "algo.dual_clip",
             f"must be None or > 1, got {self.dual_clip}")
    _require(self.is_cap >= 1, "algo.is_cap", f"must be >= 1 (inf disables truncation), got {self.is_cap}")
    _require(self.dual_clip is None or not self.policy_loss.startswith("tis_"), "algo.dual_clip",
             f"the truncated-IS loss {self.policy_loss!r} has no PPO clip to cap; set dual_clip=None")
    for name in ("gamma", "lam"):
      value = getattr(self, name)
      _require(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1,
               f"algo.{name}", f"must be a number in [0, 1], got {value!r}")
    _require(isinstance(self.overlong_buffer, int) and self.overlong_buffer >= 0, "algo.overlong_buffer",
             f"must be an int >= 0 (0: off), got {self.overlong_buffer!r}")
    _require(math.isfinite(self.overlong_factor) and self.overlong_factor >= 0, "algo.overlong_factor",
             f"must be a finite number >= 0, got {self.overlong_factor!r}")
    _require(isinstance(self.dynamic_sampling_rounds, int) and self.dynamic_sampling_rounds >= 0,
             "algo.dynamic_sampling_rounds", f"must be an int >= 0, got {self.dynamic_sampling_rounds!r}")
    for name in ("ppo_epochs", "mini_batches"):
      value = getattr(self, name)
      _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"algo.{name}",
               f"must be an int >= 1, got {value!r}")
    try:
      self.loss_hparams, self.advantage_hparams  # pylint: disable=pointless-statement
    except ValueError as e:
      raise ConfigError(f"config.{e}") from e

  @property
  def loss_hparams(self) -> dict:
    """The policy loss's hyperparameters (its registered dataclass's fields) as keyword arguments."""
    from rl_fusion_jax.algorithms import registry
    return registry.hparams_dict(registry.hyperparameters(
        registry.POLICY_LOSS_PARAMS, "policy loss", self.policy_loss, dataclasses.asdict(self),
        self.loss_kwargs, "algo.loss_kwargs"))

  @property
  def advantage_hparams(self) -> dict:
    """The advantage estimator's hyperparameters as keyword arguments."""
    from rl_fusion_jax.algorithms import registry
    return registry.hparams_dict(registry.hyperparameters(
        registry.ADVANTAGE_PARAMS, "advantage estimator", self.advantage, dataclasses.asdict(self),
        self.advantage_kwargs, "algo.advantage_kwargs"))

  @property
  def updates_per_batch(self) -> int:
    """Optimizer updates per rollout batch: ppo_epochs x mini_batches."""
    return self.ppo_epochs * self.mini_batches

  @property
  def uses_critic(self) -> bool:
    """A token-level estimator (GAE) with a learned value model (config.critic)."""
    from rl_fusion_jax.algorithms import registry
    return self.advantage in registry.TOKEN_ADVANTAGE_ESTIMATORS

  @property
  def group_relative(self) -> bool:
    """The advantage compares the samples of a group (GRPO, Dr. GRPO, RLOO): group_size must be >= 2."""
    return not self.uses_critic

  @property
  def needs_reference(self) -> bool:
    return self.kl_coef > 0


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  """The PPO critic, used when ``algo.advantage`` is token-level ('gae'): a value model (the policy's
  decoder body with a per-token scalar head, transformers' ``*ForTokenClassification`` format;
  models/value_model.py) trained by regression on the GAE returns, one update per RL step.

  init: '' starts from the policy after the warm-up (its body, a zero head: every value 0); else a folder
  written by ``value_model.save_value_model`` whose shapes must match the policy's config.
  value_clip: PPO's value clipping around the rollout-time values (0 disables). The optimizer is
  ``config.optim``'s AdamW at ``learning_rate``. Residency follows ``fusion.mode``: its optimizer state
  leaves the devices while generating (with ``fusion.offload_optimizer``), and in ``full`` mode its
  weights too, so they are off the devices while generating (they come back for the train phase).
  """
  learning_rate: float = 1e-4
  value_clip: float = 0.2
  init: str = ""

  def __post_init__(self):
    _require(self.learning_rate > 0, "critic.learning_rate", f"must be > 0, got {self.learning_rate}")
    _require(math.isfinite(self.value_clip) and self.value_clip >= 0, "critic.value_clip",
             f"must be a finite number >= 0 (0: no clipping), got {self.value_clip!r}")
    _require(isinstance(self.init, str), "critic.init", f"must be '' or a folder path, got {self.init!r}")


@dataclasses.dataclass(frozen=True)
class StaleSyncConfig:
  """Bounded-staleness rollout (StaleSync). ``enabled=False`` runs the synchronous loop.

  max_staleness (s): a group is trained on only while ``learner_version - min(token versions) <= s``.
  train_fraction (f): the engine keeps ``ceil(num_prompts / f)`` groups outstanding, and a rollout phase
  ends once ``num_prompts`` of them (a fraction f) finished and every group that would otherwise exceed
  s has finished; the rest stay in flight into the next phase. s = 0 needs f = 1, and then the schedule
  is the synchronous algorithm (tested equal to the synchronous loop).
  """
  enabled: bool = False
  max_staleness: int = 0
  train_fraction: float = 1.0

  def __post_init__(self):
    _require(isinstance(self.max_staleness, int) and self.max_staleness >= 0, "stalesync.max_staleness",
             f"must be an int >= 0, got {self.max_staleness!r}")
    _require(0 < self.train_fraction <= 1, "stalesync.train_fraction",
             f"must be in (0, 1], got {self.train_fraction}")
    _require(self.max_staleness > 0 or self.train_fraction == 1, "stalesync.train_fraction",
             f"must be 1 when max_staleness is 0 (groups left over would be stale), "
             f"got {self.train_fraction}")

  def pool_groups(self, num_prompts: int) -> int:
    """Groups the engine keeps outstanding (queued, in flight, or finished and not yet trained)."""
    return math.ceil(num_prompts / self.train_fraction - 1e-9)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with global-norm clipping, linear warm-up, and micro-batch gradient accumulation.

  How the RL update splits its batch into micro-batches (``train/step.py::MicroBatching``):
  ``micro_batches > 1`` fixes the count and wins; otherwise each micro-batch holds at most
  ``tokens_per_micro_batch`` token positions per device (rows per batch shard * width), the count rounded
  to a divisor that keeps every micro-batch evenly split over the batch shards. 0 or None picks a budget
  per backend (``step.DEFAULT_TOKENS_PER_MICRO_BATCH``: cache-sized on CPU, large on GPU / TPU).
  """
  learning_rate: float = 1e-5
  b1: float = 0.9
  b2: float = 0.999
  weight_decay: float = 0.0
  grad_clip: float = 1.0           # 0 disables
  warmup_steps: int = 0
  micro_batches: int = 1
  tokens_per_micro_batch: int | None = 0
  # The RL update on packed rows (several samples per row, train/packing.py): same loss and gradients,
  # no padding positions; row counts are bucketed, one compile per bucket used.
  pack_rows: bool = False
  # The padded update's row width. False: rollout.seq_len on every step, so the update, the reference and
  # the reward model each compile once per run (no compile mid-run). True: the batch's longest sample
  # rounded up to a width bucket (train/step.py::train_width): less compute on batches of short samples,
  # and a compile each time a run first meets a width (seconds each, mid-run). The packed update
  # (pack_rows) drops padding positions either way.
  width_buckets: bool = False
  # The padded update runs a group's shared prompt once: each group of rollout.group_size rows becomes one
  # sequence (its first row, then the other rows' responses, which attend to that row's prompt), so the
  # decoder runs T - 1 + (group_size - 1) * (max_new_tokens - 1) positions a group instead of
  # group_size * (T - 1); log-probs and gradients equal the unshared update's up to float32 rounding
  # (train/logprobs.py::shared_prompt_logprobs). Dense policies, the padded update, algo.mini_batches=1.
  shared_prompts: bool = False
  # The packed update at one row count per run (the largest row bucket, which holds any batch) instead of
  # a row bucket per batch: the update and the reference forward compile once, and their micro-batches
  # of padding rows only are skipped at run time, so their compute follows the rows used, rounded up to
  # whole micro-batches (only with several micro-batches: tokens_per_micro_batch or micro_batches). A
  # critic's and a reward model's forward run on every row. Needs pack_rows; not with mesh.stage > 1.
  fixed_row_count: bool = False
  # With mesh.stage > 1: each micro-batch above runs through the layer pipeline in this many pieces
  # (GPipe, sharding/pipeline.py; idle share of the stages (stage - 1) / (pieces + stage - 1)). 0: mesh.stage.
  pipeline_micro_batches: int = 0

  def __post_init__(self):
    _require(self.learning_rate > 0, "optim.learning_rate", f"must be > 0, got {self.learning_rate}")
    _require(self.grad_clip >= 0, "optim.grad_clip", f"must be >= 0, got {self.grad_clip}")
    _require(self.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
    _require(self.micro_batches >= 1, "optim.micro_batches", f"must be >= 1, got {self.micro_batches}")
    tokens = self.tokens_per_micro_batch
    _require(tokens is None or (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0),
             "optim.tokens_per_micro_batch",
             f"must be None or an int >= 0, got {tokens!r}")
    pieces = self.pipeline_micro_batches
    _require(isinstance(pieces, int) and not isinstance(pieces, bool) and pieces >= 0,
             "optim.pipeline_micro_batches", f"must be an int >= 0 (0: mesh.stage), got {pieces!r}")


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
  """Supervised warm-up on the task's reference completions before RL (0 steps disables it)."""
  steps: int = 0
  batch_size: int = 64
  learning_rate: float = 1e-3
  checkpoint_every: int = 0       # warm-up checkpoints (a resume continues the warm-up); 0: none
  # Seed of the starting policy: its random init and the warm-up's problem stream. -1: run.seed. A fixed
  # value gives every run.seed the same warmed-up policy (RL seeds from one SFT checkpoint).
  seed: int = -1

  def __post_init__(self):
    _require(self.steps >= 0, "warmup.steps", f"must be >= 0, got {self.steps}")
    _require(isinstance(self.seed, int) and self.seed >= -1, "warmup.seed",
             f"must be an int >= 0, or -1 (run.seed), got {self.seed!r}")
    _require(self.checkpoint_every >= 0, "warmup.checkpoint_every",
             f"must be >= 0, got {self.checkpoint_every}")
    _require(self.batch_size >= 1, "warmup.batch_size", f"must be >= 1, got {self.batch_size}")
    _require(self.learning_rate > 0, "warmup.learning_rate", f"must be > 0, got {self.learning_rate}")


NONFINITE_POLICIES = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Loop length, seeds, logging, checkpoint cadence and the divergence guard.

  on_nonfinite: what happens when an update's loss, gradients or new parameters are not finite (the
  update is never applied): ``stop`` raises naming the step and the quantity; ``skip`` drops the update,
  counts it in the metrics and stops only after ``max_consecutive_skips`` non-finite updates in a row.
  """
  steps: int = 100
  seed: int = 0
  checkpoint_every: int = 50      # 0: only at the end
  keep_checkpoints: int = 2
  progress_every_s: float = 5.0
  eval_every: int = 0             # 0: only before and after RL
  on_nonfinite: str = "stop"
  max_consecutive_skips: int = 3

  def __post_init__(self):
    _require(self.steps >= 0, "run.steps", f"must be >= 0, got {self.steps}")
    _require(self.checkpoint_every >= 0, "run.checkpoint_every", f"must be >= 0, got {self.checkpoint_every}")
    _require(self.keep_checkpoints >= 1, "run.keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}")
    _require(self.eval_every >= 0, "run.eval_every", f"must be >= 0, got {self.eval_every}")
    _require(self.progress_every_s >= 0, "run.progress_every_s", f"must be >= 0, got {self.progress_every_s}")
    _require(self.on_nonfinite in NONFINITE_POLICIES, "run.on_nonfinite",
             f"must be one of {NONFINITE_POLICIES}, got {self.on_nonfinite!r}")
    _require(self.max_consecutive_skips >= 1, "run.max_consecutive_skips",
             f"must be >= 1, got {self.max_consecutive_skips}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """One experiment: a container of the subsystem configs plus the cross-field checks between them."""
  model: ModelSource
  # Factories, not instances built at class definition: AlgoConfig() checks its names against
  # algorithms.registry (which imports JAX), and importing this module must not.
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  fusion: FusionConfig = dataclasses.field(default_factory=FusionConfig)
  task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  warmup: WarmupConfig = dataclasses.field(default_factory=WarmupConfig)
  run: RunConfig = dataclasses.field(default_factory=RunConfig)
  stalesync: StaleSyncConfig = dataclasses.field(default_factory=StaleSyncConfig)
  critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)

  def __post_init__(self):
    r, a = self.rollout, self.algo
    _require(not a.group_relative or r.group_size >= 2, "rollout.group_size",
             f"the group-relative advantage {a.advantage!r} compares the samples of a group and needs "
             f"group_size >= 2, got {r.group_size}")
    _require(a.overlong_buffer <= r.max_new_tokens, "algo.overlong_buffer",
             f"{a.overlong_buffer} exceeds rollout.max_new_tokens = {r.max_new_tokens}")
    _require(not a.dynamic_sampling or a.group_relative, "algo.dynamic_sampling",
             f"drops groups of equal rewards, which only carry no signal for a group-relative advantage, "
             f"not {a.advantage!r}")
    _require(not a.dynamic_sampling or not self.stalesync.enabled, "algo.dynamic_sampling",
             "runs in the synchronous loop; set stalesync.enabled=False")
    _require(not a.dynamic_sampling or not self.task.reward_model, "algo.dynamic_sampling",
             "filters on the verifier's rewards and cannot be combined with task.reward_model")
    _require(not self.critic.init or a.uses_critic, "critic.init",
             f"is set but algo.advantage={a.advantage!r} uses no critic")
    _require(not self.optim.fixed_row_count or self.optim.pack_rows, "optim.fixed_row_count",
             "fixes the packed update's row count; set optim.pack_rows=True")
    _require(not self.optim.fixed_row_count or self.mesh.stage == 1, "optim.fixed_row_count",
             f"skips micro-batches of padding in the update without pipeline stages; mesh.stage={self.mesh.stage}")
    if self.optim.shared_prompts:
      _require(not self.optim.pack_rows, "optim.shared_prompts",
               "runs in the padded update; the packed update (optim.pack_rows) has no groups to share")
      _require(r.group_size >= 2, "optim.shared_prompts", f"needs groups: rollout.group_size={r.group_size}")
      _require(not self.model.config.num_experts, "optim.shared_prompts",
               "is for dense policies: an MoE router's losses count every position it routes")
      _require(a.mini_batches == 1, "optim.shared_prompts",
               f"needs whole groups in every update; algo.mini_batches={a.mini_batches} draws samples apart")
      _require(r.batch_size // self.optim.micro_batches % r.group_size == 0, "optim.micro_batches",
               f"with optim.shared_prompts each micro-batch holds whole groups of {r.group_size}")
    _require(not (self.optim.pack_rows and self.algo.policy_loss == "tis_seq"), "optim.pack_rows",
             "the sequence-level loss 'tis_seq' sums over a row and cannot take packed rows")
    _require(r.batch_size % self.optim.micro_batches == 0, "optim.micro_batches",
             f"must divide the rollout batch num_prompts * group_size = {r.batch_size}")
    _require(r.batch_size % a.mini_batches == 0, "algo.mini_batches",
             f"must divide the rollout batch num_prompts * group_size = {r.batch_size}")
    _require(r.batch_size // a.mini_batches % self.optim.micro_batches == 0, "optim.micro_batches",
             f"must divide each of the algo.mini_batches={a.mini_batches} mini-batches of "
             f"{r.batch_size // a.mini_batches} samples")
    _require(r.seq_len <= self.model.config.max_position_embeddings, "rollout.max_new_tokens",
             f"max_prompt_len + max_new_tokens = {r.seq_len} exceeds "
             f"model.config.max_position_embeddings = {self.model.config.max_position_embeddings}")

  @property
  def policy_seed(self) -> int:
    """The seed of the starting policy (init and warm-up data): ``warmup.seed``, or ``run.seed`` for -1."""
    return self.run.seed if self.warmup.seed == -1 else self.warmup.seed

  def _check_pipeline(self, stages: int, batch_shards: int) -> None:
    """mesh.stage > 1: the packed update runs the layers as a pipeline (sharding/pipeline.py)."""
    _require(self.optim.pack_rows, "mesh.stage",
             f"{stages} pipeline stages run in the packed update only; set optim.pack_rows=True")
    pieces = self.optim.pipeline_micro_batches or stages
    problem = pipeline_problem(self.model.config, stages, pieces)
    if problem:
      raise ConfigError(f"config.{problem}")
    per_micro = self.rollout.batch_size // self.optim.micro_batches
    _require(per_micro % (batch_shards * pieces) == 0, "optim.pipeline_micro_batches",
             f"the micro-batch of {per_micro} sequences must split into {pieces} pipeline micro-batches "
             f"over data * fsdp = {batch_shards} devices")

  def check_devices(self, num_devices: int) -> dict[str, int]:
    """Resolves the (training) mesh and checks that every batch splits evenly over its batch axes."""
    rollout_shards = None
    if self.fusion.mode == "separated":
      rollout, num_devices = self.fusion.split(num_devices)
      rollout_mesh = MeshConfig(data=-1, fsdp=1, tensor=self.mesh.tensor)
      try:
        rollout_sizes = rollout_mesh.resolve(rollout)
      except ValueError as e:
        raise ConfigError(f"config.fusion.rollout_device_fraction: the rollout sub-mesh of {rollout} "
                          f"devices: {e}")
      _require(self.rollout.batch_size % rollout_sizes["data"] == 0, "fusion.rollout_device_fraction",
               f"the rollout batch of {self.rollout.batch_size} must divide over the rollout sub-mesh's "
               f"{rollout_sizes['data']} data replicas")
      rollout_shards = rollout_sizes["data"]
    if self.fusion.mode == "hybrid":
      aux = self.fusion.aux_split(num_devices)
      num_devices -= aux
      _require(self.rollout.batch_size % aux == 0, "fusion.aux_devices",
               f"the batch of {self.rollout.batch_size} must divide over the {aux} aux devices")
    sizes = self.mesh.resolve(num_devices)
    rollout_shards = rollout_shards or sizes["data"] * sizes["fsdp"]
    batch_shards = sizes["data"] * sizes["fsdp"]
    if sizes["stage"] > 1:
      self._check_pipeline(sizes["stage"], batch_shards)
    per_micro = self.rollout.batch_size // self.optim.micro_batches
    _require(per_micro % batch_shards == 0, "rollout.num_prompts",
             f"the micro-batch of {per_micro} sequences (num_prompts * group_size / micro_batches) "
             f"must divide over data * fsdp = {batch_shards} devices")
    _require(not self.optim.shared_prompts or per_micro // batch_shards % self.rollout.group_size == 0,
             "optim.shared_prompts", f"the micro-batch's {per_micro // batch_shards} rows per device (data * "
             f"fsdp = {batch_shards}) must hold whole groups of rollout.group_size={self.rollout.group_size}")
    tokens = self.optim.tokens_per_micro_batch
    _require(self.optim.micro_batches > 1 or not tokens or tokens >= self.rollout.seq_len,
             "optim.tokens_per_micro_batch",
             f"{tokens} positions per device cannot hold one row of seq_len = {self.rollout.seq_len} tokens")
    _require(self.warmup.steps == 0 or self.warmup.batch_size % batch_shards == 0, "warmup.batch_size",
             f"must be divisible by data * fsdp = {batch_shards}")
    for field, value in (("rollout.num_slots", self.rollout.slots),
                         ("task.eval_problems", self.task.eval_problems)):
      _require(value % rollout_shards == 0, field,
               f"{value} does not divide over the generation mesh's {rollout_shards} batch shards")
    return sizes


# ----------------------------------------------------------------------------------------------------
# ConfigDict -> dataclasses, rejecting unknown keys by path.
# ----------------------------------------------------------------------------------------------------

# Old name -> new name of renamed fields (one name used to mean two things): the old one is refused,
# naming the new one, at conversion and (experiments/common.py) when a command-line override uses it.
RENAMED_FIELDS = {
    "fusion.rollout_fraction": "fusion.rollout_device_fraction",
    "stalesync.rollout_fraction": "stalesync.train_fraction",
}


@functools.cache
def _hints(cls) -> dict[str, Any]:
  """``typing.get_type_hints`` of a config dataclass, cached: each conversion and config file reads them."""
  return typing.get_type_hints(cls)


def _from_mapping(cls, values: Mapping[str, Any], path: str):
  hints = _hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - set(fields))
  for name in unknown:
    if new := RENAMED_FIELDS.get(f"{path}.{name}".removeprefix("config.")):
      raise ConfigError(f"{path}.{name} was renamed: use config.{new}")
  if unknown:
    named = ", ".join(f"{path}.{k}{closest(k, fields)}" for k in unknown)
    raise ConfigError(f"unknown config field(s) {named}; known in {path}: {sorted(fields)}")
  kwargs = {}
  for name, value in values.items():
    hint = hints[name]
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
      value = _from_mapping(hint, value, f"{path}.{name}")
    elif isinstance(value, list):
      value = tuple(value)
    kwargs[name] = value
  try:
    return cls(**kwargs)
  except model_config.ModelConfigError as e:
    raise ConfigError(f"{path}.{e.field}: {e.reason}") from None
  except TypeError as e:
    raise ConfigError(f"{path}: {e}") from e


def to_plain(value: Any) -> Any:
  """ConfigDict / FrozenConfigDict / Mapping -> nested plain dicts (lists kept)."""
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {k: to_plain(v) for k, v in value.items()}
  return value


def _model_from_checkpoint(hf_path: str, given: Mapping[str, Any]) -> ModelConfig:
  """The architecture comes from ``hf_path/config.json``; given fields must agree with it.

  Only the fields of ``model_config.RUNTIME_FIELDS`` (precision policy, remat, logits chunk) may differ
  from the checkpoint. Anything else that disagrees is an error
  naming the field, so a config never silently describes a different model than the one it loads.
  """
  try:
    ckpt = model_config.read_config(hf_path)
  except (OSError, ValueError) as e:
    raise ConfigError(f"config.model.hf_path: {e}") from e
  unknown = sorted(set(given) - {f.name for f in dataclasses.fields(ModelConfig)})
  if unknown:
    raise ConfigError(f"unknown config field(s) {', '.join('config.model.' + k for k in unknown)}")
  overrides = {k: v for k, v in given.items() if k in RUNTIME_FIELDS}
  try:
    cfg = dataclasses.replace(ckpt, **overrides)
  except model_config.ModelConfigError as e:
    raise ConfigError(f"config.model.{e.field}: {e.reason}") from None
  for name, value in given.items():
    if name not in RUNTIME_FIELDS and getattr(cfg, name) != value:
      raise ConfigError(f"config.model.{name}={value!r} disagrees with {hf_path}/config.json "
                       f"({getattr(cfg, name)!r}); drop the field or fix it")
  return cfg


def _check_architecture_given(model: Mapping[str, Any]) -> None:
  """Without hf_path the model section must give every required ModelConfig field; the error says both
  ways out (a config such as gsm8k_chat.py lists only hf_path and expects it on the command line)."""
  missing = [f.name for f in dataclasses.fields(ModelConfig)
             if f.default is dataclasses.MISSING and f.name not in model]
  if missing:
    raise ConfigError(f"config.model.hf_path is empty and config.model lacks {', '.join(missing)}: pass "
                      "--config.model.hf_path=DIR (a Hugging Face checkpoint folder), or give those fields")


def experiment_from_dict(config: Mapping[str, Any]) -> ExperimentConfig:
  """Builds the typed experiment config; every error names the offending ``config.<path>``.

  A model field that is None is not given (``default_config_dict`` holds every one as a None
  placeholder): it takes the ModelConfig default, or with ``model.hf_path`` the checkpoint's value.
  """
  values = to_plain(config)
  model = {k: v for k, v in values.pop("model", {}).items() if v is not None}
  source = {k: model.pop(k) for k in _SOURCE_FIELDS if k in model}
  if "rope_scaling" in model and isinstance(model["rope_scaling"], Mapping):
    model["rope_scaling"] = tuple(sorted(model["rope_scaling"].items()))
  if source.get("hf_path"):
    model_cfg = _model_from_checkpoint(source["hf_path"], model)
  else:
    _check_architecture_given(model)
    model_cfg = _from_mapping(ModelConfig, model, "config.model")
  kwargs = {"model": ModelSource(config=model_cfg, **source)}
  for name, sub in values.items():
    field_types = _hints(ExperimentConfig)
    if name not in field_types:
      raise ConfigError(f"unknown config field config.{name}{closest(name, field_types)}; "
                        f"known: {sorted(field_types)}")
    if name == "task":
      sub = dict(sub)
      sub["kwargs"] = dict(sub.get("kwargs", {}))
    kwargs[name] = _from_mapping(field_types[name], sub, f"config.{name}")
  return ExperimentConfig(**kwargs)


# ModelSource's own fields, given in config.model beside the ModelConfig fields.
_SOURCE_FIELDS = ("hf_path", "init_std")


def as_dict(cfg: ExperimentConfig) -> dict[str, Any]:
  """JSON-friendly dict of the resolved config (saved as config.json in the workdir)."""
  def plain(v):
    if dataclasses.is_dataclass(v):
      return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, Mapping):
      return {k: plain(x) for k, x in v.items()}
    if isinstance(v, tuple):
      return [plain(x) for x in v]
    return v
  return plain(cfg)


# ----------------------------------------------------------------------------------------------------
# Dataclass defaults -> ConfigDict: what every shipped config starts from.
# ----------------------------------------------------------------------------------------------------

# ModelConfig.rope_scaling is given as a dict ({"rope_type": "llama3", ...}) or as (key, value) pairs:
# an override of it parses as any Python literal.
_LITERAL_FIELDS = ("rope_scaling",)


def _override_type(name: str, hint) -> type:
  """The type config_flags parses a command-line override of a field with: its hint without None, the
  container itself for a generic (``Mapping[str, Any]`` -> Mapping)."""
  if name in _LITERAL_FIELDS:
    return object
  if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
    hint = next(a for a in typing.get_args(hint) if a is not type(None))
  return typing.get_origin(hint) or hint


def _section(cls, names, *, all_placeholders: bool = False) -> ml_collections.ConfigDict:
  """The fields ``names`` of dataclass ``cls`` at their defaults. A None (or required) field becomes a
  typed placeholder, so that ``--config.algo.dual_clip=3`` parses as a float; a float field always holds
  a float (an int would make config_flags parse its overrides as ints)."""
  hints = _hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  out = {}
  for name in names:
    f, kind = fields[name], _override_type(name, hints[name])
    default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    if all_placeholders or default is None or default is dataclasses.MISSING:
      out[name] = config_dict.placeholder(kind)
    elif kind is Mapping:
      out[name] = ml_collections.ConfigDict(dict(default))
    else:
      out[name] = float(default) if kind is float else default
  return ml_collections.ConfigDict(out)


def default_config_dict() -> ml_collections.ConfigDict:
  """Every field of ``ExperimentConfig`` at its dataclass default, nested as :func:`experiment_from_dict`
  reads it; locked, so a mistyped field fails where it is set. A config file starts from it and sets only
  what it changes.

  ``model`` holds ModelSource's ``hf_path`` and ``init_std``, and every ModelConfig field as a typed None
  placeholder, i.e. not given: random init takes the ModelConfig default (the architecture fields without
  one must then be set), and ``model.hf_path`` takes the checkpoint's value, which a given field must
  match (runtime fields excepted). ``experiment_from_dict`` of this dict plus the architecture is the
  default ``ExperimentConfig`` of that model.
  """
  hints = _hints(ExperimentConfig)
  c = ml_collections.ConfigDict()
  for f in dataclasses.fields(ExperimentConfig):
    if f.name == "model":
      names = [m.name for m in dataclasses.fields(ModelConfig)]
      c.model = _section(ModelConfig, names, all_placeholders=True)
      c.model.update(_section(ModelSource, _SOURCE_FIELDS))
    else:
      c[f.name] = _section(hints[f.name], [m.name for m in dataclasses.fields(hints[f.name])])
  c.lock()
  return c
