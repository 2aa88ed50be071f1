"""StaleSync end to end on 8 devices: s = 0 is the synchronous loop, s > 0 is reproducible and bounded,
nothing is lost, and a crash mid-run resumes with the queue and in-flight samples intact."""
import pytest

from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.errors import ConfigError
from rl_fusion_jax.orchestration import loop, stalesync
from rl_fusion_jax.testing.experiments import tiny
from rl_fusion_jax.testing.tiny import save_tiny_reward_model

KEYS = ("reward", "loss", "grad_norm", "entropy", "response_len_mean", "accuracy", "kl_seq")


def rows(workdir):
  return [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]


def assert_equal_rows(a, b, keys=KEYS):
  assert len(a) == len(b) and len(a) > 0
  for ra, rb in zip(a, b):
    assert ra["step"] == rb["step"]
    for key in keys:
      if key in ra or key in rb:
        assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])


def stale(s, f, **over):
  # A warm-up long enough that responses end at different lengths (EOS), so groups finish apart.
  base = {"stalesync.enabled": True, "stalesync.max_staleness": s, "stalesync.train_fraction": f,
          "run.steps": 5, "rollout.max_new_tokens": 6, "model.max_position_embeddings": 32,
          "warmup.steps": 40, "warmup.learning_rate": 3e-3}
  if f < 1:    # slots for the whole pool, so the groups left in flight have generated tokens
    base["rollout.num_slots"] = 16
  return tiny(**{**base, **over})


@pytest.mark.parametrize("mode", ["colocated", "separated", "hybrid", "hybrid_packed", "hybrid_rm"])
def test_staleness_zero_is_the_synchronous_loop(tmp_path, mode):
  # hybrid: the reference's log-probs (and a reward model's scores, hybrid_rm) reach the update through
  # the queue's ref_logp (rm_score) field, fetched from the aux devices after the rollout phase, not from
  # the aux stage's buffers as in the synchronous loop; the advantages are the queue's too.
  over = {"fusion.mode": mode.split("_")[0], "algo.kl_coef": 0.05, "run.steps": 2, "rollout.max_new_tokens": 6,
          "model.max_position_embeddings": 32, "optim.pack_rows": mode.endswith("packed")}
  if mode.startswith("hybrid"):
    over["fusion.aux_devices"] = 4     # the actor on 4 devices, the reference on the other 4
  if mode.endswith("rm"):
    save_tiny_reward_model(str(tmp_path / "rm"))
    over |= {"task.reward_model": str(tmp_path / "rm"), "task.reward_model_weight": 0.5}
  sync, s0 = str(tmp_path / "sync"), str(tmp_path / "s0")
  summary_sync = loop.run(tiny(**over), sync)
  summary_s0 = loop.run(tiny(**{**over, "stalesync.enabled": True}), s0)
  assert_equal_rows(rows(sync), rows(s0))
  assert summary_sync["accuracy_after"] == summary_s0["accuracy_after"]
  assert all(r["stalesync/staleness_max"] == 0 for r in rows(s0))
  # Advantages from the queue's advantage field (separated: written by the trainer's advantage stage).
  if mode != "separated":
    assert all(r["stalesync/advantage_groups"] == 4 for r in rows(s0))
  if mode.startswith("hybrid"):
    assert rows(s0)[-1]["kl_seq"] > 0          # the reference differs from the policy: the check can fail
    assert all(r["queue/link_bytes/aux_to_host"] > 0 for r in rows(s0))
    # The aux devices scored the samples as they finished, inside each step's generate phase, and the
    # fetch into the queue came after it.
    from rl_fusion_jax.timeline import load_timeline, timeline_path  # pylint: disable=g-import-not-at-top
    data = load_timeline(timeline_path(s0))
    for step in (0, 1):
      gen = next(i for i in data.intervals if i.name == "generate" and i.step == step)
      scored = [i for i in data.intervals if i.name == "reference" and i.step == step]
      fetch = next(i for i in data.intervals if i.name == "aux_fetch" and i.step == step)
      assert scored and {i.group for i in scored} == {"aux"} and any(i.start < gen.end for i in scored)
      assert fetch.group == "aux" and fetch.start >= gen.end
  if mode.endswith("rm"):
    assert all(r["reward_model_score"] != 0 for r in rows(s0))
    assert rows(s0)[0]["reward_model_score"] == rows(sync)[0]["reward_model_score"]


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("stale") / "run")
  loop.run(stale(1, 0.5), workdir)
  return workdir


