"""Clipped surrogate, KL estimators, entropy and token-weight aggregation against hand values."""

import functools

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax.algorithms import losses

LN2 = float(np.log(2.0))


def _surrogate_and_grad(ratio_b, adv, **kwargs):
  """Loss and d loss / d logp for one token per row, with old_logp = 0 so ratio = exp(logp)."""
  logp_bt = jnp.log(jnp.asarray(ratio_b, jnp.float32))[:, None]
  old_bt = jnp.zeros_like(logp_bt)
  loss_fn = lambda lp: losses.clipped_surrogate(lp, old_bt, adv, **kwargs)
  loss_bt, stats = loss_fn(logp_bt)
  grad_bt = jax.grad(lambda lp: loss_fn(lp)[0].sum())(logp_bt)
  return (
      np.asarray(loss_bt[:, 0]),
      {k: np.asarray(v[:, 0]) for k, v in stats.items()},
      np.asarray(grad_bt[:, 0]),
  )


# ----------------------------------------------------------------------------------------------------
# Clipped surrogate
# ----------------------------------------------------------------------------------------------------


def test_clipped_surrogate_hand_cases():
  # eps = 0.2, clip range [0.8, 1.2]; loss = -min(rho*A, clip(rho)*A):
  #   A= 1, rho=1.5: min(1.5, 1.2)   = 1.2  -> loss -1.2, clipped, grad 0
  #   A= 1, rho=0.5: min(0.5, 0.8)   = 0.5  -> loss -0.5, unclipped, grad -A*rho = -0.5
  #   A=-1, rho=0.5: min(-0.5, -0.8) = -0.8 -> loss  0.8, clipped, grad 0
  #   A=-1, rho=1.5: min(-1.5, -1.2) = -1.5 -> loss  1.5, unclipped, grad -A*rho = 1.5
  #   A= 2, rho=1.1: inside the range       -> loss -2.2, unclipped, grad -2*1.1 = -2.2
  ratio_b = [1.5, 0.5, 0.5, 1.5, 1.1]
  adv_b = jnp.array([1.0, 1.0, -1.0, -1.0, 2.0])
  loss_b, stats, grad_b = _surrogate_and_grad(ratio_b, adv_b)
  np.testing.assert_allclose(loss_b, [-1.2, -0.5, 0.8, 1.5, -2.2], rtol=1e-6)
  np.testing.assert_array_equal(stats["clipped"], [1, 0, 1, 0, 0])
  np.testing.assert_allclose(stats["ratio"], ratio_b, rtol=1e-6)
  np.testing.assert_allclose(grad_b, [0.0, -0.5, 0.0, 1.5, -2.2], rtol=1e-6, atol=0)
  np.testing.assert_array_equal(stats["dual_clipped"], [0, 0, 0, 0, 0])


def test_clip_higher_is_asymmetric():
  # clip_low 0.2, clip_high 0.28 -> range [0.8, 1.28]:
  #   A= 1, rho=1.25: 1.25 < 1.28, unclipped -> loss -1.25 (symmetric 0.2 would clip to -1.2)
  #   A= 1, rho=1.40: clipped at 1.28        -> loss -1.28
  #   A=-1, rho=0.70: clipped at 0.8         -> loss  0.8
  loss_b, stats, _ = _surrogate_and_grad(
      [1.25, 1.4, 0.7], jnp.array([1.0, 1.0, -1.0]), clip_low=0.2, clip_high=0.28
  )
  np.testing.assert_allclose(loss_b, [-1.25, -1.28, 0.8], rtol=1e-6)
  np.testing.assert_array_equal(stats["clipped"], [0, 1, 1])
  symmetric_b, _, _ = _surrogate_and_grad([1.25], jnp.array([1.0]))
  np.testing.assert_allclose(symmetric_b, [-1.2], rtol=1e-6)


