"""Off-policy corrections (decoupled PPO, token- and sequence-level truncated IS) against hand values.

Every expected number is worked out in the comments (or with plain numpy), never by calling the
function under test. Log-probs are built from ratios, so each case reads as (w, r, A).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax.algorithms import losses, offpolicy

LN = np.log
E20 = float(np.exp(np.float64(20.0)))


def _col(values):
  """One token per row: a [B, 1] float32 array."""
  return jnp.asarray(np.asarray(values, np.float64)[:, None], jnp.float32)


def _loss_and_grad(fn, logp_bt, behaviour_bt, adv, **kwargs):
  """loss_bt, stats and d sum(loss_bt) / d logp_bt, all as numpy."""
  loss_fn = lambda lp: fn(lp, behaviour_bt, adv, **kwargs)
  loss_bt, stats = loss_fn(logp_bt)
  grad_bt = jax.grad(lambda lp: loss_fn(lp)[0].sum())(logp_bt)
  return np.asarray(loss_bt), {k: np.asarray(v) for k, v in stats.items()}, np.asarray(grad_bt)


# ----------------------------------------------------------------------------------------------------
# decoupled_ppo
# ----------------------------------------------------------------------------------------------------


def test_decoupled_ppo_hand_cases():
  # eps = 0.2 (r in [0.8, 1.2]), cap C = 1.5. w = exp(prox - behaviour), r = exp(logp - prox),
  # loss = -min(w, C) * min(r*A, clip(r)*A), grad = -min(w, C) * A * r where the clip is inactive.
  #   a: beh -1.0, prox -0.5 -> w = e^0.5  = 1.648721 -> 1.5 (truncated); r = 1;   A =  2:
  #      PPO -2;                      loss 1.5 * -2        = -3.0,      grad -1.5*2*1       = -3.0
  #   b: beh -1.0, prox -0.8 -> w = e^0.2  = 1.221403;                     r = 1.1; A =  2:
  #      PPO -min(2.2, 2.2) = -2.2;   loss 1.221403 * -2.2 = -2.687086, grad -1.221403*2*1.1 = -2.687086
  #   c: beh -1.0, prox -0.5 -> w -> 1.5 (truncated);                      r = 1.5; A =  2:
  #      PPO -min(3, 2.4) = -2.4, clipped; loss 1.5 * -2.4 = -3.6,      grad 0
  #   d: beh -0.5, prox -1.0 -> w = e^-0.5 = 0.606531;                     r = 1.5; A = -1:
  #      PPO -min(-1.5, -1.2) = 1.5;  loss 0.606531 * 1.5  = 0.909796,  grad -0.606531*-1*1.5 = 0.909796
  #   e: beh -1.0, prox -1.0 -> w = 1;                                     r = 0.5; A = -1:
  #      PPO -min(-0.5, -0.8) = 0.8, clipped; loss 0.8,                 grad 0
  behaviour = [-1.0, -1.0, -1.0, -0.5, -1.0]
  prox = [-0.5, -0.8, -0.5, -1.0, -1.0]
  ratio = [1.0, 1.1, 1.5, 1.5, 0.5]
  adv_b = jnp.array([2.0, 2.0, 2.0, -1.0, -1.0])
  logp_bt = _col(np.add(prox, LN(ratio)))
  loss_bt, stats, grad_bt = _loss_and_grad(
      offpolicy.decoupled_ppo_surrogate, logp_bt, _col(behaviour), adv_b,
      proximal_logp_bt=_col(prox), is_cap=1.5,
  )
  np.testing.assert_allclose(loss_bt[:, 0], [-3.0, -2.687086, -3.6, 0.909796, 0.8], rtol=1e-5)
  np.testing.assert_allclose(grad_bt[:, 0], [-3.0, -2.687086, 0.0, 0.909796, 0.0], rtol=1e-5, atol=0)
  np.testing.assert_allclose(
      stats["is_weight"][:, 0], [1.648721, 1.221403, 1.648721, 0.606531, 1.0], rtol=1e-5
  )
  np.testing.assert_array_equal(stats["is_truncated"][:, 0], [1, 0, 1, 0, 0])
  np.testing.assert_array_equal(stats["clipped"][:, 0], [0, 0, 1, 0, 1])
  np.testing.assert_allclose(stats["ratio"][:, 0], ratio, rtol=1e-5)
  np.testing.assert_array_equal(stats["log_ratio_clamped"], np.zeros((5, 1)))


def test_decoupled_ppo_dual_clip_caps_the_ppo_term_before_the_weight():
  # beh -2, prox -1 -> w = e^1 = 2.718282 -> truncated at C = 1.5. A = -1, eps 0.2, dual clip c = 3:
  #   r = 4: PPO -min(-4, -1.2) = 4 > -c*A = 3 -> 3, dual-clipped; loss 1.5 * 3 = 4.5, grad 0
  #   r = 2: PPO 2 <= 3;                                            loss 1.5 * 2 = 3.0, grad -1.5*-1*2 = 3
  # Without the dual clip the r = 4 token gives 1.5 * 4 = 6.0 with grad -1.5*-1*4 = 6.0.
  behaviour, prox = _col([-2.0, -2.0]), _col([-1.0, -1.0])
  logp_bt = _col(np.add([-1.0, -1.0], LN([4.0, 2.0])))
  adv_b = jnp.array([-1.0, -1.0])
  fn = functools.partial(offpolicy.decoupled_ppo_surrogate, proximal_logp_bt=prox, is_cap=1.5)
  loss_bt, stats, grad_bt = _loss_and_grad(fn, logp_bt, behaviour, adv_b, dual_clip=3.0)
  np.testing.assert_allclose(loss_bt[:, 0], [4.5, 3.0], rtol=1e-5)
  np.testing.assert_allclose(grad_bt[:, 0], [0.0, 3.0], rtol=1e-5, atol=0)
  np.testing.assert_array_equal(stats["dual_clipped"][:, 0], [1, 0])
  np.testing.assert_array_equal(stats["is_truncated"][:, 0], [1, 1])
  loss_bt, _, grad_bt = _loss_and_grad(fn, logp_bt, behaviour, adv_b)
  np.testing.assert_allclose(loss_bt[:, 0], [6.0, 3.0], rtol=1e-5)
  np.testing.assert_allclose(grad_bt[:, 0], [6.0, 3.0], rtol=1e-5)


def test_decoupled_ppo_default_proximal_is_the_current_policy():
  # prox = stop_gradient(logp): r = 1 (never clipped), w = exp(logp - beh); per-token advantages.
  #   logp -0.5, beh -1.0: w = 1.648721 -> C = 1.5; A =  2: loss -3.0,                 grad -3.0
  #   logp -1.0, beh -0.5: w = 0.606531;            A = -1: loss  0.606531,            grad  0.606531
  logp_bt = jnp.array([[-0.5, -1.0]])
  behaviour_bt = jnp.array([[-1.0, -0.5]])
  adv_bt = jnp.array([[2.0, -1.0]])
  loss_bt, stats, grad_bt = _loss_and_grad(
      offpolicy.decoupled_ppo_surrogate, logp_bt, behaviour_bt, adv_bt, is_cap=1.5
  )
  np.testing.assert_allclose(loss_bt, [[-3.0, 0.606531]], rtol=1e-5)
  np.testing.assert_allclose(grad_bt, [[-3.0, 0.606531]], rtol=1e-5)
  np.testing.assert_array_equal(stats["ratio"], [[1.0, 1.0]])
  np.testing.assert_array_equal(stats["clipped"], [[0, 0]])


def _random_case(seed, shape=(3, 4)):
  rng = np.random.default_rng(seed)
  logp = rng.uniform(-3.0, -0.1, shape).astype(np.float32)
  behaviour = (logp + rng.normal(0.0, 0.4, shape)).astype(np.float32)
  adv = rng.normal(size=shape[:1]).astype(np.float32)
  return jnp.asarray(logp), jnp.asarray(behaviour), jnp.asarray(adv)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_decoupled_ppo_equals_ppo_clip_when_proximal_is_behaviour(dual_clip):
  # w = exp(0) = 1 exactly, so the loss, its gradient and the PPO stats must be identical, bit for bit.
  logp_bt, behaviour_bt, adv_b = _random_case(0)
  kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
  got = _loss_and_grad(offpolicy.decoupled_ppo_surrogate, logp_bt, behaviour_bt, adv_b,
                       proximal_logp_bt=behaviour_bt, is_cap=1.5, **kw)
  want = _loss_and_grad(losses.clipped_surrogate, logp_bt, behaviour_bt, adv_b, **kw)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[2], want[2])
  for key in losses.POLICY_LOSS_STATS:
    np.testing.assert_array_equal(got[1][key], want[1][key], err_msg=key)
  # Some tokens must be clipped, or the comparison would not cover the clip.
  assert 0 < want[1]["clipped"].sum() < want[1]["clipped"].size


# ----------------------------------------------------------------------------------------------------
# tis_token
# ----------------------------------------------------------------------------------------------------


def test_tis_token_hand_cases():
  # w = exp(logp - beh) (prox = stop_gradient(logp)), C = 1.5; loss = -min(w, C) * A, grad the same.
  #   logp -0.5, beh -1.0: w = e^0.5  = 1.648721 -> 1.5; A =  2: loss -3.0,      grad -3.0
  #   logp -0.5, beh -0.7: w = e^0.2  = 1.221403;        A = -1: loss  1.221403, grad  1.221403
  #   logp -1.0, beh -0.5: w = e^-0.5 = 0.606531;        A =  2: loss -1.213061, grad -1.213061
  logp_bt = _col([-0.5, -0.5, -1.0])
  behaviour_bt = _col([-1.0, -0.7, -0.5])
  adv_b = jnp.array([2.0, -1.0, 2.0])
  loss_bt, stats, grad_bt = _loss_and_grad(offpolicy.tis_token_loss, logp_bt, behaviour_bt, adv_b, is_cap=1.5)
  np.testing.assert_allclose(loss_bt[:, 0], [-3.0, 1.221403, -1.213061], rtol=1e-5)
  np.testing.assert_allclose(grad_bt[:, 0], [-3.0, 1.221403, -1.213061], rtol=1e-5)
  np.testing.assert_allclose(stats["is_weight"][:, 0], [1.648721, 1.221403, 0.606531], rtol=1e-5)
  np.testing.assert_array_equal(stats["is_truncated"][:, 0], [1, 0, 0])
  np.testing.assert_array_equal(stats["ratio"][:, 0], [1, 1, 1])
  for key in ("clipped", "dual_clipped", "log_ratio_clamped"):
    np.testing.assert_array_equal(stats[key], np.zeros((3, 1)), err_msg=key)
  # An infinite cap disables truncation: the first token then has loss -1.648721 * 2 = -3.297443.
  loss_bt, stats, _ = _loss_and_grad(offpolicy.tis_token_loss, logp_bt, behaviour_bt, adv_b, is_cap=np.inf)
  np.testing.assert_allclose(loss_bt[0, 0], -3.297443, rtol=1e-5)
  np.testing.assert_array_equal(stats["is_truncated"], np.zeros((3, 1)))


def test_tis_token_with_an_explicit_proximal_policy():
  # prox -0.9, beh -1.0: w = e^0.1 = 1.105171 (below C = 5); logp -0.3 does not enter the weight.
  # A = 2: loss -2.210342, grad -2.210342; ratio stat exp(logp - prox) = e^0.6 = 1.822119.
  loss_bt, stats, grad_bt = _loss_and_grad(
      offpolicy.tis_token_loss, _col([-0.3]), _col([-1.0]), jnp.array([2.0]), proximal_logp_bt=_col([-0.9])
  )
  np.testing.assert_allclose(loss_bt, [[-2.210342]], rtol=1e-5)
  np.testing.assert_allclose(grad_bt, [[-2.210342]], rtol=1e-5)
  np.testing.assert_allclose(stats["ratio"], [[1.822119]], rtol=1e-5)
  np.testing.assert_allclose(stats["is_weight"], [[1.105171]], rtol=1e-5)


def _softmax_policy_logp(theta_btv, tokens_bt):
  logp_btv = jax.nn.log_softmax(theta_btv, axis=-1)
  return jnp.take_along_axis(logp_btv, tokens_bt[..., None], axis=-1)[..., 0]


def _reinforce_grad_numpy(theta_btv, tokens_bt, adv_b, mask_bt):
  # d(-A * log softmax(theta)_k) / d theta_j = -A * (1[j = k] - p_j), per masked token.
  theta = np.asarray(theta_btv, np.float64)
  p = np.exp(theta - theta.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  onehot = np.eye(theta.shape[-1])[np.asarray(tokens_bt)]
  return -np.asarray(adv_b)[:, None, None] * (onehot - p) * np.asarray(mask_bt)[..., None]


@pytest.mark.parametrize("name", ["tis_token", "tis_seq"])
def test_tis_on_policy_gradient_is_reinforce(name):
  # behaviour == current on every response token -> w = 1 -> the parameter gradient of the masked sum
  # is REINFORCE's, sum_t -A * grad log pi(token_t). Padding holds a garbage behaviour log-prob (+50),
  # which must not reach tis_seq's sequence weight.
  rng = np.random.default_rng(3)
  theta_btv = jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32)
  tokens_bt = jnp.asarray(rng.integers(0, 5, size=(2, 3)))
  adv_b = jnp.array([1.5, -0.5])
  mask_bt = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
  behaviour_bt = jnp.where(mask_bt > 0, _softmax_policy_logp(theta_btv, tokens_bt), 50.0)
  fn = {"tis_token": offpolicy.tis_token_loss, "tis_seq": offpolicy.tis_seq_loss}[name]

  def objective(theta):
    loss_bt, _ = fn(_softmax_policy_logp(theta, tokens_bt), behaviour_bt, adv_b, mask_bt=mask_bt, is_cap=1.5)
    return jnp.sum(loss_bt * mask_bt)

  grad = np.asarray(jax.grad(objective)(theta_btv))
  np.testing.assert_allclose(grad, _reinforce_grad_numpy(theta_btv, tokens_bt, adv_b, mask_bt), atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# tis_seq
# ----------------------------------------------------------------------------------------------------


def test_tis_seq_hand_cases_with_a_mask():
  # mask [[1,1,0],[1,1,1],[1,0,0]], prox = logp, C = 1.5; w_b = exp(sum over the mask of logp - beh).
  #   row 0: (-0.5 + 0.7) + (-1.0 + 1.1) = 0.3  -> w = e^0.3  = 1.349859;          A =  1 -> loss -1.349859
  #   row 1: 0.3 + 0.3 + 0.3              = 0.9  -> w = e^0.9  = 2.459603 -> 1.5;   A = -2 -> loss  3.0
  #   row 2: -1.0 + 0.5                   = -0.5 -> w = e^-0.5 = 0.606531;          A =  2 -> loss -1.213061
  # The weight applies to every token of the row; grad of sum(loss * mask) = -min(w_b, C) * A_b * mask.
  # Padded behaviour entries (-50 would give w = e^50, NaN would poison the sum) must be ignored. The
  # token-level weights of row 0 would differ: e^0.2 and e^0.1.
  mask_bt = jnp.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
  logp_bt = jnp.array([[-0.5, -1.0, 0.0], [-0.2, -0.3, -0.4], [-1.0, 0.0, 0.0]])
  behaviour_bt = jnp.array([[-0.7, -1.1, -50.0], [-0.5, -0.6, -0.7], [-0.5, jnp.nan, jnp.nan]])
  adv_b = jnp.array([1.0, -2.0, 2.0])
  loss_fn = lambda lp: offpolicy.tis_seq_loss(lp, behaviour_bt, adv_b, mask_bt=mask_bt, is_cap=1.5)
  loss_bt, stats = loss_fn(logp_bt)
  grad_bt = jax.grad(lambda lp: jnp.sum(loss_fn(lp)[0] * mask_bt))(logp_bt)
  want_loss_b = np.array([-1.349859, 3.0, -1.213061])
  np.testing.assert_allclose(loss_bt, np.repeat(want_loss_b[:, None], 3, axis=1), rtol=1e-5)
  np.testing.assert_allclose(grad_bt, want_loss_b[:, None] * np.asarray(mask_bt), rtol=1e-5, atol=0)
  np.testing.assert_allclose(
      stats["is_weight"], np.repeat([[1.349859], [2.459603], [0.606531]], 3, axis=1), rtol=1e-5
  )
  np.testing.assert_array_equal(stats["is_truncated"], [[0] * 3, [1] * 3, [0] * 3])
  np.testing.assert_array_equal(stats["log_ratio_clamped"], np.zeros((3, 3)))
  np.testing.assert_array_equal(stats["clipped"], np.zeros((3, 3)))


def test_tis_seq_clamps_the_summed_log_weight():
  # 30 response tokens, each logp - beh = 1: log w = 30 > 20 -> w = e^20 (flagged), truncated to C = 5;
  # A = 1 -> loss -5 on every token, grad -5. An empty row has log w = 0 -> w = 1, loss -A = -1.
  logp_bt = jnp.zeros((2, 30))
  behaviour_bt = jnp.full((2, 30), -1.0)
  mask_bt = jnp.stack([jnp.ones(30), jnp.zeros(30)])
  loss_fn = lambda lp: offpolicy.tis_seq_loss(lp, behaviour_bt, jnp.ones(2), mask_bt=mask_bt)
  loss_bt, stats = loss_fn(logp_bt)
  grad_bt = jax.grad(lambda lp: loss_fn(lp)[0].sum())(logp_bt)
  np.testing.assert_allclose(loss_bt, np.stack([np.full(30, -5.0), np.full(30, -1.0)]), rtol=1e-6)
  np.testing.assert_allclose(grad_bt, np.stack([np.full(30, -5.0), np.full(30, -1.0)]), rtol=1e-6)
  np.testing.assert_allclose(stats["is_weight"][:, 0], [E20, 1.0], rtol=1e-5)
  np.testing.assert_array_equal(stats["log_ratio_clamped"][:, 0], [1, 0])
  np.testing.assert_array_equal(stats["is_truncated"][:, 0], [1, 0])


def test_tis_seq_needs_a_mask():
  with pytest.raises(ValueError, match="tis_seq needs mask_bt"):
    offpolicy.tis_seq_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1,)))
  with pytest.raises(ValueError, match="mask_bt"):
    offpolicy.tis_seq_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1,)), mask_bt=jnp.ones((1, 3)))


# ----------------------------------------------------------------------------------------------------
# Shared: clamping, validation, jit
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_decoupled_ppo_huge_log_ratios_stay_finite(dual_clip):
  # Token 0: logp - prox = 100 (r -> e^20) and prox - beh = 0; token 1: prox - beh = 100 (w -> e^20 ->
  # C = 5) and r = 1. A = -1, eps 0.2:
  #   token 0: PPO -min(-e^20, -1.2) = e^20 (or the dual cap 3), w = 1; grad 0 (r clamped)
  #   token 1: PPO -min(-1, -1) = 1, loss 5 * 1 = 5, grad -5 * -1 * 1 = 5
  prox_bt = jnp.array([[-100.0, -0.5]])
  logp_bt = jnp.array([[0.0, -0.5]])
  behaviour_bt = jnp.array([[-100.0, -100.5]])
  loss_bt, stats, grad_bt = _loss_and_grad(
      offpolicy.decoupled_ppo_surrogate, logp_bt, behaviour_bt, jnp.array([-1.0]),
      proximal_logp_bt=prox_bt, dual_clip=dual_clip,
  )
  np.testing.assert_allclose(loss_bt, [[E20 if dual_clip is None else 3.0, 5.0]], rtol=1e-5)
  np.testing.assert_allclose(grad_bt, [[0.0, 5.0]], rtol=1e-5, atol=0)
  np.testing.assert_array_equal(stats["log_ratio_clamped"], [[1, 1]])
  np.testing.assert_allclose(stats["is_weight"], [[1.0, E20]], rtol=1e-5)


def test_tis_token_huge_weight_is_clamped_then_truncated():
  # logp - beh = 100 -> w = e^20 (flagged) -> C = 5; A = -1 -> loss 5, grad 5. Second token w = 1.
  loss_bt, stats, grad_bt = _loss_and_grad(
      offpolicy.tis_token_loss, jnp.array([[0.0, -1.0]]), jnp.array([[-100.0, -1.0]]), jnp.array([-1.0])
  )
  np.testing.assert_allclose(loss_bt, [[5.0, 1.0]], rtol=1e-6)
  np.testing.assert_allclose(grad_bt, [[5.0, 1.0]], rtol=1e-6)
  np.testing.assert_array_equal(stats["log_ratio_clamped"], [[1, 0]])
  np.testing.assert_array_equal(stats["is_truncated"], [[1, 0]])


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        (offpolicy.decoupled_ppo_surrogate, dict(is_cap=0.9), "is_cap"),
        (offpolicy.tis_token_loss, dict(is_cap=None), "is_cap"),
        (offpolicy.tis_token_loss, dict(dual_clip=3.0), "dual_clip does not apply to tis_token"),
        (offpolicy.tis_seq_loss, dict(dual_clip=3.0, mask_bt=jnp.ones((1, 2))), "dual_clip"),
        (offpolicy.decoupled_ppo_surrogate, dict(dual_clip=1.0), "dual_clip"),
        (offpolicy.decoupled_ppo_surrogate, dict(log_ratio_clamp=-1.0), "log_ratio_clamp"),
        (offpolicy.decoupled_ppo_surrogate, dict(proximal_logp_bt=jnp.zeros((1, 3))), "proximal_logp_bt"),
    ],
)
def test_bad_arguments_raise(fn, kwargs, match):
  with pytest.raises(ValueError, match=match):
    fn(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1,)), **kwargs)


def test_behaviour_and_proximal_are_not_differentiated():
  logp_bt, behaviour_bt, adv_b = _random_case(1)
  for fn in (offpolicy.decoupled_ppo_surrogate, offpolicy.tis_token_loss, offpolicy.tis_seq_loss):
    objective = lambda beh, prox: fn(
        logp_bt, beh, adv_b, proximal_logp_bt=prox, mask_bt=jnp.ones_like(logp_bt)
    )[0].sum()
    grads = jax.grad(objective, argnums=(0, 1))(behaviour_bt, logp_bt - 0.1)
    for g in grads:
      np.testing.assert_array_equal(g, np.zeros(logp_bt.shape))


# ----------------------------------------------------------------------------------------------------
# uncorrected (the no-correction arm: behaviour log-probs never enter the loss)
# ----------------------------------------------------------------------------------------------------


def test_uncorrected_hand_cases():
  # eps = 0.2. r = exp(logp - prox), loss = -min(r*A, clip(r)*A), no behaviour weight:
  #   a: beh -3.0, prox -0.5, r = 1.1, A = 2:  loss -2.2, grad -2*1.1 = -2.2   (w = e^2.5 = 12.182494)
  #   b: beh -1.0, prox -1.0, r = 1.5, A = 2:  loss -min(3, 2.4) = -2.4 (clipped), grad 0  (w = 1)
  #   c: beh  0.0, prox -1.0, r = 0.9, A = -1: loss -min(-0.9, -0.9) = 0.9, grad 0.9  (w = e^-1)
  behaviour, prox, ratio = [-3.0, -1.0, 0.0], [-0.5, -1.0, -1.0], [1.1, 1.5, 0.9]
  adv_b = jnp.array([2.0, 2.0, -1.0])
  loss_bt, stats, grad_bt = _loss_and_grad(
      offpolicy.uncorrected_surrogate, _col(np.add(prox, LN(ratio))), _col(behaviour), adv_b,
      proximal_logp_bt=_col(prox), is_cap=5.0)
  np.testing.assert_allclose(loss_bt[:, 0], [-2.2, -2.4, 0.9], rtol=1e-5)
  np.testing.assert_allclose(grad_bt[:, 0], [-2.2, 0.0, 0.9], rtol=1e-5, atol=0)
  np.testing.assert_allclose(stats["is_weight"][:, 0], [12.182494, 1.0, 0.367879], rtol=1e-5)
  np.testing.assert_array_equal(stats["is_truncated"][:, 0], [1, 0, 0])   # reported, not applied
  np.testing.assert_array_equal(stats["clipped"][:, 0], [0, 1, 0])


def test_uncorrected_default_proximal_is_reinforce_whatever_the_behaviour():
  # prox = stop_gradient(logp): r = 1, so d loss / d logp = -A for every token, stale or not.
  logp_bt = _col([-0.3, -2.0, -1.0])
  adv_b = jnp.array([1.5, -0.5, 2.0])
  for behaviour in ([-0.3, -2.0, -1.0], [-5.0, 0.0, -0.1]):
    loss_bt, stats, grad_bt = _loss_and_grad(offpolicy.uncorrected_surrogate, logp_bt, _col(behaviour), adv_b)
    np.testing.assert_allclose(grad_bt[:, 0], [-1.5, 0.5, -2.0], rtol=1e-6)
    np.testing.assert_allclose(loss_bt[:, 0], [-1.5, 0.5, -2.0], rtol=1e-6)
    np.testing.assert_allclose(stats["ratio"][:, 0], [1.0, 1.0, 1.0], rtol=1e-6)