def test_bounded_staleness_is_reproducible_and_within_the_bound(tmp_path, stale_run):
  again = str(tmp_path / "again")
  loop.run(stale(1, 0.5), again)
  a, b = rows(stale_run), rows(again)
  assert_equal_rows(a, b, KEYS + ("stalesync/staleness_mean", "stalesync/held_back", "data_position"))
  assert all(r["stalesync/staleness_max"] <= 1 for r in a)
  assert max(r["stalesync/staleness_max"] for r in a) == 1      # tokens of an older policy were trained on
  assert any(r["stalesync/trained_token_staleness_mean"] > 0 for r in a)


def test_every_generated_group_is_trained_waiting_or_counted(stale_run):
  last = rows(stale_run)[-1]
  waiting_groups = last["stalesync/waiting_samples_after"] / 2         # group_size 2
  assert last["stalesync/trained_groups_total"] == 5 * 4
  assert last["stalesync/generated_groups_total"] == (
      last["stalesync/trained_groups_total"] + last["stalesync/discarded_groups_total"] + waiting_groups)


def test_a_sample_is_ready_for_the_trainer_once_the_reward_stage_scored_it():
  import types  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.queue.distqueue import Packed  # pylint: disable=g-import-not-at-top
  queue = stalesync.make_queue(types.SimpleNamespace(cfg=stale(1, 0.5)), stalesync.SCORE_FIELDS)
  n = np.array([3, 2])
  queue.put(np.array([4, 5]), tokens=Packed(np.arange(5, dtype=np.int32), n),
            logp=Packed(np.zeros(5, np.float32), n), version=Packed(np.zeros(5, np.int32), n),
            prompt_len=[2, 1], response_len=[1, 1], finished=[True, True], sample_id=[4, 5], group_id=[2, 2],
            min_version=[0, 0])
  assert queue.ready(stalesync.CONSUMER).tolist() == []           # generated, not scored yet
  for name, values in (("reward", [1.1, 0.1]), ("format_ok", [True, True]), ("correct", [True, False])):
    queue.write(name, [4, 5], values)
  assert queue.ready(stalesync.CONSUMER).tolist() == [4, 5]
  batch = queue.read(stalesync.CONSUMER, [4, 5])
  assert batch["reward"].tolist() == pytest.approx([1.1, 0.1]) and batch["correct"].tolist() == [True, False]


def test_waiting_samples_hold_the_verifiers_scores(monkeypatch, tmp_path):
  # The reward stage writes each finished group's scores into the queue; those of the samples still
  # waiting at the end of a run are the verifier's scores of their decoded responses.
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.orchestration import data  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.rewards.base import score_batch  # pylint: disable=g-import-not-at-top
  seen, real = [], stalesync.StaleSync.step

  def spy(self, *args):
    seen.append(self)
    return real(self, *args)

  monkeypatch.setattr(stalesync.StaleSync, "step", spy)
  loop.run(stale(1, 0.5, **{"run.steps": 2}), str(tmp_path / "run"))
  schedule = seen[-1]
  waiting = schedule.queue.ready(stalesync.CONSUMER)
  assert len(waiting) > 0
  got = schedule.queue.peek(waiting, ("reward", "format_ok", "correct", "group_id"))
  batch = schedule.queue.read(stalesync.CONSUMER, waiting)
  rollout = stalesync.host_rollout([batch], 32)
  texts = data.decode_responses(schedule.setup.tokenizer, rollout.tokens_bt, rollout.prompt_len_b,
                                rollout.response_len_b)
  want = score_batch(schedule.setup.train_task, [schedule.setup.train_task.problem(int(g)) for g in got["group_id"]],
                     texts)
  assert len(set(np.asarray(want[0]).tolist())) > 1      # scores that differ: a sample mix-up would show
  np.testing.assert_allclose(got["reward"], want[0])
  assert got["format_ok"].tolist() == list(want[1]) and got["correct"].tolist() == list(want[2])


class Crash(Exception):
  pass


