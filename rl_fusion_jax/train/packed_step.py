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
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

from rl_fusion_jax import algorithms, distributed, models, shared_programs
from rl_fusion_jax.algorithms import registry
from rl_fusion_jax.config import AlgoConfig
from rl_fusion_jax.models import decoder
from rl_fusion_jax.queue.global_batch import global_batch, global_batch_once_per_group
from rl_fusion_jax.sharding import pipeline
from rl_fusion_jax.sharding.expert_parallel import with_expert_parallel
from rl_fusion_jax.sharding.rules import TRAIN_RULES
from rl_fusion_jax.sharding.mesh import BATCH_AXES, batch_sharding, batch_shards, num_stages, replicated
from rl_fusion_jax.train import packing
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.train.logprobs import head_logprobs
from rl_fusion_jax.train.state import TrainState



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
  proximal_logp_rw: jax.Array | None = None   # float32 [R, W]: as TrainBatch.proximal_logp_bt


# The fields a host PackedBatch carries (the proximal log-probs are computed on the device).
FIELDS = tuple(f.name for f in dataclasses.fields(PackedTrainBatch) if f.name != "proximal_logp_rw")


def packed_batch_shardings(mesh: Mesh, proximal: bool = False) -> PackedTrainBatch:
  b2 = batch_sharding(mesh, 2)
  return PackedTrainBatch(**{name: b2 for name in FIELDS}, proximal_logp_rw=b2 if proximal else None)


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
                   batch: PackedTrainBatch, weights, *, hidden_fn=decoder.hidden_with_aux, current_version=None):
  """``step.rl_loss`` on packed rows (router aux over the non-padding tokens)."""
  logp_rw, entropy_rw, aux = packed_token_logprobs(model_cfg, params, batch.tokens_rw, batch.positions_rw,
                                                   batch.segment_ids_rw, temperature, with_aux=True,
                                                   hidden_fn=hidden_fn)
  loss, sums = step_lib.rl_loss_from_logprobs(
      algo, logp_rw, entropy_rw, behaviour_logp_bt=batch.behaviour_logp_rw, advantages=batch.advantages_rw,
      mask_bt=batch.mask_rw, ref_logp_bt=batch.ref_logp_rw, weights=weights, proximal_logp_bt=batch.proximal_logp_rw,
      version_bt=batch.version_rw, current_version=current_version)
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
                   batch: PackedTrainBatch, bump_version: bool = True, skip_empty: bool = False):
  loss_w_rw = packed_token_weights(batch.mask_rw, batch.segment_ids_rw, algo.aggregation, norm_len=norm_len)
  weights = (loss_w_rw, algorithms.token_weights(batch.mask_rw, "token-mean"))
  loss_fn = functools.partial(packed_rl_loss, model_cfg, algo, temperature)
  num_micro = micro.num_micro(*batch.tokens_rw.shape, batch_shards(mesh))
  if num_stages(mesh) > 1:
    loss_fn, num_micro = pipelined_loss(model_cfg, algo, temperature, micro, mesh, pipeline_micro,
                                        *batch.tokens_rw.shape)
  loss_fn = functools.partial(loss_fn, current_version=state.policy_version)
  return step_lib.update(loss_fn, tx, num_micro, mesh, state, batch, weights, bump_version=bump_version,
                         skip_empty=skip_empty)


def check_packable(algo: AlgoConfig) -> None:
  if algo.policy_loss in registry.ROW_LEVEL_POLICY_LOSSES:   # it reduces over a row, which mixes samples
    raise ValueError(f"algo.policy_loss: {algo.policy_loss!r} reduces over a whole row, and a packed row "
                     "holds several samples; use the padded step (step.make_rl_step)")


