"""The schedule simulator (rl_fusion_jax/sim): the engine replay against the real engine, schedules and
the cost fit against hand-computed cases, the measured-run validation, and that it imports no JAX."""
import dataclasses
import functools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from rl_fusion_jax import models
from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.rollout import slots
from rl_fusion_jax.rollout import workload as rollout_workload
from rl_fusion_jax.rollout.decode import GenerateSpec
from rl_fusion_jax.rollout.engine import Engine, EngineConfig
from rl_fusion_jax.rollout.sampling import SamplingParams
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.sim import fit, schedules
from rl_fusion_jax.sim.costs import Costs, GenCost, TrainCost
from rl_fusion_jax.sim.engine import SimEngine, SimRequest
from rl_fusion_jax.sim.workload import Workload, fit_lognormal
from rl_fusion_jax.testing.tiny import tiny_model_config

CFG = tiny_model_config(qkv_bias=False)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTS = ("decode_steps", "decode_chunks", "prefill_calls", "refill_prefills", "prefill_rows", "reprefill_rows",
          "prefill_tokens", "generated_tokens")


@functools.lru_cache(maxsize=None)
def _setup():
  mesh = make_mesh(MeshConfig(data=-1))
  shardings = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh, TRAIN_RULES)
  return mesh, shardings, jax.device_put(models.init_params(CFG, jax.random.key(0)), shardings)


