"""Packed rows placed straight from the host's samples: the device-derived layout, the advantage stage
and the reference log-probs on packed rows equal what the padded path computes, and the bytes put are
counted by hand."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax import models
from rl_fusion_jax.algorithms import batch as algo_batch
from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.queue import global_batch
from rl_fusion_jax.sharding.mesh import batch_sharding, make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.tiny import tiny_model_config
from rl_fusion_jax.train import packed_step, packing
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.types import Rollout

SEQ_LEN, GROUP = 24, 4


def samples(seed: int, num: int = 16):
  """Right-padded host samples [num, SEQ_LEN] of random prompt / response lengths (some responses empty)."""
  rng = np.random.default_rng(seed)
  prompt_b = rng.integers(1, 8, num).astype(np.int32)
  response_b = rng.integers(0, SEQ_LEN - 8, num).astype(np.int32)
  length_b = prompt_b + response_b
  inside_bt = np.arange(SEQ_LEN)[None] < length_b[:, None]
  tokens_bt = np.where(inside_bt, rng.integers(1, 50, (num, SEQ_LEN)), 0).astype(np.int32)
  resp_bt = inside_bt & (np.arange(SEQ_LEN)[None] >= prompt_b[:, None])
  logp_bt = np.where(resp_bt, -rng.random((num, SEQ_LEN)), 0).astype(np.float32)
  version_bt = np.where(resp_bt, rng.integers(0, 3, (num, SEQ_LEN)), -1).astype(np.int32)
  return prompt_b, response_b, tokens_bt, logp_bt, version_bt, resp_bt.astype(np.float32)


def stream_bytes_by_hand(prompt_b, response_b, token_bytes, version_bytes):
  """Bytes each sample takes in its group's stream, from the wire format's definition: its tokens, then 4
  bytes of log-prob bits and the version's bytes per response token."""
  return token_bytes * (prompt_b + response_b) + (4 + version_bytes) * response_b


# (vocab size, versions the samples span, staleness the format is sized for) -> (token bytes, version bytes)
FORMATS = {(128, 3, 2): (1, 1), (2 ** 16 + 1, 3, 2): (3, 1), (128, 300, 2): (1, 2), (128, 3, 1000): (1, 2)}


@pytest.mark.parametrize("case", list(FORMATS))
def test_device_layout_is_the_host_packers(case):
  vocab_size, span, max_span = case
  token_bytes, version_bytes = FORMATS[case]
  mesh = make_mesh(MeshConfig(data=-1), jax.devices()[:2])
  for seed in range(3):
    prompt_b, response_b, tokens_bt, logp_bt, version_bt, mask_bt = samples(seed)
    tokens_bt = np.where(tokens_bt > 0, tokens_bt + vocab_size - 50, 0).astype(np.int32)   # up to vocab - 1
    version_bt = np.where(version_bt >= 0, version_bt * (span - 1) // 2 + 1000 * seed, -1).astype(np.int32)
    layout = packing.plan(prompt_b + response_b, SEQ_LEN, packing.row_buckets(16, 2), groups=2)
    rows, link = packed_step.place_rows(mesh, layout, tokens_bt=tokens_bt, behaviour_logp_bt=logp_bt,
                                        version_bt=version_bt, prompt_len_b=prompt_b, vocab_size=vocab_size,
                                        max_version_span=max_span)
    positions, segments, sample, mask = jax.device_get(packed_step.make_row_layout(mesh)(rows))
    host = packing.pack_batch(layout, tokens_bt=tokens_bt, mask_bt=mask_bt, advantages_bt=mask_bt,
                              behaviour_logp_bt=logp_bt, ref_logp_bt=mask_bt, version_bt=version_bt)
    np.testing.assert_array_equal(positions, host.positions_rw)
    np.testing.assert_array_equal(segments, host.segment_ids_rw)
    np.testing.assert_array_equal(sample, host.sample_rw)
    np.testing.assert_array_equal(mask, host.mask_rw)
    for name in ("tokens_rw", "behaviour_logp_rw", "version_rw"):
      got = jax.device_get(getattr(rows, name))
      assert got.dtype == getattr(host, name).dtype, name
      np.testing.assert_array_equal(got, getattr(host, name), err_msg=name)
    # Bytes by hand. Each of the 2 groups (one device each) is sent its stream: its samples' bytes, the
    # stream length rounded up to 256 x (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, ...); 6 16-bit numbers per sample
    # and the version base (int32).
    # Padded: 3 int32 / float32 fields as [B, train_width] rows and the same per-sample numbers.
    b, half = len(prompt_b), layout.num_rows // 2
    bytes_b = stream_bytes_by_hand(prompt_b, response_b, token_bytes, version_bytes)
    group_b = layout.row_b // half
    most = max(bytes_b[group_b == g].sum() for g in range(2))
    n = 256 * min(s for s in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16) if 256 * s >= most)
    padded_width = step_lib.train_width(int((prompt_b + response_b).max()), SEQ_LEN)
    assert link == {"stream_bytes": n, "stream_used_bytes": bytes_b.sum(),
                    "host_to_device": 2.0 * n + 12 * b + 4,
                    "host_to_device_padded": 12.0 * b * padded_width + 12 * b + 4,
                    "host_to_device_per_device": 1.0 * n + 12 * b + 4,
                    "host_to_device_this_host": 2.0 * n + 12 * b + 4}   # one process: both groups