@shared_programs.shared
def make_packed_rl_step(model_cfg, algo: AlgoConfig, temperature: float, tx,
                        micro: step_lib.MicroBatching | int, mesh: Mesh, norm_len: int, shardings: TrainState,
                        *, pipeline_micro: int = 0, rules=None, proximal: bool = False, skip_empty: bool = False):
  """``train_step(state, packed_batch) -> (state, metrics)``: one compile per row bucket, state donated.

  Same arguments as ``step.make_rl_step``; the batch's row count must be a multiple of
  ``batch_shards * micro.count`` (``packing.row_multiple``). With a token budget, each bucket's
  micro-batch count is derived from its rows and width (``step.micro_batch_count``). On a mesh with
  pipeline stages the layers run as a pipeline of ``pipeline_micro`` pieces per micro-batch
  (``optim.pipeline_micro_batches``; ``pipelined_loss``), and the rows must also be a multiple of
  ``batch_shards * micro.count * pieces``. ``rules``: the training rule table ``shardings`` came from
  (default TRAIN_RULES; an MoE policy's experts run expert-parallel in that layout). ``proximal``:
  batches carry ``proximal_logp_rw`` (several updates per batch). ``skip_empty``: micro-batches of padding
  rows only are skipped at run time (``step.update``; lay rows out with ``packing.plan(..., micro=...)`` so
  the padding rows make up whole micro-batches): with one fixed row count, compute still follows the rows
  used.
  """
  check_packable(algo)
  micro = step_lib.as_micro_batching(micro)
  fn = functools.partial(packed_rl_step, model_cfg, algo, temperature, tx, micro, mesh, norm_len,
                         pipeline_micro, bump_version=not proximal, skip_empty=skip_empty)
  fn = with_expert_parallel(fn, model_cfg, mesh, TRAIN_RULES if rules is None else rules)
  return jax.jit(fn, in_shardings=(shardings, packed_batch_shardings(mesh, proximal)),
                 out_shardings=(shardings, replicated(mesh)), donate_argnums=(0,))


# ----------------------------------------------------------------------------------------------------
# Packed rows placed straight from the host's samples: no padded batch on the devices, none fetched back.
# ----------------------------------------------------------------------------------------------------

@flax.struct.dataclass
class PackedRows:
  """A packed update's samples on the devices: the per-token fields as packed rows (split over the batch
  axes, rebuilt on the device from what the host sent, ``place_rows``) and, per sample, where it sits
  (replicated, [B]).
  Everything else of the rows (positions, segment ids, sample index, response mask) is derived on the
  device by ``row_layout``."""
  tokens_rw: jax.Array           # int32 [R, W]
  behaviour_logp_rw: jax.Array   # float32 [R, W]
  version_rw: jax.Array          # int32 [R, W]
  row_b: jax.Array               # int32 [B], -1: an empty sample (no row)
  start_b: jax.Array             # int32 [B]
  length_b: jax.Array            # int32 [B], prompt + response
  prompt_len_b: jax.Array        # int32 [B]
  segment_b: jax.Array           # int32 [B], 1.. in its row's column order
  ref_logp_rw: jax.Array | None = None   # float32 [R, W]: the reference log-probs, where they were sent


def _write_page(buffer, page, j):
  return jax.lax.dynamic_update_index_in_dim(buffer, page, j, 0)


class StreamPages:
  """A fixed-shape device buffer for the groups' streams of one row count: ``[pages, G * C, P]`` bytes
  (G data-parallel groups of C devices; P bytes per device and page, so a page holds C * P bytes of each
  group's stream), split over the batch axes like the streams. A stream crosses as whole pages, each put
  once per group (``global_batch_once_per_group``) and written into the buffer by one program of fixed
  shape, so the program that rebuilds the rows (``rows_from_stream``) sees one shape whatever the
  stream's length: nothing compiles when a batch's stream is longer or shorter than before. The buffer
  holds the most a group's rows can carry: ``rows / G * width`` tokens of ``token_bytes + 8`` bytes (a
  token id, its log-prob bits, a version of up to 4 bytes; 4 more with ``ref_logp``, the reference
  log-prob's bits; ``token_bytes`` alone with ``tokens_only``), in at most ``max_pages`` pages (a stream
  rounds up to a whole page: 1/64 of that at most, and a page to ``unit`` bytes per device)."""

  def __init__(self, mesh: Mesh, num_rows: int, width: int, token_bytes: int, max_pages: int = 64,
               ref_logp: bool = False, tokens_only: bool = False, unit: int = 256):
    self.mesh, self.groups = mesh, batch_shards(mesh)
    self.devices = mesh.size // self.groups
    per_token = token_bytes + (0 if tokens_only else 8 + (4 if ref_logp else 0))
    capacity = num_rows // self.groups * width * per_token
    self.device_bytes = unit * math.ceil(capacity / (max_pages * self.devices * unit))
    self.page_bytes = self.devices * self.device_bytes       # of one group's stream
    self.pages = math.ceil(capacity / self.page_bytes)
    shape = (self.pages, self.groups * self.devices, self.device_bytes)
    self.sharding = NamedSharding(mesh, P(None, BATCH_AXES, None))
    # Made on the first put: only a process that places rows runs a program on this mesh (in the separated
    # deployment the rollout process builds these programs too, and must not).
    self._zeros = shared_programs.jit(jnp.zeros, shape, packing.STREAM_DTYPE, out_shardings=self.sharding)
    self.buffer = None
    self._write = shared_programs.jit(_write_page, donate_argnums=(0,), out_shardings=self.sharding)

  def put(self, bytes_gn: np.ndarray) -> tuple[jax.Array, int, int]:
    """A ``pack_stream(..., page=page_bytes)`` stream ([G, k * page_bytes]) -> (the buffer holding it in
    its first k pages, the most bytes sent to one device, the bytes this process sent)."""
    pages = bytes_gn.shape[1] // self.page_bytes
    if bytes_gn.shape[1] % self.page_bytes or pages > self.pages:
      raise ValueError(f"a stream of {bytes_gn.shape[1]} bytes per group is not a whole number of pages of "
                       f"{self.page_bytes} bytes within the buffer's {self.pages}")
    most = here = 0
    if self.buffer is None:
      self.buffer = self._zeros()
    for j in range(pages):
      part = bytes_gn[:, j * self.page_bytes:(j + 1) * self.page_bytes].reshape(-1, self.device_bytes)
      page, sent, mine = global_batch_once_per_group(batch_sharding(self.mesh, 2), part.shape, part.dtype,
                                                     lambda a, b, part=part: part[a:b])
      self.buffer = self._write(self.buffer, page, np.int32(j))
      most, here = most + sent, here + mine
    return self.buffer, most, here


