"""Host-side sequence packing: samples of different lengths laid several to a row of fixed width W.

A sample is its prompt followed by its response (``length = prompt_len + response_len``), read from a
right-padded row ``x_bt[b, :length_b]``. ``plan`` places whole samples into rows by first-fit decreasing
(longest first, ties in sample order; deterministic), then rounds the row count up to one of a few
buckets, so the jitted packed step compiles once per bucket, never once per batch. Every bucket is a
multiple of ``batch_shards * micro_batches``: each micro-batch then splits evenly over the batch axes.

In a packed row, sample k (k = 1, 2, ...) has segment id k and positions 0, 1, ... (they restart per
sample); padding has segment id 0, position 0, mask 0. Per-sample values (the advantage) are broadcast
over the sample's tokens. ``Layout`` is the index map both ways: ``pack`` and ``unpack`` are inverses on
each sample's tokens.

This module never imports jax, never splits a sample across rows, and never drops a sample: a sample
longer than the row width is an error.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from jaxtyping import Float, Int, Shaped

# Fill values outside every sample, per field (version -1 as in Rollout: "no policy produced this").
PAD = {"tokens": 0, "positions": 0, "segment_ids": 0, "sample": -1, "mask": 0.0, "advantages": 0.0,
       "behaviour_logp": 0.0, "ref_logp": 0.0, "version": -1}


def row_multiple(batch_shards: int, micro_batches: int) -> int:
  """Row counts must be multiples of this: each of the micro-batches splits over the batch shards."""
  if batch_shards < 1 or micro_batches < 1:
    raise ValueError(f"batch_shards={batch_shards} and micro_batches={micro_batches} must be >= 1")
  return batch_shards * micro_batches


def _smooth_ceil(x: float) -> int:
  """The smallest 2^a * 3^b >= x."""
  best, three = 2 ** math.ceil(math.log2(max(x, 1.0)) - 1e-9), 1
  while three < x:
    three *= 3
    best = min(best, three * 2 ** max(0, math.ceil(math.log2(x / three) - 1e-9)))
  return best


def row_buckets(num_samples: int, multiple: int, per_doubling: int = 1) -> tuple[int, ...]:
  """Row counts ``multiple * s`` below the all-rows case, s the smallest 2^a * 3^b >= 2 ** (k / per_doubling),
  then that case (``num_samples`` rounded up to a multiple).

  One sample per row always fits (a sample never exceeds the width), so the last bucket always does. More
  steps per doubling waste fewer padding rows and cost more compiles (one per bucket used). The factors
  2^a * 3^b (1, 2, 3, 4, 6, 8, 12, 16, 24, ...) have many divisors, so a token budget can split a bucket
  into micro-batches of about the budgeted size (``step.micro_batch_count``).
  """
  if per_doubling < 1:
    raise ValueError(f"per_doubling must be >= 1, got {per_doubling}")
  top = max(multiple, math.ceil(num_samples / multiple) * multiple)
  buckets, k = set(), 0
  while (rows := _smooth_ceil(2 ** (k / per_doubling)) * multiple) < top:
    buckets.add(rows)
    k += 1
  return tuple(sorted(buckets)) + (top,)


def check_buckets(buckets, multiple: int) -> tuple[int, ...]:
  buckets = tuple(sorted(int(b) for b in buckets))
  bad = [b for b in buckets if b < 1 or b % multiple]
  if not buckets or bad:
    raise ValueError(f"row buckets {buckets}: each must be a positive multiple of {multiple} "
                     "(batch_shards * micro_batches)")
  return buckets


def choose_rows(rows_needed: int, buckets) -> int:
  """The smallest bucket holding ``rows_needed`` rows."""
  fits = [b for b in sorted(buckets) if b >= rows_needed]
  if not fits:
    raise ValueError(f"{rows_needed} packed rows needed; the largest row bucket is {max(buckets)}")
  return fits[0]


def first_fit_decreasing(length_b: Int[np.ndarray, "B"], width: int
                         ) -> tuple[Int[np.ndarray, "B"], Int[np.ndarray, "B"], int]:
  """(row_b, start_b, rows used): each sample in the first row with room, longest samples first.

  Empty samples (length 0) take no room and no row (row -1).
  """
  length_b = np.asarray(length_b, np.int64)
  if length_b.ndim != 1 or (length_b < 0).any():
    raise ValueError(f"lengths must be a 1-D array of values >= 0, got {length_b}")
  if len(length_b) and length_b.max() > width:
    raise ValueError(f"sample {int(length_b.argmax())} has {int(length_b.max())} tokens; "
                     f"rows hold {width}")
  row_b, start_b = np.full(len(length_b), -1, np.int64), np.zeros(len(length_b), np.int64)
  used_r = np.zeros(len(length_b), np.int64)     # tokens placed per row (at most one row per sample)
  rows = 0
  for b in np.argsort(-length_b, kind="stable"):
    if length_b[b] == 0:
      continue
    r = int(np.flatnonzero(used_r[:rows + 1] + length_b[b] <= width)[0])
    row_b[b], start_b[b] = r, used_r[r]
    used_r[r] += length_b[b]
    rows = max(rows, r + 1)
  return row_b, start_b, rows


@dataclasses.dataclass(frozen=True)
class Layout:
  """Sample b occupies row ``row_b[b]``, columns ``start_b[b] : start_b[b] + length_b[b]``."""
  row_b: np.ndarray
  start_b: np.ndarray
  length_b: np.ndarray
  num_rows: int
  width: int
  rows_used: int

  def _token_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sample, offset, row, column) of every real token, one entry per token."""
    sample = np.repeat(np.arange(len(self.length_b)), self.length_b)
    offset = np.arange(len(sample)) - np.repeat(np.cumsum(self.length_b) - self.length_b, self.length_b)
    return sample, offset, self.row_b[sample], self.start_b[sample] + offset

  def pack(self, x_bt: Shaped[np.ndarray, "B T"], fill=0) -> Shaped[np.ndarray, "R W"]:
    """Right-padded rows [B, >= max length] -> packed [R, W] (``fill`` outside every sample)."""
    x_bt = np.asarray(x_bt)
    if x_bt.shape[0] != len(self.length_b) or (len(self.length_b) and x_bt.shape[1] < self.length_b.max()):
      raise ValueError(f"pack: rows of shape {x_bt.shape} for {len(self.length_b)} samples of up to "
                       f"{self.length_b.max(initial=0)} tokens")
    sample, offset, row, col = self._token_index()
    out_rw = np.full((self.num_rows, self.width), fill, x_bt.dtype)
    out_rw[row, col] = x_bt[sample, offset]
    return out_rw

  def pack_per_sample(self, x_b: Shaped[np.ndarray, "B"], fill=0) -> Shaped[np.ndarray, "R W"]:
    """One value per sample [B] -> [R, W], broadcast over the sample's tokens."""
    x_b = np.asarray(x_b)
    return self.pack(np.broadcast_to(x_b[:, None], (len(x_b), max(1, self.length_b.max(initial=0)))), fill)

  def unpack(self, x_rw: Shaped[np.ndarray, "R W"], seq_len: int, fill=0) -> Shaped[np.ndarray, "B T"]:
    """Packed [R, W] -> right-padded [B, seq_len]: the inverse of ``pack`` on every sample's tokens."""
    x_rw = np.asarray(x_rw)
    sample, offset, row, col = self._token_index()
    out_bt = np.full((len(self.length_b), seq_len), fill, x_rw.dtype)
    out_bt[sample, offset] = x_rw[row, col]
    return out_bt

  def positions_rw(self) -> Int[np.ndarray, "R W"]:
    return self.pack(np.broadcast_to(np.arange(self.width), (len(self.length_b), self.width)))

  def segment_b(self) -> Int[np.ndarray, "B"]:
    """Each sample's segment id: 1, 2, ... in its row's column order; 0 for an empty sample."""
    order = np.lexsort((self.start_b, self.row_b))
    placed = order[self.row_b[order] >= 0]
    rank = np.arange(len(placed)) - np.searchsorted(self.row_b[placed], self.row_b[placed])
    segment_b = np.zeros(len(self.length_b), np.int64)
    segment_b[placed] = rank + 1
    return segment_b

  def segment_ids_rw(self) -> Int[np.ndarray, "R W"]:
    """1, 2, ... per row in column order; 0 on padding."""
    return self.pack_per_sample(self.segment_b())

  def stats(self) -> dict[str, float]:
    tokens = int(self.length_b.sum())
    return {"rows": self.num_rows, "rows_used": self.rows_used, "width": self.width, "tokens": tokens,
            "padding_fraction": 1.0 - tokens / max(1, self.num_rows * self.width)}


