"""The main binary as 2 local processes x 2 CPU devices (jax.distributed on 127.0.0.1), end to end.

Each run is compared with the same config as 1 process x 4 devices joined to its own coordinator
(``--num_processes=1``): the same runtime and collectives (gloo). Over these short runs every metric but
the timings is equal, bit for bit: the processes compute the same thing and exchange what they must. The
two do not sum every reduction in the same order (the full main job's warm-up first differed at step 64
of 2,500), so longer runs drift apart; these tests are sized well inside that. (A plain one-process run
uses XLA's in-process collectives: float rounding apart from the first update, then sampling apart.)

Marked ``multihost`` (README's test command runs this suite after the default one).
"""
import fcntl
import json
import os
import re
import shutil
import signal
import time

import pytest

from rl_fusion_jax.testing import launch

pytestmark = pytest.mark.multihost

CONFIG = os.path.join(launch.ROOT, "experiments", "configs", "arithmetic.py")
CACHE = launch.TEST_CACHE
# The main job's config with one layer (less to compile), a few steps: 16 held-out problems, a checkpoint
# every 2 steps. The policy fixed at bf16_matmul (the config's 'auto' picks float32 on a CPU without
# bfloat16 instructions): in float32 the 1-process and 2-process runs differ at rounding level from the
# first update on (loss 0.17834024 against 0.17834023, and the KL to the reference 7e-17 against 0 at step 1,
# on a 2-core AMD EPYC without AVX-512), where in bf16_matmul they are equal bit for bit on that machine and
# on one with AVX512-BF16.
QUICK = ["--config.task.eval_problems=16", "--config.task.eval_samples=0", "--config.run.eval_every=0",
         "--config.run.checkpoint_every=2", "--config.model.num_layers=1", "--config.model.scan_unroll=1",
         "--config.model.dtype=bf16_matmul", f"--compilation_cache={CACHE}"]
# Where a run starts: 8 warm-up steps of its own (the killed-and-resumed full-mode test: the warm-up across
# processes), or the policy 8 warm-up steps give as 1 process x 1 device, exported once (``warm_hf``) and
# loaded. From a random policy every reward, advantage and loss of these short runs is 0; from the
# warmed-up one they are not (mean |advantage| 0.82-0.84 at step 1), so the equalities below compare real
# updates.
WARMUP = ["--config.warmup.steps=8", "--config.warmup.checkpoint_every=0"]
RUN_TIMEOUT = 300


def _args(workdir, variant="", steps=4, extra=(), warm=None):
  """``warm``: the exported warm-up to start from (``warm_hf``); None: the run's own 8 warm-up steps."""
  start = WARMUP if warm is None else [f"--config.model.hf_path={warm}", "--config.warmup.steps=0"]
  return [f"--config={CONFIG}{variant}", f"--workdir={workdir}", f"--config.run.steps={steps}", *QUICK, *start,
          *extra]