@pytest.mark.parametrize("mode", ["colocated", "hybrid"])
def test_crash_mid_run_resumes_the_queue_and_in_flight_samples(tmp_path, monkeypatch, stale_run, mode):
  # hybrid: the checkpointed queue also holds the waiting samples' reference log-probs (ref_logp), fetched
  # from the aux stage before the crash; the resumed run trains on them as the uninterrupted one does.
  workdir = str(tmp_path / "run")
  real = stalesync.StaleSync.step
  over = {"fusion.mode": "hybrid", "fusion.aux_devices": 4, "algo.kl_coef": 0.05} if mode == "hybrid" else {}
  uninterrupted = stale_run
  if mode == "hybrid":
    uninterrupted = str(tmp_path / "uninterrupted")
    loop.run(stale(1, 0.5, **over), uninterrupted)

  def crashing(self, state, ref, step, timeline):
    if step == 3:
      raise Crash()
    return real(self, state, ref, step, timeline)

  resumed = []

  def recording(self, state, ref, step, timeline):
    if not resumed:     # the queue as the checkpoint after step 2 restored it
      resumed.append(len(self.queue.ready(stalesync.CONSUMER)))
    return real(self, state, ref, step, timeline)

  cfg = stale(1, 0.5, **{"run.checkpoint_every": 2, **over})
  monkeypatch.setattr(stalesync.StaleSync, "step", crashing)
  with pytest.raises(Crash):
    loop.run(cfg, workdir)
  monkeypatch.setattr(stalesync.StaleSync, "step", recording)
  loop.run(cfg, workdir)
  # Waiting samples came back from the checkpoint, ready for the trainer: every field it needs (hybrid:
  # ref_logp too) restored.
  assert resumed[0] > 0
  assert [r["step"] for r in rows(workdir)] == [1, 2, 3, 4, 5]
  assert_equal_rows(rows(workdir), rows(uninterrupted),
                    KEYS + ("stalesync/staleness_mean", "stalesync/generated_groups_total", "data_position"))


@pytest.mark.parametrize("over,match", [
    ({"stalesync.max_staleness": -1}, "config.stalesync.max_staleness"),
    ({"stalesync.train_fraction": 0.0}, "config.stalesync.train_fraction"),
    ({"stalesync.train_fraction": 1.5}, "config.stalesync.train_fraction"),
    ({"stalesync.max_staleness": 0, "stalesync.train_fraction": 0.5}, "must be 1 when max_staleness is 0"),
])
def test_bad_stalesync_config_is_named(over, match):
  with pytest.raises(ConfigError, match=match):
    tiny(**over)


ENGINE_COUNTS = ("decode_steps", "decode_chunks", "prefill_calls", "refill_prefills", "prefill_rows", "reprefill_rows")


def test_engine_counts_per_update_are_the_replays_and_stalesync_takes_few_chunks(tmp_path):
  # Forced long-tail lengths (EOS ignored), so every decision is known up front: the engine's counts of
  # every update, synchronous and StaleSync, must be those of the simulator's replay of the same schedule
  # (rl_fusion_jax/sim, no JAX: an implementation of its own), and StaleSync, whose refills and target
  # test run on the device, takes at most 2 chunks more per update than the synchronous loop.
  from rl_fusion_jax.sim import schedules
  from rl_fusion_jax.sim.costs import Costs, GenCost, TrainCost
  from rl_fusion_jax.sim.workload import Workload
  over = {"rollout.forced_length_median": 3, "rollout.forced_length_sigma": 1.0, "rollout.max_new_tokens": 12,
          "model.max_position_embeddings": 32, "rollout.num_slots": 16, "rollout.prefill_rows": 8,
          "rollout.chunk_steps": 4, "warmup.steps": 0, "run.steps": 6, "run.checkpoint_every": 0}
  runs = {}
  for s, f in ((0, 1.0), (1, 0.5)):
    cfg = tiny(**over, **({"stalesync.enabled": True, "stalesync.max_staleness": s,
                           "stalesync.train_fraction": f} if s else {}))
    workdir = str(tmp_path / f"s{s}")
    loop.run(cfg, workdir)
    r = cfg.rollout
    w = Workload(r.num_prompts, r.group_size, r.max_prompt_len, r.max_new_tokens, r.forced_length_median,
                 r.forced_length_sigma, seed=cfg.run.seed, forced=True)
    sim = schedules.simulate(w, schedules.Schedule(max_staleness=s, train_fraction=f, num_slots=16,
                                                    chunk_steps=4, prefill_rows=8),
                             Costs(GenCost(), TrainCost()), cfg.run.steps)
    measured = rows(workdir)
    assert len(measured) == len(sim.steps) == cfg.run.steps
    for row, record in zip(measured, sim.steps):
      for key in ENGINE_COUNTS:
        assert row.get(f"engine/{key}", 0) == getattr(record.counts, key), (s, row["step"], key)
    runs[s] = [row.get("engine/decode_chunks", 0) for row in measured]
  assert sum(runs[1]) and max(runs[1]) <= max(runs[0]) + 2, runs