def test_dual_clip_caps_negative_advantages():
  # c = 3, eps = 0.2:
  #   A=-1, rho=4: PPO loss -min(-4, -1.2) = 4 > cap -c*A = 3 -> 3, dual-clipped, grad 0
  #   A=-1, rho=2: PPO loss 2 <= cap 3                         -> 2, grad -A*rho = 2
  #   A=-2, rho=4: PPO loss 8 > cap 6                          -> 6, dual-clipped, grad 0
  #   A= 1, rho=4: A > 0, PPO clip: -min(4, 1.2) = -1.2        -> -1.2, clipped, grad 0
  loss_b, stats, grad_b = _surrogate_and_grad(
      [4.0, 2.0, 4.0, 4.0], jnp.array([-1.0, -1.0, -2.0, 1.0]), dual_clip=3.0
  )
  np.testing.assert_allclose(loss_b, [3.0, 2.0, 6.0, -1.2], rtol=1e-6)
  np.testing.assert_array_equal(stats["dual_clipped"], [1, 0, 1, 0])
  np.testing.assert_array_equal(stats["clipped"], [0, 0, 0, 1])
  np.testing.assert_allclose(grad_b, [0.0, 2.0, 0.0, 0.0], rtol=1e-6, atol=0)
  # Without dual clip the first case is the uncapped 4.
  np.testing.assert_allclose(_surrogate_and_grad([4.0], jnp.array([-1.0]))[0], [4.0], rtol=1e-6)


def test_per_token_advantages_and_old_logp_not_differentiated():
  # adv_bt [[1, -1]] with rho = [0.5, 1.5] gives losses [-0.5, 1.5] (cases 2 and 4 above). The
  # gradient w.r.t. old_logp must be 0: it is the behaviour policy, a constant of the objective.
  logp_bt = jnp.log(jnp.array([[0.5, 1.5]]))
  old_bt = jnp.zeros((1, 2))
  adv_bt = jnp.array([[1.0, -1.0]])
  loss_bt, _ = losses.clipped_surrogate(logp_bt, old_bt, adv_bt)
  np.testing.assert_allclose(loss_bt, [[-0.5, 1.5]], rtol=1e-6)
  grad_old = jax.grad(lambda o: losses.clipped_surrogate(logp_bt, o, adv_bt)[0].sum())(old_bt)
  np.testing.assert_array_equal(grad_old, np.zeros((1, 2)))


def test_clipped_surrogate_jits():
  fn = jax.jit(functools.partial(losses.clipped_surrogate, clip_high=0.28, dual_clip=3.0))
  loss_bt, stats = fn(jnp.log(jnp.full((2, 3), 1.5)), jnp.zeros((2, 3)), jnp.array([1.0, -1.0]))
  # Row 0: A=1, rho=1.5 -> clipped at 1.28 -> -1.28. Row 1: A=-1, rho=1.5 -> 1.5 (< cap 3).
  np.testing.assert_allclose(loss_bt, [[-1.28] * 3, [1.5] * 3], rtol=1e-6)
  # The stats contract shared by every policy loss (a key set: jit returns dicts with sorted keys);
  # ppo_clip has no importance weight: w = 1, never truncated.
  assert set(stats) == set(losses.POLICY_LOSS_STATS)
  assert set(stats) == {"ratio", "clipped", "dual_clipped", "is_weight", "is_truncated", "log_ratio_clamped"}
  np.testing.assert_array_equal(stats["is_weight"], np.ones((2, 3)))
  np.testing.assert_array_equal(stats["is_truncated"], np.zeros((2, 3)))
  np.testing.assert_array_equal(stats["log_ratio_clamped"], np.zeros((2, 3)))


# Log-ratios 100, -100 and ln 1.1 against old_logp = 0, one row per advantage sign. e^20 = 485165195.4.
HUGE_LOGP_BT = jnp.array([[100.0, -100.0, np.log(1.1)]] * 2)
E20 = float(np.exp(np.float64(20.0)))


def _loss_and_grad(logp_bt, adv, **kwargs):
  loss_fn = lambda lp: losses.clipped_surrogate(lp, jnp.zeros_like(lp), adv, **kwargs)
  loss_bt, stats = loss_fn(logp_bt)
  return np.asarray(loss_bt), stats, np.asarray(jax.grad(lambda lp: loss_fn(lp)[0].sum())(logp_bt))


