"""Partial rollout across a weight change (re-prefill vs kept cache) and GRPO group targets."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rl_fusion_jax import models
from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.rollout.decode import GenerateSpec
from rl_fusion_jax.rollout.engine import Engine, EngineConfig, Request
from rl_fusion_jax.rollout.sampling import SamplingParams
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.tiny import tiny_model_config

CFG = tiny_model_config()
P, N, B, EOS = 6, 10, 24, 20
GREEDY, SAMPLED = SamplingParams(0.0), SamplingParams(1.0)


@functools.lru_cache(maxsize=None)
def setup(seed=0):
  mesh = make_mesh(MeshConfig(data=-1))
  shardings = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh,
                              TRAIN_RULES)
  params = jax.device_put(models.init_params(CFG, jax.random.key(seed), init_std=0.5), shardings)
  return mesh, shardings, params


def make_engine(sampling, **kw):
  mesh, shardings, _ = setup()
  return Engine(EngineConfig(GenerateSpec(CFG, sampling, P, N, EOS), **kw), mesh, shardings)


def requests(forced, group_size=1):
  """B requests with forced lengths (EOS ignored); prompts of 1..P random tokens."""
  rng = np.random.default_rng(0)
  lens = rng.integers(1, P + 1, size=B)
  return [Request(b, b // group_size, rng.integers(3, 60, size=lens[b]), int(forced[b])) for b in range(B)]


def recompute(params, tokens_bt):
  logits = jax.jit(lambda p, t: models.forward(CFG, p, t))(params, jnp.asarray(tokens_bt))
  return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def split_run_with_new_weights(keep_cache):
  """Run 1 under weights A (version 1) stops at 4 samples; run 2 continues under weights B (version 2)."""
  params_a, params_b = setup()[2], setup(seed=1)[2]
  forced = np.random.default_rng(5).integers(3, N + 1, size=B)
  engine = make_engine(GREEDY, num_slots=8, chunk_steps=3, keep_cache=keep_cache)
  engine.add(requests(forced))
  first = engine.run(params_a, 1, target_samples=4)
  # L x S x K x T x H x {k, v} x 4 bytes = 2 x 8 x 2 x 16 x 8 x 2 x 4 = 32768, held only with keep_cache.
  assert engine.held_cache_bytes == (32768 if keep_cache else 0)
  assert engine.num_in_flight >= 2
  in_flight = engine.num_in_flight
  second = engine.run(params_b, 2)
  assert second.stats.get("reprefill_rows", 0) == (0 if keep_cache else in_flight)
  return params_a, params_b, forced, first, second


def test_partial_rollout_reprefills_under_new_weights():
  params_a, params_b, forced, first, second = split_run_with_new_weights(keep_cache=False)
  assert len(first.group_id_b) == 4 and len(second.group_id_b) == B - 4
  assert set(first.rollout.sample_id_b) | set(second.rollout.sample_id_b) == set(range(B))
  logp_a = recompute(params_a, first.rollout.tokens_bt)
  for b, t in zip(*np.nonzero(first.rollout.version_bt >= 0)):
    assert first.rollout.version_bt[b, t] == 1
    assert first.rollout.tokens_bt[b, t] == np.argmax(logp_a[b, t - 1])
  ro = second.rollout
  logp = {1: recompute(params_a, ro.tokens_bt), 2: recompute(params_b, ro.tokens_bt)}
  mixed = 0
  for b in range(len(ro.sample_id_b)):
    start, n = int(ro.prompt_len_b[b]), int(ro.response_len_b[b])
    assert n == forced[ro.sample_id_b[b]]
    versions = ro.version_bt[b, start:start + n]
    assert set(versions) <= {1, 2} and (np.diff(versions) >= 0).all()
    mixed += len(set(versions)) == 2
    for t in range(start, start + n):
      v = int(ro.version_bt[b, t])   # greedy under the weights of the token's version, given its prefix
      assert ro.tokens_bt[b, t] == np.argmax(logp[v][b, t - 1]), (b, t, v)
      np.testing.assert_allclose(ro.logp_bt[b, t], logp[v][b, t - 1, ro.tokens_bt[b, t]], atol=2e-5)
  assert mixed >= 1      # some sample was carried across the weight change
  assert max(ro.prompt_len_b + ro.response_len_b) > 12   # some prefixes needed the widest prefill


def test_keep_cache_continues_on_stale_kv():
  # The negative control of the test above: with the old weights' KV kept, the new tokens' log-probs
  # are not those of weights B given the prefix.
  _, params_b, _, _, second = split_run_with_new_weights(keep_cache=True)
  ro = second.rollout
  logp_b = recompute(params_b, ro.tokens_bt)
  diffs = [abs(ro.logp_bt[b, t] - logp_b[b, t - 1, ro.tokens_bt[b, t]])
           for b in range(len(ro.sample_id_b)) for t in range(ro.tokens_bt.shape[1])
           if ro.version_bt[b, t] == 2 and ro.version_bt[b, int(ro.prompt_len_b[b])] == 1]
  assert diffs and max(diffs) > 1e-3


def test_target_groups_returns_whole_groups():
  forced = np.random.default_rng(3).integers(1, 2 * N, size=B)
  engine = make_engine(SAMPLED, num_slots=8, chunk_steps=2, group_size=4)
  engine.add(requests(forced, group_size=4))
  first = engine.run(setup()[2], 0, target_groups=2)
  groups, counts = np.unique(first.group_id_b, return_counts=True)
  assert len(groups) == 2 and (counts == 4).all()
  np.testing.assert_array_equal(first.group_id_b, first.rollout.sample_id_b // 4)
  rest = engine.run(setup()[2], 1)
  ids = np.concatenate([first.rollout.sample_id_b, rest.rollout.sample_id_b])
  np.testing.assert_array_equal(np.sort(ids), np.arange(B))
  for ro in (first.rollout, rest.rollout):
    np.testing.assert_array_equal(ro.response_len_b, np.minimum(forced[ro.sample_id_b], N))
    np.testing.assert_array_equal(ro.finished_b, forced[ro.sample_id_b] <= N)
