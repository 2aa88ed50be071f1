"""The benchmark hook ``rollout.forced_length_*``: per-sample forced response lengths that depend only on
the run seed and the sample id, within [1, max_new_tokens], off by default, validated by field name."""
import math

import numpy as np
import pytest

from rl_fusion_jax.errors import ConfigError
from rl_fusion_jax.orchestration import phases
from rl_fusion_jax.rewards.registry import make_task
from rl_fusion_jax.testing.experiments import tiny
from rl_fusion_jax.tokenizer import CharTokenizer

FORCED = {"rollout.forced_length_median": 3, "rollout.forced_length_sigma": 1.0}


def make_requests(cfg, first_problem: int, count: int):
  r, task = cfg.rollout, make_task("arithmetic", max_digits=2)
  problems = [task.problem(first_problem + i) for i in range(count)]
  return phases.requests(CharTokenizer(), problems, r.max_prompt_len, r.group_size,
                         first_problem * r.group_size, first_problem,
                         forced_len=phases.forced_lengths(cfg))


def test_lengths_depend_only_on_seed_and_sample_id():
  cfg = tiny(**FORCED)
  whole = {q.sample_id: q.forced_len for q in make_requests(cfg, 0, 6)}
  split = {q.sample_id: q.forced_len for q in make_requests(cfg, 4, 2) + make_requests(cfg, 0, 4)}
  assert whole == split and sorted(whole) == list(range(12))
  length = phases.forced_lengths(cfg)
  assert [length(i) for i in range(12)] == [whole[i] for i in range(12)]
  other_seed = phases.forced_lengths(tiny(**FORCED, **{"run.seed": 1}))
  assert [other_seed(i) for i in range(200)] != [length(i) for i in range(200)]


def test_lengths_are_within_bounds_and_long_tailed():
  cfg = tiny(**FORCED)      # max_new_tokens 4
  lengths = np.array([phases.forced_lengths(cfg)(i) for i in range(2000)])
  assert lengths.min() == 1 and lengths.max() == cfg.rollout.max_new_tokens
  assert set(np.unique(lengths)) == {1, 2, 3, 4}
  wide = tiny(**FORCED, **{"rollout.max_new_tokens": 200, "model.max_position_embeddings": 256})
  lengths = np.array([phases.forced_lengths(wide)(i) for i in range(2000)])
  assert np.median(lengths) == 3 and lengths.max() > 6 * 3


def test_off_by_default():
  cfg = tiny()
  assert cfg.rollout.forced_length_median == 0
  assert phases.forced_lengths(cfg) is None
  assert all(q.forced_len is None for q in make_requests(cfg, 0, 3))


@pytest.mark.parametrize("field,value", [
    ("forced_length_median", -1), ("forced_length_median", 2.5), ("forced_length_median", True),
    ("forced_length_sigma", -0.1), ("forced_length_sigma", math.nan), ("forced_length_sigma", "wide"),
])
def test_bad_values_name_the_field(field, value):
  with pytest.raises(ConfigError, match=rf"config\.rollout\.{field}"):
    tiny(**{f"rollout.{field}": value})
