"""The jitted RL update: one trace across steps, exact micro-batch accumulation, gradient by reference."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_fusion_jax import models
from rl_fusion_jax.config import AlgoConfig, MeshConfig, OptimConfig
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.train.logprobs import token_logprobs
from rl_fusion_jax.types import TrainBatch

CFG = models.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, qkv_bias=True, max_position_embeddings=64)
B, T, PROMPT = 32, 12, 4


def setup(optim=OptimConfig(learning_rate=1e-2), algo=AlgoConfig(), mesh_cfg=MeshConfig(data=2, fsdp=4),
          tx=None):
  mesh = make_mesh(mesh_cfg)
  psh = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh, TRAIN_RULES)
  tx = tx or state_lib.make_optimizer(optim)
  ssh = state_lib.state_shardings(tx, models.abstract_params(CFG), psh, mesh)
  params = jax.device_put(models.init_params(CFG, jax.random.key(0), init_std=0.3), psh)
  state = state_lib.create_train_state(params, tx, ssh)
  step = step_lib.make_rl_step(CFG, algo, 1.0, tx, optim.micro_batches, mesh, T - PROMPT, ssh)
  return state, step


def batch(seed, params=None):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, 64, size=(B, T)).astype(np.int32)
  lens = rng.integers(1, T - PROMPT + 1, size=B)
  mask = np.zeros((B, T), np.float32)
  for b, n in enumerate(lens):
    mask[b, PROMPT:PROMPT + n] = 1
    tokens[b, PROMPT + n:] = 0
  adv = rng.normal(size=B).astype(np.float32)
  if params is None:
    behaviour = rng.normal(size=(B, T)).astype(np.float32) * 0.1 - 4
  else:   # on-policy: behaviour log-probs are the current policy's
    behaviour = np.asarray(token_logprobs(CFG, params, jnp.asarray(tokens))) * mask
  return TrainBatch(tokens_bt=jnp.asarray(tokens), mask_bt=jnp.asarray(mask), advantages_b=jnp.asarray(adv),
                    behaviour_logp_bt=jnp.asarray(behaviour * mask), ref_logp_bt=jnp.zeros((B, T)),
                    version_bt=jnp.zeros((B, T), jnp.int32))


def test_traces_once_across_steps_with_different_contents_and_lengths():
  state, step = setup()
  for seed in range(4):
    state, metrics = step(state, batch(seed))
    assert np.isfinite(float(metrics["loss"]))
  assert step._cache_size() == 1
  assert int(state.policy_version) == 4 and int(state.step) == 4


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_full_batch_update(aggregation):
  algo = AlgoConfig(aggregation=aggregation)
  # Plain SGD, so the parameter change is the gradient itself (Adam's first step is ~sign(grad)).
  s1, step1 = setup(OptimConfig(micro_batches=1), algo, tx=optax.sgd(1.0))
  s4, step4 = setup(OptimConfig(micro_batches=4), algo, tx=optax.sgd(1.0))
  data = batch(7)
  s1, m1 = step1(s1, data)
  s4, m4 = step4(s4, data)
  np.testing.assert_allclose(float(m1["grad_norm"]), float(m4["grad_norm"]), rtol=1e-4)
  np.testing.assert_allclose(float(m1["loss"]), float(m4["loss"]), rtol=1e-4, atol=1e-6)
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)


def test_on_policy_gradient_equals_reinforce_reference():
  """At ratio 1 the clipped surrogate's gradient is -sum_t w_t A_b grad log pi(token_t).

  The reference is written independently: a plain REINFORCE objective with token-mean weights.
  """
  state, _ = setup()
  params = jax.device_get(state.params)
  data = batch(3, params)
  mask = np.asarray(data.mask_bt)
  weights = mask / mask.sum()

  def reinforce(p):
    logp = token_logprobs(CFG, p, data.tokens_bt)
    return -jnp.sum(weights * np.asarray(data.advantages_b)[:, None] * logp)

  ref = jax.grad(reinforce)(params)
  ours, sums = jax.grad(
      lambda p: step_lib.rl_loss(CFG, AlgoConfig(), 1.0, p, data, (jnp.asarray(weights), jnp.asarray(weights))),
      has_aux=True)(params)
  np.testing.assert_allclose(float(sums["ratio"]), 1.0, atol=1e-5)
  assert float(sums["clip_frac"]) == 0.0
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)


def test_kl_term_adds_coef_times_k3():
  params = jax.device_get(setup()[0].params)
  data = batch(5, params)
  ref_logp = np.asarray(data.behaviour_logp_bt) - 0.3 * np.asarray(data.mask_bt)   # log r = -0.3 on tokens
  data = dataclasses.replace(data, ref_logp_bt=jnp.asarray(ref_logp))
  mask = np.asarray(data.mask_bt)
  w = (jnp.asarray(mask / mask.sum()),) * 2
  base, _ = step_lib.rl_loss(CFG, AlgoConfig(), 1.0, params, data, w)
  with_kl, sums = step_lib.rl_loss(CFG, AlgoConfig(kl_coef=0.5, kl_estimator="k3"), 1.0, params, data, w)
  k3 = np.exp(-0.3) - 1 + 0.3      # (r - 1) - log r with log r = -0.3
  np.testing.assert_allclose(float(sums["kl"]), k3, rtol=1e-4)
  np.testing.assert_allclose(float(with_kl) - float(base), 0.5 * k3, rtol=1e-3)


def test_sft_step_lowers_loss():
  mesh = make_mesh(MeshConfig(data=-1))
  psh = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh, TRAIN_RULES)
  tx = optax.adam(1e-2)
  ssh = state_lib.state_shardings(tx, models.abstract_params(CFG), psh, mesh)
  state = state_lib.create_train_state(
      jax.device_put(models.init_params(CFG, jax.random.key(1)), psh), tx, ssh)
  sft = step_lib.make_sft_step(CFG, tx, 1, mesh, ssh)
  data = batch(0)
  losses = []
  for _ in range(20):
    state, m = sft(state, data.tokens_bt, data.mask_bt)
    losses.append(float(m["loss"]))
  assert losses[-1] < 0.5 * losses[0]
  assert int(state.policy_version) == 0


def _params_equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_guard_skips_an_update_with_a_nan_loss():
  state, step = setup()
  before = jax.device_get(state)
  data = batch(3)
  data = data.replace(advantages_b=data.advantages_b.at[5].set(jnp.nan))   # NaN loss (and gradients)
  state, metrics = step(state, data)
  assert float(metrics["nonfinite"]) == 1.0                   # loss: the first quantity computed
  assert _params_equal(state.params, before.params) and _params_equal(state.opt_state, before.opt_state)
  assert int(state.step) == 1 and int(state.policy_version) == 1
  state, metrics = step(state, batch(4))                      # a finite batch applies again
  assert float(metrics["nonfinite"]) == 0.0 and not _params_equal(state.params, before.params)


def test_guard_catches_parameters_that_overflow():
  # An update of gradient * 1e30 * 1e30: finite loss and gradients, but the new params overflow to inf.
  state, step = setup(tx=optax.chain(optax.scale(-1e30), optax.scale(1e30)))
  before = jax.device_get(state.params)
  state, metrics = step(state, batch(5))
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  assert float(metrics["nonfinite"]) == 3.0                   # updated parameters
  assert _params_equal(state.params, before)