def test_huge_log_ratio_is_clamped_finite_loss_and_gradient():
  # Clamp c = 20: log-ratio 100 -> rho = e^20, -100 -> rho = e^-20 = 2.061154e-9; both are constants, so
  # their gradient is 0. eps = 0.2, A = [-1, +1] per row:
  #   A=-1, rho=e^20:   -min(-e^20, -1.2)     = e^20         (no dual clip)
  #   A=-1, rho=e^-20:  -min(-e^-20, -0.8)    = 0.8, clipped
  #   A=-1, rho=1.1:    -min(-1.1, -1.1)      = 1.1, grad -A*rho = 1.1
  #   A=+1, rho=e^20:   -min(e^20, 1.2)       = -1.2, clipped
  #   A=+1, rho=e^-20:  -min(e^-20, 0.8)      = -2.061154e-9
  #   A=+1, rho=1.1:                            -1.1, grad -1.1
  # Unclamped, exp(100) = inf in float32 and the gradient at that token is 0 * inf = NaN in both rows.
  adv_b = jnp.array([-1.0, 1.0])
  loss_bt, stats, grad_bt = _loss_and_grad(HUGE_LOGP_BT, adv_b)
  np.testing.assert_allclose(loss_bt, [[E20, 0.8, 1.1], [-1.2, -2.061154e-9, -1.1]], rtol=1e-5)
  np.testing.assert_allclose(grad_bt, [[0.0, 0.0, 1.1], [0.0, 0.0, -1.1]], rtol=1e-5, atol=0)
  np.testing.assert_array_equal(stats["log_ratio_clamped"], [[1, 1, 0], [1, 1, 0]])
  np.testing.assert_allclose(stats["ratio"][:, 0], [E20, E20], rtol=1e-5)
  # Dual clip c = 3: the A=-1, rho=e^20 token is capped at -c*A = 3; everything else is unchanged.
  loss_bt, stats, grad_bt = _loss_and_grad(HUGE_LOGP_BT, adv_b, dual_clip=3.0)
  np.testing.assert_allclose(loss_bt, [[3.0, 0.8, 1.1], [-1.2, -2.061154e-9, -1.1]], rtol=1e-5)
  np.testing.assert_allclose(grad_bt, [[0.0, 0.0, 1.1], [0.0, 0.0, -1.1]], rtol=1e-5, atol=0)
  np.testing.assert_array_equal(stats["dual_clipped"], [[1, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(stats["log_ratio_clamped"], [[1, 1, 0], [1, 1, 0]])


def test_log_ratio_clamp_is_configurable():
  # Clamp c = 1: log-ratio 2 -> rho = e = 2.718282 (flagged, grad 0); log-ratio 0.5 -> rho = e^0.5 =
  # 1.648721 (not flagged). A = -1, eps 0.2: losses -min(-rho, -1.2) = rho; grad -A*rho where unclamped.
  logp_bt = jnp.array([[2.0, 0.5]])
  loss_bt, stats, grad_bt = _loss_and_grad(logp_bt, jnp.array([-1.0]), log_ratio_clamp=1.0)
  np.testing.assert_allclose(loss_bt, [[2.718282, 1.648721]], rtol=1e-6)
  np.testing.assert_allclose(grad_bt, [[0.0, 1.648721]], rtol=1e-6, atol=0)
  np.testing.assert_array_equal(stats["log_ratio_clamped"], [[1, 0]])
  assert losses.LOG_RATIO_CLAMP == 20.0
  with pytest.raises(ValueError, match="log_ratio_clamp"):
    losses.clipped_surrogate(logp_bt, jnp.zeros((1, 2)), jnp.ones((1,)), log_ratio_clamp=0.0)


def test_ppo_clip_rejects_a_proximal_policy_and_ignores_is_cap_and_mask():
  with pytest.raises(ValueError, match="decoupled_ppo"):
    losses.clipped_surrogate(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1,)),
                             proximal_logp_bt=jnp.zeros((1, 2)))
  logp_bt = jnp.log(jnp.array([[0.5, 1.5]]))
  plain, _ = losses.clipped_surrogate(logp_bt, jnp.zeros((1, 2)), jnp.ones((1,)))
  extra, _ = losses.clipped_surrogate(logp_bt, jnp.zeros((1, 2)), jnp.ones((1,)), is_cap=1.5,
                                      mask_bt=jnp.array([[1, 0]]))
  np.testing.assert_array_equal(plain, extra)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(clip_low=1.0), "clip_low"),
        (dict(clip_low=-0.1), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(dual_clip=0.5), "dual_clip"),
    ],
)
def test_bad_clip_params_raise(kwargs, name):
  with pytest.raises(ValueError, match=name):
    losses.clipped_surrogate(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1,)), **kwargs)


