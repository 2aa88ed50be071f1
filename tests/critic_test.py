"""The critic update: a hand-computed loss, exact micro-batch accumulation, learning, one compile, 8 devices."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_fusion_jax import algorithms, models
from rl_fusion_jax import shared_programs
from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.models import value_model as vm
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.tiny import tiny_model_config
from rl_fusion_jax.train import critic
from rl_fusion_jax.train import state as state_lib

CFG = tiny_model_config()
B, T, PROMPT = 16, 10, 3

# ----------------------------------------------------------------------------------------------------
# The loss on fixed values, by hand. One row, clip c = 0.2; positions 0 and 4 are masked out (position 4
# holds garbage that must not count). Per token, V' = old + clip(V - old, -c, c):
#   t=1  V=1.0 old=0.9 R=1.5  V-old= 0.1 (inside)  V'=1.0  (V-R)^2=0.25  (V'-R)^2=0.25  loss 0.125  not clipped
#   t=2  V=1.0 old=0.5 R=2.0  V-old= 0.5 -> 0.2    V'=0.7  (V-R)^2=1.00  (V'-R)^2=1.69  loss 0.845  clipped
#   t=3  V=0.0 old=1.0 R=0.5  V-old=-1.0 -> -0.2   V'=0.8  (V-R)^2=0.25  (V'-R)^2=0.09  loss 0.125  not clipped
# Token mean: (0.125 + 0.845 + 0.125) / 3 = 0.365; clip fraction 1/3; without clipping (0.125+0.5+0.125)/3
# = 0.25. value_mean = 2/3. Explained variance: R = [1.5, 2, 0.5] has mean 4/3 and variance
# 6.5/3 - 16/9 = 7/18; R - V = [0.5, 1, 0.5] has mean 2/3 and variance 1.5/3 - 4/9 = 1/18; 1 - 1/7 = 6/7.
# |V - old| = [0.1, 0.5, 1.0]: mean 1.6/3.
# ----------------------------------------------------------------------------------------------------
HAND_VALUES = np.array([[7.0, 1.0, 1.0, 0.0, 100.0]], np.float32)
HAND_OLD = np.array([[3.0, 0.9, 0.5, 1.0, -100.0]], np.float32)
HAND_RETURNS = np.array([[5.0, 1.5, 2.0, 0.5, 9.0]], np.float32)
HAND_MASK = np.array([[0, 1, 1, 1, 0]], np.float32)


def _hand_batch():
  return critic.CriticBatch(jnp.zeros((1, 5), jnp.int32), jnp.asarray(HAND_MASK), jnp.asarray(HAND_OLD),
                            jnp.asarray(HAND_RETURNS))


def test_value_loss_bt_by_hand():
  loss_bt, clipped_bt = algorithms.value_loss(HAND_VALUES[:, 1:4], HAND_OLD[:, 1:4], HAND_RETURNS[:, 1:4], clip=0.2)
  np.testing.assert_allclose(np.asarray(loss_bt), [[0.125, 0.845, 0.125]], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(clipped_bt), [[0, 1, 0]])
  loss_bt, clipped_bt = algorithms.value_loss(HAND_VALUES[:, 1:4], HAND_OLD[:, 1:4], HAND_RETURNS[:, 1:4], clip=None)
  np.testing.assert_allclose(np.asarray(loss_bt), [[0.125, 0.5, 0.125]], rtol=1e-6)
  assert not np.asarray(clipped_bt).any()


@pytest.mark.parametrize("clip, loss, clip_frac", [(0.2, 0.365, 1 / 3), (None, 0.25, 0.0)])
def test_critic_loss_by_hand(monkeypatch, clip, loss, clip_frac):
  # The model's values are replaced by fixed numbers: this checks the loss glue, masking and metrics.
  monkeypatch.setattr(vm, "values", lambda cfg, params, tokens_bt: jnp.asarray(HAND_VALUES))
  weights_bt = jnp.asarray(HAND_MASK / HAND_MASK.sum())
  value, sums = critic.critic_loss(CFG, clip, None, _hand_batch(), weights_bt)
  np.testing.assert_allclose(float(value), loss, rtol=1e-6)
  np.testing.assert_allclose(float(sums["value_loss"]), loss, rtol=1e-6)
  np.testing.assert_allclose(float(sums["value_clip_frac"]), clip_frac, rtol=1e-6, atol=0)
  np.testing.assert_allclose(float(sums["value_mean"]), 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(float(sums["return_mean"]), 4 / 3, rtol=1e-6)
  np.testing.assert_allclose(float(sums["value_abs_change"]), 1.6 / 3, rtol=1e-6)
  np.testing.assert_allclose(float(critic.explained_variance(sums)), 6 / 7, rtol=1e-5)
  # The gradient w.r.t. V is w_t (V - R) where the unclipped term wins, 0 at the clipped token.
  grad = jax.grad(lambda v: critic.value_loss_from_values(clip, v, _hand_batch(), weights_bt)[0])(
      jnp.asarray(HAND_VALUES))
  expected = np.array([[0, -0.5, -1.0 if clip is None else 0.0, -0.5, 0]]) / 3
  np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-7)


def test_explained_variance_edge_cases():
  perfect = {"value_error_mean": 0.0, "value_error_sq_mean": 0.0, "return_mean": 1.0, "return_sq_mean": 2.0}
  assert float(critic.explained_variance(perfect)) == 1.0
  constant = {"value_error_mean": 0.5, "value_error_sq_mean": 0.25, "return_mean": 1.0, "return_sq_mean": 1.0}
  assert float(critic.explained_variance(constant)) == 0.0    # Var(R) = 0: undefined, reported as 0


# ----------------------------------------------------------------------------------------------------
# The jitted step on a (data=2, fsdp=4) mesh of 8 CPU devices
# ----------------------------------------------------------------------------------------------------

def setup(tx, micro=1, clip=0.2, params=None, mesh_cfg=MeshConfig(data=2, fsdp=4)):
  mesh = make_mesh(mesh_cfg)
  abstract = vm.abstract_value_params(CFG)
  psh = param_shardings(abstract, vm.value_logical_axes(CFG), mesh, TRAIN_RULES)
  ssh = state_lib.state_shardings(tx, abstract, psh, mesh)
  if params is None:
    params = vm.init_value_params(CFG, jax.random.key(0), init_std=0.3)
    params["score"]["bias"] = params["score"]["bias"] + 0.1
  state = state_lib.create_train_state(jax.device_put(params, psh), tx, ssh)
  return state, critic.make_critic_step(CFG, clip, tx, micro, mesh, ssh), critic.make_value_fn(CFG, mesh, psh)


def batch(seed, value_fn=None, params=None):
  """Right-padded rows (prompt, response, padding); returns ~ 1 + 0.5 * (row's first token parity), old
  values the critic's own (when given) moved by noise, so some tokens clip."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, 64, size=(B, T)).astype(np.int32)
  lens = rng.integers(1, T - PROMPT + 1, size=B)
  mask = ((np.arange(T)[None] >= PROMPT) & (np.arange(T)[None] < PROMPT + lens[:, None])).astype(np.float32)
  tokens[mask.cumsum(1) >= lens[:, None] + (mask == 0)] = 0
  old = rng.normal(size=(B, T)).astype(np.float32) * 0.3
  if value_fn is not None:
    old = old + np.asarray(value_fn(params, jnp.asarray(tokens)))
  returns = (1.0 + 0.5 * (tokens[:, :1] % 2) + 0.1 * rng.normal(size=(B, T))).astype(np.float32)
  return critic.CriticBatch(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(old * mask),
                            jnp.asarray(returns * mask))


def test_micro_batches_give_the_full_batch_update():
  # Plain SGD, so the parameter change is the gradient itself (Adam's first step is ~sign(grad)).
  s1, step1, value_fn = setup(optax.sgd(1.0), micro=1)
  s2, step2, _ = setup(optax.sgd(1.0), micro=2)
  init = jax.device_get(s1.params)
  data = batch(7, value_fn, s1.params)
  s1, m1 = step1(s1, data)
  s2, m2 = step2(s2, data)
  assert 0 < float(m1["value_clip_frac"]) < 1, "no token clipped: the check would miss the clipped branch"
  for name in m1:
    np.testing.assert_allclose(float(m2[name]), float(m1[name]), rtol=1e-5, atol=1e-6, err_msg=name)
  moved = 0.0
  for a, b, p0 in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), jax.tree.leaves(init)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    moved = max(moved, float(np.abs(np.asarray(a) - np.asarray(p0)).max()))
  assert moved > 1e-3
  # The body moved too (a random head passes gradient into it), not only the head.
  assert np.abs(np.asarray(s1.params["body"]["embed"]["embedding"]) - init["body"]["embed"]["embedding"]).max() > 0