def source_map(full: Layout, sub: Layout, indices_k) -> Int[np.ndarray, "R W"]:
  """Where each position of ``sub`` (a packing of samples ``indices_k`` of ``full``, in that order) comes
  from: the flattened index ``row * width + column`` of the same token in ``full``, -1 on padding."""
  indices_k = np.asarray(indices_k, np.int64)
  if sub.width != full.width or not np.array_equal(sub.length_b, full.length_b[indices_k]):
    raise ValueError("source_map: sub must pack samples indices_k of full, at its width")
  sample, offset, row, col = sub._token_index()
  b = indices_k[sample]
  out_rw = np.full((sub.num_rows, sub.width), -1, np.int64)
  out_rw[row, col] = full.row_b[b] * full.width + full.start_b[b] + offset
  return out_rw


def plan(length_b: Int[np.ndarray, "B"], width: int, buckets, groups: int = 1, micro: int = 1) -> Layout:
  """Places every sample (first-fit decreasing) and pads the row count up to the smallest fitting bucket.

  With ``groups`` > 1 (data-parallel groups, each taking an equal block of rows) the filled rows are dealt
  round robin over the groups (first-fit row i to the group's row k = i // groups, row
  ``(i % groups) * R/groups + k``), so every group holds about as many tokens, and the padding rows of the
  bucket are shared alike. With ``micro`` > 1 (the update's micro-batch count: micro-batch m takes rows m,
  m + micro, ..., ``step.split_micro_batches``) a group's k-th filled row goes to its row
  ``(k % (R/groups/micro)) * micro + k // (R/groups/micro)`` instead: filled rows fill micro-batch 0 first,
  then 1, ..., so the padding rows make up whole micro-batches (which the update can skip)."""
  row_b, start_b, used = first_fit_decreasing(length_b, width)
  num_rows = choose_rows(used, buckets)
  if num_rows % (groups * micro):
    raise ValueError(f"{num_rows} rows do not split over {groups} groups x {micro} micro-batches")
  per_group, k = num_rows // groups, row_b // groups
  local = k if micro == 1 else (k % (per_group // micro)) * micro + k // (per_group // micro)
  row_b = np.where(row_b >= 0, (row_b % groups) * per_group + local, -1)
  return Layout(row_b, start_b, np.asarray(length_b, np.int64), num_rows, width, used)


@dataclasses.dataclass(frozen=True)
class PackedBatch:
  """What the packed RL step consumes, on the host: [R, W] arrays plus the layout that maps them back."""
  layout: Layout
  tokens_rw: np.ndarray            # int32
  positions_rw: np.ndarray         # int32, restart at 0 per sample
  segment_ids_rw: np.ndarray       # int32, 1..k per row, 0 = padding
  sample_rw: np.ndarray            # int32, index of the sample in the input batch, -1 = padding
  mask_rw: np.ndarray              # float32, 1 on response tokens
  advantages_rw: np.ndarray        # float32, per token (0 outside the response)
  behaviour_logp_rw: np.ndarray    # float32
  ref_logp_rw: np.ndarray          # float32
  version_rw: np.ndarray           # int32


def pack_batch(layout: Layout, *, tokens_bt, mask_bt, advantages_bt, behaviour_logp_bt, ref_logp_bt,
               version_bt) -> PackedBatch:
  """Right-padded TrainBatch fields (host arrays) -> PackedBatch laid out by ``layout``."""
  i32, f32 = np.int32, np.float32
  token = lambda name, x, dtype: layout.pack(np.asarray(x, dtype), PAD[name])
  return PackedBatch(
      layout=layout, tokens_rw=token("tokens", tokens_bt, i32),
      positions_rw=layout.positions_rw().astype(i32), segment_ids_rw=layout.segment_ids_rw().astype(i32),
      sample_rw=layout.pack_per_sample(np.arange(len(layout.length_b)), PAD["sample"]).astype(i32),
      mask_rw=token("mask", mask_bt, f32),
      advantages_rw=token("advantages", advantages_bt, f32),
      behaviour_logp_rw=token("behaviour_logp", behaviour_logp_bt, f32),
      ref_logp_rw=token("ref_logp", ref_logp_bt, f32), version_rw=token("version", version_bt, i32))


def unpack_batch(packed: PackedBatch, seq_len: int) -> dict[str, np.ndarray]:
  """PackedBatch -> right-padded [B, seq_len] fields: the inverse of ``pack_batch``."""
  lay = packed.layout
  return {name: lay.unpack(getattr(packed, f"{name}_rw"), seq_len, PAD[name])
          for name in ("tokens", "mask", "advantages", "behaviour_logp", "ref_logp", "version")}


def lengths_from_mask(mask_bt: Float[np.ndarray, "B T"]) -> Int[np.ndarray, "B"]:
  """Sample lengths of right-padded rows whose response ends the sample: last masked index + 1 (0 if none)."""
  mask_bt = np.asarray(mask_bt) != 0
  last = mask_bt.shape[1] - np.argmax(mask_bt[:, ::-1], axis=1)
  return np.where(mask_bt.any(axis=1), last, 0).astype(np.int64)


# ----------------------------------------------------------------------------------------------------
# The wire format of packed samples host -> device: one flat byte stream per data-parallel group, real
# tokens only (no row padding, no prompt log-probs or versions), rebuilt into rows on the device
# (``packed_step.place_rows``).
# ----------------------------------------------------------------------------------------------------

STREAM_DTYPE = np.uint8


def value_bytes(num_values: int) -> int:
  """Bytes an unsigned value below ``num_values`` takes on the wire (1 to 4)."""
  for n in (1, 2, 3):
    if num_values <= 2 ** (8 * n):
      return n
  return 4


def stream_length(used: int, multiple: int, unit: int = 256) -> int:
  """A group's stream length for ``used`` bytes: ``unit * multiple`` times the smallest ceil(2^(k/4)) that
  holds them (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 23, 27, 32, ...: at most 1/4 more than needed
  beyond the first few, so the stream program compiles once per length met and a few cover a run)."""
  step = unit * multiple
  need, k = max(1, math.ceil(used / step)), 0
  while math.ceil(2 ** (k / 4) - 1e-9) < need:
    k += 1
  return step * math.ceil(2 ** (k / 4) - 1e-9)


@dataclasses.dataclass(frozen=True)
class StreamFormat:
  """Bytes per token id (``value_bytes(vocab_size)``) and per version (above the batch's lowest); with
  ``ref_logp`` also a reference log-prob per response token (float32 bits); with ``tokens_only`` the
  token ids alone (for a consumer that reads nothing else: the aux stage's models)."""
  token_bytes: int
  version_bytes: int
  ref_logp: bool = False
  tokens_only: bool = False

  def __post_init__(self):
    if self.tokens_only and self.ref_logp:
      raise ValueError("StreamFormat: tokens_only carries no reference log-probs")

  def sample_bytes(self, length_b, prompt_len_b) -> np.ndarray:
    """Bytes each sample takes: its tokens, then 4 (float32 log-prob bits) + ``version_bytes`` (+ 4, the
    reference log-prob's bits) per response token; with ``tokens_only`` its tokens alone."""
    length_b, prompt_len_b = np.asarray(length_b, np.int64), np.asarray(prompt_len_b, np.int64)
    if self.tokens_only:
      return self.token_bytes * length_b
    per_response = 4 + self.version_bytes + (4 if self.ref_logp else 0)
    return self.token_bytes * length_b + per_response * np.where(length_b > 0, length_b - prompt_len_b, 0)


@dataclasses.dataclass(frozen=True)
class Stream:
  """Per group g (rows ``g * R/G`` to ``(g + 1) * R/G``), ``bytes_gn[g]`` holds its samples in sample
  order, each as: its token ids, the float32 bits of its response tokens' behaviour log-probs, its
  response tokens' versions minus ``version_base``, with ``StreamFormat.ref_logp`` the float32 bits of
  their reference log-probs (every value little-endian, in ``StreamFormat``'s widths); zeros after the
  last sample."""
  bytes_gn: np.ndarray         # uint8 [G, N]
  offset_b: np.ndarray         # int64 [B]: where sample b starts in its group's stream
  version_base: int
  used_bytes: int              # bytes holding samples, summed over the groups
  fmt: StreamFormat            # the format asked for, its versions widened where they did not fit


def group_offsets(layout: Layout, groups: int, bytes_b) -> tuple[np.ndarray, np.ndarray]:
  """(group of each sample, -1 for an empty one; where it starts in its group's stream: the bytes of the
  samples before it in the same group)."""
  if layout.num_rows % groups:
    raise ValueError(f"{layout.num_rows} rows do not split over {groups} data-parallel groups")
  group_b = np.where(layout.row_b >= 0, layout.row_b // (layout.num_rows // groups), -1)
  offset_b = np.zeros(len(group_b), np.int64)
  for g in range(groups):
    mine = np.flatnonzero(group_b == g)
    offset_b[mine] = np.cumsum(bytes_b[mine]) - bytes_b[mine]
  return group_b, offset_b


def _put(out, g, at, values, width: int, what: str):
  values = np.asarray(values, np.int64)
  if values.size and (values.min() < 0 or values.max() >= 2 ** (8 * width)):
    raise ValueError(f"{what} must lie in [0, 2**{8 * width}) to cross in {width} byte(s); got "
                     f"{values.min()}..{values.max()}")
  for w in range(width):
    out[g, at + w] = (values >> (8 * w)) & 0xFF


def pack_stream(layout: Layout, groups: int, fmt: StreamFormat, *, tokens_bt, behaviour_logp_bt, version_bt,
                prompt_len_b, multiple: int = 1, page: int = 0, ref_logp_bt=None,
                version_range: tuple[int, int] | None = None, held_b=None) -> Stream:
  """Samples (right-padded rows) -> their ``Stream``: each group's bytes, the stream length bucketed
  (``stream_length``, a multiple of ``multiple``), or with ``page`` > 0 a whole number of pages of
  ``page`` bytes (at least one). ``ref_logp_bt``: the reference log-probs, given exactly when
  ``fmt.ref_logp``. With ``fmt.tokens_only`` the log-probs and versions are not read (None will do).
  ``version_range``: the batch's lowest and highest response-token versions, where the caller holds only
  some samples' versions (default: taken from ``version_bt``); ``held_b`` (with it): the samples whose
  responses the caller holds; the others' versions are written as the lowest (their groups' bytes are
  another process's to place)."""
  if (ref_logp_bt is not None) != fmt.ref_logp:
    raise ValueError(f"pack_stream: ref_logp_bt {'given' if ref_logp_bt is not None else 'missing'} for a "
                     f"format with ref_logp={fmt.ref_logp}")
  length_b, prompt_b = layout.length_b, np.asarray(prompt_len_b, np.int64)
  bad = (prompt_b > length_b) & (length_b > 0)
  if bad.any():
    raise ValueError(f"sample {int(np.argmax(bad))}: its prompt is longer than the sample")
  sample, offset, _, _ = layout._token_index()
  response = offset >= prompt_b[sample]
  s, j = sample[response], offset[response] - prompt_b[sample[response]]
  version = (np.zeros((0,), np.int64) if fmt.tokens_only else np.asarray(version_bt, np.int64)[s, prompt_b[s] + j])
  if version_range is not None and not fmt.tokens_only:
    version_base, highest = (int(v) for v in version_range)
    if held_b is not None:
      version = np.where(np.asarray(held_b, bool)[s], version, version_base)
  else:
    version_base = int(version.min()) if version.size else 0
    highest = int(version.max(initial=version_base))
  # Versions wider than the format expects (a span beyond the staleness bound it was sized for) widen it.
  fmt = dataclasses.replace(fmt, version_bytes=max(fmt.version_bytes, value_bytes(highest - version_base + 1)))
  bytes_b = fmt.sample_bytes(length_b, prompt_b)
  group_b, offset_b = group_offsets(layout, groups, bytes_b)
  per_group = np.bincount(group_b[group_b >= 0], bytes_b[group_b >= 0], minlength=groups).astype(np.int64)
  most = int(per_group.max(initial=0))
  length = max(1, math.ceil(most / page)) * page if page else stream_length(most, multiple)
  out = np.zeros((groups, length), STREAM_DTYPE)
  tb, vb = fmt.token_bytes, fmt.version_bytes
  _put(out, group_b[sample], offset_b[sample] + tb * offset, np.asarray(tokens_bt)[sample, offset], tb, "token ids")
  if fmt.tokens_only:
    return Stream(out, offset_b, version_base, int(per_group.sum()), fmt)
  g, base, r = group_b[s], offset_b[s] + tb * length_b[s], length_b[s] - prompt_b[s]
  bits = np.ascontiguousarray(np.asarray(behaviour_logp_bt, np.float32)[s, prompt_b[s] + j]).view(np.uint32)
  _put(out, g, base + 4 * j, bits, 4, "log-prob bits")
  _put(out, g, base + 4 * r + vb * j, version - version_base, vb, "versions above the batch's lowest")
  if fmt.ref_logp:
    ref_bits = np.ascontiguousarray(np.asarray(ref_logp_bt, np.float32)[s, prompt_b[s] + j]).view(np.uint32)
    _put(out, g, base + (4 + vb) * r + 4 * j, ref_bits, 4, "reference log-prob bits")
  return Stream(out, offset_b, version_base, int(per_group.sum()), fmt)