def test_bad_shapes_raise():
  with pytest.raises(ValueError, match="old_logp_bt"):
    losses.clipped_surrogate(jnp.zeros((1, 2)), jnp.zeros((1, 3)), jnp.ones((1,)))
  with pytest.raises(ValueError, match="adv"):
    losses.clipped_surrogate(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((3,)))


# ----------------------------------------------------------------------------------------------------
# KL estimators
# ----------------------------------------------------------------------------------------------------


def test_kl_hand_values():
  # Token 0: pi = 0.5, pi_ref = 0.25 -> log r = ln 0.5 = -0.693147, r = 0.5:
  #   k1 = 0.693147, k2 = 0.5 * 0.480453 = 0.240227, k3 = (0.5 - 1) + 0.693147 = 0.193147.
  # Token 1: pi = 0.25, pi_ref = 0.5 -> log r = ln 2 = 0.693147, r = 2:
  #   k1 = -0.693147, k2 = 0.240227, k3 = (2 - 1) - 0.693147 = 0.306853.
  # Token 2: pi = pi_ref -> all 0.
  logp_bt = jnp.log(jnp.array([[0.5, 0.25, 0.3]]))
  ref_bt = jnp.log(jnp.array([[0.25, 0.5, 0.3]]))
  expected = {"k1": [LN2, -LN2, 0.0], "k2": [0.240227, 0.240227, 0.0], "k3": [0.193147, 0.306853, 0.0]}
  for kind, want in expected.items():
    np.testing.assert_allclose(losses.kl_estimate(logp_bt, ref_bt, kind)[0], want, rtol=1e-5, atol=1e-7)


def test_kl_unknown_kind_lists_known():
  with pytest.raises(ValueError, match="k1, k2, k3"):
    losses.kl_estimate(jnp.zeros((1, 1)), jnp.zeros((1, 1)), "k4")


_k3_jit = jax.jit(functools.partial(losses.kl_estimate, kind="k3"))
_logp_arrays = hnp.arrays(np.float32, (4, 8), elements=st.floats(-30.0, 0.0, width=32))
# Differences from far apart to a few ulps: near r = 1 a naive exp(x) - 1 - x rounds below 0 in float32.
_delta_arrays = hnp.arrays(
    np.float32,
    (4, 8),
    elements=st.one_of(st.floats(-30.0, 30.0, width=32), st.floats(-(2.0**-20), 2.0**-20, width=32)),
)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(logp=_logp_arrays, delta=_delta_arrays)
def test_k3_is_non_negative(logp, delta):
  # k3 = (r - 1) - log r >= 0 because e^x >= 1 + x; it must hold in float32 too, including r ~ 1.
  ref = (logp + delta).astype(np.float32)
  kl = np.asarray(_k3_jit(logp, ref))
  assert np.all(kl >= 0.0), kl.min()


def test_k3_near_ratio_one_is_non_negative():
  # logp = -1 and ref one float32 ulp above: log r = 2^-23 ~ 1.19e-7, where exp(log r) - 1 - log r
  # evaluated naively in float32 rounds to a negative number; the true k3 ~ (log r)^2 / 2 ~ 7e-15 >= 0.
  logp = np.full((1, 3), -1.0, np.float32)
  ref = np.array(
      [[np.nextafter(np.float32(-1.0), np.float32(0.0)), np.float32(-1.0 + 2e-7), np.float32(-1.0)]]
  )
  kl = np.asarray(losses.kl_estimate(logp, ref, "k3"))
  assert np.all(kl >= 0.0), kl
  np.testing.assert_allclose(kl, 0.0, atol=1e-12)


