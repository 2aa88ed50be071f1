"""The aux stage (hybrid): reference log-probs and reward-model scores of samples scored as they finish, in
chunks, equal the reference's log-probs of the whole batch in the update's layout (packed or padded) and the
reward model's scores of the whole batch; samples never scored or evicted from a full buffer are scored when
asked for; forgotten samples free their rows."""
import functools
import types

import jax
import numpy as np
import pytest

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import models
from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.models import ModelConfig, reward_model
from rl_fusion_jax.orchestration import aux_stage as aux_stage_lib
from rl_fusion_jax.orchestration.aux_stage import AuxStage
from rl_fusion_jax.sharding import mesh as mesh_lib
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.tiny import tiny_model_config
from rl_fusion_jax.train import packed_step, packing
from rl_fusion_jax.types import Rollout

SEQ_LEN = 24
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"   # one per jit cache miss


def _setup(capacity: int):
  model_cfg = tiny_model_config()
  cfg = config_lib.experiment_from_dict(dict(
      model=dict(vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.hidden_size,
                 num_layers=model_cfg.num_layers, num_heads=model_cfg.num_heads,
                 num_kv_heads=model_cfg.num_kv_heads, intermediate_size=model_cfg.intermediate_size,
                 max_position_embeddings=32),
      rollout=dict(num_prompts=8, group_size=2, max_prompt_len=8, max_new_tokens=SEQ_LEN - 8)))
  mesh = make_mesh(MeshConfig(data=-1), jax.devices()[:2])
  shardings = param_shardings(models.abstract_params(cfg.model.config), models.param_logical_axes(cfg.model.config),
                              mesh, TRAIN_RULES)
  params = jax.device_put(models.init_params(cfg.model.config, jax.random.key(1)), shardings)
  fn = packed_step.make_packed_logprob_fn(cfg.model.config, 1.0, mesh, shardings)
  stage = AuxStage(cfg, types.SimpleNamespace(aux_mesh=mesh, packed_ref_logprobs=fn), "all", capacity)
  return cfg, mesh, params, fn, stage


def _samples(n: int, vocab: int, seed: int = 0) -> Rollout:
  rng = np.random.default_rng(seed)
  prompt = rng.integers(1, 8, n).astype(np.int32)
  response = rng.integers(0, SEQ_LEN - 8, n).astype(np.int32)
  t = np.arange(SEQ_LEN)[None]
  inside = t < (prompt + response)[:, None]
  resp = inside & (t >= prompt[:, None])
  return Rollout(tokens_bt=np.where(inside, rng.integers(1, vocab, (n, SEQ_LEN)), 0).astype(np.int32),
                 prompt_len_b=prompt, response_len_b=response,
                 logp_bt=np.where(resp, -rng.random((n, SEQ_LEN)), 0).astype(np.float32),
                 version_bt=np.where(resp, 0, -1).astype(np.int32), finished_b=np.ones(n, bool),
                 sample_id_b=np.arange(100, 100 + n, dtype=np.int32))


def _part(rollout: Rollout, idx) -> Rollout:
  return jax.tree.map(lambda x: np.asarray(x)[idx], rollout)


