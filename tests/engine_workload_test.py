"""Long-tail workload: the length distribution, the schedules' step counts, and the benchmark binary."""
import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from rl_fusion_jax import models
from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.rollout import workload
from rl_fusion_jax.rollout.decode import GenerateSpec
from rl_fusion_jax.rollout.engine import Engine, EngineConfig
from rl_fusion_jax.rollout.sampling import SamplingParams
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.tiny import tiny_model_config
from rl_fusion_jax.testing import launch

CFG = tiny_model_config(qkv_bias=False)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def setup():
  mesh = make_mesh(MeshConfig(data=-1))
  shardings = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh,
                              TRAIN_RULES)
  return mesh, shardings, jax.device_put(models.init_params(CFG, jax.random.key(0)), shardings)


def test_long_tail_lengths_are_heavy_tailed_and_clipped():
  lengths = workload.long_tail_lengths(np.random.default_rng(0), 4096, median=16, sigma=0.8, max_len=128)
  p50, p99 = np.percentile(lengths, [50, 99])
  # Log-normal: p50 = 16, p99 = 16 * exp(2.326 * 0.8) = 16 * 6.43 = 103 (below the clip at 128).
  assert 15 <= p50 <= 17 and 90 <= p99 <= 118 and p99 / p50 >= 4
  assert lengths.min() >= 1 and lengths.max() <= 128 and lengths.dtype == np.int32
  with pytest.raises(ValueError, match="median"):
    workload.long_tail_lengths(np.random.default_rng(0), 4, median=0, sigma=1, max_len=8)


def test_make_requests_groups_share_a_prompt():
  reqs = workload.make_requests(np.random.default_rng(0), [3, 1, 4, 1, 5, 9], group_size=2, prompt_len=5,
                                vocab_size=64, first_id=10)
  assert [r.sample_id for r in reqs] == list(range(10, 16))
  assert [r.group_id for r in reqs] == [5, 5, 6, 6, 7, 7]           # (10 + i) // 2
  assert [r.forced_len for r in reqs] == [3, 1, 4, 1, 5, 9]
  assert reqs[0].prompt == reqs[1].prompt != reqs[2].prompt and len(reqs[0].prompt) == 5
  with pytest.raises(ValueError, match="group_size"):
    workload.make_requests(np.random.default_rng(0), [1, 2, 3], group_size=2, prompt_len=5, vocab_size=64)


def test_schedules_generate_the_same_tokens_in_the_expected_steps():
  mesh, shardings, params = setup()
  spec = GenerateSpec(CFG, SamplingParams(1.0), 4, 12, eos_id=0)
  base = EngineConfig(spec, num_slots=16, chunk_steps=4, prefill_rows=8, group_size=2)
  forced = [12, 1, 1, 1, 1, 1, 1, 1,  2, 2, 2, 2, 2, 2, 2, 2,  30, 3, 3, 3, 3, 3, 3, 3]
  requests = workload.make_requests(np.random.default_rng(0), forced, group_size=2, prompt_len=4,
                                    vocab_size=64)
  out = {s: workload.run_schedule(s, Engine(workload.schedule_config(base, s), mesh, shardings), params,
                                  requests, phase_samples=8) for s in workload.SCHEDULES}
  for row in out.values():
    # min(forced, 12) summed: 12 + 7 * 1 + 8 * 2 + 12 + 7 * 3 = 68
    assert row["generated_tokens"] == 68
  # Static: two batches of 16, each runs until its longest sample: 12 + 12 = 24 steps.
  assert out["static"]["decode_steps"] == 24
  # Continuous (refills of 8 rows once 8 slots are free): samples 0-15 start at once; after step 2
  # fifteen slots are free and samples 16-23 start; the longest of them (12) ends at step 2 + 12 = 14.
  assert out["continuous"]["decode_steps"] == 14
  assert out["partial"]["reprefill_rows"] > 0 and out["partial_keep_cache"]["reprefill_rows"] == 0
  with pytest.raises(ValueError, match="schedule"):
    workload.schedule_config(base, "eager")


def test_benchmark_binary_prints_one_line_per_schedule_and_ratios():
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "benchmark_generate_main.py"), "--devices=1",
         "--vocab=64", "--hidden=32", "--layers=1", "--heads=4", "--kv_heads=2", "--mlp=64", "--slots=8",
         "--samples=32", "--group_size=4", "--chunk=4", "--prompt_len=4", "--max_new_tokens=16",
         "--median_len=4", "--repeats=1", f"--compilation_cache={jax.config.jax_compilation_cache_dir}"]
  env = launch.child_env()
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
  schedules, (ratios, roofline) = lines[:-2], lines[-2:]
  assert [l.get("schedule") for l in schedules] == list(workload.SCHEDULES)
  assert len({l["generated_tokens"] for l in schedules}) == 1 and lines[0]["devices"] == 1
  assert set(ratios["ratios_vs_static"]) == set(workload.SCHEDULES)
  assert ratios["ratios_vs_static"]["static"] == 1.0
  # Weights: 1 layer of the tiny model in float32, counted by hand: embed 64*32 + lm head 32*64,
  # q/k/v/o 32*4*8 + 2*(32*2*8) + 4*8*32, their biases 4*8 + 2*2*8, MLP 3*32*64, two norms 32 + final 32.
  weights = 4 * (2 * 64 * 32 + 32 * 32 + 2 * 32 * 16 + 32 * 32 + 32 + 32 + 3 * 32 * 64 + 3 * 32)
  assert roofline["roofline"]["weight_bytes"] == weights
  # KV cache: 2 (k, v) x 1 layer x 8 slots x 20 positions x 2 kv heads x 8 head dim x 4 bytes.
  assert roofline["roofline"]["kv_cache_bytes"] == 2 * 1 * 8 * 20 * 2 * 8 * 4
  assert roofline["roofline"]["continuous_tokens_per_s"] == schedules[1]["tokens_per_s"]