def test_rows_are_dealt_round_robin_over_the_groups():
  # First-fit decreasing fills rows 0, 1, ...; dealt over 2 groups of 4 rows, filled row i goes to
  # (i % 2) * 4 + i // 2: rows 0, 4, 1, 5, ... So both groups hold about half the tokens.
  length_b = np.array([10, 9, 8, 7, 3, 2])          # width 12: rows {10, 2}, {9, 3}, {8}, {7}
  plain = packing.plan(length_b, 12, (8,))
  dealt = packing.plan(length_b, 12, (8,), groups=2)
  np.testing.assert_array_equal(plain.row_b, [0, 1, 2, 3, 1, 0])
  np.testing.assert_array_equal(dealt.row_b, [0, 4, 1, 5, 4, 0])
  np.testing.assert_array_equal(dealt.start_b, plain.start_b)


def test_rows_fill_micro_batches_in_order():
  # The same 4 filled rows, 2 groups of 4 rows, 2 micro-batches (micro-batch m: rows m, m + 2, ...): a
  # group's k-th filled row goes to its row (k % 2) * 2 + k // 2, so rows 0, 4, 2, 6 (micro-batch 0) are
  # filled and rows 1, 3, 5, 7 (micro-batch 1) are all padding.
  length_b = np.array([10, 9, 8, 7, 3, 2])
  laid = packing.plan(length_b, 12, (8,), groups=2, micro=2)
  np.testing.assert_array_equal(laid.row_b, [0, 4, 2, 6, 4, 0])
  np.testing.assert_array_equal(laid.start_b, packing.plan(length_b, 12, (8,)).start_b)
  with pytest.raises(ValueError, match="8 rows do not split over 2 groups x 3 micro-batches"):
    packing.plan(length_b, 12, (8,), groups=2, micro=3)


def test_stream_rows_on_a_group_of_four_devices():
  # data=2, tensor=4: each group's stream is split in 4 parts, one per device, gathered on the device; the
  # rows equal the host packer's.
  mesh = make_mesh(MeshConfig(data=2, tensor=4), jax.devices()[:8])
  prompt_b, response_b, tokens_bt, logp_bt, version_bt, mask_bt = samples(5)
  layout = packing.plan(prompt_b + response_b, SEQ_LEN, packing.row_buckets(16, 2), groups=2)
  rows, link = packed_step.place_rows(mesh, layout, tokens_bt=tokens_bt, behaviour_logp_bt=logp_bt,
                                      version_bt=version_bt, prompt_len_b=prompt_b, vocab_size=128,
                                      max_version_span=2)
  host = packing.pack_batch(layout, tokens_bt=tokens_bt, mask_bt=mask_bt, advantages_bt=mask_bt,
                            behaviour_logp_bt=logp_bt, ref_logp_bt=mask_bt, version_bt=version_bt)
  for name in ("tokens_rw", "behaviour_logp_rw", "version_rw"):
    np.testing.assert_array_equal(jax.device_get(getattr(rows, name)), getattr(host, name), err_msg=name)
  streams = link["host_to_device"] - 12 * 16 - 4
  assert streams == 2 * link["stream_bytes"] and link["stream_bytes"] % 4 == 0
  assert link["host_to_device_per_device"] - 12 * 16 - 4 == streams / 8   # a quarter of one of 2 groups
  assert link["host_to_device_this_host"] == link["host_to_device"]       # one process sends every group's