def place_rows(mesh: Mesh, layout: packing.Layout, *, tokens_bt, behaviour_logp_bt, version_bt, prompt_len_b,
               vocab_size: int, max_version_span: int = 0, padded_width: int | None = None,
               pages: StreamPages | None = None, ref_logp_bt=None,
               tokens_only: bool = False, version_range: tuple[int, int] | None = None, held_b=None
               ) -> tuple[PackedRows, dict[str, float]]:
  """Host samples (right-padded rows, any width >= their lengths) -> ``PackedRows`` on ``mesh``, and the
  bytes put.

  What crosses is each data-parallel group's ``packing.Stream``: its samples' real tokens
  (``packing.value_bytes(vocab_size)`` bytes each), their response tokens' behaviour log-probs (float32
  bits) and versions (above the batch's lowest, in ``value_bytes(max_version_span + 1)`` bytes, more where
  the batch's span needs them), back to back, the stream length bucketed; no row padding and no prompt
  log-probs or versions cross; the per-sample numbers cross as 16-bit values where they fit. A group's
  stream is sent once (``global_batch_once_per_group``) and rebuilt into the group's rows on the device
  (``rows_from_stream``): the rows ``layout.pack`` builds on the host. Take ``layout`` from
  ``packing.plan(..., groups=batch_shards(mesh))`` so the groups' streams are alike in length.
  Bytes: ``host_to_device`` (the streams, once per group, and 6 numbers per sample + 1), its padded
  equivalent ``host_to_device_padded`` (tokens, log-probs and versions as int32 / float32
  [B, padded_width] rows, what the padded update places, and the same per-sample numbers; default width:
  the longest sample's ``step.train_width`` bucket) and
  ``host_to_device_per_device`` (the most one device was sent: its part of its group's stream and the
  replicated per-sample numbers), ``host_to_device_this_host`` (what this process sent: the parts of its
  own groups' streams, and the per-sample numbers once); ``stream_bytes`` (each group's stream length)
  and ``stream_used_bytes`` (the bytes holding samples, all groups). ``pages``: the stream crosses as whole pages into that buffer
  (``StreamPages``; its length a number of pages rather than a bucket), so the rows are rebuilt by one
  program for every stream length. ``ref_logp_bt``: the reference's log-probs too (right-padded rows, as
  the other token fields), their response tokens' float32 bits in the stream (``ref_logp_rw``); the
  padded equivalent then counts 4 fields a token. ``tokens_only``: the token ids alone cross (the rows'
  log-probs 0.0 and versions -1; ``behaviour_logp_bt`` and ``version_bt`` are not read), the padded
  equivalent one field a token. ``version_range``, ``held_b``: ``packing.pack_stream``'s (the batch's lowest
  and highest versions and the samples this process holds, where it holds only its own groups')."""
  groups = batch_shards(mesh)
  if layout.num_rows % groups:
    raise ValueError(f"{layout.num_rows} packed rows do not split over data*fsdp={groups} "
                     "batch shards; take the row buckets from packing.row_multiple")
  per_group_devices = mesh.size // groups
  fmt = packing.StreamFormat(packing.value_bytes(vocab_size), packing.value_bytes(max_version_span + 1),
                             ref_logp=ref_logp_bt is not None, tokens_only=tokens_only)
  stream = packing.pack_stream(layout, groups, fmt, tokens_bt=tokens_bt, behaviour_logp_bt=behaviour_logp_bt,
                               version_bt=version_bt, prompt_len_b=prompt_len_b, multiple=per_group_devices,
                               page=pages.page_bytes if pages is not None else 0, ref_logp_bt=ref_logp_bt,
                               version_range=version_range, held_b=held_b)
  if pages is not None:
    data, most, here = pages.put(stream.bytes_gn)
  else:
    # [G * C, N / C]: each of a group's C devices is sent a distinct C-th of its stream, gathered on the device.
    data = stream.bytes_gn.reshape(groups * per_group_devices, -1)
    data, most, here = global_batch_once_per_group(batch_sharding(mesh, 2), data.shape, data.dtype,
                                                   lambda a, b: data[a:b])
  # Per sample: row + 1 (0: empty), start, length, prompt length, segment id, stream offset, in 16 bits
  # where every value fits (int32 otherwise).
  table = np.stack([layout.row_b + 1, layout.start_b, layout.length_b, np.asarray(prompt_len_b, np.int64),
                    layout.segment_b(), stream.offset_b])
  table = table.astype(np.uint16 if table.max(initial=0) < 2 ** 16 else np.int32)
  # distributed.put: of several processes each fills its own devices (jax.device_put would first check with
  # a collective that every process passed the same value).
  table_dev, base = distributed.put((table, np.int32(stream.version_base)), replicated(mesh))
  rows = _rows_from_stream_fn(mesh, layout.num_rows, layout.width, stream.fmt, pages is not None)(data, table_dev, base)
  sample_bytes = table.nbytes + 4
  width = padded_width or step_lib.train_width(int(layout.length_b.max(initial=0)), layout.width)
  return rows, {"stream_bytes": float(stream.bytes_gn.shape[1]), "stream_used_bytes": float(stream.used_bytes),
                "host_to_device": float(stream.bytes_gn.nbytes + sample_bytes),
                "host_to_device_padded": float((1 if tokens_only else 3 + fmt.ref_logp) * 4 * len(layout.length_b)
                                               * width + sample_bytes),
                "host_to_device_per_device": float(most + sample_bytes),
                "host_to_device_this_host": float(here + sample_bytes)}


