"""The work a run generates: prompts per step, samples per prompt, and each sample's lengths.

Response lengths come from a clipped log-normal. ``Workload.forced`` reproduces
``orchestration/phases.py::forced_lengths`` exactly (a generator seeded with (run.seed, sample id)), so a
simulated long-tail run draws the very lengths the measured one was forced to; otherwise lengths are
drawn from one generator seeded with ``seed`` (the fitted distribution of a run whose lengths the policy
chose). ``expected_longest`` is the expected longest of n draws (what a synchronous step waits for).
Pure numpy.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from rl_fusion_jax.sim.engine import SimRequest


def lognormal_lengths(z: np.ndarray, median: float, sigma: float, max_len: int) -> np.ndarray:
  """round(median * exp(sigma * z)) clipped to [1, max_len] (``rollout/workload.py::long_tail_lengths``)."""
  return np.clip(np.rint(median * np.exp(sigma * z)), 1, max_len).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Workload:
  num_prompts: int
  group_size: int
  prompt_len: int          # tokens per prompt (mean)
  max_new_tokens: int
  median: float            # response-length log-normal: median and sigma of log
  sigma: float
  seed: int = 0
  forced: bool = False     # per-sample draws as phases.forced_lengths (True) or one seeded stream

  @property
  def batch_size(self) -> int:
    return self.num_prompts * self.group_size

  @functools.cached_property
  def _stream(self) -> dict:
    return {}

  def length(self, sample_id: int) -> int:
    if self.forced:
      z = np.random.default_rng((self.seed, sample_id)).standard_normal(1)
      return int(lognormal_lengths(z, self.median, self.sigma, self.max_new_tokens)[0])
    cache = self._stream
    block = sample_id // 4096
    if block not in cache:
      z = np.random.default_rng((self.seed, 1 << 20, block)).standard_normal(4096)
      cache[block] = lognormal_lengths(z, self.median, self.sigma, self.max_new_tokens)
    return int(cache[block][sample_id % 4096])

  def requests(self, first_group: int, groups: int) -> list[SimRequest]:
    """The samples of groups [first_group, first_group + groups): ids as ``phases.requests`` numbers them."""
    g = self.group_size
    return [SimRequest(sample_id=(first_group + i) * g + k, group_id=first_group + i,
                       prompt_len=self.prompt_len, length=self.length((first_group + i) * g + k))
            for i in range(groups) for k in range(g)]


def fit_lognormal(mean_len: float, mean_max: float, batch: int, max_len: int, draws: int = 64) -> tuple[float, float]:
  """(median, sigma) whose clipped, rounded draws have mean ``mean_len`` and whose batch maximum
  averages ``mean_max`` (a grid search over sigma, median solved per sigma; common random numbers)."""
  z = np.random.default_rng(0).standard_normal((draws, batch))
  best = (math.inf, mean_len, 0.0)
  for sigma in np.linspace(0.0, 1.6, 81):
    lo, hi = 0.05, float(max_len)
    for _ in range(40):     # the clipped mean grows with the median: bisect for the measured mean
      mid = (lo + hi) / 2
      if lognormal_lengths(z, mid, sigma, max_len).mean() < mean_len:
        lo = mid
      else:
        hi = mid
    x = lognormal_lengths(z, (lo + hi) / 2, sigma, max_len)
    err = abs(x.max(axis=1).mean() - mean_max) / max(mean_max, 1) + abs(x.mean() - mean_len) / max(mean_len, 1)
    if err < best[0]:
      best = (err, (lo + hi) / 2, float(sigma))
  return best[1], best[2]


def length_cdf(k: np.ndarray, median: float, sigma: float, max_len: int) -> np.ndarray:
  """P(length <= k) for integer ``k`` under ``lognormal_lengths``: round(median * exp(sigma * z)) <= k
  iff median * exp(sigma * z) < k + 1/2 (ties have probability 0), clipped to [1, max_len]."""
  k = np.asarray(k, np.float64)
  if sigma <= 0:
    p = (np.clip(np.rint(median), 1, max_len) <= k).astype(np.float64)
  else:
    x = np.log(np.maximum(k + 0.5, 1e-300) / median) / sigma
    p = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
  return np.where(k < 1, 0.0, np.where(k >= max_len, 1.0, p))


def expected_longest(median: float, sigma: float, max_len: int, n: int) -> float:
  """E[max of n independent lengths] = sum over k >= 0 of P(max > k) = sum_{k=0}^{max_len-1} 1 - F(k)^n.

  A synchronous step's generation ends with its longest sample: over all data-parallel groups, the
  slowest group's longest sample, i.e. the longest of all n samples of the step. More groups at the same
  samples per group draw more samples, hence a longer expected tail (until the cap ``max_len`` binds)."""
  if n < 1:
    raise ValueError(f"expected_longest: n must be >= 1, got {n}")
  k = np.arange(max_len, dtype=np.float64)
  return float(np.sum(1.0 - length_cdf(k, median, sigma, max_len) ** n))


_erf = np.vectorize(math.erf, otypes=[np.float64])