@pytest.fixture(scope="session")
def warm_hf(tmp_path_factory) -> str:
  """The policy after the main job's 8 warm-up steps (one layer), as a Hugging Face folder: made once per
  test session (the pytest-xdist workers share it through their common temporary folder, under a lock) by
  ``grpo_main.py --export_hf`` as 1 process x 1 device."""
  base = tmp_path_factory.getbasetemp()
  # A pytest-xdist worker's folder is one of this session's; their parent is shared.
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  out = root / "multihost_warmup_hf"
  with open(root / "multihost_warmup.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (out / "model.safetensors").exists():
      made = root / "multihost_warmup_hf.partial"
      shutil.rmtree(made, ignore_errors=True)
      _run(root, "multihost_warmup_run", 1, 1, steps=0, extra=[f"--export_hf={made}"])
      os.rename(made, out)
  return str(out)


def _run(tmp_path, name, processes, devices, **kwargs) -> str:
  """Runs to the end; returns the workdir. Fails with the processes' log tails when one fails."""
  workdir = str(tmp_path / name)
  run = launch.start("grpo_main.py", _args(workdir, **kwargs), processes=processes, devices=devices,
                     log_dir=str(tmp_path / f"{name}_logs"))
  codes = run.wait(RUN_TIMEOUT)
  assert codes == [0] * processes, "\n".join(run.log(i)[-3000:] for i in range(processes))
  return workdir


def _metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _recorded_steps(path: str) -> list[int]:
  """Steps of the complete lines of a metrics file being written (the last line may still be partial)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line)["step"] for line in f if line.endswith("\n") and line.strip()]


def _assert_same_metrics(a: str, b: str, run_ends=(), only_in_a=(), a_up_to=None):
  """Equal metric rows, timings and what each host moved itself (``*_this_host``, ``*_hosts_sum``: it
  depends on the process count) aside; at ``run_ends`` (steps where b's run ended and was resumed: a run
  evaluates at its last step) b's row also holds that evaluation. Keys starting with ``only_in_a`` are
  a's alone and left out. ``a_up_to``: a's rows up to that step only (a ran longer than b)."""
  per_host = lambda rows: [{k: v for k, v in r.items() if not k.endswith(("_this_host", "_hosts_sum"))}
                           for r in rows]
  rows_a, rows_b = per_host(launch.comparable(_metrics(a))), per_host(launch.comparable(_metrics(b)))
  if a_up_to is not None:
    rows_a = [r for r in rows_a if r["step"] <= a_up_to]
  rows_a = [{k: v for k, v in r.items() if not k.startswith(tuple(only_in_a))} for r in rows_a]
  assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
  for ra, rb in zip(rows_a, rows_b):
    if rb["step"] in run_ends:
      rb = {k: v for k, v in rb.items() if not k.startswith("eval/")}
    assert ra == rb, {k: (ra.get(k), rb.get(k)) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)}


def test_two_processes_equal_one_and_a_killed_run_resumes_to_the_same_metrics(tmp_path):
  """fusion.mode=full with the KL reference (the policy's and the reference's params rest in host memory
  while generating; the reference is checkpointed and restored) and DAPO's dynamic sampling (its rounds'
  rows kept by process): 2 processes equal 1, also after process 1 is killed and the same two commands
  resume. (Synchronous colocated runs across processes: the StaleSync tests below run colocated; the other
  modes: test_deployment_modes_across_processes_equal_one_process.)"""
  # A 4 s heartbeat timeout (the binaries' default is 10 s): the survivor notices the kill sooner. 32 slots
  # for 128 samples: the engine refills them as samples finish, so a sample's slot (and process) is not
  # the process whose devices train on it, and some rows move between the processes.
  steps, extra = 6, ["--config.fusion.mode=full", "--heartbeat_timeout_s=4", "--config.rollout.num_slots=32",
                     "--config.algo.dynamic_sampling=True"]
  reference = _run(tmp_path, "one", 1, 4, variant=":kl", steps=steps, extra=extra)

  # Two processes; process 1 is killed once step 3 is recorded (after the checkpoint of step 2).
  workdir = str(tmp_path / "two")
  args = _args(workdir, variant=":kl", steps=steps, extra=extra)
  run = launch.start("grpo_main.py", args, processes=2, devices=2, log_dir=str(tmp_path / "two_logs"))
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + RUN_TIMEOUT
  while max(_recorded_steps(metrics), default=0) < 3:
    assert time.monotonic() < deadline and run.procs[0].poll() is None, run.log(0)[-3000:]
    time.sleep(0.02)
  run.kill(1)
  killed_at = time.monotonic()
  code = run.wait(120)[0]
  waited = time.monotonic() - killed_at
  log = run.log(0)
  assert code != 0
  assert waited < 60, waited           # the heartbeat timeout is 4 s: no hang
  assert "another task died" in log and "heartbeat" in log, log[-3000:]
  done = _recorded_steps(metrics)
  assert max(done) < steps, "the run ended before the kill; the test needs a slower step"

  # The same two commands again: resumed from the last checkpoint, equal to the uninterrupted run.
  run = launch.start("grpo_main.py", args, processes=2, devices=2, log_dir=str(tmp_path / "resume_logs"))
  codes = run.wait(RUN_TIMEOUT)
  assert codes == [0, 0], "\n".join(run.log(i)[-3000:] for i in range(2))
  assert "resumed from rl checkpoint" in run.log(0)
  _assert_same_metrics(reference, workdir)
  # Dynamic sampling drew more than one round on some step (the rounds' rows also kept by process).
  assert max(r["dynamic_sampling/rounds"] for r in _metrics(workdir) if "loss" in r) > 1
  # Rows by process (Engine.local_rows): each process read its own engine shards' rows only (half the
  # blocks), no row was exchanged wholesale, and what crossed between the hosts were the rows a process's
  # devices train on that the other process had generated: some, on some step.
  for rows, processes in ((_metrics(reference), 1), (_metrics(workdir), 2)):
    rows = [r for r in rows if "loss" in r]
    fetch, between = "queue/link_bytes/engine_to_host", "queue/link_bytes/rows_between_hosts"
    sums = [r.get(f"{fetch}_hosts_sum", r[f"{fetch}_this_host"]) for r in rows]
    assert all(s == r[fetch] > 0 and (processes == 1) == (r[f"{fetch}_this_host"] == s) for s, r in zip(sums, rows))
    assert all(r["queue/link_bytes/engine_rows_between_hosts_this_host"] == 0 for r in rows)
    if processes == 1:
      assert not any(f"{between}_this_host" in r for r in rows)
    else:
      assert any(r[f"{between}_this_host"] > 0 for r in rows), [r[f"{between}_this_host"] for r in rows]
  summary, ref_summary = (json.load(open(os.path.join(d, "summary.json"))) for d in (workdir, reference))
  assert summary == ref_summary
  # Process 0 wrote every file; the timeline has a lane for process 1's phases.
  names = sorted(os.listdir(workdir))
  assert not [n for n in names if n.endswith(".tmp")], names
  groups = [json.loads(l)["name"] for l in open(os.path.join(workdir, "timeline.jsonl"))
            if '"kind": "group"' in l]
  assert "all" in groups and "all@p1" in groups, groups


# The StaleSync tests share one 1-process reference run and one 2-process run stopped by SIGTERM (module
# fixtures): one worker runs both.
_STALESYNC_STEPS = 6
# A checkpoint every step, all kept: what each holds is checked complete (_saved_rows).
_STALESYNC_SAVES = ["--config.run.checkpoint_every=1", "--config.run.keep_checkpoints=10"]
stalesync_group = pytest.mark.xdist_group("multihost_run_test.py::stalesync")


@pytest.fixture(scope="module")
def stalesync_one(tmp_path_factory, warm_hf) -> str:
  """StaleSync (s = 1, half the groups per update), 1 process x 4 devices, straight through."""
  return _run(tmp_path_factory.mktemp("stalesync"), "one", 1, 4, variant=":stalesync", steps=_STALESYNC_STEPS,
              warm=warm_hf)


@pytest.fixture(scope="module")
def stalesync_stopped(tmp_path_factory, warm_hf) -> dict:
  """StaleSync across 2 processes; only process 1 gets SIGTERM once step 2 is recorded. Returns the run's
  exit codes, logs and args, its workdir (resumed by one test) and a copy of that workdir as the run
  left it (resumed on another process count by the other)."""
  tmp_path = tmp_path_factory.mktemp("stalesync_stopped")
  workdir = str(tmp_path / "two")
  args = _args(workdir, variant=":stalesync", steps=_STALESYNC_STEPS, extra=_STALESYNC_SAVES, warm=warm_hf)
  run = launch.start("grpo_main.py", args, processes=2, devices=2, log_dir=str(tmp_path / "two_logs"))
  metrics = os.path.join(workdir, "metrics.jsonl")
  run.wait_for(lambda: len(_recorded_steps(metrics)) >= 3,
               RUN_TIMEOUT, "step 2 recorded", interval=0.002)
  run.signal(signal.SIGTERM, 1)
  codes = run.wait(RUN_TIMEOUT)
  copy = str(tmp_path / "copy")
  shutil.copytree(workdir, copy)
  return {"codes": codes, "logs": [run.log(i) for i in range(2)], "args": args, "workdir": workdir,
          "copy": copy, "tmp_path": tmp_path}


def _stop_step(stopped: dict) -> int:
  """The step the SIGTERM stopped both processes after (checked: exit 75 and the same step on both)."""
  codes, logs = stopped["codes"], stopped["logs"]
  assert codes == [75, 75], (codes, [l[-3000:] for l in logs])
  stops = [re.search(r"preempted: stopped by SIGTERM after RL step (\d+); checkpoint (\S+) written", l)
           for l in logs]
  assert all(stops), [l[-2000:] for l in logs]
  step = int(stops[0].group(1))
  assert int(stops[1].group(1)) == step and 2 <= step < _STALESYNC_STEPS
  return step


@stalesync_group
def test_stalesync_across_processes_equals_one_process_also_resumed_on_another_count(
    tmp_path, stalesync_one, stalesync_stopped, warm_hf):
  """StaleSync (s = 1, half the groups per update): each process feeds its devices' rows from its own
  queue replica; the run's queue counters are the processes' sums, equal to one process reading all.
  The 2-process run, stopped after the checkpoint of step 2 or later (SIGTERM), continues as 1 process x
  4 devices from it (queue, in-flight samples and counters restored) to the end: still equal."""
  step = _stop_step(stalesync_stopped)
  workdir = stalesync_stopped["copy"]
  assert max(r["step"] for r in _metrics(workdir)) == step
  run = launch.start("grpo_main.py", _args(workdir, variant=":stalesync", steps=_STALESYNC_STEPS,
                                           extra=_STALESYNC_SAVES, warm=warm_hf),
                     processes=1, devices=4, log_dir=str(tmp_path / "one_logs"))
  assert run.wait(RUN_TIMEOUT) == [0], run.log(0)[-3000:]
  assert "resumed from rl checkpoint" in run.log(0)
  _assert_same_metrics(stalesync_one, workdir)
  assert _metrics(workdir)[-1]["queue/bytes_read_tokens"] > 0


@stalesync_group
def test_sigterm_to_one_process_stops_both_after_the_same_step_and_they_resume_to_the_same_metrics(
    stalesync_one, stalesync_stopped):
  """StaleSync across 2 processes; only process 1 gets SIGTERM. The processes agree on the step (each step
  they exchange whether one was signalled), both take part in that step's checkpoint and exit with 75;
  the same two commands resume, equal to one process run straight through."""
  step = _stop_step(stalesync_stopped)
  workdir, tmp_path = stalesync_stopped["workdir"], stalesync_stopped["tmp_path"]
  metrics = os.path.join(workdir, "metrics.jsonl")
  assert os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))
  assert max(json.loads(l)["step"] for l in open(metrics) if l.strip()) == step
  run = launch.start("grpo_main.py", stalesync_stopped["args"], processes=2, devices=2,
                     log_dir=str(tmp_path / "resume_logs"))
  assert run.wait(RUN_TIMEOUT) == [0, 0], "\n".join(run.log(i)[-3000:] for i in range(2))
  _assert_same_metrics(stalesync_one, workdir)
  _assert_rows_by_process(workdir)
  # Each process holds the responses it generated; a checkpoint holds every waiting one, complete.
  assert _saved_rows(workdir)["queue"] > 0


def _saved_rows(workdir: str) -> dict[str, int]:
  """Checks that every response a kept RL checkpoint's StaleSync state holds is complete (each version of
  it >= 0: no row left blank for another process to hold) -> how many it checked: queued samples' rows
  (``queue``) and the engine's finished, unreturned ones (``engine``)."""
  from rl_fusion_jax import checkpointing  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.orchestration import resume  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.queue.distqueue import Packed  # pylint: disable=g-import-not-at-top
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, resume.RL_DIR), keep=100, create=False)
  counts = {"queue": 0, "engine": 0}
  try:
    for step in ckpt.steps():
      host = ckpt.restore_host(step, ckpt.read_meta(step))
      columns = host["queue"]["columns"]
      versions = Packed(columns["version"]["flat"], columns["version"]["lengths"])
      for i, (p, n) in enumerate(zip(columns["prompt_len"]["values"], columns["response_len"]["values"])):
        assert (versions.row(i)[p:p + n] >= 0).all(), (step, i)
        counts["queue"] += 1
      engine = host["engine"]
      for v, p, n in zip(engine["done.version_st"], engine["done.prompt_len_s"], engine["done.response_len_s"]):
        assert (v[p:p + n] >= 0).all(), step
        counts["engine"] += 1
  finally:
    ckpt.close()
  return counts