def rows_from_stream(data_xl, table_6b, version_base, *, num_rows: int, width: int, groups: int,
                     fmt: packing.StreamFormat) -> PackedRows:
  """Groups' ``packing.Stream`` bytes ([G * C, N / C], group-major, or ``StreamPages``' buffer
  [pages, G * C, P]: page j holds bytes [j * C * P, (j + 1) * C * P) of each group's stream) and the
  per-sample table (row + 1,
  start, length, prompt length, segment id, stream offset; [6, B]) -> ``PackedRows``: the token fields
  [num_rows, width] as ``packing.Layout`` lays them out, ``packing.PAD`` outside the samples and 0.0 / -1
  on prompt tokens (as in ``Rollout``). Row r reads its group's stream (group r // (num_rows / groups))."""
  row_b, start_b, length_b, prompt_len_b, segment_b, offset_b = table_6b.astype(jnp.int32)
  row_b = row_b - 1
  if data_xl.ndim == 3:
    pages, _, per_device = data_xl.shape
    data_xl = data_xl.reshape(pages, groups, -1, per_device).transpose(1, 0, 2, 3)
  data_gn = data_xl.reshape(groups, -1).astype(jnp.uint32)
  n = data_gn.shape[1]
  k_rw, pos_rw, inside = covering(num_rows, width, row_b, start_b, length_b)
  prompt_rw, offset_rw, length_rw = prompt_len_b[k_rw], offset_b[k_rw], length_b[k_rw]
  response = inside & (pos_rw >= prompt_rw)
  j_rw = pos_rw - prompt_rw

  def value(at_rw, nbytes: int):    # little-endian, nbytes from at_rw in the row's group stream
    out = None
    for i in range(nbytes):
      index_gm = jnp.clip(at_rw + i, 0, n - 1).reshape(groups, -1)
      byte = jnp.take_along_axis(data_gn, index_gm, axis=1).reshape(num_rows, width) << (8 * i)
      out = byte if out is None else out | byte
    return out

  tb, vb = fmt.token_bytes, fmt.version_bytes
  tokens_rw = jnp.where(inside, value(offset_rw + tb * pos_rw, tb), 0).astype(jnp.int32)
  if fmt.tokens_only:     # no log-probs or versions crossed: 0.0 / -1 everywhere
    return PackedRows(tokens_rw=tokens_rw, behaviour_logp_rw=jnp.zeros((num_rows, width), jnp.float32),
                      version_rw=jnp.full((num_rows, width), -1, jnp.int32), row_b=row_b, start_b=start_b,
                      length_b=length_b, prompt_len_b=prompt_len_b, segment_b=segment_b, ref_logp_rw=None)
  base = offset_rw + tb * length_rw
  bits = value(base + 4 * j_rw, 4)
  version = value(base + 4 * (length_rw - prompt_rw) + vb * j_rw, vb).astype(jnp.int32) + version_base
  as_float = lambda bits_rw: jnp.where(response, jax.lax.bitcast_convert_type(bits_rw, jnp.float32), 0.0)
  ref = as_float(value(base + (4 + vb) * (length_rw - prompt_rw) + 4 * j_rw, 4)) if fmt.ref_logp else None
  return PackedRows(tokens_rw=tokens_rw, behaviour_logp_rw=as_float(bits),
                    version_rw=jnp.where(response, version, -1), row_b=row_b, start_b=start_b, length_b=length_b,
                    prompt_len_b=prompt_len_b, segment_b=segment_b, ref_logp_rw=ref)


