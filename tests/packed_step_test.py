"""Packed training: the host packer (by hand, round trip, buckets) and the packed RL step, which must give
the padded step's loss, metrics and updated parameters, compiling once per row bucket."""
import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_fusion_jax import algorithms, models
from rl_fusion_jax import shared_programs
from rl_fusion_jax.config import AlgoConfig, MeshConfig
from rl_fusion_jax.sharding.mesh import batch_shards, make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.tiny import tiny_model_config
from rl_fusion_jax.train import packed_step, packing
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.train.logprobs import token_logprobs
from rl_fusion_jax.types import TrainBatch

CFG = tiny_model_config()
B, T, WIDTH = 32, 12, 24
# Packed and padded rows sum in different orders (and attend over different widths): float32 rounding.
RTOL, ATOL = 1e-5, 1e-6


# ----------------------------------------------------------------------------------------------------
# The packer (numpy only)
# ----------------------------------------------------------------------------------------------------

def test_pack_by_hand():
  prompt, response = np.array([2, 2, 1, 2]), np.array([1, 3, 1, 2])   # lengths 3, 5, 2, 4
  length = prompt + response
  tokens = np.zeros((4, 6), np.int32)
  mask = np.zeros((4, 6), np.float32)
  for b in range(4):
    tokens[b, :length[b]] = 10 * (b + 1) + np.arange(length[b])
    mask[b, prompt[b]:length[b]] = 1
  version = np.where(np.arange(6)[None] < length[:, None], np.arange(4)[:, None], -1)
  lay = packing.plan(length, 6, buckets=(2, 4))
  # First fit decreasing: 5 -> row 0, 4 -> row 1, 3 -> row 2 (no room left in rows 0, 1), 2 -> row 1.
  np.testing.assert_array_equal(lay.row_b, [2, 0, 1, 1])
  np.testing.assert_array_equal(lay.start_b, [0, 0, 4, 0])
  assert (lay.rows_used, lay.num_rows) == (3, 4)
  p = packing.pack_batch(lay, tokens_bt=tokens, mask_bt=mask, advantages_bt=np.array([[1.], [-2.], [3.], [-4.]]) * mask,
                         behaviour_logp_bt=-mask, ref_logp_bt=-2 * mask, version_bt=version)
  pad = [0] * 6
  np.testing.assert_array_equal(p.tokens_rw, [[20, 21, 22, 23, 24, 0], [40, 41, 42, 43, 30, 31],
                                              [10, 11, 12, 0, 0, 0], pad])
  np.testing.assert_array_equal(p.segment_ids_rw, [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 2, 2],
                                                   [1, 1, 1, 0, 0, 0], pad])
  np.testing.assert_array_equal(p.positions_rw, [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 1],
                                                 [0, 1, 2, 0, 0, 0], pad])
  np.testing.assert_array_equal(p.mask_rw, [[0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 0, 1], [0, 0, 1, 0, 0, 0], pad])
  np.testing.assert_array_equal(p.advantages_rw, [[0, 0, -2, -2, -2, 0], [0, 0, -4, -4, 0, 3], [0, 0, 1, 0, 0, 0], pad])
  np.testing.assert_array_equal(p.behaviour_logp_rw, -p.mask_rw)
  np.testing.assert_array_equal(p.ref_logp_rw, -2 * p.mask_rw)
  np.testing.assert_array_equal(p.version_rw, [[1] * 5 + [-1], [3] * 4 + [2, 2], [0] * 3 + [-1] * 3,
                                               [-1] * 6])
  np.testing.assert_array_equal(p.sample_rw, p.version_rw)
  assert p.tokens_rw.dtype == p.segment_ids_rw.dtype == p.version_rw.dtype == np.int32
  assert p.mask_rw.dtype == p.advantages_rw.dtype == np.float32
  assert lay.stats() == {"rows": 4, "rows_used": 3, "width": 6, "tokens": 14,
                         "padding_fraction": pytest.approx(1 - 14 / 24)}