@pytest.mark.parametrize("packed", [True, False])
def test_chunks_scored_early_equal_the_batch_scored_at_once(packed):
  cfg, mesh, params, fn, stage = _setup(capacity=64)
  batch = _samples(16, cfg.model.config.vocab_size)
  stage.begin(params, None, 0)
  for idx in (np.arange(0, 3), np.arange(3, 10), np.arange(10, 16)):       # chunks as the engine reports them
    stage.submit(_part(batch, idx))
  assert stage.scored == 16
  lengths = batch.prompt_len_b + batch.response_len_b
  layout = packing.plan(lengths, SEQ_LEN, packing.row_buckets(16, 2, per_doubling=2), groups=2)
  got, scores, metrics = stage.take(batch, layout if packed else None, SEQ_LEN)
  assert scores is None
  assert metrics["aux_stage/early_frac"] == 1.0 and not stage.slot_of and len(stage.free) == 64
  # Host -> aux bytes, by hand: 3 calls (one per chunk: each fits one block), each the token ids of its
  # samples (1 byte each, vocabulary 128), every group's part rounded up to a page of 32 bytes, and the
  # per-sample table (6 16-bit numbers for each of SEQ_LEN // 2 entries) and the version base (4 bytes); against
  # the samples as int32 rows of SEQ_LEN.
  sent, table = metrics["queue/link_bytes/host_to_aux"], 6 * 2 * (SEQ_LEN // 2) + 4
  assert stage.pages.page_bytes == 32
  assert lengths.sum() + 3 * table <= sent < lengths.sum() + 3 * (table + 2 * 32)
  assert metrics["queue/link_bytes/host_to_aux_padded"] == 16 * SEQ_LEN * 4 > sent
  assert metrics["queue/link_bytes/host_to_aux_this_host"] == sent      # one process
  assert stage.link_bytes() == {}                                        # reported once
  rows, _ = packed_step.place_rows(mesh, layout, tokens_bt=batch.tokens_bt, behaviour_logp_bt=batch.logp_bt,
                                   version_bt=batch.version_bt, prompt_len_b=batch.prompt_len_b, vocab_size=128)
  positions, segments, _, mask = packed_step.make_row_layout(mesh)(rows)
  want_rw = np.asarray(fn(params, rows.tokens_rw, positions, segments))
  got = np.asarray(jax.device_get(got))
  if packed:
    np.testing.assert_allclose(got, want_rw, rtol=1e-5, atol=1e-5)
  else:
    inside = np.arange(SEQ_LEN)[None] < lengths[:, None]
    np.testing.assert_allclose(got, layout.unpack(want_rw, SEQ_LEN) * inside, rtol=1e-5, atol=1e-5)
  assert np.abs(want_rw).max() > 0.1


def test_samples_are_scored_by_their_engine_shards_group():
  """``submit`` with the engine's batch shards: each sample is packed into the rows of the aux group of the
  shard that generated it (engine shard r of 4 -> aux group r x 2 / 4 of 2: on the process that holds its
  row where the two meshes split over the processes alike), and the results still equal the batch's."""
  cfg, mesh, params, fn, stage = _setup(capacity=64)
  stage.engine_shards = 4
  batch = _samples(16, cfg.model.config.vocab_size)
  shard = np.random.default_rng(3).integers(0, 4, 16)
  shard[:2] = [0, 3]                                   # both groups take samples
  placed, score_block = [], stage._score_block
  stage._score_block = lambda rollout, rows, row_k, *rest: (
      placed.append((rollout.sample_id_b[rows].tolist(), np.asarray(row_k).tolist())),
      score_block(rollout, rows, row_k, *rest))
  stage.begin(params, None, 0)
  for idx in (np.arange(0, 7), np.arange(7, 16)):
    stage.submit(_part(batch, idx), None, shard[idx])
  per_group = stage.block_rows // stage.shards
  group_of = {int(s): int(shard[i]) * 2 // 4 for i, s in enumerate(batch.sample_id_b)}
  assert sorted(s for ids, _ in placed for s in ids) == batch.sample_id_b.tolist()
  assert all(row // per_group == group_of[s] for ids, rows in placed for s, row in zip(ids, rows))
  lengths = batch.prompt_len_b + batch.response_len_b
  layout = packing.plan(lengths, SEQ_LEN, packing.row_buckets(16, 2, per_doubling=2), groups=2)
  got, _, metrics = stage.take(batch, layout, SEQ_LEN)
  assert metrics["aux_stage/early_frac"] == 1.0
  rows, _ = packed_step.place_rows(mesh, layout, tokens_bt=batch.tokens_bt, behaviour_logp_bt=batch.logp_bt,
                                   version_bt=batch.version_bt, prompt_len_b=batch.prompt_len_b, vocab_size=128)
  positions, segments, _, _ = packed_step.make_row_layout(mesh)(rows)
  np.testing.assert_allclose(np.asarray(jax.device_get(got)),
                             np.asarray(fn(params, rows.tokens_rw, positions, segments)), rtol=1e-5, atol=1e-5)


def test_every_call_has_one_shape_and_reused_rows_read_back_only_their_sample():
  # Chunks of 1, 9 and 54 samples (the last over several blocks of block_rows rows): the stage's programs
  # compile on the first chunk only. Then a second batch of shorter samples takes the same buffer rows:
  # read back as padded rows they are the reference's log-probs up to each sample's length and 0 after,
  # nothing of the longer samples that held the rows before.
  cfg, mesh, params, fn, stage = _setup(capacity=64)
  vocab = cfg.model.config.vocab_size
  batch = _samples(64, vocab, seed=5)
  traced = []
  listener = lambda event, duration, **kw: traced.append(kw.get("fun_name")) if event == TRACE_EVENT else None
  stage.begin(params, None, 0)
  stage.submit(_part(batch, np.arange(0, 1)))
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    stage.submit(_part(batch, np.arange(1, 10)))
    stage.submit(_part(batch, np.arange(10, 64)))
    jax.block_until_ready(stage.buffer)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert traced == [] and stage.scored == 64
  lengths = batch.prompt_len_b + batch.response_len_b
  assert packing.first_fit_decreasing(lengths[10:], SEQ_LEN)[2] > 2 * stage.block_rows
  got, _, _ = stage.take(batch, None, SEQ_LEN)
  want = _reference_padded(mesh, params, fn, batch)
  np.testing.assert_allclose(np.asarray(jax.device_get(got)), want, rtol=1e-5, atol=1e-5)
  short = _samples(64, vocab, seed=6)
  short = short.replace(response_len_b=np.minimum(short.response_len_b, 2),
                        sample_id_b=np.arange(300, 364, dtype=np.int32))
  inside = np.arange(SEQ_LEN)[None] < (short.prompt_len_b + short.response_len_b)[:, None]
  short = short.replace(tokens_bt=np.where(inside, short.tokens_bt, 0))
  stage.submit(short)
  got, _, _ = stage.take(short, None, SEQ_LEN)
  np.testing.assert_allclose(np.asarray(jax.device_get(got)), _reference_padded(mesh, params, fn, short),
                             rtol=1e-5, atol=1e-5)


def _reference_padded(mesh, params, fn, batch: Rollout) -> np.ndarray:
  """The reference's log-probs of the whole batch at once, as padded rows (0 from each sample's length)."""
  lengths = batch.prompt_len_b + batch.response_len_b
  layout = packing.plan(lengths, SEQ_LEN, packing.row_buckets(len(lengths), 2, per_doubling=2), groups=2)
  rows, _ = packed_step.place_rows(mesh, layout, tokens_bt=batch.tokens_bt, behaviour_logp_bt=batch.logp_bt,
                                   version_bt=batch.version_bt, prompt_len_b=batch.prompt_len_b, vocab_size=128)
  positions, segments, _, _ = packed_step.make_row_layout(mesh)(rows)
  want_rw = np.asarray(fn(params, rows.tokens_rw, positions, segments))
  inside = np.arange(SEQ_LEN)[None] < lengths[:, None]
  return layout.unpack(want_rw, SEQ_LEN) * inside


def test_evicted_and_unscored_samples_are_scored_when_asked_for():
  cfg, mesh, params, fn, stage = _setup(capacity=10)
  batch = _samples(10, cfg.model.config.vocab_size, seed=3)
  others = _samples(2, cfg.model.config.vocab_size, seed=4).replace(sample_id_b=np.array([200, 201], np.int32))
  stage.begin(params, None, 0)
  stage.submit(_part(batch, np.arange(0, 9)))              # 9 of the batch (109 never)
  stage.submit(others)                                     # 11 into 10 rows: the oldest (100) is evicted
  assert 100 not in stage.slot_of and {200, 201} <= set(stage.slot_of)
  stage.forget([102])                                       # released: scored again when asked for
  assert 102 not in stage.slot_of and len(stage.free) == 1
  # 100, 102 and 109 are scored now, evicting the two samples outside the batch, never the batch's own.
  lengths = batch.prompt_len_b + batch.response_len_b
  layout = packing.plan(lengths, SEQ_LEN, packing.row_buckets(10, 2, per_doubling=2), groups=2)
  got, _, metrics = stage.take(batch, layout, SEQ_LEN)
  assert metrics["aux_stage/early_frac"] == pytest.approx(7 / 10) and not stage.slot_of
  rows, _ = packed_step.place_rows(mesh, layout, tokens_bt=batch.tokens_bt, behaviour_logp_bt=batch.logp_bt,
                                   version_bt=batch.version_bt, prompt_len_b=batch.prompt_len_b, vocab_size=128)
  positions, segments, _, _ = packed_step.make_row_layout(mesh)(rows)
  np.testing.assert_allclose(np.asarray(jax.device_get(got)), np.asarray(fn(params, rows.tokens_rw, positions, segments)),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="buffer holds 10"):
    stage.take(_samples(12, cfg.model.config.vocab_size), None, SEQ_LEN)


def test_fetched_reference_holds_the_response_log_probs_as_the_queue_field(monkeypatch):
  # The reference log-probs fetched for the queue's ref_logp field: the samples scored early and those
  # scored now (never submitted) alike, response positions only (prompt positions 0), in large blocks and
  # then small ones (made small here, so that this batch takes both), and the bytes that crossed.
  monkeypatch.setattr(aux_stage_lib, "FETCH_BLOCKS", (512, 64))
  cfg, mesh, params, fn, stage = _setup(capacity=200)
  batch = _samples(160, cfg.model.config.vocab_size, seed=5)
  total = int(batch.response_len_b.sum())
  starts = aux_stage_lib.fetch_starts(total)
  assert {size for _, size in starts} == {512, 64} and 0 <= sum(size for _, size in starts) - total < 64
  stage.begin(params, None, 0)
  stage.submit(_part(batch, np.arange(0, 100)))
  rows, scores, metrics = stage.fetch(batch)
  assert scores is None                                           # no reward model in this stage
  assert not stage.slot_of and len(stage.free) == 200          # released: the queue holds them now
  assert {k: metrics[k] for k in ("link_bytes/aux_to_host", "link_bytes/aux_to_host_padded")} == {
      "link_bytes/aux_to_host": float(4 * sum(size for _, size in starts)),
      "link_bytes/aux_to_host_padded": float(160 * SEQ_LEN * 4)}
  # The 100 submitted and the 60 scored now crossed to the aux devices: 160 samples' padded equivalent.
  assert metrics["link_bytes/host_to_aux_padded"] == 160 * SEQ_LEN * 4 > metrics["link_bytes/host_to_aux"]
  lengths = batch.prompt_len_b + batch.response_len_b
  layout = packing.plan(lengths, SEQ_LEN, packing.row_buckets(160, 2, per_doubling=2), groups=2)
  placed, _ = packed_step.place_rows(mesh, layout, tokens_bt=batch.tokens_bt, behaviour_logp_bt=batch.logp_bt,
                                     version_bt=batch.version_bt, prompt_len_b=batch.prompt_len_b, vocab_size=128)
  positions, segments, _, _ = packed_step.make_row_layout(mesh)(placed)
  want = layout.unpack(np.asarray(fn(params, placed.tokens_rw, positions, segments)), SEQ_LEN)
  assert [len(r) for r in rows] == lengths.tolist()
  for b, row in enumerate(rows):
    p = batch.prompt_len_b[b]
    np.testing.assert_array_equal(row[:p], 0.0)
    np.testing.assert_allclose(row[p:], want[b, p:lengths[b]], rtol=1e-5, atol=1e-5)
  assert max(np.abs(r).max(initial=0) for r in rows) > 0.1
  # A stage whose buffer holds fewer samples than the fetch: the same log-probs, fetched in parts.
  small = _setup(capacity=64)[-1]
  small.begin(params, None, 0)
  small.submit(_part(batch, np.arange(0, 100)))          # more than it holds: the oldest are evicted
  again, _, small_metrics = small.fetch(batch)
  assert not small.slot_of and len(small.free) == 64
  assert small_metrics["link_bytes/aux_to_host_padded"] == metrics["link_bytes/aux_to_host_padded"]
  for a, b in zip(rows, again):     # scored in other chunks (other row layouts): equal to rounding
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_reward_model_scores_early_equal_the_batch_scored_at_once():
  # The reward model alone (no reference: e.g. kl_coef 0): each chunk's samples scored as they finish give
  # the scores of the whole batch scored at once by the padded reward model, in batch order; a sample
  # evicted from the full buffer is scored again when asked for.
  cfg, mesh, _, _, _ = _setup(capacity=12)
  rm_cfg = ModelConfig(vocab_size=cfg.model.config.vocab_size, hidden_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, intermediate_size=32, max_position_embeddings=32)
  rm_params = jax.device_put(reward_model.init_reward_params(rm_cfg, jax.random.key(3), init_std=0.5),
                             mesh_lib.replicated(mesh))
  score = jax.jit(functools.partial(reward_model.packed_score, rm_cfg))
  stage = AuxStage(cfg, types.SimpleNamespace(aux_mesh=mesh, packed_reward_score=score), "all", 12,
                   reference=False, reward=True)
  batch = _samples(10, cfg.model.config.vocab_size, seed=5)
  others = _samples(3, cfg.model.config.vocab_size, seed=6).replace(sample_id_b=np.array([300, 301, 302], np.int32))
  stage.submit(batch)                                     # before begin: nothing is scored
  assert stage.scored == 0
  stage.begin(None, None, 0, rm_params=rm_params)
  for idx in (np.arange(0, 4), np.arange(4, 10)):
    stage.submit(_part(batch, idx))
  stage.submit(others)                                    # 13 into 12: the batch's first sample is evicted
  assert 100 not in stage.slot_of
  ref, got, metrics = stage.take(batch, None, SEQ_LEN)
  assert ref is None and metrics["aux_stage/early_frac"] == pytest.approx(9 / 10)
  lengths = batch.prompt_len_b + batch.response_len_b
  want = np.asarray(reward_model.score(rm_cfg, rm_params, batch.tokens_bt, lengths))
  np.testing.assert_allclose(np.asarray(jax.device_get(got)), want, rtol=1e-5, atol=1e-5)
  assert np.ptp(want) > 1e-3     # the samples' scores differ: a mix-up of the order would show


def test_stage_needs_a_model():
  cfg, mesh, _, _, _ = _setup(capacity=4)
  with pytest.raises(ValueError, match="reference, the reward model or both"):
    AuxStage(cfg, types.SimpleNamespace(aux_mesh=mesh), "all", 4, reference=False, reward=False)
