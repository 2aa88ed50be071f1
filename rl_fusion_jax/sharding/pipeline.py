"""Pipeline parallelism (GPipe) over the mesh's 'stage' axis: the decoder's stacked layers in the update.

Under TRAIN_RULES the stacked ``params['layers']`` are split over 'stage' (stage s holds layers
[s * L / S, (s + 1) * L / S)). ``pipelined_hidden`` computes what ``decoder.hidden_with_aux`` does, with
the layers run as a pipeline: the batch is cut into M micro-batches (rows m, m + M, m + 2M, ...: each
micro-batch keeps its rows on their batch shard), and inside one ``jax.shard_map`` that is manual over
'stage' only (data, fsdp and tensor stay automatic, so every layer computes as it does unpipelined),
iteration i of the M + S - 1 runs micro-batch i - s on stage s when 0 <= i - s < M and sends each stage's
output to the next with ``jax.lax.ppermute``. The other S (S - 1) stage-iterations are the bubble:
stages compute on zeros there and the result is dropped. The last stage's outputs reach every stage
through a psum over 'stage' (an all-reduce where a broadcast would do). ``jax.grad`` of this forward is
the same schedule run backwards (the transpose of a ppermute is the reverse ppermute), and the gradients
are those of the unpipelined model: every row meets the same layers in the same order.

Embedding, final norm and the lm head stay outside the pipeline: their inputs are replicated over
'stage', so every stage computes them for all of its batch shard's rows (S-fold repeated work, small
next to the layers for deep models). The schedule is a Python loop over its static iterations: XLA:CPU's
in-process collectives inside rolled loops deadlocked on multi-device meshes (``ModelConfig.scan_unroll``);
compile time therefore grows with M + S - 1. This module never places parameters at rest; the only
specs it spells are the shard_map's view of the stage axis (layers split over it, the rest replicated).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int

from rl_fusion_jax.config import pipeline_problem
from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models import decoder, moe
from rl_fusion_jax.sharding.mesh import STAGE_AXIS, batch_shards, num_stages

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Schedule:
  """GPipe over ``stages`` stages and ``micro`` micro-batches: stage s runs micro-batch i - s at
  iteration i, for M + S - 1 iterations; the S (S - 1) stage-iterations with no micro-batch are the bubble."""
  stages: int
  micro: int

  @property
  def iterations(self) -> int:
    return self.micro + self.stages - 1

  def micro_batch(self, iteration: int, stage: int) -> int | None:
    m = iteration - stage
    return m if 0 <= m < self.micro else None

  def table(self) -> np.ndarray:
    """[iterations, stages]: the micro-batch each stage runs at each iteration, -1 where it idles."""
    return np.array([[-1 if (m := self.micro_batch(i, s)) is None else m for s in range(self.stages)]
                     for i in range(self.iterations)])

  @property
  def idle_slots(self) -> int:
    return int(np.sum(self.table() < 0))

  @property
  def bubble_fraction(self) -> float:
    """Idle share of the stage-iterations: (S - 1) / (M + S - 1), the GPipe formula."""
    return self.idle_slots / (self.stages * self.iterations)


def check_pipeline(cfg: ModelConfig, stages: int, num_micro: int, rows: int | None = None,
                   shards: int = 1) -> None:
  """Raises ValueError naming the fields when ``cfg`` cannot run as a ``stages``-stage pipeline of
  ``num_micro`` micro-batches (``config.pipeline_problem``) and, given ``rows``, when the rows do not
  split into them over the batch shards."""
  problem = pipeline_problem(cfg, stages, num_micro)
  if problem:
    raise ValueError(problem)
  if rows is not None and rows % (num_micro * shards):
    raise ValueError(f"{rows} rows do not split into optim.pipeline_micro_batches={num_micro} micro-batches "
                     f"over data*fsdp={shards} batch shards")


def _stage_config(cfg: ModelConfig, stages: int) -> ModelConfig:
  """The config of one stage: num_layers / stages layers of the model's one kind."""
  count = cfg.num_layers // stages
  dense_moe = cfg.num_experts and not cfg.is_moe       # num_experts set, every layer in mlp_only_layers
  return dataclasses.replace(cfg, num_layers=count, decoder_sparse_step=1,
                             mlp_only_layers=tuple(range(count)) if dense_moe else ())


def _run_layers(stage_cfg: ModelConfig, abstract_rest, layers, x_btd, positions_bt, segment_ids_bt):
  """The stage's layers on one micro-batch: (output, router aux summed over the stage's sparse layers)."""
  model = decoder.bind(stage_cfg, dict(abstract_rest, layers=layers))   # only `layers` holds arrays
  mask_btt = decoder.attention_mask(positions_bt, segment_ids_bt)
  valid_bt = segment_ids_bt != 0
  acc = moe.empty_aux(stage_cfg.num_experts) if stage_cfg.is_moe else {}

  def step(layer, carry, _):
    x_btd, acc = carry
    x_btd, aux = layer.call_with_aux(x_btd, positions_bt, mask_btt, valid_bt)
    return x_btd, ({k: acc[k] + aux[k] for k in acc} if aux else acc)

  return model.scan_layers(step, (x_btd, acc))