def host_batch(seed, kind="mixed"):
  """Right-padded host fields of B samples: prompts of 2-5 tokens; responses long-tailed ("mixed"),
  of 1-2 tokens ("short") or as long as the row allows ("long")."""
  rng = np.random.default_rng(seed)
  prompt = rng.integers(2, 6, size=B)
  room = T - prompt
  response = {"mixed": lambda: np.minimum(room, rng.geometric(0.3, size=B)),
              "short": lambda: rng.integers(1, 3, size=B), "long": lambda: room}[kind]()
  length = prompt + response
  col = np.arange(T)[None]
  tokens = np.where(col < length[:, None], rng.integers(3, 64, size=(B, T)), 0).astype(np.int32)
  mask = ((col >= prompt[:, None]) & (col < length[:, None])).astype(np.float32)
  return dict(tokens_bt=tokens, mask_bt=mask, advantages_bt=rng.normal(size=(B, 1)).astype(np.float32) * mask,
              behaviour_logp_bt=(rng.normal(size=(B, T)) * 0.1 - 4).astype(np.float32) * mask,
              ref_logp_bt=(rng.normal(size=(B, T)) * 0.3 - 4).astype(np.float32) * mask,
              version_bt=np.where(mask > 0, seed, -1).astype(np.int32)), length


@pytest.mark.parametrize("seed", range(5))
def test_unpacking_gives_the_samples_back(seed):
  fields, length = host_batch(seed)
  length[3] = 0                       # an empty sample takes no room and comes back empty
  for name, value in fields.items():
    value[3] = packing.PAD[name[:-len("_bt")]]
  lay = packing.plan(length, WIDTH, packing.row_buckets(B, 8))
  back = packing.unpack_batch(packing.pack_batch(lay, **fields), T)
  for name, value in fields.items():
    np.testing.assert_array_equal(back[name.rsplit("_", 1)[0]], value, err_msg=name)
  # Whole samples only: each placed sample is one contiguous run of one segment in one row.
  p = packing.pack_batch(lay, **fields)
  for b in np.flatnonzero(length):
    r, c = np.nonzero(p.sample_rw == b)
    assert len(set(r)) == 1 and np.array_equal(c, np.arange(c[0], c[0] + length[b]))
    assert len(set(p.segment_ids_rw[r, c])) == 1
  assert (p.sample_rw >= 0).sum() == length.sum()


