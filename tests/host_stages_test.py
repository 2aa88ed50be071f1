"""The verify stage: background scoring of finished samples gives exactly the synchronous scores."""
import jax
import numpy as np
import pytest

from rl_fusion_jax import models
from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.orchestration.host_stages import VerifyStage
from rl_fusion_jax.rewards.base import score_batch
from rl_fusion_jax.rewards.registry import make_task
from rl_fusion_jax.rollout.decode import GenerateSpec
from rl_fusion_jax.rollout.engine import Engine, EngineConfig, Request
from rl_fusion_jax.rollout.sampling import SamplingParams
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.tokenizer import load_tokenizer
from rl_fusion_jax.types import Rollout

G = 2   # group size


def batch(task, tokenizer, groups=(0, 1, 2), width=24):
  """A host Rollout of len(groups) * G samples: each group answers its problem right once, wrong once."""
  rows, plens, rlens, ids = [], [], [], []
  for g in groups:
    problem = task.problem(g)
    prompt = tokenizer.encode(problem.prompt)[:6]
    for j, text in enumerate((problem.target, "7")):
      response = tokenizer.encode(text) + [tokenizer.eos_id]
      row = np.zeros((width,), np.int32)
      row[:len(prompt)] = prompt
      row[len(prompt):len(prompt) + len(response)] = response
      rows.append(row), plens.append(len(prompt)), rlens.append(len(response)), ids.append(g * G + j)
  n = len(rows)
  return Rollout(tokens_bt=np.stack(rows), prompt_len_b=np.array(plens, np.int32),
                 response_len_b=np.array(rlens, np.int32), logp_bt=np.zeros((n, width), np.float32),
                 version_bt=np.zeros((n, width), np.int32), finished_b=np.ones((n,), bool),
                 sample_id_b=np.array(ids, np.int32))


def expected(task, tokenizer, rollout):
  """Independent of the stage: decode by hand and score with the task's own verifier."""
  texts = []
  for row, p, n in zip(rollout.tokens_bt, rollout.prompt_len_b, rollout.response_len_b):
    texts.append(tokenizer.decode([int(t) for t in row[p:p + n] if t != tokenizer.eos_id]))
  problems = [task.problem(int(s) // G) for s in rollout.sample_id_b]
  return score_batch(task, problems, texts)


@pytest.fixture(scope="module")
def env():
  return make_task("arithmetic", seed=0, max_digits=2), load_tokenizer("char")


def _take(rollout, rows):
  return jax.tree.map(lambda x: np.asarray(x)[rows], rollout)


@pytest.mark.parametrize("workers,submitted,early", [(1, (0, 1, 2, 3, 4, 5), 1.0), (2, (0, 1, 4), 0.5),
                                                     (1, (), 0.0), (0, (0, 1, 2, 3, 4, 5), 0.0)])
def test_scores_equal_the_verifier(env, workers, submitted, early):
  task, tokenizer = env
  rollout = batch(task, tokenizer)
  stage = VerifyStage(task, tokenizer, G, workers)
  if submitted:   # as the engine reports them: in two chunks
    half = len(submitted) // 2
    for rows in (list(submitted[:half]), list(submitted[half:])):
      part = _take(rollout, rows)
      stage.submit(part, part.sample_id_b // G)
  rewards, fmt, correct, m = stage.scores(rollout, [task.problem(g) for g in (0, 1, 2)])
  want = expected(task, tokenizer, rollout)
  np.testing.assert_array_equal(rewards, want[0])
  np.testing.assert_array_equal(fmt, want[1])
  np.testing.assert_array_equal(correct, want[2])
  assert correct.tolist() == [True, False] * 3      # the batch is not trivially all-right or all-wrong
  assert m["verify/early_frac"] == pytest.approx(early)
  assert not stage._pending                         # consumed results are not kept
  stage.close()


def test_forget_drops_background_results(env):
  task, tokenizer = env
  rollout = batch(task, tokenizer)
  stage = VerifyStage(task, tokenizer, G, 1)
  stage.submit(rollout, rollout.sample_id_b // G)
  stage.forget(rollout.sample_id_b[:2])
  *_, m = stage.scores(_take(rollout, [0, 1, 2, 3]), [task.problem(0), task.problem(1)])
  assert m["verify/early_frac"] == 0.5
  assert sorted(stage._pending) == [4, 5]
  stage.close()


def test_engine_reports_each_finished_sample_once():
  """on_finished sees every sample the engine returns, once, chunk by chunk, with its group id."""
  cfg = models.ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=32, max_position_embeddings=32)
  mesh = make_mesh(MeshConfig(data=-1))
  shardings = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  params = jax.device_put(models.init_params(cfg, jax.random.key(0), init_std=0.5), shardings)
  engine = Engine(EngineConfig(GenerateSpec(cfg, SamplingParams(1.0), 4, 12, 1), num_slots=8, chunk_steps=2,
                               group_size=2), mesh, shardings)
  seen = []
  engine.on_finished = lambda rollout, groups, shards: seen.append((rollout.sample_id_b.tolist(), groups.tolist(),
                                                                    shards.tolist()))
  lengths = [1 + (7 * i) % 12 for i in range(16)]          # forced lengths 1..12: finishing at many chunks
  engine.add([Request(i, i // 2, np.array([3, 4, 5], np.int32), lengths[i]) for i in range(16)])
  returned = []
  while engine.num_queued or engine.num_in_flight or engine.num_unreturned:
    returned += engine.run(params, 0, target_groups=2).rollout.sample_id_b.tolist()
  ids = [i for chunk, _, _ in seen for i in chunk]
  assert sorted(ids) == sorted(returned) == list(range(16))   # each once
  assert len(seen) > 3                                         # chunk by chunk, not once at the end
  assert all(g == [i // 2 for i in chunk] for chunk, g, _ in seen)
  # Each sample's batch shard: one of the mesh's 8 (a slot each), several in use.
  shards = [r for _, _, chunk in seen for r in chunk]
  assert len(shards) == 16 and set(shards) <= set(range(8)) and len(set(shards)) > 1