def test_k1_and_k3_means_approximate_true_kl():
  # p = [0.5, 0.3, 0.2], q = [0.2, 0.3, 0.5]:
  #   KL(p||q) = 0.5 ln 2.5 + 0.3 ln 1 + 0.2 ln 0.4 = (0.5 - 0.2) * 0.916291 = 0.274887.
  # Per-sample k1 = ln(p/q) takes 0.916, 0, -0.916 w.p. 0.5, 0.3, 0.2: variance
  # 0.7 * 0.8396 - 0.2749^2 = 0.5122, std 0.716; with N = 100_000 the standard error is 0.00226, so a
  # 0.012 tolerance is > 5 standard errors (k3 has lower variance, so the same bound covers it).
  p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.3, 0.5])
  true_kl = float(np.sum(p * np.log(p / q)))
  assert abs(true_kl - 0.274887) < 1e-6
  idx = np.random.default_rng(0).choice(3, size=100_000, p=p)
  logp_bt = np.log(p)[idx].reshape(100, 1000).astype(np.float32)
  ref_bt = np.log(q)[idx].reshape(100, 1000).astype(np.float32)
  for kind in ("k1", "k3"):
    estimate = float(jnp.mean(losses.kl_estimate(logp_bt, ref_bt, kind)))
    assert abs(estimate - true_kl) < 0.012, (kind, estimate)


# ----------------------------------------------------------------------------------------------------
# Entropy
# ----------------------------------------------------------------------------------------------------


def _numpy_entropy(logits):
  logits = logits.astype(np.float64)
  z = logits - logits.max(axis=-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
  return -(p * np.log(p)).sum(axis=-1)


def test_entropy_matches_numpy_reference():
  logits = np.random.default_rng(1).normal(0.0, 3.0, size=(2, 3, 17)).astype(np.float32)
  ent_bt = losses.entropy_from_logits(logits)
  assert ent_bt.shape == (2, 3) and ent_bt.dtype == jnp.float32
  np.testing.assert_allclose(ent_bt, _numpy_entropy(logits), rtol=1e-5, atol=1e-6)


def test_entropy_uniform_and_large_logits():
  # Uniform over V = 11: H = ln 11 = 2.397895, whatever the common logit value (here 3.7 and 1e4,
  # which would overflow exp without the max shift). bf16 input still gives a float32 result.
  np.testing.assert_allclose(
      losses.entropy_from_logits(jnp.full((1, 2, 11), 3.7)), [[2.397895] * 2], rtol=1e-6
  )
  np.testing.assert_allclose(losses.entropy_from_logits(jnp.full((1, 1, 11), 1e4)), [[2.397895]], rtol=1e-6)
  assert losses.entropy_from_logits(jnp.zeros((1, 1, 4), jnp.bfloat16)).dtype == jnp.float32


def test_entropy_with_masked_vocab_has_no_nan_in_value_or_grad():
  # logits [0, -inf, 0, -inf]: uniform over the two live entries -> H = ln 2.
  # dH/dz_i = -p_i (ln p_i + H) = -0.5 (ln 0.5 + ln 2) = 0 for live entries, and 0 for masked ones.
  logits = jnp.array([[[0.0, -jnp.inf, 0.0, -jnp.inf]]])
  np.testing.assert_allclose(losses.entropy_from_logits(logits), [[LN2]], rtol=1e-6)
  grad = jax.grad(lambda z: losses.entropy_from_logits(z).sum())(logits)
  assert np.all(np.isfinite(grad))
  np.testing.assert_allclose(grad, np.zeros((1, 1, 4)), atol=1e-7)


# ----------------------------------------------------------------------------------------------------
# Token weights and aggregation
# ----------------------------------------------------------------------------------------------------

MASK = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], np.float32)
# Masked positions hold NaN: aggregation must not let them through.
LOSS = np.array([[1.0, 2.0, 3.0, np.nan], [4.0, np.nan, np.nan, np.nan]], np.float32)