def test_sim_imports_no_jax():
  code = ("import sys\nimport rl_fusion_jax.sim.cluster, rl_fusion_jax.sim.fit, rl_fusion_jax.sim.measure\n"
          "assert not [m for m in sys.modules if m == 'jax' or m.startswith('jax.')], 'jax imported'\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
  assert result.returncode == 0, result.stderr


def test_engine_replay_counts_what_the_engine_does():
  # The real engine (16 slots over the 8 devices, chunks of 4, prefill calls of 8 rows, groups of 2) and
  # the replay get the same requests and the same sequence of runs: a partial run with a group target,
  # one that must also finish named groups, and one that drains everything. Every count and every
  # returned group must agree.
  mesh, shardings, params = _setup()
  spec = GenerateSpec(CFG, SamplingParams(1.0), 4, 16, eos_id=0)
  engine = Engine(EngineConfig(spec, num_slots=16, chunk_steps=4, prefill_rows=8, group_size=2), mesh, shardings)
  sim = SimEngine(num_slots=16, group_size=2, chunk_steps=4, prefill_rows=8,
                  widths=slots.prefill_widths(4, 20), max_prompt_len=4)
  forced = rollout_workload.long_tail_lengths(np.random.default_rng(1), 160, median=3, sigma=0.9, max_len=16).tolist()
  real = rollout_workload.make_requests(np.random.default_rng(0), forced, group_size=2, prompt_len=4,
                                        vocab_size=64)
  engine.add(real)
  sim.add([SimRequest(r.sample_id, r.group_id, 4, r.forced_len) for r in real])
  plans = [dict(target_groups=6), "at_risk", dict(target_groups=20), "at_risk", dict()]
  for version, plan in enumerate(plans):
    if plan == "at_risk":   # every in-flight group that already has tokens, as StaleSync asks
      real_risk = sorted(g for g, v in engine.group_min_versions().items() if v is not None)
      sim_risk = sorted(g for g, v in sim.group_min_versions().items() if v is not None)
      assert real_risk == sim_risk and real_risk
      plan = dict(target_groups=1, finish_groups=real_risk)
    out = engine.run(params, version, **plan)
    taken, counts = sim.run(version, **plan)
    assert sorted(set(out.group_id_b.tolist())) == sorted({t.group_id for t in taken}), plan
    assert [int(n) for n in out.rollout.response_len_b] == [t.length for t in sorted(
        taken, key=lambda t: list(out.rollout.sample_id_b).index(t.sample_id))]
    for key in COUNTS:
      assert out.stats.get(key, 0) == getattr(counts, key), (plan, key)
  assert sim.num_in_flight == 0 and not sim.queue


def test_engine_replay_hand_case():
  # 2 slots, one group of 2 per prompt, refills of 1 row, chunks of 4; lengths 3, 1 | 2, 2.
  # Chunk 1 uploads the first 2 requests (one per slot): two refills fill both slots; after step 1
  # sample 1 is done, a refill is due but the upload is spent and 2 requests wait on the host: the chunk
  # ends. Chunk 2 uploads samples 2, 3: sample 2 takes the free slot; at step 2 samples 0 and 2 finish,
  # sample 3 takes a slot and needs 2 steps; the chunk's budget of 4 steps ends with it.
  # Total 5 steps, 2 chunks, 4 refills, no host prefill call, 3 + 1 + 2 + 2 = 8 tokens.
  sim = SimEngine(num_slots=2, group_size=2, chunk_steps=4, prefill_rows=1)
  sim.add([SimRequest(0, 0, 5, 3), SimRequest(1, 0, 5, 1), SimRequest(2, 1, 5, 2), SimRequest(3, 1, 5, 2)])
  taken, c = sim.run(0)
  assert (c.decode_steps, c.decode_chunks, c.refill_prefills, c.prefill_calls, c.generated_tokens) == (5, 2, 4, 0, 8)
  assert [t.sample_id for t in taken] == [1, 0, 2, 3]       # completion order
  # Context tokens read: chunk 1: samples 0, 1 at 5; chunk 2: sample 0 at 6, 7, sample 2 at 5, 6, sample 3
  # at 5, 6.
  assert c.kv_token_steps == 10 + 13 + 11 + 11


def test_forced_lengths_match_the_loop():
  from rl_fusion_jax import config as config_lib   # the loop's own draw
  from rl_fusion_jax.orchestration import phases
  import types
  cfg = types.SimpleNamespace(rollout=config_lib.RolloutConfig(max_new_tokens=64, forced_length_median=8,
                                                                 forced_length_sigma=0.8),
                              run=config_lib.RunConfig(seed=3))
  loop = phases.forced_lengths(cfg)
  w = Workload(4, 2, 5, 64, 8, 0.8, seed=3, forced=True)
  assert [w.length(i) for i in range(50)] == [loop(i) for i in range(50)]


def _costs(gen=1.0, train=0.5, other=0.25, rollout_other=0.0, push=0.0):
  # A phase costs `gen` s (constant), an update `train` s, whatever the counts.
  return Costs(GenCost(phase=gen), TrainCost(fixed=train), other_s=other, rollout_other_s=rollout_other,
               push_s=push)


def test_colocated_sync_step_is_the_sum_of_its_phases():
  w = Workload(2, 2, 3, 8, 4, 0.0)
  res = schedules.simulate(w, schedules.Schedule(), _costs(), 5)
  # Every step: generate 1 + train 0.5 + other 0.25 = 1.75 s; 4 samples of 3 + 4 tokens = 28 tokens.
  assert [r.train_end for r in res.steps] == pytest.approx([1.75, 3.5, 5.25, 7.0, 8.75])
  assert res.tokens_per_s(1) == pytest.approx(4 * 28 / 7.0)
  assert res.idle_frac(1) == {"all": pytest.approx(0.0)}


def test_separated_overlaps_only_under_staleness():
  w = Workload(2, 2, 3, 8, 4, 0.0)
  costs = _costs(gen=1.0, train=0.6, other=0.0, rollout_other=0.0, push=0.2)
  sync = schedules.simulate(w, schedules.Schedule(mode="separated"), costs, 6)
  # s = 0: batch k needs version k, ready 0.2 s after update k - 1: a period of 1 + 0.6 + 0.2 = 1.8 s.
  ends = [r.train_end for r in sync.steps]
  assert np.diff(ends) == pytest.approx([1.8] * 5)
  stale = schedules.simulate(w, schedules.Schedule(mode="separated", max_staleness=1), costs, 8)
  # s = 1: the rollout lane is the bottleneck (1.0 s per batch > 0.6 + 0.2): one update per second.
  assert np.diff([r.train_end for r in stale.steps])[-4:] == pytest.approx([1.0] * 4)
  # Window: end of update 3 (3.6 s) to end of update 8 (8.6 s). Batch k is generated in [k, k + 1], so
  # the rollout lane is busy until 8.0 (it has nothing left to generate after batch 7): idle 0.6 / 5.
  # The trainer's lane: update k in [k + 1, k + 1.6], then its push until k + 1.8 (busy, as the measured
  # timeline shows it): in the window the push of update 3, updates 4-7 with their pushes, update 8:
  # 0.2 + 4 x 0.8 + 0.6 = 4.0 s busy, idle 1.0 / 5.
  assert stale.idle_frac(3)["rollout"] == pytest.approx(0.12)
  assert stale.idle_frac(3)["train"] == pytest.approx(0.2)


def test_contention_slows_only_the_overlapped_phases():
  w = Workload(2, 2, 3, 8, 4, 0.0)
  slow = dataclasses.replace(_costs(gen=1.0, train=0.6, other=0.0, push=0.0), gen_contention=2.0,
                             train_contention=2.0)
  # s = 0: the sides never run at once, so contention changes nothing: period 1.6 s.
  sync = schedules.simulate(w, schedules.Schedule(mode="separated"), slow, 6)
  assert np.diff([r.train_end for r in sync.steps]) == pytest.approx([1.6] * 5)
  # s = 1 in the steady state both sides run at once; with everything at half speed while overlapped
  # the fixed point is a period between the alone one (1.0 s) and twice it.
  stale = schedules.simulate(w, schedules.Schedule(mode="separated", max_staleness=1), slow, 12)
  period = np.diff([r.train_end for r in stale.steps])[-5:-1]   # the last update runs alone
  assert np.all(period > 1.2) and np.all(period < 2.0)


def test_colocated_stalesync_reaches_the_bound_and_trains_every_prompt_once():
  w = Workload(4, 2, 3, 64, 8, 0.8, forced=True)
  res = schedules.simulate(w, schedules.Schedule(max_staleness=2, rollout_fraction=0.5, num_slots=8),
                           _costs(), 20)
  assert max(r.staleness_mean for r in res.steps) <= 2
  assert all(r.train_tokens > 0 for r in res.steps)


def test_fit_recovers_known_costs():
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(40):
    steps, chunks, calls, tokens = rng.integers(10, 60), rng.integers(1, 8), rng.integers(2, 12), rng.integers(900, 2000)
    rows.append({"generate_s": 0.05 + 0.004 * steps + 0.003 * chunks + 0.01 * calls,
                 "engine/decode_steps": steps, "engine/decode_chunks": chunks, "engine/prefill_calls": calls,
                 "train_s": 0.02 + 1e-4 * tokens, "train_tokens": tokens})
  g, t = fit.fit_gen(rows), fit.fit_train(rows)
  assert (g.phase, g.decode_steps, g.decode_chunks, g.prefill_calls) == pytest.approx((0.05, 0.004, 0.003, 0.01))
  assert (t.fixed, t.per_token) == pytest.approx((0.02, 1e-4))


def test_fit_lognormal_matches_mean_and_batch_max():
  median, sigma = fit_lognormal(3.2, 4.4, 128, 6)
  z = np.random.default_rng(7).standard_normal((200, 128))
  from rl_fusion_jax.sim.workload import lognormal_lengths
  x = lognormal_lengths(z, median, sigma, 6)
  assert abs(x.mean() - 3.2) < 0.1 and abs(x.max(1).mean() - 4.4) < 0.3


def test_fitted_simulation_within_15_percent_of_every_measured_run():
  # results/runs/: what the simulator reads of the runs behind RESULTS.md's Table 1 (both workloads,
  # the four variants, every repeat; written by experiments/report_main.py). Costs are fitted per
  # workload and deployment on those runs, then each run's configuration is simulated and compared.
  v = fit.validate_manifest(os.path.join(ROOT, "results", "runs", "ablation.json"))
  assert len(v["checks"]) >= 16
  assert {c["variant"] for c in v["checks"]} == {"separated_sync", "separated_stalesync", "colocated_sync",
                                                 "colocated_stalesync"}
  worst = max(v["checks"], key=lambda c: max(abs(c["step_error"]), abs(c["tokens_error"])))
  assert v["max_abs_error"] <= 0.15, worst
  # The engine replay is exact where the lengths are forced: the simulated decode steps are measured ones.
  for c in v["checks"]:
    if c["workload"] == "longtail":
      assert c["simulated_decode_steps"] == c["measured_decode_steps"], c
