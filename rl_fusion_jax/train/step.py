"""The jitted update steps: ``train_step(state, batch) -> (state, metrics)`` for RL and for SFT warm-up.

Each is compiled once per batch shape with explicit in/out shardings and the state donated. Gradients
accumulate over micro-batches in a ``lax.scan``; the loss aggregation is expressed as per-token weights
computed on the whole batch first (``registry.AGGREGATIONS[algo.aggregation]``), so accumulation gives
exactly the full-batch gradient. Micro-batches take every M-th row, so each device's shard contributes equally to
every micro-batch. The RL step derives M from the batch's static shape (``MicroBatching``). The loop runs
it at ``rollout.seq_len`` (one compile per run); with ``optim.width_buckets`` the host cuts the batch width
to the longest sample's bucket (``train_width``), and each width compiles once.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_fusion_jax import algorithms, models
from rl_fusion_jax.algorithms import registry
from rl_fusion_jax.config import AlgoConfig
from rl_fusion_jax.sharding.expert_parallel import with_expert_parallel
from rl_fusion_jax.sharding.mesh import BATCH_AXES, batch_sharding, batch_shards, replicated
from rl_fusion_jax.sharding.rules import TRAIN_RULES, Rules
from rl_fusion_jax.shared_programs import shared
from rl_fusion_jax.train.logprobs import response_window, shared_prompt_logprobs, token_logprobs
from rl_fusion_jax.train.state import TrainState
from rl_fusion_jax.types import TrainBatch

# loss_fn(params, micro_batch, weights_bt) -> (loss, metric_sums); metric sums add over micro-batches.
LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


# Token positions per micro-batch and device (rows per batch shard * width) when
# ``optim.tokens_per_micro_batch`` is 0 / None. On CPU, smaller micro-batches keep the activations in the
# caches: tiny-grpo's update on 2 cores ([128, 44], 2 devices), median of 14 interleaved steps: 1, 2, 4, 8
# micro-batches (2816, 1408, 704, 352 positions per device) took 0.90, 0.75, 0.73, 0.75 s, and 16 / 32
# micro-batches were slower again. On GPU / TPU, micro-batching only bounds memory, so the budget is large.
DEFAULT_TOKENS_PER_MICRO_BATCH = {"cpu": 1024}
ACCELERATOR_TOKENS_PER_MICRO_BATCH = 32768


def tokens_per_micro_batch(value: int | None, platform: str) -> int:
  """``optim.tokens_per_micro_batch`` resolved: the value itself, or the platform's default for 0 / None."""
  return value or DEFAULT_TOKENS_PER_MICRO_BATCH.get(platform, ACCELERATOR_TOKENS_PER_MICRO_BATCH)