@functools.lru_cache(maxsize=32)
def _rows_from_stream_fn(mesh: Mesh, num_rows: int, width: int, fmt: packing.StreamFormat, paged: bool = False):
  b2, rep = batch_sharding(mesh, 2), replicated(mesh)
  out = PackedRows(b2, b2, b2, rep, rep, rep, rep, rep, b2 if fmt.ref_logp else None)
  fn = functools.partial(rows_from_stream, num_rows=num_rows, width=width, groups=batch_shards(mesh), fmt=fmt)
  b2_in = NamedSharding(mesh, P(None, BATCH_AXES, None)) if paged else b2
  return jax.jit(fn, in_shardings=(b2_in, rep, rep), out_shardings=out)


def covering(num_rows: int, width: int, row_k, start_k, length_k):
  """Which of K samples placed at (``row_k``, ``start_k``) with ``length_k`` tokens covers each position of
  [num_rows, width] rows -> (k_rw: its index, clipped to 0 on padding; pos_rw: the position within it;
  inside_rw: the position is one of its tokens). Samples of length 0 or row -1 take no place."""
  k = jnp.arange(row_k.shape[0], dtype=jnp.int32)
  row_k = jnp.where((row_k >= 0) & (length_k > 0), row_k, num_rows)      # empty: dropped by the scatters
  owner_rw = jnp.full((num_rows, width), -1, jnp.int32).at[row_k, start_k].set(k, mode="drop")
  opened_rw = jnp.zeros((num_rows, width), jnp.int32).at[row_k, start_k].set(start_k + 1, mode="drop")
  start_rw = jax.lax.cummax(opened_rw, axis=1) - 1          # where the sample covering each column began
  k_rw = jnp.maximum(jnp.take_along_axis(owner_rw, jnp.maximum(start_rw, 0), axis=1), 0)
  pos_rw = jnp.arange(width, dtype=jnp.int32)[None, :] - start_rw
  return k_rw, pos_rw, (start_rw >= 0) & (pos_rw < length_k[k_rw])


def row_layout(rows: PackedRows):
  """(positions_rw, segment_ids_rw, sample_rw, mask_rw) of the packed rows, from the per-sample layout:
  positions restart at 0 per sample, segment ids as ``packing``'s, sample_rw the sample's index (-1 on
  padding), mask_rw 1 on response tokens (from the prompt length to the sample's end)."""
  s_rw, pos_rw, inside = covering(*rows.tokens_rw.shape, rows.row_b, rows.start_b, rows.length_b)
  return (jnp.where(inside, pos_rw, 0), jnp.where(inside, rows.segment_b[s_rw], 0), jnp.where(inside, s_rw, -1),
          (inside & (pos_rw >= rows.prompt_len_b[s_rw])).astype(jnp.float32))


