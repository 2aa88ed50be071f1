"""The schedule simulator (rl_fusion_jax/sim): the engine replay against the real engine, schedules and
the cost fit against hand-computed cases, the measured-run validation, and that it imports no JAX."""
import dataclasses
import functools
import math
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
from rl_fusion_jax.sim.costs import Costs, GenCost, Sharing, TrainCost
from rl_fusion_jax.sim.engine import PhaseCounts, SimEngine, SimRequest
from rl_fusion_jax.sim.workload import Workload, fit_lognormal
from rl_fusion_jax.testing.tiny import tiny_model_config

CFG = tiny_model_config(qkv_bias=False)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTS = ("decode_steps", "decode_chunks", "prefill_calls", "refill_prefills", "prefill_rows", "reprefill_rows",
          "prefill_tokens", "generated_tokens")


@functools.lru_cache(maxsize=None)
def _setup(data: int = -1, tensor: int = 1):
  devices = jax.devices()[:data * tensor] if data > 0 else None
  mesh = make_mesh(MeshConfig(data=data, tensor=tensor), devices)
  shardings = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh, TRAIN_RULES)
  return mesh, shardings, jax.device_put(models.init_params(CFG, jax.random.key(0)), shardings)


def test_sim_imports_no_jax():
  code = ("import sys\nimport rl_fusion_jax.sim.cluster, rl_fusion_jax.sim.fit, rl_fusion_jax.sim.measure\n"
          "import rl_fusion_jax.sim.tables\n"
          "assert not [m for m in sys.modules if m == 'jax' or m.startswith('jax.')], 'jax imported'\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
  assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("group_size,data,tensor,unique_rows", [(2, 8, 1, 8), (4, 2, 2, 4)])
def test_engine_replay_counts_what_the_engine_does(group_size, data, tensor, unique_rows):
  # The real engine (16 slots, chunks of 4, prefill calls of 8 rows) and the replay get the same requests
  # and the same sequence of runs: a partial run with a group target, one that must also finish named
  # groups, and one that drains everything. Every count and every returned group must agree. Groups of 2
  # over 8 batch shards: a refill's forward runs on all 8 rows (ceil(7 / 2) + 1 = 5 distinct prompts at
  # most, rounded up to the shards); groups of 4 over 2 shards (a 2 x 2 mesh): on ceil(7 / 4) + 1 = 3 -> 4 rows, one per
  # distinct prompt, and a refill admits only the requests whose prompts fit.
  mesh, shardings, params = _setup(data, tensor)
  spec = GenerateSpec(CFG, SamplingParams(1.0), 4, 16, eos_id=0)
  engine = Engine(EngineConfig(spec, num_slots=16, chunk_steps=4, prefill_rows=8, group_size=group_size), mesh,
                  shardings)
  sim = SimEngine(num_slots=16, group_size=group_size, chunk_steps=4, prefill_rows=8, batch_shards=data,
                  widths=slots.prefill_widths(4, 20), max_prompt_len=4)
  assert engine.programs.unique_rows == sim.unique_rows == unique_rows
  forced = rollout_workload.long_tail_lengths(np.random.default_rng(1), 160, median=3, sigma=0.9, max_len=16).tolist()
  real = rollout_workload.make_requests(np.random.default_rng(0), forced, group_size=group_size, prompt_len=4,
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


def test_processor_sharing_hand_cases():
  # 2 cores; generation 1 thread, update 2, push 1. Generation beside the update: 3 threads on 2 cores, each
  # gets 2/3 of a core: generation at 2/3 of its speed, the update at (2 x 2/3) / 2 = 2/3. Generation
  # beside the push: 2 threads, 2 cores, no slowdown. All three: 4 threads, every activity at 1/2.
  share = Sharing(cores=2, gen_threads=1, train_threads=2, push_threads=1)
  assert share.rate(1, 2) == pytest.approx(2 / 3) and share.rate(2, 1) == pytest.approx(2 / 3)
  assert share.rate(1, 1) == 1.0 and share.rate(1, 3) == pytest.approx(0.5) and share.rate(2, 2) == pytest.approx(0.5)
  assert Sharing(cores=0).rate(1, 5) == 1.0
  # One second of generation work from t = 0 while the update runs in [0, 0.5): 1/3 s of work done by 0.5,
  # the remaining 2/3 s alone: it ends at 0.5 + 2/3. And the work done in that span is the second again.
  others = [(0.0, 0.5, 2.0)]
  assert share.finish(0.0, 1.0, 1, others) == pytest.approx(0.5 + 2 / 3)
  assert share.work((0.0, 0.5 + 2 / 3), 1, others) == pytest.approx(1.0)
  # A phase that starts after the others ended runs alone.
  assert share.finish(1.0, 0.25, 1, others) == pytest.approx(1.25)


def test_sharing_slows_only_the_overlapped_phases():
  w = Workload(2, 2, 3, 8, 4, 0.0)
  one_core = dataclasses.replace(_costs(gen=1.0, train=0.6, other=0.0, push=0.0),
                                 sharing=Sharing(cores=1, gen_threads=1, train_threads=1, push_threads=1))
  # s = 0: the sides never run at once, so sharing changes nothing: period 1 + 0.6 = 1.6 s.
  sync = schedules.simulate(w, schedules.Schedule(mode="separated"), one_core, 6)
  assert np.diff([r.train_end for r in sync.steps]) == pytest.approx([1.6] * 5)
  # s = 1, steady state: batch k and update k - 1 start together on one core, each at half speed; the
  # update's 0.6 s of work ends after 1.2 s, by when generation did 0.6 of its 1.0 s; the rest alone:
  # a period of 1.2 + 0.4 = 1.6 s (the rollout side is the bottleneck).
  stale = schedules.simulate(w, schedules.Schedule(mode="separated", max_staleness=1), one_core, 12)
  assert np.diff([r.train_end for r in stale.steps])[-5:-1] == pytest.approx([1.6] * 4, rel=1e-3)
  # Two cores and one thread each: nothing to share, the period of dedicated devices (1.0 s).
  two = dataclasses.replace(one_core, sharing=Sharing(cores=2, gen_threads=1, train_threads=1, push_threads=1))
  stale = schedules.simulate(w, schedules.Schedule(mode="separated", max_staleness=1), two, 12)
  assert np.diff([r.train_end for r in stale.steps])[-5:-1] == pytest.approx([1.0] * 4)


def test_colocated_stalesync_reaches_the_bound_and_trains_every_prompt_once():
  w = Workload(4, 2, 3, 64, 8, 0.8, forced=True)
  res = schedules.simulate(w, schedules.Schedule(max_staleness=2, train_fraction=0.5, num_slots=8),
                           _costs(), 20)
  assert max(r.staleness_mean for r in res.steps) <= 2
  assert all(r.train_tokens > 0 for r in res.steps)


def test_fit_recovers_known_costs():
  # Host calls (chunks and host prefill calls) share one cost (fit.GEN_TERMS).
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(40):
    steps, chunks, calls, tokens = rng.integers(10, 60), rng.integers(1, 8), rng.integers(2, 12), rng.integers(900, 2000)
    rows.append({"generate_s": 0.05 + 0.004 * steps + 0.003 * (chunks + calls),
                 "engine/decode_steps": steps, "engine/decode_chunks": chunks, "engine/prefill_calls": calls,
                 "train_s": 0.02 + 1e-4 * tokens, "train_tokens": tokens})
  g, t = fit.fit_gen(rows), fit.fit_train(rows)
  assert (g.phase, g.decode_steps, g.decode_chunks, g.prefill_calls) == pytest.approx((0.05, 0.004, 0.003, 0.003))
  assert (t.fixed, t.per_token) == pytest.approx((0.02, 1e-4))
  # Synchronous rows make no prefill call: the fit still prices the calls StaleSync makes (at a chunk's cost).
  sync = [m | {"engine/prefill_calls": 0, "generate_s": m["generate_s"] - 0.003 * m["engine/prefill_calls"]}
          for m in rows]
  g = fit.fit_gen(sync)
  assert (g.decode_chunks, g.prefill_calls) == pytest.approx((0.003, 0.003))


def _chunk_rows(a, b, c, phase, chunks_per_phase, rng):
  """Rows of phases made of chunks (steps, refills), each chunk a + b x steps + c x refills seconds."""
  rows = []
  for chunks in chunks_per_phase:
    m = {"engine/decode_chunks": len(chunks), "engine/prefill_calls": 0, "train_s": 0.1, "train_tokens": 1000,
         **{f"engine/{k}": 0.0 for k in fit.CHUNK_MOMENTS}}
    m["engine/decode_steps"] = sum(n for n, _ in chunks)
    m["engine/refill_prefills"] = sum(r for _, r in chunks)
    for n, r in chunks:
      s = a + b * n + c * r + rng.normal(0, 1e-5)
      for key, v in zip(fit.CHUNK_MOMENTS, (s, s * n, s * r, n * n, n * r, r * r)):
        m[f"engine/{key}"] += v
    m["generate_s"] = phase + m["engine/chunk_s"]
    rows.append(m)
  return rows


def test_fit_from_chunk_sums_separates_chunk_and_step_costs_when_every_phase_has_the_same_counts():
  rng = np.random.default_rng(1)
  a, b, c, phase = 0.02, 0.008, 0.01, 0.04
  # A synchronous long tail: every phase the same three chunks (16, 16 and 7 steps; 4 refills in the first).
  sync = _chunk_rows(a, b, c, phase, [[(16, 4), (16, 0), (7, 0)]] * 8, rng)
  g = fit.fit_gen(sync)
  assert (g.decode_steps, g.refill_prefills) == pytest.approx((b, c), rel=0.02)
  # The same host calls in every phase: the chunk intercept cannot be told from the phase's, so it joins it;
  # the phase then costs what it measured.
  assert (g.decode_chunks, g.prefill_calls) == (0.0, 0.0) and g.phase == pytest.approx(phase + 3 * a, rel=0.02)
  short = PhaseCounts(decode_steps=12, decode_chunks=2, refill_prefills=4)
  assert g.seconds(PhaseCounts(decode_steps=39, decode_chunks=3, refill_prefills=4)) == pytest.approx(
      phase + 3 * a + 39 * b + 4 * c, rel=1e-3)
  # Phases of 2 or 3 chunks: the intercept is a chunk's, and a shorter phase is priced by its own counts.
  mixed = _chunk_rows(a, b, c, phase, [[(16, 4), (16, 0), (7, 0)], [(9, 4), (3, 0)]] * 4, rng)
  g = fit.fit_gen(mixed)
  assert (g.phase, g.decode_chunks, g.decode_steps, g.refill_prefills) == pytest.approx((phase, a, b, c), rel=0.02)
  assert g.seconds(short) == pytest.approx(phase + 2 * a + 12 * b + 4 * c, rel=1e-3)
  # Without the chunk sums the phase-level fit cannot split the synchronous phases' constant counts.
  old = [{k: v for k, v in m.items() if not k.startswith("engine/chunk")} for m in sync]
  g = fit.fit_gen(old)
  assert (g.decode_steps, g.decode_chunks) == (0.0, 0.0)


def test_fit_names_the_engines_chunk_sums():
  from rl_fusion_jax.rollout import engine  # pylint: disable=g-import-not-at-top
  assert fit.CHUNK_MOMENTS == engine.CHUNK_MOMENTS


def test_sharing_threads_from_slowdown_inverts_the_rate():
  s = Sharing(cores=2)
  for threads in (1.35, 1.7, 2.0):
    assert s.threads_from_slowdown(1 / s.rate(threads, 1), 1) == pytest.approx(threads)
    assert s.threads_from_slowdown(1 / s.rate(threads, 2), 2) == pytest.approx(threads)
  assert s.threads_from_slowdown(1.0, 1) == 0.0       # not slowed: any count up to cores - others
  assert s.threads_from_slowdown(2.1, 1) == 2.0       # more than sharing explains (2 threads, 1 other: 1.5x)


def test_fit_lognormal_matches_mean_and_batch_max():
  median, sigma = fit_lognormal(3.2, 4.4, 128, 6)
  z = np.random.default_rng(7).standard_normal((200, 128))
  from rl_fusion_jax.sim.workload import lognormal_lengths
  x = lognormal_lengths(z, median, sigma, 6)
  assert abs(x.mean() - 3.2) < 0.1 and abs(x.max(1).mean() - 4.4) < 0.3


RUNS = os.path.join(ROOT, "results", "runs", "ablation.json")


@functools.lru_cache(maxsize=None)
def _validation():
  return fit.validate_manifest(RUNS)


@functools.lru_cache(maxsize=None)
def _runs():
  return {(w, v, i): run for w, runs in fit.load_manifest(RUNS).items() for v, i, run in runs}


def _phase_seconds(workload, variant, repeat):
  """The run's counts per update (decode steps, trained tokens) and its generate + update seconds."""
  run = _runs()[(workload, variant, repeat)]
  counts = [(m["engine/decode_steps"], m["train_tokens"]) for m in run.rows]
  return counts, sum(m["generate_s"] + m["train_s"] for m in run.rows)


# The runs a prediction misses by more than 15% (RESULTS.md lists them), each held to the figure RESULTS.md
# reports, rounded up. Arithmetic, colocated sync, repeat 0: its three repeats took 0.100, 0.135 and 0.116 s
# a step (every step of repeat 1 slower alike): one value within 15% of all three would have to lie in
# 0.1145-0.1155 s (14.6% from both extremes at best), and the prediction is 0.119 s; in sample the model
# misses it by 17.7% too.
HELD_OUT_MISSES = {("arithmetic", "colocated_sync", 0): 0.19}
IN_SAMPLE_MISSES = {("arithmetic", "colocated_sync", 0): 0.18}


def test_repeats_floor_is_the_best_any_one_value_can_do():
  # Brute force over candidate values: the smallest largest relative error against the runs.
  for measured in ([0.1004, 0.1347, 0.1164], [0.3, 0.3, 0.3], [1.0, 2.0], [0.2, 0.25, 0.21, 0.4]):
    grid, m = np.linspace(min(measured), max(measured), 200001), np.array(measured)
    best = np.max(np.abs(grid[:, None] - m[None, :]) / m[None, :], axis=1).min()
    assert fit.spread_floor(measured) == pytest.approx(best, abs=1e-5)
  assert fit.spread_floor([1.0, 2.0]) == pytest.approx(1 / 3)     # p = 4/3: +1/3 and -1/3
  # The committed runs: arithmetic colocated sync's repeats allow no value closer than 14.6% to all three.
  rows = {(w["workload"], w["mode"], w["predicted"]): w for w in fit.worst_held_out(_validation())}
  assert rows[("arithmetic", "colocated", "sync")]["repeat_floor"] == pytest.approx(0.146, abs=0.001)


def test_held_out_predictions_within_15_percent_of_every_measured_run_but_the_named():
  # results/runs/: what the simulator reads of the runs behind RESULTS.md's Table 1 (both workloads, the
  # four variants, 3 repeats each). Per workload and deployment, costs fitted on the synchronous runs only
  # predict the StaleSync runs, and the reverse; the step time (mean time between update ends) of every
  # run must be within 15%, but for the named misses, held to the figures RESULTS.md reports.
  v = _validation()
  assert len(v["checks"]) == 24 and all(c["held_out"] for c in v["checks"])
  assert {(c["mode"], c["schedule"], c["fitted_on"]) for c in v["checks"]} == {
      (m, s, o) for m in ("colocated", "separated") for s, o in (("sync", "stalesync"), ("stalesync", "sync"))}
  for c in v["checks"]:
    limit = HELD_OUT_MISSES.get((c["workload"], c["variant"], c["repeat"]), 0.15)
    assert abs(c["held_out"]["step_error"]) <= limit, c
  # The misses are not different work: every repeat of a long-tail variant made the same counts.
  for variant in ("colocated_sync", "separated_sync", "separated_stalesync"):
    counts = [_phase_seconds("longtail", variant, r)[0] for r in (0, 1, 2)]
    assert counts[0] == counts[1] == counts[2], variant
  # The engine replay is exact where the lengths are forced: the simulated decode steps are measured ones.
  for c in v["checks"]:
    if c["workload"] == "longtail":
      assert c["in_sample"]["simulated_decode_steps"] == c["measured_decode_steps"], c


# Paired by repeat (costs fitted on the other schedule's run of the same repeat only): the one run beyond
# 15% on the committed runs, held to the figure RESULTS.md reports, rounded up.
PAIRED_MISSES = {("longtail", "separated_stalesync", 0): 0.16}


def test_paired_held_out_fits_only_the_same_repeat_and_predicts_the_committed_runs(monkeypatch):
  v = _validation()
  assert all(c["held_out_paired"] for c in v["checks"])
  for c in v["checks"]:
    limit = PAIRED_MISSES.get((c["workload"], c["variant"], c["repeat"]), 0.15)
    assert abs(c["held_out_paired"]["step_error"]) <= limit, c
  # Slow down every other repeat's update threefold: the pooled held-out predictions of repeat 0 move,
  # its paired predictions do not (they never see another repeat), and neither does anything measured.
  slowed = {w: [(var, i, run if i == 0 else dataclasses.replace(
                run, rows=[{**m, "train_s": 3 * m["train_s"]} for m in run.rows])) for var, i, run in runs]
            for w, runs in fit.load_manifest(RUNS).items()}
  monkeypatch.setattr(fit, "load_manifest", lambda path: slowed)
  after = fit.validate_manifest(RUNS)
  for a, b in zip(v["checks"], after["checks"]):
    assert (a["workload"], a["variant"], a["repeat"]) == (b["workload"], b["variant"], b["repeat"])
    if a["repeat"] == 0:
      assert b["held_out_paired"] == a["held_out_paired"], a
      assert b["measured_step_s"] == a["measured_step_s"]
  moved = [a for a, b in zip(v["checks"], after["checks"])
           if a["repeat"] == 0 and b["held_out"]["simulated_step_s"] != a["held_out"]["simulated_step_s"]]
  assert len(moved) == 8, len(moved)


def test_in_sample_fit_describes_every_measured_run():
  # In-sample (fitted on all runs of the workload and deployment, this one included): labelled as such in
  # RESULTS.md; beyond 15% only the named runs.
  for c in _validation()["checks"]:
    limit = IN_SAMPLE_MISSES.get((c["workload"], c["variant"], c["repeat"]), 0.15)
    assert abs(c["in_sample"]["step_error"]) <= limit, c


def test_synchronous_separated_runs_never_share_the_cores():
  # The reason a processor-sharing model is needed and cannot be fitted on synchronous runs: in them every
  # generate, update and push phase ran alone (share of its work alone = 1), in the StaleSync runs not.
  for variant, alone in (("separated_sync", True), ("separated_stalesync", False)):
    run = _runs()[("longtail", variant, 0)]
    shares = fit.alone_shares(run, fit.MEASURED_MACHINE)
    measured = [shares[a][m["step"] - 1] for a in ("gen", "train") for m in run.rows]
    if alone:
      assert measured == pytest.approx([1.0] * len(measured)), measured
    else:
      assert np.median(measured) < 0.9, measured


# ------------------------------------------------------------------------------------------- cluster model


def test_expected_longest_against_closed_form_and_monte_carlo():
  from rl_fusion_jax.sim.workload import expected_longest, lognormal_lengths
  # n = 1: the clipped log-normal's mean, E[min(X, cap)] = m e^(s^2/2) Phi((ln(cap/m) - s^2) / s)
  # + cap (1 - Phi(ln(cap/m) / s)) (rounding to integers moves it by far less than the tolerance).
  m, s, cap = 2048.0, 0.9, 16384
  phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
  mean = m * math.exp(s * s / 2) * phi((math.log(cap / m) - s * s) / s) + cap * (1 - phi(math.log(cap / m) / s))
  assert expected_longest(m, s, cap, 1) == pytest.approx(mean, rel=1e-3)
  # sigma = 0: every draw is the median; a cap that ~1% of draws reach: the longest of 8192 is the cap.
  assert expected_longest(100, 0.0, 1000, 50) == 100
  assert expected_longest(m, s, cap, 8192) == pytest.approx(cap, rel=1e-6)
  # Uncapped tail: against 4,000 batches of n draws each (standard error ~0.3%).
  z = np.random.default_rng(0).standard_normal((4000, 256))
  for n in (16, 256):
    mc = lognormal_lengths(z[:, :n], 300, 0.5, 1 << 20).max(1)
    assert abs(expected_longest(300, 0.5, 1 << 20, n) - mc.mean()) < 3 * mc.std() / math.sqrt(len(mc))
  # More draws, a longer expected tail.
  assert expected_longest(300, 0.5, 1 << 20, 1024) > expected_longest(300, 0.5, 1 << 20, 256)


def test_sync_phase_ends_with_the_longest_sample():
  # The premise of the tail barrier: with a slot for every sample, a synchronous phase takes as many decode
  # steps as the batch's longest sample; over many steps their mean is the expected longest.
  from rl_fusion_jax.sim.workload import expected_longest
  w = Workload(16, 4, 8, 1 << 20, 30, 0.5, seed=1)
  res = schedules.simulate(w, schedules.Schedule(num_slots=64, chunk_steps=1000), _costs(), 400)
  steps = np.array([r.counts.decode_steps for r in res.steps], float)
  assert abs(steps.mean() - expected_longest(30, 0.5, 1 << 20, 64)) < 3 * steps.std() / math.sqrt(len(steps))


def test_cluster_terms_by_hand():
  from rl_fusion_jax.sim import cluster
  c = cluster.Cluster(work=cluster.WorkloadInputs(sigma=0.0))   # every response 2,048 tokens
  # One near-empty decode step: 65.6e9 / 8 bytes at 0.7 x 3.35e12 B/s + 2 ms + a 1 ms chunk over 64 steps.
  tail = 65.6e9 / 8 / (0.7 * 3.35e12) + 2e-3 + 1e-3 / 64
  assert cluster.tail_step_s(c) == pytest.approx(tail)
  # No tail to grow without spread; with it, (E[longest of 4 x 8192] - E[longest of 8192]) near-empty steps.
  assert cluster.barrier_s(c, 4, 0) == 0.0
  u = cluster.Cluster(work=cluster.WorkloadInputs(sigma=0.4))
  from rl_fusion_jax.sim.workload import expected_longest
  extra = expected_longest(2048, 0.4, 16384, 4 * 8192) - expected_longest(2048, 0.4, 16384, 8192)
  assert extra > 1000
  assert cluster.barrier_s(u, 4, 0) == pytest.approx(extra * tail)
  assert cluster.barrier_s(u, 4, 1) == pytest.approx(extra * tail / 2)
  # DistQueue: 16 bytes per token of 512 + 2,048 (packed) or 512 + 16,384 (padded) tokens; 8,192 samples per
  # supernode served by 384 links, once (one read per group) or 8 times (every device of a group); on 4
  # supernodes 3/4 of it to other supernodes at 0.7 x 50e9 B/s, 1/4 inside at 0.7 x 450e9 B/s.
  q = cluster.queue_traffic(c, 4)
  assert q["bytes_per_sample"] == 16 * (512 + 2048)
  assert q["bytes_per_device"] == pytest.approx(8192 * 40960 / 384)
  assert q["seconds"] == pytest.approx(8192 * 40960 / 384 * (0.75 / 35e9 + 0.25 / 315e9))
  padded = dataclasses.replace(c, scaling=dataclasses.replace(c.scaling, packed=False, hierarchical=False))
  assert cluster.queue_traffic(padded, 4)["bytes_per_device"] == pytest.approx(8192 * 16 * 16896 * 8 / 384)
  # Weight publication: 50 ms on more than one supernode (hybrid sharding); FSDP over every device adds
  # 3/4 of a replica device's 8.2 GB shard over 35e9 B/s.
  assert (cluster.publish_s(c, 1), cluster.publish_s(c, 4)) == (0.0, pytest.approx(0.05))
  fsdp = dataclasses.replace(c, scaling=dataclasses.replace(c.scaling, fsdp_across_nodes=True))
  assert cluster.publish_s(fsdp, 4) == pytest.approx(0.05 + 8.2e9 * 0.75 / 35e9)
  # All-reduce: each device's fp32 gradient shard (4 x 32.8e9 / 384 bytes), ring over 4 supernodes.
  assert cluster.allreduce_s(c, 4) == pytest.approx(2 * 0.75 * 4 * 32.8e9 / 384 / 35e9)
  # Stragglers: 1 + 0.5 x P(one of 1,536 devices is slow), p = 1e-3.
  slow = dataclasses.replace(c, scaling=dataclasses.replace(c.scaling, straggler_prob=1e-3))
  assert cluster.straggler_factor(slow, 4) == pytest.approx(1 + 0.5 * (1 - 0.999 ** 1536))
  assert cluster.straggler_factor(c, 4) == 1.0
  # The step on 4 supernodes: the one-supernode step plus what grows, times the straggler factor.
  s = cluster.scaled(slow, 100.0, 1e6, 0, 4)
  grown = 100.0 + 0.05 + cluster.allreduce_s(c, 4) + q["seconds"]
  assert s.step_s == pytest.approx(grown * (1 + 0.5 * (1 - 0.999 ** 1536)))
  assert s.tokens_per_s == pytest.approx(4e6 / s.step_s)


def test_every_cluster_input_names_its_source():
  from rl_fusion_jax.sim import cluster
  rows = cluster.input_table()
  assert len(rows) >= 35 and {r[0] for r in rows} >= {"ScalingInputs.straggler_prob", "ScalingInputs.packed",
                                                       "WorkloadInputs.sigma", "Cluster.tp"}
  for name, _, source in rows:
    assert source.split(":")[0].split(" ")[0] in cluster.LABELS, (name, source)
