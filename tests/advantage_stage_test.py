"""The host's advantage stage: per-group advantages by hand, the StaleSync queue's advantage field and its
readiness, and the update taking the advantages as given."""
import types

import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax.algorithms import batch as algo_batch
from rl_fusion_jax.algorithms import registry
from rl_fusion_jax.orchestration import advantage_stage, stalesync
from rl_fusion_jax.queue.distqueue import Packed
from rl_fusion_jax.testing.experiments import tiny


def test_group_advantages_by_hand():
  cfg = tiny()
  # Groups of 2: [1, 0] -> mean 0.5, std 0.5 -> +-0.5 / (0.5 + 1e-6); [0.3, 0.3] -> equal rewards -> 0.
  # 9 groups: more than one call of GROUPS_PER_CALL (8), the second padded.
  rewards = np.array([1.0, 0.0] + [0.3, 0.3] * 8, np.float32)
  adv = advantage_stage.advantages(cfg.algo, 2, rewards)
  want = np.array([0.5 / 0.500001, -0.5 / 0.500001] + [0.0] * 16)
  np.testing.assert_allclose(adv, want, rtol=1e-6)
  assert adv.dtype == np.float32
  # RLOO, groups of 3: A_i = r_i - mean of the other two.
  rloo = cfg.algo.__class__(**{**cfg.algo.__dict__, "advantage": "rloo"})
  np.testing.assert_allclose(advantage_stage.advantages(rloo, 3, [3.0, 0.0, 0.0, 1.0, 2.0, 3.0]),
                             [3.0, -1.5, -1.5, -1.5, 0.0, 1.5], rtol=1e-6)
  with pytest.raises(ValueError, match="whole groups of 2"):
    advantage_stage.advantages(cfg.algo, 2, [1.0, 0.0, 1.0])


def test_which_runs_compute_their_advantages_on_the_host():
  algo = tiny().algo
  assert advantage_stage.on_host(algo)
  assert not advantage_stage.on_host(algo.__class__(**{**algo.__dict__, "kl_coef": 0.1, "kl_mode": "reward"}))
  assert advantage_stage.on_host(algo.__class__(**{**algo.__dict__, "kl_coef": 0.1, "kl_mode": "loss"}))
  assert "gae" not in registry.PER_GROUP_ADVANTAGES
  assert {"grpo", "dr_grpo", "rloo"} <= registry.PER_GROUP_ADVANTAGES


def test_an_estimator_not_declared_per_group_stays_in_the_update():
  name = "batch_whitened_for_test"
  registry.register_advantage(name)(lambda r, g: (r - r.mean()) / (r.std() + 1e-6))
  try:
    algo = tiny().algo
    assert not advantage_stage.on_host(algo.__class__(**{**algo.__dict__, "advantage": name}))
    with pytest.raises(ValueError, match="not registered per_group"):
      advantage_stage.advantages(algo.__class__(**{**algo.__dict__, "advantage": name}), 2, [1.0, 0.0])
  finally:
    del registry.ADVANTAGE_ESTIMATORS[name]


def _queue(cfg):
  setup = types.SimpleNamespace(cfg=cfg)
  return stalesync.make_queue(setup, stalesync.SCORE_FIELDS + advantage_stage.ADVANTAGE_FIELDS)