def test_token_weights_by_hand():
  # sum(mask) = 4, len_b = [3, 1], 2 non-empty sequences, norm_len = 4.
  # token-mean:              1/4 per token                        -> loss (1+2+3+4)/4 = 2.5
  # seq-mean-token-mean:     row 0 1/(3*2) = 1/6, row 1 1/(1*2)  -> ((1+2+3)/3 + 4/1)/2 = 3.0
  # seq-mean-token-sum-norm: 1/(4*2) = 1/8 per token              -> (1+2+3+4)/8 = 1.25
  cases = {
      "token-mean": ([[1 / 4, 1 / 4, 1 / 4, 0], [1 / 4, 0, 0, 0]], 2.5),
      "seq-mean-token-mean": ([[1 / 6, 1 / 6, 1 / 6, 0], [1 / 2, 0, 0, 0]], 3.0),
      "seq-mean-token-sum-norm": ([[1 / 8, 1 / 8, 1 / 8, 0], [1 / 8, 0, 0, 0]], 1.25),
  }
  for mode, (want_w, want_loss) in cases.items():
    np.testing.assert_allclose(losses.token_weights(MASK, mode, norm_len=4), want_w, rtol=1e-6)
    np.testing.assert_allclose(losses.aggregate(LOSS, MASK, mode, norm_len=4), want_loss, rtol=1e-6)


def test_empty_rows_do_not_count_as_sequences():
  # mask [[1,1,0,0],[0,0,0,0]]: one non-empty sequence of length 2.
  #   token-mean 1/2; seq-mean-token-mean 1/(2*1) = 1/2; seq-mean-token-sum-norm 1/(4*1) = 1/4.
  mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0]], np.float32)
  for mode, w in [("token-mean", 0.5), ("seq-mean-token-mean", 0.5), ("seq-mean-token-sum-norm", 0.25)]:
    np.testing.assert_allclose(losses.token_weights(mask, mode, norm_len=4), mask * w, rtol=1e-6)


@pytest.mark.parametrize("mode", losses.AGGREGATION_MODES)
def test_empty_mask_gives_zero_and_no_nan(mode):
  mask = jnp.zeros((2, 4))
  weights = losses.token_weights(mask, mode, norm_len=4)
  np.testing.assert_array_equal(weights, np.zeros((2, 4)))
  loss_fn = lambda l: losses.aggregate(l, mask, mode, norm_len=4)
  assert float(loss_fn(jnp.ones((2, 4)))) == 0.0
  np.testing.assert_array_equal(jax.grad(loss_fn)(jnp.ones((2, 4))), np.zeros((2, 4)))


@pytest.mark.parametrize("mode", losses.AGGREGATION_MODES)
def test_micro_batch_accumulation_is_exact(mode):
  # Weights from the full batch, sliced into two micro-batches of 2 rows: the two partial sums must
  # add up to the full-batch aggregate. Rows have unequal lengths (and row 3 is empty) so a
  # per-micro-batch normalisation would give a different number (checked below).
  rng = np.random.default_rng(2)
  loss = rng.normal(size=(4, 5)).astype(np.float32)
  mask = np.array([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], np.float32)
  full = float(losses.aggregate(loss, mask, mode, norm_len=5))
  weights = losses.token_weights(mask, mode, norm_len=5)
  accumulated = sum(float(losses.weighted_sum(loss[s], weights[s])) for s in (slice(0, 2), slice(2, 4)))
  np.testing.assert_allclose(accumulated, full, rtol=1e-6)
  naive = sum(float(losses.aggregate(loss[s], mask[s], mode, norm_len=5)) for s in (slice(0, 2), slice(2, 4)))
  assert abs(naive - full) > 1e-3


def test_aggregation_errors():
  with pytest.raises(ValueError, match="norm_len"):
    losses.token_weights(MASK, "seq-mean-token-sum-norm")
  with pytest.raises(ValueError, match="norm_len"):
    losses.token_weights(MASK, "seq-mean-token-sum-norm", norm_len=0)
  with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"):
    losses.token_weights(MASK, "sum")
  with pytest.raises(ValueError, match="mask_bt"):
    losses.token_weights(np.ones(4), "token-mean")
  with pytest.raises(ValueError, match="loss_bt"):
    losses.aggregate(np.ones((2, 3)), MASK, "token-mean")