def capped(seed: int, cap: int):
  """``samples(seed)`` with every response cut to at most ``cap`` tokens."""
  prompt_b, response_b, tokens_bt, logp_bt, version_bt, mask_bt = samples(seed)
  response_b = np.minimum(response_b, cap).astype(np.int32)
  inside_bt = np.arange(SEQ_LEN)[None] < (prompt_b + response_b)[:, None]
  resp_bt = inside_bt & (np.arange(SEQ_LEN)[None] >= prompt_b[:, None])
  return (prompt_b, response_b, np.where(inside_bt, tokens_bt, 0).astype(np.int32),
          np.where(resp_bt, logp_bt, 0).astype(np.float32), np.where(resp_bt, version_bt, -1).astype(np.int32),
          resp_bt.astype(np.float32))


@pytest.mark.parametrize("tensor", [1, 4])
def test_streams_in_pages_give_the_same_rows_at_every_length(tensor):
  # data=2 (x tensor=4: each page split over a group's 4 devices). Pages of 256 bytes per device into a
  # 16-row buffer of 7 pages (2 of 1024 with tensor=4): batches of 16 samples with responses of at most 2,
  # 16 and all tokens send 1, 2 and 2 pages per group (1 with tensor=4), and the rows equal the host
  # packer's and the unpaged placement's; one program rebuilds them at every length.
  mesh = make_mesh(MeshConfig(data=2, tensor=tensor), jax.devices()[:2 * tensor])
  pages = packed_step.StreamPages(mesh, 16, SEQ_LEN, token_bytes=1, max_pages=16 // tensor)
  capacity = 8 * SEQ_LEN * (1 + 8)               # a group's 8 rows of 24 tokens, 1 + 4 + 4 bytes each
  assert (pages.device_bytes, pages.page_bytes, pages.pages) == (256, 256 * tensor, -(-capacity // (256 * tensor)))
  sizes = set()
  for seed, cap in ((1, 2), (2, 16), (3, SEQ_LEN)):
    prompt_b, response_b, tokens_bt, logp_bt, version_bt, mask_bt = capped(seed, cap)
    layout = packing.plan(prompt_b + response_b, SEQ_LEN, (16,), groups=2)
    kw = dict(tokens_bt=tokens_bt, behaviour_logp_bt=logp_bt, version_bt=version_bt, prompt_len_b=prompt_b,
              vocab_size=128, max_version_span=2)
    rows, link = packed_step.place_rows(mesh, layout, pages=pages, **kw)
    plain, plain_link = packed_step.place_rows(mesh, layout, **kw)
    host = packing.pack_batch(layout, tokens_bt=tokens_bt, mask_bt=mask_bt, advantages_bt=mask_bt,
                              behaviour_logp_bt=logp_bt, ref_logp_bt=mask_bt, version_bt=version_bt)
    for name in ("tokens_rw", "behaviour_logp_rw", "version_rw"):
      np.testing.assert_array_equal(jax.device_get(getattr(rows, name)), getattr(host, name), err_msg=name)
      np.testing.assert_array_equal(jax.device_get(getattr(rows, name)), jax.device_get(getattr(plain, name)))
    group_b = layout.row_b // 8
    most = max(stream_bytes_by_hand(prompt_b, response_b, 1, 1)[group_b == g].sum() for g in range(2))
    assert link["stream_bytes"] == pages.page_bytes * max(1, -(-most // pages.page_bytes))
    assert link["stream_used_bytes"] == plain_link["stream_used_bytes"]
    assert link["host_to_device_per_device"] - 12 * 16 - 4 == link["stream_bytes"] / tensor
    assert link["host_to_device_this_host"] == link["host_to_device"]
    sizes.add(link["stream_bytes"])
  assert sizes == ({256.0, 512.0} if tensor == 1 else {1024.0})
  assert packed_step._rows_from_stream_fn(mesh, 16, SEQ_LEN, packing.StreamFormat(1, 1), True)._cache_size() == 1


@pytest.mark.parametrize("paged", [False, True])
def test_reference_log_probs_cross_in_the_stream(paged):
  # The queue's reference log-probs (StaleSync in hybrid) ride in the rows' stream: 4 more bytes a
  # response token, rebuilt as ref_logp_rw on the response positions (0 elsewhere), the other rows as
  # without them; the padded equivalent counts a fourth float field.
  mesh = make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
  prompt_b, response_b, tokens_bt, logp_bt, version_bt, mask_bt = samples(7)
  ref_bt = np.where(mask_bt > 0, -2.0 - np.random.default_rng(8).random(mask_bt.shape), 0).astype(np.float32)
  layout = packing.plan(prompt_b + response_b, SEQ_LEN, (16,), groups=2)
  kw = dict(tokens_bt=tokens_bt, behaviour_logp_bt=logp_bt, version_bt=version_bt, prompt_len_b=prompt_b,
            vocab_size=128, max_version_span=2)
  pages = packed_step.StreamPages(mesh, 16, SEQ_LEN, token_bytes=1, ref_logp=True) if paged else None
  rows, link = packed_step.place_rows(mesh, layout, ref_logp_bt=ref_bt, pages=pages, **kw)
  plain, plain_link = packed_step.place_rows(mesh, layout, **kw)
  assert plain.ref_logp_rw is None
  np.testing.assert_array_equal(jax.device_get(rows.ref_logp_rw), layout.pack(ref_bt))
  for name in ("tokens_rw", "behaviour_logp_rw", "version_rw"):
    np.testing.assert_array_equal(jax.device_get(getattr(rows, name)), jax.device_get(getattr(plain, name)))
  by_hand = stream_bytes_by_hand(prompt_b, response_b, 1, 1) + 4 * response_b
  assert link["stream_used_bytes"] == by_hand.sum() == plain_link["stream_used_bytes"] + 4 * response_b.sum()
  extra = link["host_to_device_padded"] - plain_link["host_to_device_padded"]   # one more float [B, width]
  assert extra > 0 and 3 * extra == plain_link["host_to_device_padded"] - (6 * 16 * 2 + 4)


@pytest.mark.parametrize("paged", [True, False])
def test_tokens_only_stream_carries_the_token_ids_alone(paged):
  # The aux stage's format: each sample's token ids and nothing else (its models read nothing else): the
  # rows' tokens as the full format's, log-probs 0.0 and versions -1 everywhere, the stream one byte a
  # token here (vocabulary 128), the padded equivalent one int32 field a token.
  mesh = make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
  prompt_b, response_b, tokens_bt, logp_bt, version_bt, _ = samples(9)
  layout = packing.plan(prompt_b + response_b, SEQ_LEN, (16,), groups=2)
  pages = packed_step.StreamPages(mesh, 16, SEQ_LEN, token_bytes=1, tokens_only=True, unit=16) if paged else None
  rows, link = packed_step.place_rows(mesh, layout, tokens_bt=tokens_bt, behaviour_logp_bt=None, version_bt=None,
                                      prompt_len_b=prompt_b, vocab_size=128, tokens_only=True, pages=pages,
                                      padded_width=SEQ_LEN)
  full, _ = packed_step.place_rows(mesh, layout, tokens_bt=tokens_bt, behaviour_logp_bt=logp_bt,
                                   version_bt=version_bt, prompt_len_b=prompt_b, vocab_size=128, max_version_span=2)
  np.testing.assert_array_equal(jax.device_get(rows.tokens_rw), jax.device_get(full.tokens_rw))
  assert not np.asarray(jax.device_get(rows.behaviour_logp_rw)).any()
  assert (np.asarray(jax.device_get(rows.version_rw)) == -1).all() and rows.ref_logp_rw is None
  assert link["stream_used_bytes"] == (prompt_b + response_b).sum()
  table = 6 * 2 * len(prompt_b) + 4
  assert link["host_to_device_padded"] == 4 * len(prompt_b) * SEQ_LEN + table
  with pytest.raises(ValueError, match="tokens_only carries no reference"):
    packing.StreamFormat(1, 1, ref_logp=True, tokens_only=True)


def test_per_sample_numbers_widen_to_int32_when_they_do_not_fit_16_bits():
  mesh = make_mesh(MeshConfig(data=-1), jax.devices()[:2])
  width, prompt_b = 2 ** 16 + 8, np.array([3, 5, 2, 4], np.int32)
  length_b = np.array([2 ** 16 + 2, 9, 7, 2 ** 15], np.int32)
  tokens_bt = np.zeros((4, width), np.int32)
  tokens_bt[np.arange(width)[None] < length_b[:, None]] = 7
  resp = (np.arange(width)[None] < length_b[:, None]) & (np.arange(width)[None] >= prompt_b[:, None])
  logp_bt, version_bt = np.where(resp, -0.5, 0).astype(np.float32), np.where(resp, 3, -1).astype(np.int32)
  layout = packing.plan(length_b, width, (2,), groups=2)
  rows, link = packed_step.place_rows(mesh, layout, tokens_bt=tokens_bt, behaviour_logp_bt=logp_bt,
                                      version_bt=version_bt, prompt_len_b=prompt_b, vocab_size=128)
  np.testing.assert_array_equal(jax.device_get(rows.length_b), length_b)
  np.testing.assert_array_equal(jax.device_get(rows.tokens_rw), layout.pack(tokens_bt))
  assert link["host_to_device"] == 2 * link["stream_bytes"] + 6 * 4 * 4 + 4


def test_stream_refuses_what_it_cannot_carry():
  prompt_b, response_b, tokens_bt, logp_bt, version_bt, _ = samples(0)
  layout = packing.plan(prompt_b + response_b, SEQ_LEN, (16,))
  fmt = packing.StreamFormat(token_bytes=1, version_bytes=1)
  with pytest.raises(ValueError, match="token ids must lie in"):
    packing.pack_stream(layout, 2, fmt, tokens_bt=tokens_bt + 256, version_bt=version_bt,
                        behaviour_logp_bt=logp_bt, prompt_len_b=prompt_b)
  with pytest.raises(ValueError, match="prompt is longer"):
    packing.pack_stream(layout, 2, fmt, tokens_bt=tokens_bt, version_bt=version_bt, behaviour_logp_bt=logp_bt,
                        prompt_len_b=prompt_b + response_b + 1)
  with pytest.raises(ValueError, match="ref_logp_bt given for a format with ref_logp=False"):
    packing.pack_stream(layout, 2, fmt, tokens_bt=tokens_bt, version_bt=version_bt, behaviour_logp_bt=logp_bt,
                        prompt_len_b=prompt_b, ref_logp_bt=logp_bt)


def test_rows_cross_once_per_data_parallel_group_and_are_shared_on_the_device():
  # data=2, tensor=4: each data-parallel group is 4 devices. Placed once per group, each device is sent a
  # quarter of its group's rows (an eighth of all) and gathers the rest on the device; the result is the
  # per-device placement's, shard for shard.
  mesh = make_mesh(MeshConfig(data=2, tensor=4), jax.devices()[:8])
  x_rw = np.arange(16 * SEQ_LEN, dtype=np.int32).reshape(16, SEQ_LEN)
  reads = []

  def read(a, b):
    reads.append((a, b))
    return x_rw[a:b]

  sharding = batch_sharding(mesh, 2)
  split = global_batch.group_split(sharding, x_rw.shape)
  parts = global_batch.global_batch(split, x_rw.shape, x_rw.dtype, read)
  assert sorted(reads) == [(2 * i, 2 * i + 2) for i in range(8)]          # every row read once
  assert {s.data.nbytes for s in parts.addressable_shards} == {x_rw.nbytes // 8}
  shared, most, here = global_batch.global_batch_once_per_group(sharding, x_rw.shape, x_rw.dtype,
                                                                lambda a, b: x_rw[a:b])
  assert most == x_rw.nbytes // 8 and shared.sharding == sharding
  assert here == x_rw.nbytes          # this host (the only one) sent every row once
  plain = global_batch.global_batch(sharding, x_rw.shape, x_rw.dtype, lambda a, b: x_rw[a:b])
  for s1, s2 in zip(shared.addressable_shards, plain.addressable_shards):
    assert s1.device == s2.device and s1.index == s2.index
    np.testing.assert_array_equal(s1.data, s2.data)
  # 12 rows do not split over 8 devices: each device is sent its group's 6 rows.
  assert global_batch.group_split(sharding, (12, SEQ_LEN)) is None
  _, most, here = global_batch.global_batch_once_per_group(sharding, (12, SEQ_LEN), np.int32,
                                                           lambda a, b: x_rw[a:b])
  assert most == 6 * SEQ_LEN * 4 and here == 8 * 6 * SEQ_LEN * 4     # 8 devices, 6 rows each


@pytest.mark.parametrize("kl_mode", ["loss", "reward"])
@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_packed_advantage_stage_equals_the_padded_one(kl_mode, advantage):
  prompt_b, response_b, tokens_bt, logp_bt, version_bt, mask_bt = samples(7)
  rng = np.random.default_rng(1)
  ref_bt = np.where(mask_bt > 0, logp_bt - 0.3 * rng.random(logp_bt.shape), 0).astype(np.float32)
  rewards_b = rng.random(16).astype(np.float32)
  kw = dict(advantage=advantage, group_size=GROUP, kl_coef=0.1, kl_estimator="k3", kl_mode=kl_mode)
  rollout = Rollout(tokens_bt=tokens_bt, prompt_len_b=prompt_b, response_len_b=response_b, logp_bt=logp_bt,
                    version_bt=version_bt, finished_b=np.ones(16, bool), sample_id_b=np.arange(16, dtype=np.int32))
  padded, padded_stats = algo_batch.train_batch(rollout, rewards_b, ref_bt, **kw)
  layout = packing.plan(prompt_b + response_b, SEQ_LEN, (16,))
  host = packing.pack_batch(layout, tokens_bt=tokens_bt, mask_bt=mask_bt, advantages_bt=np.asarray(padded.advantages_bt),
                            behaviour_logp_bt=logp_bt, ref_logp_bt=ref_bt, version_bt=version_bt)
  adv_rw, stats = algo_batch.packed_train_batch(host.sample_rw, host.mask_rw, host.behaviour_logp_rw,
                                                host.ref_logp_rw, rewards_b, **kw)
  np.testing.assert_allclose(adv_rw, host.advantages_rw, rtol=1e-5, atol=1e-6)
  assert set(stats) == set(padded_stats)
  for key in stats:
    np.testing.assert_allclose(stats[key], padded_stats[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_packed_reference_logprobs_equal_the_padded_rows():
  cfg = tiny_model_config()
  mesh = make_mesh(MeshConfig(data=-1), jax.devices()[:2])
  params = models.init_params(cfg, jax.random.key(0))
  shardings = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  params = jax.device_put(params, shardings)
  prompt_b, response_b, tokens_bt, logp_bt, version_bt, mask_bt = samples(3)
  tokens_bt = tokens_bt % cfg.vocab_size
  padded = jax.device_get(step_lib.make_logprob_fn(cfg, 1.0, mesh, shardings)(params, tokens_bt))
  layout = packing.plan(prompt_b + response_b, SEQ_LEN, packing.row_buckets(16, 2))
  rows, _ = packed_step.place_rows(mesh, layout, tokens_bt=tokens_bt, behaviour_logp_bt=logp_bt,
                                   version_bt=version_bt, prompt_len_b=prompt_b, vocab_size=cfg.vocab_size,
                                   max_version_span=2)
  positions, segments, _, mask = packed_step.make_row_layout(mesh)(rows)
  packed = packed_step.make_packed_logprob_fn(cfg, 1.0, mesh, shardings)(params, rows.tokens_rw, positions, segments)
  # Compare on the response tokens (what the loss reads); the packed rows' first token of a sample is 0.
  unpacked = layout.unpack(jax.device_get(packed), SEQ_LEN)
  np.testing.assert_allclose(unpacked * mask_bt, padded * mask_bt, rtol=1e-5, atol=1e-5)
  assert float(jnp.sum(mask)) == mask_bt.sum()


@pytest.mark.parametrize("kl_mode", ["loss", "reward"])
def test_packed_gae_stage_equals_the_padded_one(kl_mode):
  # Rows hold several responses, each followed by the next sample's prompt (mask 0): GAE restarts at every
  # response's end as on padded rows, so advantages (whitened), returns and stats are the padded ones.
  prompt_b, response_b, tokens_bt, logp_bt, version_bt, mask_bt = samples(11)
  rng = np.random.default_rng(2)
  ref_bt = np.where(mask_bt > 0, logp_bt - 0.3 * rng.random(logp_bt.shape), 0).astype(np.float32)
  values_bt = np.where(mask_bt > 0, rng.normal(size=logp_bt.shape), 0).astype(np.float32)
  rewards_b = rng.random(16).astype(np.float32)
  kw = dict(advantage="gae", kl_coef=0.1, kl_estimator="k3", kl_mode=kl_mode,
            advantage_hparams={"gamma": 0.99, "lam": 0.9})
  rollout = Rollout(tokens_bt=tokens_bt, prompt_len_b=prompt_b, response_len_b=response_b, logp_bt=logp_bt,
                    version_bt=version_bt, finished_b=np.ones(16, bool), sample_id_b=np.arange(16, dtype=np.int32))
  padded, padded_stats, padded_returns = algo_batch.train_batch_gae(rollout, rewards_b, ref_bt, values_bt, **kw)
  layout = packing.plan(prompt_b + response_b, SEQ_LEN, (16,))
  assert layout.rows_used < 16                                 # rows hold several samples
  host = packing.pack_batch(layout, tokens_bt=tokens_bt, mask_bt=mask_bt, advantages_bt=np.asarray(padded.advantages_bt),
                            behaviour_logp_bt=logp_bt, ref_logp_bt=ref_bt, version_bt=version_bt)
  adv_rw, stats, returns_rw = algo_batch.packed_train_batch_gae(
      host.sample_rw, host.mask_rw, host.behaviour_logp_rw, host.ref_logp_rw, rewards_b, layout.pack(values_bt),
      **kw)
  np.testing.assert_allclose(adv_rw, host.advantages_rw, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(layout.unpack(np.asarray(returns_rw), SEQ_LEN), padded_returns, rtol=1e-5, atol=1e-5)
  assert set(stats) == set(padded_stats)
  for key in stats:
    np.testing.assert_allclose(stats[key], padded_stats[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_packed_values_equal_the_padded_rows():
  from rl_fusion_jax.models import value_model
  cfg = tiny_model_config()
  params = value_model.init_value_params(cfg, jax.random.key(0), init_std=0.3)
  prompt_b, response_b, tokens_bt, _, _, mask_bt = samples(4)
  tokens_bt = tokens_bt % cfg.vocab_size
  padded = np.asarray(value_model.values(cfg, params, tokens_bt))
  layout = packing.plan(prompt_b + response_b, SEQ_LEN, (16,))
  packed = value_model.packed_values(cfg, params, layout.pack(tokens_bt), layout.positions_rw(),
                                     layout.segment_ids_rw())
  inside = np.arange(SEQ_LEN)[None] < (prompt_b + response_b)[:, None]
  np.testing.assert_allclose(layout.unpack(np.asarray(packed), SEQ_LEN) * inside, padded * inside,
                             rtol=1e-5, atol=1e-5)
  assert np.abs(padded * mask_bt).max() > 0.1                 # the values are not all 0