def _assert_rows_by_process(workdir: str):
  """Rows by process (Engine.local_rows) in a 2-process run: no finished row was exchanged wholesale, and
  what crossed between the hosts were rows a process's devices train on that the other process generated:
  some, on some step."""
  rows = [r for r in _metrics(workdir) if "loss" in r]
  assert all(r.get("queue/link_bytes/engine_rows_between_hosts_hosts_sum", 0) == 0 for r in rows)
  assert any(r["queue/link_bytes/rows_between_hosts_this_host"] > 0 for r in rows)
  # Beside it, the same rows' padded equivalent (int32 / float32 rows of the batch's width): some when any
  # crossed, none when none did.
  between = "queue/link_bytes/rows_between_hosts"
  assert all((r[f"{between}_this_host"] > 0) == (r[f"{between}_padded_this_host"] > 0) for r in rows)


@pytest.mark.parametrize("mode", ["separated", "hybrid", "hybrid_stalesync", "colocated_packed",
                                  "colocated_packed_stalesync"])
def test_deployment_modes_across_processes_equal_one_process(tmp_path, mode, warm_hf):
  """Every sub-mesh takes the same share of each process's devices (hybrid: one aux device each; its update
  on packed rows, a learned reward model beside the reference on the aux devices; hybrid_stalesync: the
  same under StaleSync, where the aux stage's results and the advantages reach the update through the
  queue's fields; colocated_packed: the packed update from rows kept by process, 32 slots for 128 samples;
  colocated_packed_stalesync: the packed update under StaleSync, the queue's rows kept by process).
  (fusion.mode=full, padded, with dynamic sampling:
  test_two_processes_equal_one_and_a_killed_run_resumes_to_the_same_metrics; StaleSync colocated, padded:
  the StaleSync tests above.)"""
  mode, *parts = mode.split("_")
  stalesync, packed = "stalesync" in parts, "packed" in parts
  extra = [f"--config.fusion.mode={mode}"]
  if stalesync:
    extra += ["--config.stalesync.enabled=True", "--config.stalesync.max_staleness=1",
              "--config.stalesync.train_fraction=0.5", "--config.rollout.num_slots=256"]
  if packed or mode == "separated":
    extra += ["--config.rollout.num_slots=32"]
  if packed:
    extra += ["--config.optim.pack_rows=True"]
  if mode == "hybrid":
    import jax  # pylint: disable=g-import-not-at-top
    from rl_fusion_jax.models import ModelConfig, reward_model  # pylint: disable=g-import-not-at-top
    rm_cfg = ModelConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=32, qkv_bias=True, max_position_embeddings=64)
    reward_model.save_reward_model(rm_cfg, reward_model.init_reward_params(rm_cfg, jax.random.key(3), init_std=0.5),
                                   str(tmp_path / "rm"))
    extra += ["--config.fusion.aux_devices=2", "--config.optim.pack_rows=True",
              f"--config.task.reward_model={tmp_path / 'rm'}", "--config.task.reward_model_weight=0.5"]
  one = _run(tmp_path, "one", 1, 4, variant=":kl", steps=2, extra=extra, warm=warm_hf)
  two = _run(tmp_path, "two", 2, 2, variant=":kl", steps=2, extra=extra, warm=warm_hf)
  # Hybrid's reference scores samples as they finish (aux_stage/*), in one process and across two alike.
  _assert_same_metrics(one, two, only_in_a=())
  # Rows by process (Engine.local_rows), in every mode.
  _assert_rows_by_process(two)
  if stalesync and packed:   # 32 slots: samples finished and not yet returned wait in the engine at a save
    assert _saved_rows(two)["engine"] > 0
  if mode == "hybrid":
    for run in (one, two):
      rows = [r for r in _metrics(run) if "loss" in r]
      assert all(r["reward_model_score"] != 0.0 for r in rows)
      if stalesync:     # fetched into the queue (ref_logp, rm_score) after each rollout phase
        assert any(r.get("queue/link_bytes/aux_to_host", 0) > 0 for r in rows)
        assert any(r.get("queue/link_bytes/host_to_aux", 0) > 0 for r in rows)
        assert not any("aux_stage/early_frac" in r for r in rows)
        assert max(r["stalesync/staleness_max"] for r in rows) == 1
      else:
        assert all(r["aux_stage/early_frac"] == 1.0 for r in rows)
    # Bytes per host and per device, host -> device: the actor's 2 devices are 2 data-parallel groups, one
    # on each process of two. One process puts both groups' byte streams; of two, each puts its own group's
    # stream only (the same length for both groups), and each its copy of the per-sample numbers (a 16-bit
    # table of 6 per sample and the version base) and the rewards (float32). A device is sent the same in
    # both (its group's stream and those numbers: equal metrics above).
    with open(os.path.join(two, "config.json")) as f:
      r = json.load(f)["rollout"]
    per_sample = 6 * 2 * r["num_prompts"] * r["group_size"] + 4 + 4 * r["num_prompts"] * r["group_size"]
    key = "queue/link_bytes/host_to_device"
    for ra, rb in zip(_metrics(one), _metrics(two)):
      if "loss" not in ra:
        continue
      assert ra[f"{key}_this_host"] == ra[key] and ra[f"{key}_per_device"] == rb[f"{key}_per_device"]
      stream = rb[key] - per_sample                                   # both groups' streams
      assert rb[f"{key}_this_host"] == stream / 2 + per_sample        # the busiest host: one group's
      assert rb[f"{key}_hosts_sum"] == stream + 2 * per_sample
      # Host -> aux (the finished samples the aux stage scores): the aux mesh's 2 devices are 2 groups, one
      # on each process of two. Each process puts its own group's token pages and its copy of each call's
      # table; one process puts both groups' pages and one copy. T: the second process's table copies.
      aux = "queue/link_bytes/host_to_aux"
      if aux in rb or not stalesync:      # StaleSync skips the rollout phase when the queue fills the update
        tables = rb[f"{aux}_hosts_sum"] - rb[aux]
        assert ra[f"{aux}_this_host"] == ra[aux] > 0 and tables > 0
        assert rb[f"{aux}_this_host"] == (rb[aux] - tables) / 2 + tables
      # Device -> host: the actor's 2 devices are 2 batch shards of the engine's slots, one on each process
      # of two. Each shard packs its own finished rows, and each process reads its own shard's blocks only
      # (one process reads both): what the hosts read sums to the run's figure, the same as one process's.
      fetch = "queue/link_bytes/engine_to_host"
      if fetch in rb or not stalesync:      # StaleSync skips the rollout phase when the queue fills the update
        assert ra[f"{fetch}_this_host"] == ra[fetch] == rb[fetch] > 0
        assert rb[f"{fetch}_hosts_sum"] == rb[fetch] > rb[f"{fetch}_this_host"] > 0
    # Rows by process: each sample is scored by the aux device of the engine shard that generated it, on the
    # process that holds its row, so no token crossed for the aux stage (below: nor a row wholesale).
    key = "queue/link_bytes/aux_rows_between_hosts_this_host"
    assert any(key in r for r in _metrics(two)) and all(r.get(key, 0) == 0 for r in _metrics(two))


