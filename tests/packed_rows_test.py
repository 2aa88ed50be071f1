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


def test_device_layout_is_the_host_packers():
  mesh = make_mesh(MeshConfig(data=-1), jax.devices()[:2])
  for seed in range(3):
    prompt_b, response_b, tokens_bt, logp_bt, version_bt, mask_bt = samples(seed)
    layout = packing.plan(prompt_b + response_b, SEQ_LEN, packing.row_buckets(16, 2))
    rows, link = packed_step.place_rows(mesh, layout, tokens_bt=tokens_bt, behaviour_logp_bt=logp_bt,
                                        version_bt=version_bt, prompt_len_b=prompt_b)
    positions, segments, sample, mask = jax.device_get(packed_step.make_row_layout(mesh)(rows))
    host = packing.pack_batch(layout, tokens_bt=tokens_bt, mask_bt=mask_bt, advantages_bt=mask_bt,
                              behaviour_logp_bt=logp_bt, ref_logp_bt=mask_bt, version_bt=version_bt)
    np.testing.assert_array_equal(positions, host.positions_rw)
    np.testing.assert_array_equal(segments, host.segment_ids_rw)
    np.testing.assert_array_equal(sample, host.sample_rw)
    np.testing.assert_array_equal(mask, host.mask_rw)
    for name in ("tokens_rw", "behaviour_logp_rw", "version_rw"):
      np.testing.assert_array_equal(jax.device_get(getattr(rows, name)), getattr(host, name), err_msg=name)
    # Bytes by hand: 3 int32/float32 fields of R x W, 5 int32 per sample; padded: the same 3 fields as
    # [B, train_width] rows.
    r, b = layout.num_rows, len(prompt_b)
    padded_width = step_lib.train_width(int((prompt_b + response_b).max()), SEQ_LEN)
    # On 2 devices of one data-parallel group each (data=-1 over 2 devices): each device is sent its rows.
    assert link == {"host_to_device": 12.0 * r * SEQ_LEN + 20 * b,
                    "host_to_device_padded": 12.0 * b * padded_width + 20 * b,
                    "host_to_device_per_device": 12.0 * r * SEQ_LEN / 2 + 20 * b}


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
  shared, most = global_batch.global_batch_once_per_group(sharding, x_rw.shape, x_rw.dtype, lambda a, b: x_rw[a:b])
  assert most == x_rw.nbytes // 8 and shared.sharding == sharding
  plain = global_batch.global_batch(sharding, x_rw.shape, x_rw.dtype, lambda a, b: x_rw[a:b])
  for s1, s2 in zip(shared.addressable_shards, plain.addressable_shards):
    assert s1.device == s2.device and s1.index == s2.index
    np.testing.assert_array_equal(s1.data, s2.data)
  # 12 rows do not split over 8 devices: each device is sent its group's 6 rows.
  assert global_batch.group_split(sharding, (12, SEQ_LEN)) is None
  _, most = global_batch.global_batch_once_per_group(sharding, (12, SEQ_LEN), np.int32, lambda a, b: x_rw[a:b])
  assert most == 6 * SEQ_LEN * 4


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
                                   version_bt=version_bt, prompt_len_b=prompt_b)
  positions, segments, _, mask = packed_step.make_row_layout(mesh)(rows)
  packed = packed_step.make_packed_logprob_fn(cfg, 1.0, mesh, shardings)(params, rows.tokens_rw, positions, segments)
  # Compare on the response tokens (what the loss reads); the packed rows' first token of a sample is 0.
  unpacked = layout.unpack(jax.device_get(packed), SEQ_LEN)
  np.testing.assert_allclose(unpacked * mask_bt, padded * mask_bt, rtol=1e-5, atol=1e-5)
  assert float(jnp.sum(mask)) == mask_bt.sum()
