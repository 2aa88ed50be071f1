"""The RL update on packed rows: several samples per row, the same loss and gradients as the padded step.

Rows come from ``train/packing.py`` ([R, W]: tokens, positions restarting per sample, segment ids 1..k
with 0 = padding, and per-token mask, advantage, behaviour / reference log-probs, version). Three things
differ from ``step.make_rl_step``, and each is chosen so that the loss is the padded one:

* Log-probs run the model with positions and segment ids (attention never crosses samples), and the
  log-prob of a token at position 0 (a sample's first token, or padding) is 0, as at t = 0 of a padded
  row: the logits before it belong to the previous sample and predict nothing.
* Aggregation weights are computed from segment ids: each sample's token count and the number of
  non-empty samples come from per-row segment sums, never from the row's length, so every mode of
  ``algorithms.token_weights`` gives the padded weights (exactly: they are integer counts).
* Advantages are per token ([R, W]); the policy losses accept [B, T] advantages as they are.

The step is jitted once per row count (bucket): the width is fixed, so R is the only shape that varies;
under a token budget each bucket takes its own micro-batch count (``step.MicroBatching``).
This module must never call the model outside the loss, build a padded [B, T] copy of the batch on the
device, or use a policy loss that reduces over a whole row (``tis_seq``: a row holds several samples).
"""
from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from rl_fusion_jax import algorithms, models
from rl_fusion_jax.config import AlgoConfig
from rl_fusion_jax.models import decoder
from rl_fusion_jax.queue.global_batch import global_batch
from rl_fusion_jax.sharding import pipeline
from rl_fusion_jax.sharding.expert_parallel import with_expert_parallel
from rl_fusion_jax.sharding.rules import TRAIN_RULES
from rl_fusion_jax.sharding.mesh import batch_sharding, batch_shards, num_stages, replicated
from rl_fusion_jax.train import packing
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.train.logprobs import head_logprobs
from rl_fusion_jax.train.state import TrainState

# Policy losses that reduce over the time axis of a row: on a packed row they would mix samples.
ROW_LEVEL_POLICY_LOSSES = ("tis_seq",)


@flax.struct.dataclass
class PackedTrainBatch:
  """``packing.PackedBatch`` on the devices (without the host-side index map)."""
  tokens_rw: jax.Array          # int32 [R, W]
  positions_rw: jax.Array       # int32 [R, W]
  segment_ids_rw: jax.Array     # int32 [R, W], 0 = padding
  mask_rw: jax.Array            # float32 [R, W]
  advantages_rw: jax.Array      # float32 [R, W]
  behaviour_logp_rw: jax.Array  # float32 [R, W]
  ref_logp_rw: jax.Array        # float32 [R, W]
  version_rw: jax.Array         # int32 [R, W]


FIELDS = tuple(f.name for f in dataclasses.fields(PackedTrainBatch))


def packed_batch_shardings(mesh: Mesh) -> PackedTrainBatch:
  return PackedTrainBatch(**{name: batch_sharding(mesh, 2) for name in FIELDS})


def device_batch(mesh: Mesh, packed: packing.PackedBatch) -> PackedTrainBatch:
  """Host PackedBatch -> global [R, W] arrays split over the batch axes, each shard's rows read once."""
  if packed.layout.num_rows % batch_shards(mesh):
    raise ValueError(f"{packed.layout.num_rows} packed rows do not split over data*fsdp={batch_shards(mesh)} "
                     "batch shards; take the row buckets from packing.row_multiple")

  def put(name):
    x_rw = getattr(packed, name)
    return global_batch(batch_sharding(mesh, 2), x_rw.shape, x_rw.dtype, lambda a, b: x_rw[a:b])
  return PackedTrainBatch(**{name: put(name) for name in FIELDS})