def micro_batch_count(rows: int, width: int, tokens: int, shards: int, group: int = 1) -> int:
  """The fewest micro-batches such that each holds at most ``tokens`` positions per device (its rows per
  batch shard * ``width``) and the same number of rows on each of the ``shards`` batch shards (the count
  divides ``rows / shards``), in whole groups of ``group`` consecutive rows (``optim.shared_prompts``).

  When even one row (group) per shard exceeds the budget, one row (group) per shard (the most
  micro-batches possible). ``tokens`` = 0: no budget, one micro-batch.
  """
  if rows % shards:
    raise ValueError(f"{rows} rows do not split over {shards} batch shards")
  per_shard = rows // shards
  if per_shard % group:
    raise ValueError(f"{per_shard} rows per batch shard do not hold whole groups of {group}")
  if not tokens:
    return 1
  units = per_shard // group
  divisors = [m for m in range(1, units + 1) if units % m == 0]
  return next((m for m in divisors if per_shard // m * width <= tokens), divisors[-1])


@dataclasses.dataclass(frozen=True)
class MicroBatching:
  """How an update splits its batch: ``count`` > 1 fixes the number of micro-batches (it wins); otherwise
  each micro-batch holds at most ``tokens`` positions per device (0: the whole batch at once)."""
  count: int = 1
  tokens: int = 0

  @classmethod
  def from_optim(cls, optim, platform: str) -> MicroBatching:
    return cls(optim.micro_batches, tokens_per_micro_batch(optim.tokens_per_micro_batch, platform))

  def num_micro(self, rows: int, width: int, shards: int, group: int = 1) -> int:
    return self.count if self.count > 1 else micro_batch_count(rows, width, self.tokens, shards, group)


def as_micro_batching(micro: MicroBatching | int) -> MicroBatching:
  """An int is a fixed micro-batch count."""
  return micro if isinstance(micro, MicroBatching) else MicroBatching(count=int(micro))


# Token widths of training rows: every width up to 32 in steps of 4, then 8 steps per doubling (36, 40,
# ..., 64, 72, ..., 128, 144, ...), capped at seq_len.
MIN_WIDTH_STEP = 4
WIDTH_STEPS_PER_DOUBLING = 8


def train_width(max_len: int, seq_len: int) -> int:
  """The row width an update runs at: the batch's longest sample (prompt + response) rounded up to a
  bucket, at most ``seq_len``. Positions past every sample are padding in every row: dropping them
  changes no loss value (their weights are 0; attention is causal) and saves their compute.

  Buckets are multiples of 4 up to 32, then 8 per doubling (steps of 1/8 of the lower power of two), so
  rounding wastes at most 4 positions or 1/8 of the width, and a run compiles at most
  8 + 8 * log2(seq_len / 32) widths (12 for seq_len = 48), in practice the few its longest samples reach.
  For tiny-grpo (longest sample 41 of 48) the width is 44.
  """
  n = max(int(max_len), 2)        # the log-prob shift needs two positions
  step = max(MIN_WIDTH_STEP, 2 ** (math.ceil(math.log2(n)) - 1) // WIDTH_STEPS_PER_DOUBLING)
  return min(seq_len, -(-n // step) * step)


def split_micro_batches(tree, num_micro: int, mesh: Mesh, group: int = 1):
  """[B, ...] -> [M, B/M, ...], micro-batch m holding rows m, m+M, m+2M, ...; with ``group`` > 1, groups
  of that many consecutive rows instead of rows (micro-batch m: groups m, m+M, ..., each kept whole)."""
  def split(x):
    b, rest = x.shape[0], x.shape[1:]
    if group == 1:
      x = x.reshape(b // num_micro, num_micro, *rest).swapaxes(0, 1)
    else:
      x = x.reshape(b // (num_micro * group), num_micro, group, *rest).swapaxes(0, 1)
      x = x.reshape(num_micro, b // num_micro, *rest)
    spec = P(None, BATCH_AXES, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  return jax.tree.map(split, tree)


def _accumulator_dtype(dtype):
  """Sums of floating values accumulate in float32 (or wider), whatever the parameter dtype."""
  return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


# Metrics whose name starts with this are maxima (of values >= 0), combined over micro-batches by max.
MAX_PREFIX = "max/"


def _accumulate(loss_fn: LossFn, params, batch, weights_bt, num_micro: int, mesh: Mesh, skip_empty: bool = False,
                group: int = 1):
  """Sum of gradients and metric sums over micro-batches (weights are global, so sums are exact); metrics
  named ``MAX_PREFIX...`` are maxima instead.

  With several micro-batches the sums accumulate in float32 (also for bfloat16 parameters); the summed
  gradients are then cast to the parameters' dtype, so optimizer state keeps its dtype step after step.
  ``skip_empty``: a micro-batch whose weights are all 0 (rows of padding only) is skipped at run time
  (``lax.cond``): no forward or backward, nothing added (it would add exact zeros, as every loss term and
  metric sum is weighted). ``group``: micro-batches hold whole groups of that many consecutive rows.
  """
  grad_fn = jax.grad(loss_fn, has_aux=True)
  if num_micro == 1:
    return grad_fn(params, batch, weights_bt)
  micro = split_micro_batches((batch, weights_bt), num_micro, mesh, group)

  def add(carry, mb):
    grads, sums = grad_fn(params, *mb)
    acc_grads, acc_sums = carry
    acc_grads = jax.tree.map(lambda acc, x: acc + x.astype(acc.dtype), acc_grads, grads)
    acc_sums = {k: jnp.maximum(acc_sums[k], v) if k.startswith(MAX_PREFIX) else acc_sums[k] + v.astype(acc_sums[k].dtype)
                for k, v in sums.items()}
    return acc_grads, acc_sums

  def body(carry, mb):
    if not skip_empty:
      return add(carry, mb), None
    used = functools.reduce(jnp.logical_or, [jnp.any(w != 0) for w in jax.tree.leaves(mb[1])])
    return jax.lax.cond(used, add, lambda c, _: c, carry, mb), None

  zero = jax.eval_shape(grad_fn, params, *jax.tree.map(lambda x: x[0], micro))
  zero = jax.tree.map(lambda s: jnp.zeros(s.shape, _accumulator_dtype(s.dtype)), zero)
  (grads, sums), _ = jax.lax.scan(body, zero, micro)
  return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), sums


# Not a divergence but a broken invariant (``rl_loss``'s head window missed masked tokens): the update is
# withheld like a non-finite one and the host always stops.
WINDOW_CODE = 5
# The count behind it, a metric of ``rl_loss`` with a head window.
WINDOW_METRIC = MAX_PREFIX + "head/tokens_outside_window"
# The same for ``optim.shared_prompts``: prompt tokens of rows that differ from their group's first row
# (rows not grouped as the update assumes).
PROMPT_CODE = 6
PROMPT_METRIC = MAX_PREFIX + "head/prompt_tokens_differing_in_group"

# The divergence guard: what ``metrics["nonfinite"]`` holds after an update (0: all finite, else the first
# non-finite quantity in the order they are computed). The host names it with NONFINITE_NAMES.
NONFINITE_NAMES = {1: "loss or a loss metric", 2: "gradients", 3: "updated parameters", 4: "optimizer state",
                   WINDOW_CODE: "response tokens outside the lm head's window (a response longer than "
                                "rollout.max_new_tokens)",
                   PROMPT_CODE: "rows of a group with different prompts (optim.shared_prompts: the update's rows "
                                "were not in groups of rollout.group_size)"}


def all_finite(tree) -> jax.Array:
  """bool scalar: every floating-point leaf of ``tree`` is finite (integer leaves always are)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _first_nonfinite(*trees) -> jax.Array:
  """int32: 0 when every tree is finite, else 1 + the index of the first tree that is not."""
  code = jnp.int32(0)
  for i, tree in reversed(list(enumerate(trees))):
    code = jnp.where(all_finite(tree), code, jnp.int32(i + 1))
  return code


def update(loss_fn: LossFn, tx: optax.GradientTransformation, num_micro: int, mesh: Mesh,
           state: TrainState, batch, weights_bt, bump_version: bool, skip_empty: bool = False, group: int = 1):
  """One guarded optimizer update: applied only when loss, gradients and the new state are all finite.

  A non-finite update leaves params and optimizer state as they were (a select on device, no host round
  trip); ``metrics["nonfinite"]`` says which quantity failed, and the host decides (stop or skip).
  Step and policy version advance either way, so versions stay a function of the step. ``skip_empty``,
  ``group``: see ``_accumulate``.
  """
  grads, sums = _accumulate(loss_fn, state.params, batch, weights_bt, num_micro, mesh, skip_empty, group)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  sums["grad_norm"] = optax.global_norm(grads)
  code = _first_nonfinite(sums, grads, params, opt_state)
  for metric, invariant in ((WINDOW_METRIC, WINDOW_CODE), (PROMPT_METRIC, PROMPT_CODE)):
    if metric in sums:
      code = jnp.where(sums[metric] > 0, jnp.int32(invariant), code)
  # The flag comes out of a conditional, which XLA never fuses: computed from ``code`` inline, the scalar
  # chain behind it (an is-finite and an and per checked leaf and metric) was copied into the select of
  # every parameter and optimizer leaf below (an optimization barrier does not survive XLA:CPU's passes).
  ok = jax.lax.cond(code == 0, lambda: jnp.bool_(True), lambda: jnp.bool_(False))
  keep = lambda new, old: jnp.where(ok, new, old)
  new_state = state.replace(step=state.step + 1, params=jax.tree.map(keep, params, state.params),
                            opt_state=jax.tree.map(keep, opt_state, state.opt_state),
                            policy_version=state.policy_version + int(bump_version))
  sums["nonfinite"] = code.astype(jnp.float32)
  return new_state, sums


# ----------------------------------------------------------------------------------------------------
# RL (GRPO / PPO-clip) and SFT losses. ``weights`` = (loss weights, metric weights), both [B, T] and both
# normalised over the whole batch; metric weights are token-mean (mask / tokens), so metric sums read as
# per-token averages whatever the loss aggregation.
# ----------------------------------------------------------------------------------------------------

def rl_loss(model_cfg: models.ModelConfig, algo: AlgoConfig, temperature: float,
            params, batch: TrainBatch, weights, current_version=None, head_len: int = 0, shared_prompts: int = 0):
  """Policy loss + optional KL and entropy terms, aggregated with the precomputed token weights; for an
  MoE policy plus the router's auxiliary losses (`router_aux_loss`; padded rows route their padding too).

  ``head_len`` > 0 (at most the longest response, ``rollout.max_new_tokens``): the lm head runs on a
  window of ``head_len`` tokens per row from its first masked token (``logprobs.response_window``), not on
  every position; the loss and metrics read masked tokens only, so they are unchanged. Masked tokens
  past the window are counted in ``WINDOW_METRIC``, and ``update`` withholds such an update.

  ``shared_prompts`` > 1 (``optim.shared_prompts``: the group size; needs the window): rows come in groups
  of that many consecutive rows with one prompt, which the decoder runs once per group
  (``logprobs.shared_prompt_logprobs``); rows that break the grouping count in ``PROMPT_METRIC``, and
  ``update`` withholds such an update.
  """
  window, outside, mismatched = None, None, None
  if shared_prompts > 1:
    logp_bt, entropy_bt, outside, mismatched = shared_prompt_logprobs(
        model_cfg, params, batch.tokens_bt, batch.mask_bt, shared_prompts,
        shared_window(head_len, batch.tokens_bt.shape[1]), temperature, with_entropy=True)
    aux = {}
  else:
    if 0 < head_len < batch.tokens_bt.shape[1] - 1:
      start_b, outside = response_window(batch.mask_bt, head_len)
      window = (start_b, head_len)
    logp_bt, entropy_bt, aux = token_logprobs(model_cfg, params, batch.tokens_bt, temperature,
                                              with_entropy=True, with_aux=True, head_window=window)
  loss, sums = rl_loss_from_logprobs(algo, logp_bt, entropy_bt, behaviour_logp_bt=batch.behaviour_logp_bt,
                                     advantages=batch.advantages_bt, mask_bt=batch.mask_bt,
                                     ref_logp_bt=batch.ref_logp_bt, weights=weights,
                                     proximal_logp_bt=batch.proximal_logp_bt, version_bt=batch.version_bt,
                                     current_version=current_version)
  if outside is not None:
    sums[WINDOW_METRIC] = outside.astype(jnp.float32)
  if mismatched is not None:
    sums[PROMPT_METRIC] = mismatched.astype(jnp.float32)
  return add_router_aux(model_cfg, loss, sums, aux, weights)


def shared_window(head_len: int, width: int) -> int:
  """The response window of ``shared_prompt_logprobs`` for rows ``width`` wide: ``head_len``, at most every
  target of a row (``width - 1``, also when ``head_len`` is 0)."""
  return min(head_len, width - 1) if head_len > 0 else width - 1


def shared_positions(width: int, group: int, head_len: int) -> int:
  """Decoder positions of one group's sequence under ``optim.shared_prompts`` (rows ``width`` wide): the
  first row's ``width - 1`` inputs, then ``window - 1`` per other row (``shared_prompt_logprobs``)."""
  return width - 1 + (group - 1) * (shared_window(head_len, width) - 1)


def add_router_aux(model_cfg: models.ModelConfig, loss, sums, aux, weights):
  """``loss`` + this micro-batch's share of the MoE router losses, with their metrics (`moe/...`).

  The share is the micro-batch's fraction of the batch's loss tokens (its metric weights' sum), so the
  terms summed over micro-batches are the token-weighted mean over the batch:
  ``router_aux_loss_coef * load_balance_loss + router_z_loss_coef * router_z_loss`` (models/moe.py).
  Metrics: both losses, the dropped fraction, and ``moe/expert_load/e{i}``: the fraction of routed
  assignments expert i received (averaged over the sparse layers; 1 / num_experts at perfect balance).
  No-op for a dense model (``aux`` empty).
  """
  if not aux:
    return loss, sums
  share = jax.lax.stop_gradient(jnp.sum(weights[1]))
  term = (model_cfg.router_aux_loss_coef * aux["load_balance_loss"]
          + model_cfg.router_z_loss_coef * aux["router_z_loss"])
  loss = loss + share * term
  sums = dict(sums, loss=loss)
  for key in ("load_balance_loss", "router_z_loss", "dropped_fraction"):
    sums[f"moe/{key}"] = share * jax.lax.stop_gradient(aux[key])
  for i in range(aux["expert_load"].shape[0]):
    sums[f"moe/expert_load/e{i}"] = share * jax.lax.stop_gradient(aux["expert_load"][i])
  return loss, sums


def rl_loss_from_logprobs(algo: AlgoConfig, logp_bt, entropy_bt, *, behaviour_logp_bt, advantages, mask_bt,
                          ref_logp_bt, weights, proximal_logp_bt=None, version_bt=None, current_version=None):
  """The RL loss after the forward pass, for any row layout (``rl_loss`` and the packed step use it).

  ``advantages`` is [B] (one per row) or [B, T] (one per token: packed rows hold several samples).
  Off-policy metrics (token means): importance-weight mean and second moment (std = sqrt(E[w^2] -
  E[w]^2)), the truncated fraction, and tokens whose log-ratio hit the clamp.

  ``proximal_logp_bt`` (several updates per batch): the log-probs before the batch's first update. The
  off-policy losses take it as their proximal policy (the clip's anchor; their behaviour weights stay
  against ``behaviour_logp_bt``); ``ppo_clip``, which has no behaviour weights, clips around it instead of
  the behaviour log-probs. Adds ``kl_proximal``: the k3 estimate of KL(pi_theta || pi_prox) per token.
  None: the proximal policy is the current parameters (one update per batch).

  Sampler/trainer agreement (with ``version_bt`` and ``current_version``, the policy version of the
  parameters before this batch's first update): on the response tokens sampled by exactly those
  parameters (version == current_version), the trainer's log-probs under them (``proximal_logp_bt``, or
  ``logp_bt`` before a single update) against the recorded behaviour log-probs: ``max/mismatch/logp_abs``
  (the largest |difference|), and token means over all response tokens of the |difference|, the k3
  estimate of KL(behaviour || trainer) and the current tokens' share (``mismatch/...``; ``train_phase``
  divides by the share).
  """
  loss_w_bt, metric_w_bt = weights
  policy_loss = registry.get_policy_loss(algo.policy_loss)
  kw = dict(algo.loss_hparams, mask_bt=mask_bt)
  old_logp_bt = behaviour_logp_bt
  if proximal_logp_bt is not None and algo.policy_loss == "ppo_clip":
    old_logp_bt = proximal_logp_bt
  elif proximal_logp_bt is not None:
    kw["proximal_logp_bt"] = proximal_logp_bt
  loss_bt, stats = policy_loss(logp_bt, old_logp_bt, advantages, **kw)
  metrics_bt = {"entropy": entropy_bt, "clip_frac": stats["clipped"], "ratio": stats["ratio"],
                "is_weight": stats["is_weight"], "is_weight_sq": stats["is_weight"] ** 2,
                "is_truncated_frac": stats["is_truncated"],
                "log_ratio_clamped_frac": stats["log_ratio_clamped"]}
  if proximal_logp_bt is not None:
    metrics_bt["kl_proximal"] = registry.get_kl_estimator("k3")(logp_bt, proximal_logp_bt)
  mismatch_max = None
  if version_bt is not None and current_version is not None:
    trainer_bt = logp_bt if proximal_logp_bt is None else proximal_logp_bt
    current_bt = ((version_bt == current_version) & (mask_bt > 0)).astype(jnp.float32)
    diff_bt = jnp.abs(trainer_bt - behaviour_logp_bt) * current_bt
    metrics_bt |= {"mismatch/current_frac": current_bt, "mismatch/logp_abs_weighted": diff_bt,
                   "mismatch/kl_weighted": registry.get_kl_estimator("k3")(behaviour_logp_bt, trainer_bt) * current_bt}
    mismatch_max = jnp.max(jax.lax.stop_gradient(diff_bt))
  if algo.needs_reference:
    metrics_bt["kl"] = registry.get_kl_estimator(algo.kl_estimator)(logp_bt, ref_logp_bt)
    if algo.kl_mode == "loss":
      loss_bt = loss_bt + algo.kl_coef * metrics_bt["kl"]
  if algo.entropy_coef:
    loss_bt = loss_bt - algo.entropy_coef * entropy_bt
  loss = algorithms.weighted_sum(loss_bt, loss_w_bt)
  sums = {"loss": loss}
  for name, value_bt in metrics_bt.items():
    sums[name] = jnp.sum(jax.lax.stop_gradient(value_bt) * metric_w_bt)
  if mismatch_max is not None:
    sums[MAX_PREFIX + "mismatch/logp_abs"] = mismatch_max
  return loss, sums


def sft_loss(model_cfg: models.ModelConfig, params, batch, weights):
  """Token-level cross-entropy on the masked (target) tokens of ``batch = (tokens_bt, mask_bt)``, plus the
  router's auxiliary losses for an MoE model (`add_router_aux`)."""
  tokens_bt, _ = batch
  loss_w_bt, _ = weights
  logp_bt, aux = token_logprobs(model_cfg, params, tokens_bt, with_aux=True)
  loss = -jnp.sum(logp_bt * loss_w_bt)
  return add_router_aux(model_cfg, loss, {"loss": loss}, aux, weights)


def _metric_weights(mask_bt):
  return mask_bt / jnp.maximum(jnp.sum(mask_bt), 1.0)


def rl_step(model_cfg, algo: AlgoConfig, temperature: float, tx, micro: MicroBatching, mesh: Mesh,
            norm_len: int, state: TrainState, batch: TrainBatch, bump_version: bool = True,
            head_len: int = 0, shared_prompts: int = 0):
  loss_w_bt = registry.get_token_weights_fn(algo.aggregation)(batch.mask_bt, norm_len=norm_len)
  weights = (loss_w_bt, _metric_weights(batch.mask_bt))
  loss_fn = functools.partial(rl_loss, model_cfg, algo, temperature, current_version=state.policy_version,
                              head_len=head_len, shared_prompts=shared_prompts)
  group = max(shared_prompts, 1)
  rows, width = batch.tokens_bt.shape
  if group > 1:   # the positions a row costs when its group shares the prompt (``shared_prompt_logprobs``)
    width = -(-shared_positions(width, group, head_len) // group)
  num_micro = micro.num_micro(rows, width, batch_shards(mesh), group)
  return update(loss_fn, tx, num_micro, mesh, state, batch, weights, bump_version=bump_version, group=group)


def bump_policy_version(state: TrainState) -> TrainState:
  """The policy version + 1: after the last of a batch's several updates (which leave it as it is), so a
  version still counts rollout batches."""
  return state.replace(policy_version=state.policy_version + 1)


def sft_step(model_cfg, tx, num_micro: int, mesh: Mesh, state: TrainState, tokens_bt, mask_bt):
  weights = (_metric_weights(mask_bt), _metric_weights(mask_bt))
  loss_fn = functools.partial(sft_loss, model_cfg)
  return update(loss_fn, tx, num_micro, mesh, state, (tokens_bt, mask_bt), weights, bump_version=False)


def batch_shardings(mesh: Mesh, proximal: bool = False) -> TrainBatch:
  """A TrainBatch's shardings; ``proximal``: with its ``proximal_logp_bt``."""
  b2 = batch_sharding(mesh, 2)
  return TrainBatch(tokens_bt=b2, mask_bt=b2, advantages_bt=b2, behaviour_logp_bt=b2, ref_logp_bt=b2,
                    version_bt=b2, proximal_logp_bt=b2 if proximal else None)


@shared
def make_rl_step(model_cfg, algo: AlgoConfig, temperature: float, tx, micro: MicroBatching | int, mesh: Mesh,
                 norm_len: int, shardings: TrainState, rules: Rules = TRAIN_RULES, *, proximal: bool = False,
                 max_response_len: int = 0, shared_prompts: int = 0):
  """``train_step(state, batch) -> (state, metrics)``, compiled once per batch shape, state donated.

  ``max_response_len`` > 0 (``rollout.max_new_tokens``): no row has more masked tokens than this, so the
  lm head runs on that many positions per row (``rl_loss``'s ``head_len``) instead of all of them.

  ``micro``: a ``MicroBatching`` (the count follows the batch's shape) or a fixed micro-batch count.
  ``norm_len`` (the Dr. GRPO constant) does not depend on the batch width. ``rules``: the training rule
  table ``shardings`` came from (an MoE policy's experts run expert-parallel in that layout).
  ``proximal``: batches carry ``proximal_logp_bt`` (several updates per batch); such an update leaves the
  policy version as it is (``bump_policy_version`` after the batch's last one). ``shared_prompts`` (the
  group size, with ``max_response_len``): a group's rows run their shared prompt once (``rl_loss``).
  """
  fn = functools.partial(rl_step, model_cfg, algo, temperature, tx, as_micro_batching(micro), mesh, norm_len,
                         bump_version=not proximal, head_len=max_response_len, shared_prompts=shared_prompts)
  fn = with_expert_parallel(fn, model_cfg, mesh, rules)
  return jax.jit(fn, in_shardings=(shardings, batch_shardings(mesh, proximal)),
                 out_shardings=(shardings, replicated(mesh)), donate_argnums=(0,))


@shared
def make_sft_step(model_cfg, tx, num_micro: int, mesh: Mesh, shardings: TrainState,
                  rules: Rules = TRAIN_RULES):
  """``sft_step(state, tokens_bt, mask_bt) -> (state, metrics)``, compiled once, state donated."""
  b2 = batch_sharding(mesh, 2)
  fn = with_expert_parallel(functools.partial(sft_step, model_cfg, tx, num_micro, mesh), model_cfg, mesh, rules)
  return jax.jit(fn, in_shardings=(shardings, b2, b2), out_shardings=(shardings, replicated(mesh)),
                 donate_argnums=(0,))


@shared
def make_logprob_fn(model_cfg, temperature: float, mesh: Mesh, param_shardings, rules: Rules = TRAIN_RULES):
  """``fn(params, tokens_bt) -> logp_bt`` (e.g. reference-policy log-probs), compiled once."""
  b2 = batch_sharding(mesh, 2)
  fn = with_expert_parallel(functools.partial(token_logprobs, model_cfg, temperature=temperature),
                            model_cfg, mesh, rules)
  return jax.jit(lambda params, tokens_bt: fn(params, tokens_bt),
                 in_shardings=(param_shardings, b2), out_shardings=b2)
