"""optim.shared_prompts: a group's prompt runs once in the update; log-probs, entropies, loss and gradients
equal the unshared padded update's (the reference: `token_logprobs` with its head window, itself checked
against transformers in tests/hf_io_test.py)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_fusion_jax import models
from rl_fusion_jax.config import AlgoConfig, ConfigError, MeshConfig, RunConfig
from rl_fusion_jax.orchestration.guard import DivergenceGuard
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing import experiments
from rl_fusion_jax.testing.tiny import tiny_model_config
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.train.logprobs import response_window, shared_prompt_logprobs, token_logprobs
from rl_fusion_jax.types import TrainBatch

CFG = tiny_model_config()
GROUP, GROUPS, T, WINDOW = 4, 4, 16, 6     # rows of GROUP samples; responses of at most WINDOW tokens


def grouped_rows(seed: int, groups: int = GROUPS):
  """Rows in groups of GROUP: one random prompt per group (3-9 tokens), each row its own response of 1 to
  WINDOW tokens, then padding (0); the mask covers the responses."""
  rng = np.random.default_rng(seed)
  tokens = np.zeros((groups * GROUP, T), np.int32)
  mask = np.zeros((groups * GROUP, T), np.float32)
  for g in range(groups):
    prompt = rng.integers(3, 64, size=rng.integers(3, 10))
    for k in range(GROUP):
      n = int(rng.integers(1, WINDOW + 1))
      row = g * GROUP + k
      tokens[row, :len(prompt)] = prompt
      tokens[row, len(prompt):len(prompt) + n] = rng.integers(3, 64, size=n)
      mask[row, len(prompt):len(prompt) + n] = 1
  return jnp.asarray(tokens), jnp.asarray(mask)


def params(seed: int = 0):
  return models.init_params(CFG, jax.random.key(seed), init_std=0.3)


def test_log_probs_and_entropies_equal_the_unshared_window():
  p = params()
  tokens, mask = grouped_rows(1)
  want_logp, want_ent = token_logprobs(CFG, p, tokens, 0.7, with_entropy=True,
                                       head_window=(response_window(mask, WINDOW)[0], WINDOW))
  logp, ent, outside, mismatched = jax.jit(
      lambda p, t, m: shared_prompt_logprobs(CFG, p, t, m, GROUP, WINDOW, 0.7, with_entropy=True))(p, tokens, mask)
  assert int(outside) == 0 and int(mismatched) == 0
  used = np.asarray(mask) > 0
  assert used.sum() > 40
  np.testing.assert_allclose(np.asarray(logp)[used], np.asarray(want_logp)[used], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent)[used], np.asarray(want_ent)[used], rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(logp)[used] < 0)


def test_a_row_with_another_prompt_and_a_token_past_the_window_are_counted():
  p = params()
  tokens, mask = grouped_rows(2)
  bad = tokens.at[GROUP + 2, 1].set((tokens[GROUP + 2, 1] + 1) % 64)    # group 1, row 2: one prompt token
  _, _, outside, mismatched = shared_prompt_logprobs(CFG, p, bad, mask, GROUP, WINDOW)
  assert (int(outside), int(mismatched)) == (0, 1)
  # A masked prompt token in row 0: the group's window starts at the prompt's end, so it lies outside.
  early = mask.at[0, 1].set(1.0)
  _, _, outside, _ = shared_prompt_logprobs(CFG, p, tokens, early, GROUP, WINDOW)
  assert int(outside) == 1


def _update(shared: int, micro, mesh_cfg, tx):
  mesh = make_mesh(mesh_cfg)
  psh = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh, TRAIN_RULES)
  ssh = state_lib.state_shardings(tx, models.abstract_params(CFG), psh, mesh)
  state = state_lib.create_train_state(jax.device_put(params(), psh), tx, ssh)
  step = step_lib.make_rl_step(CFG, AlgoConfig(), 1.0, tx, micro, mesh, WINDOW, ssh, max_response_len=WINDOW,
                               shared_prompts=shared)
  return state, step


def _batch(seed: int, groups: int):
  tokens, mask = grouped_rows(seed, groups)
  rng = np.random.default_rng(seed + 100)
  adv = jnp.asarray(rng.normal(size=(tokens.shape[0], 1)).astype(np.float32)) * mask
  behaviour = jnp.asarray(rng.normal(size=tokens.shape).astype(np.float32) * 0.1 - 4) * mask
  zeros = jnp.zeros(tokens.shape)
  return TrainBatch(tokens_bt=tokens, mask_bt=mask, advantages_bt=adv, behaviour_logp_bt=behaviour,
                    ref_logp_bt=zeros, version_bt=jnp.zeros(tokens.shape, jnp.int32))


@pytest.mark.parametrize("micro", [1, step_lib.MicroBatching(tokens=2 * T)])
def test_the_update_equals_the_unshared_update_on_sharded_micro_batches(micro):
  """8 groups over 4 batch shards (data=2, fsdp=2, tensor=2 on the 8 devices); a 32-position budget splits
  each shard's 2 groups into micro-batches of one group."""
  mesh_cfg = MeshConfig(data=2, fsdp=2, tensor=2)
  tx = optax.sgd(1.0)      # the parameter change is the gradient
  data = _batch(3, 8)
  s0, plain = _update(0, micro, mesh_cfg, tx)
  s1, shared = _update(GROUP, micro, mesh_cfg, tx)
  s0, m0 = plain(s0, data)
  s1, m1 = shared(s1, data)
  assert float(m1["nonfinite"]) == 0 and float(m1[step_lib.PROMPT_METRIC]) == 0
  for key in ("loss", "grad_norm", "entropy", "clip_frac"):
    if key in m0:
      np.testing.assert_allclose(float(m1[key]), float(m0[key]), rtol=2e-5, atol=1e-7, err_msg=key)
  for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
  rows, width = data.tokens_bt.shape
  # The budget counts the positions a shared row costs: 15 + 3 * 5 = 30 a group, 8 a row: 4 rows (a group)
  # per micro-batch under 32 positions, so 2 micro-batches on each shard of 8 rows.
  if isinstance(micro, step_lib.MicroBatching):
    assert micro.num_micro(rows, -(-(width - 1 + (GROUP - 1) * (WINDOW - 1)) // GROUP), 4, GROUP) == 2


def test_rows_out_of_their_groups_withhold_the_update():
  tx = optax.sgd(1.0)
  state, step = _update(GROUP, 1, MeshConfig(data=2, fsdp=2, tensor=2), tx)
  data = _batch(4, 8)
  rows = np.arange(data.tokens_bt.shape[0])
  rows[[1, 4]] = rows[[4, 1]]        # a row of group 1 in group 0 and the reverse
  data = jax.tree.map(lambda x: x[rows], data)
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = step(state, data)
  assert float(metrics[step_lib.PROMPT_METRIC]) > 0
  assert float(metrics["nonfinite"]) == step_lib.PROMPT_CODE
  # The host stops whatever run.on_nonfinite says, naming the reason.
  with pytest.raises(RuntimeError, match=r"step 3: rows of a group with different prompts"):
    DivergenceGuard(RunConfig(on_nonfinite="skip"), "RL").check(3, {k: float(v) for k, v in metrics.items()})
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(b), a)


@pytest.mark.parametrize("overrides,field", [
    ({"optim.pack_rows": True}, "optim.shared_prompts"),
    ({"algo.mini_batches": 2}, "optim.shared_prompts"),
    ({**experiments.TINY_MOE}, "optim.shared_prompts"),
])
def test_configs_it_cannot_serve_are_refused_naming_the_field(overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    experiments.tiny(**{"optim.shared_prompts": True, **overrides})


def test_the_loop_trains_as_without_it(tmp_path):
  """The tiny experiment (2 layers, 4 prompts x 2 samples; 8 devices as data 2 x fsdp 2 x tensor 2, so each
  batch shard holds a group) under StaleSync (s = 1, forced long-tail lengths: batches of groups generated
  under two policy versions), 4 steps with and without shared prompts: the same rewards (the same samples) and losses within float32
  rounding. The entropy bonus makes the loss and its gradient non-zero from the first step (a random
  policy's rewards and advantages are 0)."""
  from rl_fusion_jax.orchestration import loop   # pylint: disable=import-outside-toplevel
  rows = {}
  for shared in (False, True):
    cfg = experiments.tiny(**{"optim.shared_prompts": shared, "mesh.tensor": 2, "algo.entropy_coef": 0.01,
                              "stalesync.enabled": True, "stalesync.max_staleness": 1, "run.steps": 4,
                              "stalesync.train_fraction": 0.5, "rollout.forced_length_median": 3,
                              "rollout.forced_length_sigma": 1.0, "rollout.max_new_tokens": 12,
                              "rollout.chunk_steps": 4})
    loop.run(cfg, str(tmp_path / str(shared)))
    with open(tmp_path / str(shared) / "metrics.jsonl") as f:
      rows[shared] = [json.loads(line) for line in f if '"loss"' in line]
  assert [r["step"] for r in rows[True]] == [1, 2, 3, 4]
  assert max(r["stalesync/staleness_max"] for r in rows[True]) == 1
  for a, b in zip(rows[False], rows[True]):
    assert a["reward"] == b["reward"]
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-3)
    assert b["grad_norm"] > 0 and b["nonfinite"] == 0