def packed_token_logprobs(model_cfg: models.ModelConfig, params, tokens_rw: Int[Array, "R W"],
                          positions_rw: Int[Array, "R W"], segment_ids_rw: Int[Array, "R W"],
                          temperature: float = 1.0, *, with_aux: bool = False,
                          hidden_fn=decoder.hidden_with_aux):
  """(logp_rw, entropy_rw) of packed rows, aligned with ``tokens_rw``; both 0 where position == 0.

  logp_rw[r, w] = log pi(token w | the earlier tokens of its own sample), as ``token_logprobs`` on the
  sample's own padded row. With ``with_aux`` the MoE router aux over the non-padding tokens is appended.
  ``hidden_fn``: ``decoder.hidden_with_aux`` or a function computing the same (``pipelined_loss``).
  """
  hidden_rwd, aux = hidden_fn(model_cfg, params, tokens_rw[:, :-1], positions_bt=positions_rw[:, :-1],
                              segment_ids_bt=segment_ids_rw[:, :-1])
  logp_rw, entropy_rw = head_logprobs(model_cfg, params, hidden_rwd, tokens_rw[:, 1:], temperature,
                                      with_entropy=True)
  starts_rw = positions_rw[:, 1:] == 0    # the target opens a sample (or is padding): nothing predicts it
  pad = lambda x_rw: jnp.pad(jnp.where(starts_rw, 0.0, x_rw), ((0, 0), (1, 0)))
  return (pad(logp_rw), pad(entropy_rw)) + ((aux,) if with_aux else ())


def sample_token_counts(mask_rw: Float[Array, "R W"], segment_ids_rw: Int[Array, "R W"]
                        ) -> tuple[Float[Array, "R W"], Float[Array, ""]]:
  """(each token's sample's mask count, number of samples with a non-empty mask), from segment sums."""
  width = mask_rw.shape[1]
  count = lambda m_w, s_w: jax.ops.segment_sum(m_w, s_w, num_segments=width + 1)
  count_rs = jax.vmap(count)(mask_rw.astype(jnp.float32), segment_ids_rw).at[:, 0].set(0.0)
  num_samples = jnp.sum(count_rs > 0).astype(jnp.float32)
  return jnp.take_along_axis(count_rs, segment_ids_rw, axis=1), num_samples


def _guarded_div(num, den):
  nonzero = den != 0
  return jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)


def packed_token_weights(mask_rw: Float[Array, "R W"], segment_ids_rw: Int[Array, "R W"], mode: str, *,
                         norm_len: float | None = None) -> Float[Array, "R W"]:
  """``algorithms.token_weights`` of the unpacked samples, laid out like the packed rows.

  Per-sequence normalisations use each sample's token count (segment sums), never the row's.
  """
  algorithms.check_aggregation_mode(mode, norm_len)
  mask_rw = mask_rw.astype(jnp.float32)
  if mode == "token-mean":
    return algorithms.token_weights(mask_rw, mode)
  len_rw, num_samples = sample_token_counts(mask_rw, segment_ids_rw)
  if mode == "seq-mean-token-mean":
    return _guarded_div(mask_rw, len_rw * num_samples)
  return _guarded_div(mask_rw, jnp.float32(norm_len) * num_samples)


def packed_rl_loss(model_cfg: models.ModelConfig, algo: AlgoConfig, temperature: float, params,
                   batch: PackedTrainBatch, weights, *, hidden_fn=decoder.hidden_with_aux):
  """``step.rl_loss`` on packed rows (router aux over the non-padding tokens)."""
  logp_rw, entropy_rw, aux = packed_token_logprobs(model_cfg, params, batch.tokens_rw, batch.positions_rw,
                                                   batch.segment_ids_rw, temperature, with_aux=True,
                                                   hidden_fn=hidden_fn)
  loss, sums = step_lib.rl_loss_from_logprobs(
      algo, logp_rw, entropy_rw, behaviour_logp_bt=batch.behaviour_logp_rw, advantages=batch.advantages_rw,
      mask_bt=batch.mask_rw, ref_logp_bt=batch.ref_logp_rw, weights=weights)
  return step_lib.add_router_aux(model_cfg, loss, sums, aux, weights)