@shared_programs.shared
def make_row_layout(mesh: Mesh):
  """``row_layout`` jitted, its outputs split over the batch axes like the rows."""
  b2 = batch_sharding(mesh, 2)
  return jax.jit(row_layout, out_shardings=(b2, b2, b2, b2))


@shared_programs.shared
def make_packed_logprob_fn(model_cfg, temperature: float, mesh: Mesh, param_shardings, rules=None,
                           skip_micro: int = 1):
  """``fn(params, tokens_rw, positions_rw, segment_ids_rw) -> logp_rw`` (e.g. reference log-probs on
  packed rows, equal to ``step.make_logprob_fn``'s on each sample's own padded row), one compile per row
  bucket. ``skip_micro`` > 1: the rows run in that many micro-batches (rows m, m + M, ...,
  ``step.split_micro_batches``, as the update splits them) and a micro-batch of padding rows only
  (segment ids all 0) is skipped at run time (log-probs 0)."""
  b2 = batch_sharding(mesh, 2)
  forward = lambda params, tokens_rw, positions_rw, segment_ids_rw: packed_token_logprobs(
      model_cfg, params, tokens_rw, positions_rw, segment_ids_rw, temperature)[0]

  def fn(params, tokens_rw, positions_rw, segment_ids_rw):
    if skip_micro == 1:
      return forward(params, tokens_rw, positions_rw, segment_ids_rw)
    micro = step_lib.split_micro_batches((tokens_rw, positions_rw, segment_ids_rw), skip_micro, mesh)
    empty = jax.eval_shape(forward, params, *jax.tree.map(lambda x: x[0], micro))

    def body(_, mb):
      out = jax.lax.cond(jnp.any(mb[2] != 0), lambda m: forward(params, *m),
                         lambda m: jnp.zeros(empty.shape, empty.dtype), mb)
      return None, out

    _, out_mrw = jax.lax.scan(body, None, micro)
    return jax.lax.with_sharding_constraint(out_mrw.swapaxes(0, 1).reshape(tokens_rw.shape), b2)

  fn = with_expert_parallel(fn, model_cfg, mesh, TRAIN_RULES if rules is None else rules)
  return jax.jit(fn, in_shardings=(param_shardings, b2, b2, b2), out_shardings=b2)


def mini_batch_rows(batch: PackedTrainBatch, row_b, start_b, length_b, sub_row_k, sub_start_k, index_k, *,
                    num_rows: int) -> PackedTrainBatch:
  """Samples ``index_k`` of ``batch`` (laid out by ``row_b`` / ``start_b`` / ``length_b``, [B]) repacked into
  ``num_rows`` rows at ``sub_row_k`` / ``sub_start_k`` (e.g. a mini-batch's ``packing.plan``): every field
  is carried over token by token, segment ids are renumbered per row. Only the [K] placement crosses from
  the host; the positions each token comes from are ``packing.source_map``'s, derived here."""
  width = batch.tokens_rw.shape[1]
  k_rw, pos_rw, real = covering(num_rows, width, sub_row_k, sub_start_k, length_b[index_k])
  b_rw = index_k[k_rw]
  src = jnp.where(real, row_b[b_rw] * width + start_b[b_rw] + pos_rw, 0)
  take = lambda x_rw, fill: jnp.where(real, x_rw.reshape(-1)[src], fill)
  return PackedTrainBatch(
      tokens_rw=take(batch.tokens_rw, 0), positions_rw=jnp.where(real, pos_rw, 0),
      segment_ids_rw=jnp.where(real, jnp.cumsum(real & (pos_rw == 0), axis=1, dtype=jnp.int32), 0),
      mask_rw=take(batch.mask_rw, 0.0), advantages_rw=take(batch.advantages_rw, 0.0),
      behaviour_logp_rw=take(batch.behaviour_logp_rw, 0.0), ref_logp_rw=take(batch.ref_logp_rw, 0.0),
      version_rw=take(batch.version_rw, -1), proximal_logp_rw=take(batch.proximal_logp_rw, 0.0))


@shared_programs.shared
def make_mini_batch_rows(mesh: Mesh):
  """``mini_batch_rows`` jitted (``num_rows`` static: one compile per pair of row buckets), its output
  split over the batch axes."""
  return jax.jit(mini_batch_rows, static_argnames=("num_rows",),
                 out_shardings=packed_batch_shardings(mesh, proximal=True))