def test_steps_reduce_the_loss_compile_once_and_keep_shardings():
  shared_programs.clear()   # count this test's own traces: none shared from earlier tests
  policy = models.init_params(CFG, jax.random.key(1), init_std=0.3)
  state, step, value_fn = setup(optax.adam(1e-2), clip=None, params=vm.value_params_from_policy(CFG, policy))
  shardings = jax.tree.map(lambda x: x.sharding, state)
  data = batch(0)
  assert np.array_equal(np.asarray(value_fn(state.params, data.tokens_bt)), np.zeros((B, T), np.float32))
  losses, explained = [], []
  for i in range(20):
    data = data._replace(old_values_bt=value_fn(state.params, data.tokens_bt) * data.mask_bt)
    state, metrics = step(state, data)
    assert float(metrics["nonfinite"]) == 0.0
    losses.append(float(metrics["value_loss"]))
    explained.append(float(metrics["value_explained_var"]))
  assert losses[-1] < 0.1 * losses[0], losses
  # Values all 0 at first: Var(R - V) = Var(R), nothing explained; then most of the return's variance.
  assert explained[0] == 0.0 and explained[-1] > 0.5, explained
  assert step._cache_size() == 1 and value_fn._cache_size() == 1
  assert int(state.step) == 20 and int(state.policy_version) == 0
  assert jax.tree.map(lambda x: x.sharding, state) == shardings
  values_bt = value_fn(state.params, data.tokens_bt)
  assert values_bt.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)
  assert len(values_bt.sharding.device_set) == 8


def test_state_is_donated_and_bad_clip_is_refused():
  state, step, _ = setup(optax.sgd(0.1))
  old = state
  state, metrics = step(state, tuple(batch(1)))   # a plain 4-tuple is a batch as well
  assert old.params["score"]["kernel"].is_deleted() and np.isfinite(float(metrics["value_loss"]))
  with pytest.raises(ValueError, match="clip: must be None or a number > 0"):
    setup(optax.sgd(0.1), clip=0.0)