def pipelined_loss(model_cfg, algo: AlgoConfig, temperature: float, micro: step_lib.MicroBatching, mesh: Mesh,
                   pieces: int, rows: int, width: int):
  """(loss_fn, micro-batch count) of the update on a mesh with pipeline stages (``mesh.stage`` > 1).

  The loss is ``packed_rl_loss`` with the layers run as a GPipe pipeline (``sharding/pipeline.py``), each
  micro-batch in ``pieces`` pieces (0: one per stage). The micro-batch count keeps the token budget's
  meaning (positions per device per micro-batch) and divides rows / (batch shards * pieces), so every
  micro-batch splits into whole pieces on every batch shard.
  """
  pieces = pieces or num_stages(mesh)
  pipeline.check_pipeline(model_cfg, num_stages(mesh), pieces, rows=rows, shards=batch_shards(mesh))
  hidden = functools.partial(pipeline.pipelined_hidden, mesh=mesh, num_micro=pieces)
  loss_fn = functools.partial(packed_rl_loss, model_cfg, algo, temperature, hidden_fn=hidden)
  return loss_fn, micro.num_micro(rows // pieces, width * pieces, batch_shards(mesh))


def packed_rl_step(model_cfg, algo: AlgoConfig, temperature: float, tx, micro: step_lib.MicroBatching,
                   mesh: Mesh, norm_len: int, pipeline_micro: int, state: TrainState,
                   batch: PackedTrainBatch):
  loss_w_rw = packed_token_weights(batch.mask_rw, batch.segment_ids_rw, algo.aggregation, norm_len=norm_len)
  weights = (loss_w_rw, algorithms.token_weights(batch.mask_rw, "token-mean"))
  loss_fn = functools.partial(packed_rl_loss, model_cfg, algo, temperature)
  num_micro = micro.num_micro(*batch.tokens_rw.shape, batch_shards(mesh))
  if num_stages(mesh) > 1:
    loss_fn, num_micro = pipelined_loss(model_cfg, algo, temperature, micro, mesh, pipeline_micro,
                                        *batch.tokens_rw.shape)
  return step_lib.update(loss_fn, tx, num_micro, mesh, state, batch, weights, bump_version=True)


def check_packable(algo: AlgoConfig) -> None:
  if algo.policy_loss in ROW_LEVEL_POLICY_LOSSES:
    raise ValueError(f"algo.policy_loss: {algo.policy_loss!r} reduces over a whole row, and a packed row "
                     "holds several samples; use the padded step (step.make_rl_step)")


def make_packed_rl_step(model_cfg, algo: AlgoConfig, temperature: float, tx,
                        micro: step_lib.MicroBatching | int, mesh: Mesh, norm_len: int, shardings: TrainState,
                        *, pipeline_micro: int = 0, rules=None):
  """``train_step(state, packed_batch) -> (state, metrics)``: one compile per row bucket, state donated.

  Same arguments as ``step.make_rl_step``; the batch's row count must be a multiple of
  ``batch_shards * micro.count`` (``packing.row_multiple``). With a token budget, each bucket's
  micro-batch count is derived from its rows and width (``step.micro_batch_count``). On a mesh with
  pipeline stages the layers run as a pipeline of ``pipeline_micro`` pieces per micro-batch
  (``optim.pipeline_micro_batches``; ``pipelined_loss``), and the rows must also be a multiple of
  ``batch_shards * micro.count * pieces``. ``rules``: the training rule table ``shardings`` came from
  (default TRAIN_RULES; an MoE policy's experts run expert-parallel in that layout).
  """
  check_packable(algo)
  micro = step_lib.as_micro_batching(micro)
  fn = functools.partial(packed_rl_step, model_cfg, algo, temperature, tx, micro, mesh, norm_len,
                         pipeline_micro)
  fn = with_expert_parallel(fn, model_cfg, mesh, TRAIN_RULES if rules is None else rules)
  return jax.jit(fn, in_shardings=(shardings, packed_batch_shardings(mesh)),
                 out_shardings=(shardings, replicated(mesh)), donate_argnums=(0,))