def _schedule(run, schedule: Schedule, layers, x_mbtd, positions_mbt, segment_ids_mbt):
  """The GPipe loop on one stage (inside the shard_map): (outputs [M, b, T, D], weighted aux), both
  summed over stages so every stage returns the last stage's outputs."""
  stage = jax.lax.axis_index(STAGE_AXIS)
  last = schedule.stages - 1
  # Micro-batch m's share of the valid tokens: the aux of the whole batch for every key that is a token
  # mean (router_z_loss, expert_load, dropped_fraction); see pipelined_hidden for load_balance_loss.
  tokens_m = jnp.sum(segment_ids_mbt != 0, axis=(1, 2)).astype(F32)
  share_m = tokens_m / jnp.maximum(jnp.sum(tokens_m), 1.0)
  shift_btd = jnp.zeros_like(x_mbtd[0])
  outs, total = [], None
  for i in range(schedule.iterations):
    m = i - stage
    live = (m >= 0) & (m < schedule.micro)
    m = jnp.clip(m, 0, schedule.micro - 1)
    x_btd = jnp.where(stage == 0, x_mbtd[min(i, schedule.micro - 1)], shift_btd)
    x_btd = jnp.where(live, x_btd, jnp.zeros_like(x_btd))      # the bubble computes on zeros
    y_btd, aux = run(layers, x_btd, positions_mbt[m], segment_ids_mbt[m])
    weighted = {k: jnp.where(live, share_m[m] * v, jnp.zeros_like(v)) for k, v in aux.items()}
    total = weighted if total is None else {k: total[k] + weighted[k] for k in total}
    if i >= last:
      outs.append(y_btd)                        # micro-batch i - last, on the last stage
    shift_btd = jax.lax.ppermute(y_btd, STAGE_AXIS, [(s, s + 1) for s in range(last)])
  out_mbtd = jnp.where(stage == last, jnp.stack(outs), 0.0)
  return jax.lax.psum(out_mbtd, STAGE_AXIS), jax.lax.psum(total, STAGE_AXIS)


def _split(x, num_micro: int):
  """[B, ...] -> [M, B / M, ...], micro-batch m holding rows m, m + M, ... (as step.split_micro_batches)."""
  return x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:]).swapaxes(0, 1)


def pipelined_hidden(cfg: ModelConfig, params, tokens_bt: Int[Array, "B T"],
                     positions_bt: Int[Array, "B T"] | None = None,
                     segment_ids_bt: Int[Array, "B T"] | None = None, *, mesh: Mesh,
                     num_micro: int) -> tuple[Float[Array, "B T D"], dict]:
  """``decoder.hidden_with_aux`` with the layers run as a GPipe pipeline over ``mesh``'s stage axis.

  Same hidden states (float32 rounding aside: the rows are the same, the batch is cut differently);
  the router aux is summed over stages and micro-batches, each micro-batch weighted by its share of the
  valid tokens. That is the whole batch's value for router_z_loss, expert_load and dropped_fraction;
  load_balance_loss (a product of two token means per layer) becomes the token-weighted mean of the
  micro-batches' losses, as under the update's own micro-batching (so is an expert's capacity with
  ``moe_capacity_factor``: per micro-batch). Jit with ``cfg``, ``mesh`` and ``num_micro`` static; rows
  must split into ``num_micro`` micro-batches over the batch shards.
  """
  stages = num_stages(mesh)
  check_pipeline(cfg, stages, num_micro, rows=tokens_bt.shape[0], shards=batch_shards(mesh))
  if positions_bt is None:
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
  if segment_ids_bt is None:    # one segment per row: the same mask and the same valid tokens as None
    segment_ids_bt = jnp.ones_like(tokens_bt)
  model = decoder.bind(cfg, params)
  stage_cfg = _stage_config(cfg, stages)
  abstract_rest = {k: v for k, v in decoder.abstract_params(stage_cfg).items() if k != "layers"}
  run = functools.partial(_run_layers, stage_cfg, abstract_rest)
  # check_vma=False: an expert-parallel shard_map inside a stage (sharding/expert_parallel.py) fails
  # Shardy's verifier when the stage values carry their varying-over-'stage' type (JAX 0.10.2). Without
  # expert parallelism check_vma=True gave the same gradients; these are tested in both cases.
  fn = jax.shard_map(functools.partial(_schedule, run, Schedule(stages, num_micro)), mesh=mesh,
                     in_specs=(P(STAGE_AXIS), P(), P(), P()), out_specs=(P(), P()),
                     axis_names=frozenset({STAGE_AXIS}), check_vma=False)
  out_mbtd, aux = fn(params["layers"], _split(model.embed_tokens(tokens_bt), num_micro),
                     _split(positions_bt, num_micro), _split(segment_ids_bt, num_micro))
  x_btd = out_mbtd.swapaxes(0, 1).reshape(tokens_bt.shape + out_mbtd.shape[-1:])
  return model.final_norm(x_btd), {k: v / cfg.num_layers for k, v in aux.items()}