def _put(queue, ids, group_size=2):
  n = np.full(len(ids), 2)
  queue.put(np.asarray(ids), tokens=Packed(np.ones(2 * len(ids), np.int32), n),
            logp=Packed(np.zeros(2 * len(ids), np.float32), n), version=Packed(np.zeros(2 * len(ids), np.int32), n),
            prompt_len=[1] * len(ids), response_len=[1] * len(ids), finished=[True] * len(ids), sample_id=ids,
            group_id=[i // group_size for i in ids], min_version=[0] * len(ids))


def _score(queue, ids, rewards):
  for name, values in (("reward", rewards), ("format_ok", [True] * len(ids)), ("correct", [True] * len(ids))):
    queue.write(name, ids, values)


def test_a_group_is_ready_for_the_trainer_once_its_advantages_are_written():
  cfg = tiny(**{"stalesync.enabled": True, "stalesync.max_staleness": 1, "stalesync.train_fraction": 0.5})
  queue = _queue(cfg)
  stage = advantage_stage.AdvantageStage(cfg, queue)
  _put(queue, [4, 5, 6, 7])                           # groups 2 and 3
  _score(queue, [4, 5, 6], [1.0, 0.0, 2.0])           # group 3 has one of its two scores
  assert stage.run()[0] == 1                          # group 2 only
  assert queue.ready(stalesync.CONSUMER).tolist() == [4, 5]
  np.testing.assert_allclose(queue.peek([4, 5], ("advantage",))["advantage"], [0.5 / 0.500001, -0.5 / 0.500001],
                             rtol=1e-6)
  assert stage.run()[0] == 0                          # nothing new: group 2 is not written twice
  _score(queue, [7], [1.0])
  assert stage.run()[0] == 1
  assert queue.ready(stalesync.CONSUMER).tolist() == [4, 5, 6, 7]
  np.testing.assert_allclose(queue.peek([6, 7], ("advantage",))["advantage"], [0.5 / 0.500001, -0.5 / 0.500001],
                             rtol=1e-6)
  before = queue.stats()["bytes_read_samples"]
  queue.read(stalesync.CONSUMER, [4, 5, 6, 7])
  assert queue.stats()["depth"] == 0                  # read by both consumers: freed
  assert queue.stats()["bytes_read_samples"] > before  # the trainer's read is counted, the stage's was not
  assert before == 0


def test_the_stage_shapes_the_rewards_as_the_train_phase_does():
  # DAPO's overlong penalty (buffer 2 of max_new_tokens 4): a response of 4 tokens gets -1, of 1 token 0.
  cfg = tiny(**{"stalesync.enabled": True, "algo.overlong_buffer": 2, "rollout.max_new_tokens": 4,
                "algo.advantage": "dr_grpo"})
  queue = _queue(cfg)
  n = np.array([2, 5])
  queue.put([0, 1], tokens=Packed(np.ones(7, np.int32), n), logp=Packed(np.zeros(7, np.float32), n),
            version=Packed(np.zeros(7, np.int32), n), prompt_len=[1, 1], response_len=[1, 4],
            finished=[True, True], sample_id=[0, 1], group_id=[0, 0], min_version=[0, 0])
  _score(queue, [0, 1], [1.0, 1.0])
  _, metrics = advantage_stage.AdvantageStage(cfg, queue).run()
  # Shaped rewards [1, 0]: Dr. GRPO advantages [0.5, -0.5].
  np.testing.assert_allclose(queue.peek([0, 1], ("advantage",))["advantage"], [0.5, -0.5])
  assert metrics["overlong/penalized_frac"] == 0.5


def test_the_update_takes_the_given_advantages():
  resp = np.array([2, 1], np.int32)
  t = np.arange(4)[None, :]
  mask = (t >= 1) & (t < 1 + resp[:, None])
  from rl_fusion_jax.types import Rollout  # pylint: disable=g-import-not-at-top
  rollout = Rollout(tokens_bt=jnp.ones((2, 4), jnp.int32), prompt_len_b=jnp.ones((2,), jnp.int32),
                    response_len_b=jnp.asarray(resp), logp_bt=jnp.asarray(np.where(mask, -1.0, 0.0), jnp.float32),
                    version_bt=jnp.zeros((2, 4), jnp.int32), finished_b=jnp.ones((2,), bool),
                    sample_id_b=jnp.arange(2, dtype=jnp.int32))
  kw = dict(advantage="grpo", group_size=2, kl_coef=0.1, kl_estimator="k1")
  batch, stats = algo_batch.train_batch(rollout, jnp.array([1.0, 0.0]), jnp.full((2, 4), -1.5), kl_mode="loss",
                                        advantages_b=jnp.array([0.25, -3.0]), **kw)
  np.testing.assert_allclose(batch.advantages_bt, np.where(mask, [[0.25], [-3.0]], 0.0))
  assert float(stats["kl_seq"]) == pytest.approx(0.75)        # 0.5 a token: (2 + 1) / 2 samples
  assert float(stats["advantage_abs_mean"]) == pytest.approx(1.625)
  with pytest.raises(ValueError, match="kl_mode='reward'"):
    algo_batch.train_batch(rollout, jnp.array([1.0, 0.0]), jnp.full((2, 4), -1.5), kl_mode="reward",
                           advantages_b=jnp.array([0.25, -3.0]), **kw)