def test_buckets_are_multiples_of_shards_times_micro_batches():
  assert packing.row_multiple(8, 2) == 16
  assert packing.row_buckets(32, 8) == (8, 16, 32)
  assert packing.row_buckets(30, 8) == (8, 16, 32)
  assert packing.row_buckets(32, 16) == (16, 32)
  assert packing.row_buckets(4, 8) == (8,)
  assert packing.row_buckets(128, 8, per_doubling=2) == (8, 16, 24, 32, 48, 64, 96, 128)
  # Halfway steps are 2^a * 3^b (24, 48, 96; not 23, 46, 91): a token budget finds divisors of each.
  assert packing.row_buckets(128, 2, per_doubling=2) == (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
  assert packing.choose_rows(9, (8, 16, 32)) == 16 and packing.choose_rows(0, (8, 16)) == 8
  with pytest.raises(ValueError, match="largest row bucket is 16"):
    packing.choose_rows(17, (8, 16))
  with pytest.raises(ValueError, match="multiple of 8"):
    packing.check_buckets((8, 12), 8)
  with pytest.raises(ValueError, match="sample 1 has 9 tokens; rows hold 8"):
    packing.plan(np.array([3, 9]), 8, (8,))
  for seed in range(4):
    _, length = host_batch(seed, ("short", "long")[seed % 2])
    lay = packing.plan(length, WIDTH, packing.row_buckets(B, 16))
    assert lay.num_rows in (16, 32) and lay.num_rows % 16 == 0 and lay.num_rows >= lay.rows_used
    assert lay.rows_used <= -(-length.sum() // WIDTH) + 2     # first fit decreasing packs tightly here


def test_packer_imports_no_jax_and_device_batch_checks_rows():
  code = "import sys; import rl_fusion_jax.train.packing; assert 'jax' not in sys.modules"
  subprocess.run([sys.executable, "-c", code], check=True)
  fields, length = host_batch(0, "short")
  lay = packing.plan(length, WIDTH, (12,))          # 12 rows do not split over 8 batch shards
  with pytest.raises(ValueError, match="12 packed rows do not split over data\\*fsdp=8"):
    packed_step.device_batch(make_mesh(MeshConfig(data=2, fsdp=4)), packing.pack_batch(lay, **fields))


@pytest.mark.parametrize("mode", algorithms.AGGREGATION_MODES)
def test_packed_weights_are_the_padded_weights_exactly(mode):
  fields, length = host_batch(11)
  fields["mask_bt"][[4, 9]] = 0       # empty samples count in neither the token nor the sample total
  lay = packing.plan(length, WIDTH, packing.row_buckets(B, 8))
  p = packing.pack_batch(lay, **fields)
  packed = packed_step.packed_token_weights(jnp.asarray(p.mask_rw), jnp.asarray(p.segment_ids_rw), mode,
                                            norm_len=T)
  padded = algorithms.token_weights(fields["mask_bt"], mode, norm_len=T)
  np.testing.assert_array_equal(lay.unpack(np.asarray(packed), T), np.asarray(padded))
  np.testing.assert_allclose(float(jnp.sum(packed)), 1.0 if mode != "seq-mean-token-sum-norm" else
                             float(jnp.sum(padded)), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------
# The packed step against the padded step
# ----------------------------------------------------------------------------------------------------

def make_steps(algo, micro, tx):
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  psh = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh, TRAIN_RULES)
  ssh = state_lib.state_shardings(tx, models.abstract_params(CFG), psh, mesh)
  new_state = lambda: state_lib.create_train_state(
      jax.device_put(models.init_params(CFG, jax.random.key(0), init_std=0.3), psh), tx, ssh)
  padded = step_lib.make_rl_step(CFG, algo, 1.0, tx, micro, mesh, T, ssh)
  packed = packed_step.make_packed_rl_step(CFG, algo, 1.0, tx, micro, mesh, T, ssh)
  return mesh, new_state, padded, packed


def packed_batch(mesh, fields, length, micro):
  multiple = packing.row_multiple(batch_shards(mesh), micro)
  lay = packing.plan(length, WIDTH, packing.row_buckets(B, multiple))
  return packed_step.device_batch(mesh, packing.pack_batch(lay, **fields))


# Every aggregation mode, 1, 2 and 4 micro-batches (4: 32 rows for 32 samples, many all padding), the
# default PPO-clip loss and an off-policy one, KL and entropy terms. Each case compiles two steps.
CASES = [
    ("token-mean", 2, {}),
    ("seq-mean-token-mean", 1, dict(kl_coef=0.1, entropy_coef=0.01)),
    ("seq-mean-token-sum-norm", 4, dict(policy_loss="tis_token")),
]


@pytest.mark.parametrize("aggregation,micro,extra", CASES)
def test_packed_step_equals_padded_step(aggregation, micro, extra):
  """Loss, every metric and the parameters after one update; SGD(1), so the update is the gradient.

  (Adam's first step is ~lr * sign(grad): float32 noise in a near-zero gradient entry would flip it.)
  """
  algo = AlgoConfig(aggregation=aggregation, **extra)
  mesh, new_state, padded, packed = make_steps(algo, micro, optax.sgd(1.0))
  fields, length = host_batch(21)
  s_pad, m_pad = padded(new_state(), TrainBatch(**{k: jnp.asarray(v) for k, v in fields.items()}))
  s_pack, m_pack = packed(new_state(), packed_batch(mesh, fields, length, micro))
  assert set(m_pad) == set(m_pack) and float(m_pack["nonfinite"]) == 0.0
  for name in m_pad:
    np.testing.assert_allclose(float(m_pack[name]), float(m_pad[name]), rtol=RTOL, atol=ATOL, err_msg=name)
  assert float(m_pad["clip_frac"]) > 0 or algo.policy_loss != "ppo_clip"     # the batch exercises the clip
  moved = 0.0
  for a, b, init in zip(jax.tree.leaves(s_pack.params), jax.tree.leaves(s_pad.params),
                        jax.tree.leaves(new_state().params)):
    # Per leaf, relative to the leaf's largest update: the two layouts sum in different orders, so a
    # small entry of a float32 gradient may differ by more than RTOL of itself.
    scale = float(jnp.max(jnp.abs(b - init)))
    assert float(jnp.max(jnp.abs(a - b))) <= RTOL * scale + ATOL, (float(jnp.max(jnp.abs(a - b))), scale)
    moved = max(moved, scale)
  assert moved > 1e-3                         # the update is far above the tolerance


def test_packed_step_compiles_once_per_bucket():
  shared_programs.clear()   # count this test's own traces: none shared from earlier tests
  mesh, new_state, _, packed = make_steps(AlgoConfig(), 1, optax.adam(1e-2))
  state, rows = new_state(), []
  for seed in range(4):
    fields, length = host_batch(seed, ("short", "long")[seed % 2])
    batch = packed_batch(mesh, fields, length, 1)
    rows.append(batch.tokens_rw.shape[0])
    state, metrics = packed(state, batch)
    assert np.isfinite(float(metrics["loss"]))
  assert rows == [8, 16, 8, 16]
  assert packed._cache_size() == 2
  assert int(state.policy_version) == 4


def test_fixed_row_count_skips_the_micro_batches_of_padding():
  """One large row count (64 rows, 4 micro-batches; rows laid out to fill micro-batch 0 first) with the
  padding micro-batches skipped gives the update of the smallest bucket (16 rows, one micro-batch), and
  the skip is real: NaN log-probs on the rows of the padding micro-batches (weight 0 there) never reach
  the update, as they do without it."""
  algo = AlgoConfig(aggregation="seq-mean-token-mean", kl_coef=0.1)
  tx = optax.sgd(1.0)
  mesh, new_state, _, packed = make_steps(algo, 1, tx)
  ssh = state_lib.state_shardings(tx, models.abstract_params(CFG), param_shardings(
      models.abstract_params(CFG), models.param_logical_axes(CFG), mesh, TRAIN_RULES), mesh)
  fixed = packed_step.make_packed_rl_step(CFG, algo, 1.0, tx, 4, mesh, T, ssh, skip_empty=True)
  unskipped = packed_step.make_packed_rl_step(CFG, algo, 1.0, tx, 4, mesh, T, ssh)
  fields, length = host_batch(21)
  small = packing.plan(length, WIDTH, (16,), groups=8)
  large = packing.plan(length, WIDTH, (64,), groups=8, micro=4)
  # 9 rows used: at most 2 per group, which micro-batch 0 holds (2 rows of each group's 8).
  assert small.rows_used == 9 and (large.row_b % 4 == 0).all()
  s1, m1 = packed(new_state(), packed_step.device_batch(mesh, packing.pack_batch(small, **fields)))
  s2, m2 = fixed(new_state(), packed_step.device_batch(mesh, packing.pack_batch(large, **fields)))
  assert float(m2["nonfinite"]) == 0.0
  for name in m1:
    np.testing.assert_allclose(float(m2[name]), float(m1[name]), rtol=RTOL, atol=ATOL, err_msg=name)
  for a, b in zip(jax.tree.leaves(s2.params), jax.tree.leaves(s1.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
  poisoned = packing.pack_batch(large, **fields)          # NaN on the rows of micro-batches 1, 2 and 3
  logp = np.where(np.arange(64)[:, None] % 4 == 0, poisoned.behaviour_logp_rw, np.nan).astype(np.float32)
  poisoned = dataclasses.replace(poisoned, behaviour_logp_rw=logp)
  _, m3 = fixed(new_state(), packed_step.device_batch(mesh, poisoned))
  _, m4 = unskipped(new_state(), packed_step.device_batch(mesh, poisoned))
  assert float(m3["nonfinite"]) == 0.0 and float(m3["loss"]) == pytest.approx(float(m1["loss"]), rel=RTOL)
  assert float(m4["nonfinite"]) != 0.0


def test_packed_logprobs_skip_the_micro_batches_of_padding():
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  psh = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh, TRAIN_RULES)
  params = jax.device_put(models.init_params(CFG, jax.random.key(0), init_std=0.3), psh)
  fields, length = host_batch(21)
  p = packing.pack_batch(packing.plan(length, WIDTH, (64,), groups=8, micro=4), **fields)
  args = [jnp.asarray(x) for x in (p.tokens_rw, p.positions_rw, p.segment_ids_rw)]
  whole = packed_step.make_packed_logprob_fn(CFG, 1.0, mesh, psh)(params, *args)
  skipped = packed_step.make_packed_logprob_fn(CFG, 1.0, mesh, psh, skip_micro=4)(params, *args)
  real = p.segment_ids_rw != 0
  assert real[np.arange(64) % 4 != 0].sum() == 0
  np.testing.assert_allclose(np.asarray(skipped)[real], np.asarray(whole)[real], rtol=RTOL, atol=ATOL)
  assert (np.asarray(skipped)[np.arange(64) % 4 != 0] == 0).all()


def test_packed_logprobs_never_read_across_samples():
  """A sample's log-probs do not change when its row neighbour changes, and equal its padded row's."""
  params = models.init_params(CFG, jax.random.key(0), init_std=0.3)
  fields, length = host_batch(5)
  lay = packing.plan(length, WIDTH, (32,))
  p = packing.pack_batch(lay, **fields)
  logprobs = jax.jit(lambda tokens_rw: packed_step.packed_token_logprobs(
      CFG, params, tokens_rw, jnp.asarray(p.positions_rw), jnp.asarray(p.segment_ids_rw))[0])
  logp_rw = logprobs(jnp.asarray(p.tokens_rw))
  other = np.where(p.segment_ids_rw == 2, (p.tokens_rw + 7) % 64, p.tokens_rw)   # second samples change
  logp2_rw = logprobs(jnp.asarray(other))
  first = p.segment_ids_rw == 1
  np.testing.assert_array_equal(np.asarray(logp_rw)[first], np.asarray(logp2_rw)[first])
  padded = jax.jit(lambda tokens_bt: token_logprobs(CFG, params, tokens_bt))(fields["tokens_bt"])
  want = np.where(np.arange(T) < length[:, None], np.asarray(padded), 0)
  np.testing.assert_allclose(lay.unpack(np.asarray(logp_rw), T), want, rtol=RTOL, atol=ATOL)
  assert (lay.unpack(np.asarray(logp_rw), T)[:, 0] == 0).all()


def test_row_level_policy_loss_is_refused():
  tx = optax.sgd(1.0)
  with pytest.raises(ValueError, match="algo.policy_loss: 'tis_seq'"):
    packed_step.make_packed_rl_step(CFG, AlgoConfig(policy_loss="tis_seq"), 1.0, tx, 1, None, T, None)


def test_packed_token_budget_gives_the_one_micro_batch_update():
  """A budget of one row (24 tokens) per device splits the 16-row bucket (8 batch shards) into 2 micro-batches: the
  update is the one-micro-batch one (SGD(1): parameters after one step are the gradient)."""
  algo = AlgoConfig(aggregation="seq-mean-token-mean", kl_coef=0.1)
  mesh, new_state, _, packed = make_steps(algo, 1, optax.sgd(1.0))
  budget = step_lib.MicroBatching(tokens=WIDTH)
  _, _, _, packed_budget = make_steps(algo, budget, optax.sgd(1.0))
  fields, length = host_batch(21)
  batch = packed_batch(mesh, fields, length, 1)
  rows = batch.tokens_rw.shape[0]
  assert budget.num_micro(rows, WIDTH, batch_shards(mesh)) == rows // 8 > 1
  init = jax.device_get(new_state().params)
  s1, m1 = packed(new_state(), batch)
  s2, m2 = packed_budget(new_state(), batch)
  for name in m1:
    np.testing.assert_allclose(float(m2[name]), float(m1[name]), rtol=RTOL, atol=ATOL, err_msg=name)
  moved = 0.0
  for a, b, p0 in zip(jax.tree.leaves(s2.params), jax.tree.leaves(s1.params), jax.tree.leaves(init)):
    da, db = np.asarray(a) - p0, np.asarray(b) - p0
    assert float(np.max(np.abs(da - db))) <= RTOL * float(np.max(np.abs(db))) + 1e-9
    moved = max(moved, float(np.max(np.abs(db))))
  assert moved > 1e-3