def test_token_weights_jit():
  fn = jax.jit(functools.partial(losses.token_weights, mode="seq-mean-token-mean"))
  np.testing.assert_allclose(fn(MASK), [[1 / 6, 1 / 6, 1 / 6, 0], [1 / 2, 0, 0, 0]], rtol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Value loss
# ----------------------------------------------------------------------------------------------------


def _value_loss_and_grad(values, old_values, returns, clip):
  """Per-token loss, clipped flags and d(sum loss)/dV for one token per row."""
  as_bt = lambda x: jnp.asarray(x, jnp.float32)[:, None]
  values_bt, old_bt, ret_bt = as_bt(values), as_bt(old_values), as_bt(returns)
  loss_fn = lambda v: losses.value_loss(v, old_bt, ret_bt, clip=clip)
  loss_bt, clipped_bt = loss_fn(values_bt)
  grad_bt = jax.grad(lambda v: loss_fn(v)[0].sum())(values_bt)
  return np.asarray(loss_bt[:, 0]), np.asarray(clipped_bt[:, 0]), np.asarray(grad_bt[:, 0])


def test_value_loss_unclipped_hand_values_and_gradient():
  # 0.5 * (V - R)^2, d/dV = V - R:
  #   V=1.5, R=2:  0.5 * 0.25 = 0.125,  grad -0.5
  #   V=-1,  R=2:  0.5 * 9    = 4.5,    grad -3
  #   V=3,   R=2:  0.5 * 1    = 0.5,    grad 1
  # old values are irrelevant without a clip.
  loss_b, clipped_b, grad_b = _value_loss_and_grad([1.5, -1.0, 3.0], [0.0, 9.0, -9.0], [2.0, 2.0, 2.0], None)
  np.testing.assert_allclose(loss_b, [0.125, 4.5, 0.5], rtol=1e-6)
  np.testing.assert_array_equal(clipped_b, [0, 0, 0])
  np.testing.assert_allclose(grad_b, [-0.5, -3.0, 1.0], rtol=1e-6)


def test_value_loss_clipped_hand_values_and_gradient():
  # clip c = 0.2, V_old = 1, R = 2; V_clip = 1 + clip(V - 1, -0.2, 0.2):
  #   V=1.5: V_clip 1.2; (V-R)^2 = 0.25, (V_clip-R)^2 = 0.64 -> clipped larger: loss 0.32, flag 1, grad 0
  #   V=1.1: inside the range, V_clip = V; both 0.81            -> loss 0.405, flag 0, grad V-R = -0.9
  #   V=0.5: V_clip 0.8; (V-R)^2 = 2.25, (V_clip-R)^2 = 1.44   -> unclipped larger: loss 1.125, flag 0,
  #          grad V-R = -1.5 (the clip is active but the max picks the unclipped term)
  #   V=2.5: V_clip 1.2; (V-R)^2 = 0.25, (V_clip-R)^2 = 0.64   -> loss 0.32, flag 1, grad 0
  loss_b, clipped_b, grad_b = _value_loss_and_grad([1.5, 1.1, 0.5, 2.5], [1.0] * 4, [2.0] * 4, 0.2)
  np.testing.assert_allclose(loss_b, [0.32, 0.405, 1.125, 0.32], rtol=1e-6)
  np.testing.assert_array_equal(clipped_b, [1, 0, 0, 1])
  np.testing.assert_allclose(grad_b, [0.0, -0.9, -1.5, 0.0], rtol=1e-6, atol=0)


def test_value_loss_targets_are_constants_and_jit_matches():
  # d/dR and d/dV_old are 0: the returns and old values are regression targets.
  values_bt, old_bt, ret_bt = jnp.array([[1.5, 0.5]]), jnp.array([[1.0, 1.0]]), jnp.array([[2.0, 2.0]])
  d_old, d_ret = jax.grad(lambda o, r: losses.value_loss(values_bt, o, r, clip=0.2)[0].sum(), argnums=(0, 1))(
      old_bt, ret_bt)
  np.testing.assert_array_equal(d_old, 0.0)
  np.testing.assert_array_equal(d_ret, 0.0)
  fn = jax.jit(functools.partial(losses.value_loss, clip=0.2))
  for got, want in zip(fn(values_bt, old_bt, ret_bt), losses.value_loss(values_bt, old_bt, ret_bt, clip=0.2)):
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("clip", [0.0, -0.1, float("nan"), True, "0.2"])
def test_value_loss_bad_clip_raises(clip):
  with pytest.raises(ValueError, match="clip"):
    losses.value_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros((1, 2)), clip=clip)


def test_value_loss_shape_mismatch_raises():
  with pytest.raises(ValueError, match="returns_bt"):
    losses.value_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros((1, 3)), clip=None)