# ---------------------------------------------------------------------------------------------------
# Bad input: a clear error on every process, nothing written.


def _refused(tmp_path, processes, devices, extra_args=(), extra=None, timeout=120) -> list[str]:
  workdir = tmp_path / "run"
  run = launch.start("grpo_main.py", _args(str(workdir), extra=extra_args), processes=processes,
                     devices=devices, log_dir=str(tmp_path / "logs"), extra=extra)
  codes = run.wait(timeout)
  logs = [run.log(i) for i in range(processes)]
  assert all(c == 1 for c in codes), (codes, [l[-2000:] for l in logs])
  assert not workdir.exists()
  return [next(line for line in log.splitlines() if line.startswith("error: ")) for log in logs]


def test_processes_with_different_configs_are_refused(tmp_path):
  errors = _refused(tmp_path, 2, 2, extra={1: ["--config.run.seed=1"]})
  assert all("different configs" in e and "process 1" in e for e in errors), errors


def test_mesh_that_does_not_divide_the_global_devices_is_refused(tmp_path):
  errors = _refused(tmp_path, 2, 2, extra_args=["--config.mesh.data=3"])
  assert all("config.mesh" in e and "4 devices" in e for e in errors), errors


def test_unreachable_coordinator_is_refused(tmp_path):
  """Process 1 of 2 alone: nobody serves the coordinator's port."""
  workdir = tmp_path / "run"
  port = launch.free_port()
  run = launch.start("grpo_main.py", _args(str(workdir)) + ["--distributed_timeout_s=3"], processes=1,
                     devices=2, log_dir=str(tmp_path / "logs"), coordinator=False,
                     extra={0: [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", "--process_id=1"]})
  started = time.monotonic()
  assert run.wait(120) == [1], run.log(0)[-3000:]
  assert time.monotonic() - started < 60
  assert "nothing answers there within --distributed_timeout_s=3" in run.log(0), run.log(0)[-3000:]
  assert not workdir.exists()


def test_process_id_outside_the_process_count_is_refused(tmp_path):
  run = launch.start("grpo_main.py", _args(str(tmp_path / "run")), processes=1, devices=2,
                     log_dir=str(tmp_path / "logs"), coordinator=False,
                     extra={0: ["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=2"]})
  assert run.wait(120) == [1]
  assert "error: --process_id=2 is not below --num_processes=2" in run.log(0)


def test_separated_main_sides_start_as_two_commands(tmp_path):
  """The one-process-per-side schedule started with the standard settings, one command per side (as on
  two hosts): process 0 generates, process 1 trains, both return and process 0 writes the summary."""
  workdir = tmp_path / "run"
  config = os.path.join(launch.ROOT, "experiments", "configs", "tiny_grpo.py")
  args = [f"--config={config}", f"--workdir={workdir}", "--config.fusion.mode=separated",
          "--config.stalesync.enabled=True", "--config.stalesync.max_staleness=1", "--config.run.steps=2",
          # One layer and 16 held-out problems (evaluating the config's 512 was the run's longest phase):
          # what is checked is how the two sides start, meet and end.
          "--config.model.num_layers=1", "--config.task.eval_problems=16", f"--compilation_cache={CACHE}"]
  run = launch.start("separated_main.py", args, processes=2, devices=1, log_dir=str(tmp_path / "logs"))
  assert run.wait(RUN_TIMEOUT) == [0, 0], "\n".join(run.log(i)[-3000:] for i in range(2))
  summary = json.load(open(workdir / "summary.json"))
  assert summary["mode"] == "separated_async" and len(summary["groups"]["trained"]) > 0
  assert "both sides busy" in run.log(0)
