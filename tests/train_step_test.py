"""The jitted RL update: one trace across steps, exact micro-batch accumulation, gradient by reference."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_fusion_jax import models
from rl_fusion_jax import shared_programs
from rl_fusion_jax.config import AlgoConfig, MeshConfig, OptimConfig, RunConfig
from rl_fusion_jax.orchestration.guard import DivergenceGuard
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.tiny import tiny_model_config
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.train.logprobs import token_logprobs
from rl_fusion_jax.types import TrainBatch

CFG = tiny_model_config()
B, T, PROMPT = 32, 12, 4


def setup(optim=OptimConfig(learning_rate=1e-2), algo=AlgoConfig(), mesh_cfg=MeshConfig(data=2, fsdp=4),
          tx=None, micro=None, max_response_len=0):
  mesh = make_mesh(mesh_cfg)
  psh = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh, TRAIN_RULES)
  tx = tx or state_lib.make_optimizer(optim)
  ssh = state_lib.state_shardings(tx, models.abstract_params(CFG), psh, mesh)
  params = jax.device_put(models.init_params(CFG, jax.random.key(0), init_std=0.3), psh)
  state = state_lib.create_train_state(params, tx, ssh)
  step = step_lib.make_rl_step(CFG, algo, 1.0, tx, micro or optim.micro_batches, mesh, T - PROMPT, ssh,
                               max_response_len=max_response_len)
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
  return TrainBatch(tokens_bt=jnp.asarray(tokens), mask_bt=jnp.asarray(mask),
                    advantages_bt=jnp.asarray(adv[:, None] * mask),
                    behaviour_logp_bt=jnp.asarray(behaviour * mask), ref_logp_bt=jnp.zeros((B, T)),
                    version_bt=jnp.zeros((B, T), jnp.int32))


def test_traces_once_across_steps_with_different_contents_and_lengths():
  shared_programs.clear()   # count this test's own traces: none shared from earlier tests
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


@pytest.mark.parametrize("micro,window", [(1, T - PROMPT), (4, T - PROMPT + 1)])
def test_lm_head_on_the_response_window_gives_the_full_head_update(micro, window):
  """With max_response_len the lm head runs on 8 (or 9) of 11 positions per row; masked tokens sit at
  different offsets per row (prompts of 2-4 tokens), so the window's start is per row, and a 9-position
  window of a 4-token prompt runs past the row's end (that position is computed and dropped). Same update
  and metrics."""
  algo = AlgoConfig(entropy_coef=0.01)      # the entropy enters the loss, so its window entries matter too
  full, step_full = setup(OptimConfig(micro_batches=micro), algo, tx=optax.sgd(1.0))
  win, step_win = setup(OptimConfig(micro_batches=micro), algo, tx=optax.sgd(1.0), max_response_len=window)
  data = batch(11)
  shift = np.random.default_rng(0).integers(0, 3, size=B)     # prompt b has PROMPT - shift[b] tokens
  roll = lambda x: jnp.asarray(np.stack([np.roll(np.asarray(row), -k) for row, k in zip(x, shift)]))
  data = data.replace(**{f: roll(getattr(data, f)) for f in ("tokens_bt", "mask_bt", "advantages_bt",
                                                             "behaviour_logp_bt")})
  full, m_full = step_full(full, data)
  win, m_win = step_win(win, data)
  assert float(m_win[step_lib.WINDOW_METRIC]) == 0 and float(m_win["nonfinite"]) == 0
  for key in ("loss", "grad_norm", "entropy", "clip_frac", "ratio"):
    np.testing.assert_allclose(float(m_win[key]), float(m_full[key]), rtol=1e-5, atol=1e-7, err_msg=key)
  for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(win.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_a_response_longer_than_the_head_window_withholds_the_update():
  state, step = setup(max_response_len=2)
  before = jax.tree.map(np.asarray, state.params)
  data = batch(3)
  state, metrics = step(state, data)
  longer = np.sum(np.maximum(np.asarray(data.mask_bt).sum(axis=1) - 2, 0))
  assert float(metrics[step_lib.WINDOW_METRIC]) == longer > 0
  assert int(metrics["nonfinite"]) == step_lib.WINDOW_CODE
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, np.asarray(b))
  with pytest.raises(RuntimeError, match="outside the lm head's window"):
    DivergenceGuard(RunConfig(on_nonfinite="skip"), "rl").check(1, {"nonfinite": float(metrics["nonfinite"])})


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
    return -jnp.sum(weights * np.asarray(data.advantages_bt) * logp)

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
  data = data.replace(advantages_bt=data.advantages_bt.at[5].set(jnp.nan))   # NaN loss (and gradients)
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


# ----------------------------------------------------------------------------------------------------
# Token-budget micro-batches and the cut row width
# ----------------------------------------------------------------------------------------------------

def assert_same_update(new_a, new_b, init, rtol=1e-5):
  """Per leaf, the two updates (new - init; SGD(1): the gradients) agree to ``rtol`` of the leaf's largest
  entry: float32 sums in another order differ by ~1e-7 absolute, so entry-wise relative checks of tiny
  entries would test rounding. Returns the largest update, to check it is far above the tolerance."""
  moved = 0.0
  for a, b, p0 in zip(jax.tree.leaves(new_a), jax.tree.leaves(new_b), jax.tree.leaves(init)):
    da, db = np.asarray(a) - np.asarray(p0), np.asarray(b) - np.asarray(p0)
    scale = float(np.max(np.abs(db)))
    assert float(np.max(np.abs(da - db))) <= rtol * scale + 1e-9, (float(np.max(np.abs(da - db))), scale)
    moved = max(moved, scale)
  return moved


def test_micro_batch_count_keeps_every_micro_batch_split_over_the_shards():
  count = step_lib.micro_batch_count
  assert count(128, 44, 1024, 2) == 4              # per device: 16 rows x 44 = 704 <= 1024 < 32 x 44
  assert count(128, 44, 2048, 2) == 2
  assert count(128, 44, 0, 2) == 1                 # no budget
  assert count(128, 44, 10, 2) == 64               # below one row per shard: one row per shard
  assert count(24, 10, 100, 2) == 2                # 12 rows per shard: divisors 1, 2, 3, 4, 6, 12
  assert count(24, 10, 50, 2) == 3
  with pytest.raises(ValueError, match="do not split over 8"):
    count(12, 10, 100, 8)
  micro = step_lib.MicroBatching(count=4, tokens=1)    # a fixed count wins over the budget
  assert micro.num_micro(128, 44, 2) == 4
  assert step_lib.as_micro_batching(2) == step_lib.MicroBatching(count=2)
  assert step_lib.MicroBatching.from_optim(OptimConfig(), "cpu").tokens == \
      step_lib.DEFAULT_TOKENS_PER_MICRO_BATCH["cpu"]
  assert step_lib.MicroBatching.from_optim(OptimConfig(tokens_per_micro_batch=None), "gpu").tokens == \
      step_lib.ACCELERATOR_TOKENS_PER_MICRO_BATCH
  assert step_lib.MicroBatching.from_optim(OptimConfig(tokens_per_micro_batch=300), "gpu").tokens == 300


def test_train_width_buckets():
  widths = [step_lib.train_width(n, 48) for n in range(1, 49)]
  assert sorted(set(widths)) == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48]
  assert all(w >= n for n, w in zip(range(1, 49), widths))
  assert step_lib.train_width(41, 48) == 44          # tiny-grpo: prompts up to 9 + 32 new tokens
  assert [step_lib.train_width(n, 4096) for n in (65, 100, 129, 1000, 4000)] == [72, 104, 144, 1024, 4096]
  assert len({step_lib.train_width(n, 4096) for n in range(1, 4097)}) == 8 + 8 * 7


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum-norm"])
def test_token_budget_gives_the_full_batch_update(aggregation):
  """A budget of 12 tokens per device splits [32, 12] (8 batch shards) into 4 micro-batches of 8 rows."""
  algo = AlgoConfig(aggregation=aggregation)
  assert step_lib.micro_batch_count(B, T, 12, 8) == 4 and step_lib.micro_batch_count(B, T, B * T, 8) == 1
  s1, step1 = setup(OptimConfig(), algo, tx=optax.sgd(1.0), micro=step_lib.MicroBatching(tokens=B * T))
  s4, step4 = setup(OptimConfig(), algo, tx=optax.sgd(1.0), micro=step_lib.MicroBatching(tokens=12))
  data = batch(7)
  init = jax.device_get(s1.params)
  s1, m1 = step1(s1, data)
  s4, m4 = step4(s4, data)
  np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
  assert assert_same_update(s4.params, s1.params, init) > 1e-3


def wide_batch(seed, max_len, width):
  """A batch of rows ``width`` wide whose samples are at most ``max_len`` tokens long, with reference
  log-probs (for the KL term) and versions."""
  rng = np.random.default_rng(seed)
  lens = rng.integers(1, max_len - PROMPT + 1, size=B)
  lens[0] = max_len - PROMPT
  col = np.arange(width)[None]
  mask = ((col >= PROMPT) & (col < PROMPT + lens[:, None])).astype(np.float32)
  tokens = np.where(col < PROMPT + lens[:, None], rng.integers(3, 64, size=(B, width)), 0).astype(np.int32)
  noise = lambda: rng.normal(size=(B, width)).astype(np.float32)
  return TrainBatch(tokens_bt=jnp.asarray(tokens), mask_bt=jnp.asarray(mask),
                    advantages_bt=jnp.asarray(rng.normal(size=(B, 1)).astype(np.float32) * mask),
                    behaviour_logp_bt=jnp.asarray((noise() * 0.1 - 4) * mask),
                    ref_logp_bt=jnp.asarray((noise() * 0.3 - 4) * mask),
                    version_bt=jnp.asarray(np.where(mask > 0, seed, -1).astype(np.int32)))


def cut(data: TrainBatch, width: int) -> TrainBatch:
  return jax.tree.map(lambda x: x[:, :width] if x.ndim == 2 else x, data)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_cut_width_gives_the_full_width_update(aggregation):
  """Rows of 24 positions holding samples of at most 11 tokens: the update on the first 12 columns is the
  full-width one (loss, metrics, parameters after one SGD step), norm_len unchanged."""
  algo = AlgoConfig(aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)
  state, step = setup(OptimConfig(), algo, tx=optax.sgd(1.0))
  init = jax.device_get(state.params)
  data = wide_batch(3, 11, 24)
  width = step_lib.train_width(11, 24)
  assert width == 12
  s_full, m_full = step(state, data)
  s_cut, m_cut = step(setup(OptimConfig(), algo, tx=optax.sgd(1.0))[0], cut(data, width))
  for name in m_full:
    np.testing.assert_allclose(float(m_cut[name]), float(m_full[name]), rtol=1e-5, atol=1e-7, err_msg=name)
  assert assert_same_update(s_cut.params, s_full.params, init) > 1e-3


def test_one_compile_per_width_and_none_after():
  """Widths 12, 16, 12, 16, 12 under a budget of 24 tokens per device (2 and 4 micro-batches): each width traces
  once, at its first step; later steps of a seen width trace and compile nothing."""
  shared_programs.clear()   # count this test's own traces: none shared from earlier tests
  events = []
  listener = lambda event, duration, **kw: events.append(event) if "trace" in event or "compile" in event \
      else None
  micro = step_lib.MicroBatching(tokens=24)
  state, step = setup(micro=micro)
  batches = [cut(wide_batch(s, n, 24), step_lib.train_width(n, 24)) for s, n in enumerate((11, 14))]
  assert [b.tokens_bt.shape[1] for b in batches] == [12, 16]
  assert [micro.num_micro(B, w, 8) for w in (12, 16)] == [2, 4]
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    per_step = []
    for i in range(5):
      before = len(events)
      state, metrics = step(state, batches[i % 2])
      assert np.isfinite(float(metrics["loss"]))
      per_step.append(len(events) - before)
      assert step._cache_size() == min(i + 1, 2)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert per_step[0] > 0 and per_step[1] > 0, "no trace seen: the check would be vacuous"
  assert per_step[2:] == [0, 0, 0]
