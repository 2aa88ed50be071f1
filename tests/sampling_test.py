"""Sampling on logits: truncation by hand, log-probs, and per-(sample, token) random streams."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax.rollout.sampling import (SamplingParams, categorical, first_argmax, sample, sample_keys,
                                            truncate_logits)


def test_top_k_keeps_k_largest():
  logits = jnp.array([[1.0, 4.0, 3.0, 2.0]])
  out = np.asarray(truncate_logits(logits, top_k=2, top_p=1.0))
  assert out[0, 1] == 4.0 and out[0, 2] == 3.0
  assert out[0, 0] < -1e30 and out[0, 3] < -1e30


def test_top_p_nucleus_by_hand():
  # probs 0.5, 0.25, 0.125, 0.125 (logits = log p). Mass before each sorted token: 0, .5, .75, .875.
  # top_p = 0.7 keeps tokens whose preceding mass < 0.7: the first two.
  p = np.array([0.5, 0.25, 0.125, 0.125])
  out = np.asarray(truncate_logits(jnp.log(jnp.asarray(p))[None], top_k=0, top_p=0.7))
  assert np.isfinite(out[0, :2]).all() and (out[0, :2] > -1e30).all()
  assert (out[0, 2:] < -1e30).all()
  # A tiny top_p still keeps the argmax.
  out = np.asarray(truncate_logits(jnp.log(jnp.asarray(p))[None], top_k=0, top_p=0.01))
  assert out[0, 0] > -1e30 and (out[0, 1:] < -1e30).all()


def test_sample_logp_is_temperature_scaled_log_softmax():
  logits = jax.random.normal(jax.random.key(1), (6, 11)) * 3
  keys = sample_keys(jax.random.key(2), jnp.arange(6), jnp.zeros(6, jnp.int32))
  params = SamplingParams(temperature=0.7)
  tokens, logp = sample(logits, keys, params)
  scaled = np.asarray(logits, np.float64) / 0.7
  ref = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - scaled.max(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(logp), ref[np.arange(6), np.asarray(tokens)], atol=1e-5)


def test_greedy_is_argmax():
  logits = jax.random.normal(jax.random.key(3), (5, 9))
  tokens, _ = sample(logits, sample_keys(jax.random.key(0), jnp.arange(5), jnp.zeros(5, jnp.int32)),
                     SamplingParams(temperature=0.0))
  np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), -1))


def test_first_argmax_is_numpys_argmax_with_ties_infinities_and_nans():
  x = np.array(jax.random.normal(jax.random.key(4), (7, 300)), np.float32)
  x[1, [5, 17, 250]] = 9.0                         # ties: the first index wins
  x[2] = np.finfo(np.float32).min                  # a row truncated everywhere
  x[3, 40], x[3, 200] = np.inf, np.inf
  x[4, 10], x[4, 99] = np.nan, 50.0                # NaN counts as the maximum, as np.argmax has it
  x[5, [30, 31]] = np.nan
  x[6] = -np.inf
  np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8)])
def test_categorical_draws_the_tokens_jax_random_categorical_draws(top_k, top_p):
  """The same key gives the same token as jax.random.categorical, on a vocabulary of SmolLM2's width
  (ties between truncated logits included)."""
  logits = jax.random.normal(jax.random.key(5), (16, 49152)) * 4
  logits = truncate_logits(logits, top_k, top_p)
  keys = sample_keys(jax.random.key(6), jnp.arange(16) + 100, jnp.arange(16))
  ours = np.asarray(jax.jit(categorical)(keys, logits))
  theirs = np.asarray(jax.jit(jax.vmap(jax.random.categorical))(keys, logits))
  np.testing.assert_array_equal(ours, theirs)
  assert ours.dtype == np.int32


def test_stream_depends_on_sample_and_token_not_row():
  rng = jax.random.key(7)
  logits = jnp.zeros((4, 1000))   # uniform: the token is a pure function of the key
  ids = jnp.array([10, 11, 12, 13])
  tok = jnp.array([0, 0, 5, 5], jnp.int32)
  a, _ = sample(logits, sample_keys(rng, ids, tok), SamplingParams())
  b, _ = sample(logits, sample_keys(rng, ids[::-1], tok[::-1]), SamplingParams())
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[::-1])
  c, _ = sample(logits, sample_keys(rng, ids, tok + 1), SamplingParams())
  assert (np.asarray(a) != np.asarray(c)).any()


def test_sampling_frequencies_match_softmax():
  logits = jnp.log(jnp.array([0.6, 0.3, 0.1]))
  n = 20000
  keys = sample_keys(jax.random.key(0), jnp.arange(n), jnp.zeros(n, jnp.int32))
  tokens, _ = sample(jnp.broadcast_to(logits, (n, 3)), keys, SamplingParams())
  freq = np.bincount(np.asarray(tokens), minlength=3) / n
  # 4 standard errors of a binomial proportion at n = 20000 is < 0.015.
  np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.015)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0),
                                    dict(top_p=1.5)])
def test_bad_sampling_params(kwargs):
  with pytest.raises(ValueError, match=next(iter(kwargs))):
    SamplingParams(**kwargs)
