"""SIGTERM / SIGINT stop a run gracefully, one run holds a workdir, and a checkpoint that cannot be written
is one error with nothing left half-written.

The binary tests run the real ``grpo_main.py`` (tiny model) in a fresh process: a signal lands at a
random step (``RLFJ_SIGNAL_SEED`` repeats one), the run finishes that step, writes a checkpoint and exits
with status 75 and one line; the resumed run's metrics equal an uninterrupted run's, in the synchronous
and the StaleSync schedule. The multi-process case is in ``multihost_run_test.py``.
"""
import errno
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest
from etils import epath

from rl_fusion_jax import checkpointing
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.checkpointing import Checkpointer
from rl_fusion_jax.errors import PREEMPTED_EXIT, ResumeError, WriteError
from rl_fusion_jax.orchestration import loop
from rl_fusion_jax.orchestration.preemption import Preemption
from rl_fusion_jax.orchestration.workdir_lock import WorkdirLock
from rl_fusion_jax.testing import launch
from rl_fusion_jax.testing.experiments import tiny

CONFIG = os.path.join(launch.ROOT, "experiments", "configs", "arithmetic.py")
CACHE = launch.TEST_CACHE
STEPS = 6
TINY = ["--config.model.hidden_size=32", "--config.model.num_layers=1", "--config.model.scan_unroll=1",
        "--config.model.num_heads=4",
        "--config.model.num_kv_heads=2", "--config.model.intermediate_size=64", "--config.task.eval_problems=16",
        # Greedy evaluation only: the main job's sampled one (pass@8) across a resume is
        # resume_test.py::test_sigkill_at_a_random_point_then_resume_equals_uninterrupted's.
        "--config.task.eval_samples=0", "--config.rollout.num_prompts=4", "--config.rollout.group_size=4", "--config.warmup.steps=6",
        "--config.warmup.batch_size=16", "--config.warmup.checkpoint_every=0", "--config.run.checkpoint_every=0",
        "--config.run.eval_every=3", "--config.run.progress_every_s=0", f"--compilation_cache={CACHE}"]
STALESYNC = ["--config.stalesync.enabled=True", "--config.stalesync.max_staleness=1",
             "--config.stalesync.train_fraction=0.5", "--config.rollout.num_slots=32"]
KEYS = ("reward", "loss", "grad_norm", "entropy", "response_len_mean", "accuracy")
STALESYNC_KEYS = ("data_position", "stalesync/generated_groups_total", "stalesync/trained_groups_total",
                  "stalesync/staleness_mean", "stalesync/waiting_samples_after")


def _start(tmp_path, name, extra=(), steps=STEPS) -> launch.Processes:
  args = [f"--config={CONFIG}", f"--workdir={tmp_path / name}", f"--config.run.steps={steps}", *TINY, *extra]
  logs = tmp_path / f"{name}_logs{len(list(tmp_path.glob(f'{name}_logs*')))}"   # one folder per start
  return launch.start("grpo_main.py", args, processes=1, devices=2, log_dir=str(logs), coordinator=False)


def _finish(run: launch.Processes) -> str:
  assert run.wait(300) == [0], run.log(0)[-3000:]
  return run.log(0)


def _rows(workdir) -> list[dict]:
  return [r for r in metrics_lib.read_metrics(str(workdir)) if "loss" in r]


def _recorded_steps(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  return sum(1 for line in open(path) if line.strip()) - 1 if os.path.exists(path) else -1


def _last_line(log: str) -> str:
  return [line for line in log.splitlines() if line.strip()][-1]


@pytest.mark.parametrize("schedule,sig", [("sync", signal.SIGINT), ("stalesync", signal.SIGTERM)])
def test_signal_at_a_random_step_checkpoints_exits_75_and_resumes_to_the_uninterrupted_run(tmp_path, schedule,
                                                                                            sig):
  extra = STALESYNC if schedule == "stalesync" else []
  rng = random.Random(int(os.environ.get("RLFJ_SIGNAL_SEED", time.time_ns())))
  # Signal once this many RL steps are recorded (0: at the first). A signal that lands in the last step
  # ends nothing early (the run completes), and a late step takes ~20 ms here: the poll is tight and at
  # least 2 steps besides the last remain after the one it waits for.
  after = rng.randint(0, STEPS - 3)
  print(f"signal after {after} recorded RL steps (RLFJ_SIGNAL_SEED to repeat)")
  straight = tmp_path / "straight"
  _finish(_start(tmp_path, "straight", extra))

  stopped = tmp_path / "stopped"
  run = _start(tmp_path, "stopped", extra)
  run.wait_for(lambda: _recorded_steps(stopped) >= after, 300, f"{after} recorded steps", interval=0.002)
  run.signal(sig)
  assert run.wait(300) == [PREEMPTED_EXIT], run.log(0)[-3000:]
  log = run.log(0)
  assert "Traceback" not in log
  line = _last_line(log)
  m = re.fullmatch(rf"preempted: stopped by {sig.name} after RL step (\d+); checkpoint (\S+) written; "
                   r"run the same command to resume", line)
  assert m, line
  step = int(m.group(1))
  assert after <= step < STEPS        # it stopped inside the run, no earlier than the signal
  assert m.group(2) == str(stopped / "checkpoints" / str(step)) and os.path.isdir(m.group(2))
  assert [r["step"] for r in _rows(stopped)] == list(range(1, step + 1))   # metrics flushed to that step
  assert not os.path.exists(stopped / "summary.json") and not os.path.exists(stopped / ".lock")

  _finish(_start(tmp_path, "stopped", extra))   # the same command resumes
  a, b = _rows(straight), _rows(stopped)
  assert [r["step"] for r in b] == list(range(1, STEPS + 1))
  for ra, rb in zip(a, b):
    for key in KEYS + (STALESYNC_KEYS if extra else ()):
      assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
  assert json.load(open(stopped / "summary.json")) == json.load(open(straight / "summary.json"))


def test_a_second_run_on_the_workdir_is_refused_and_a_second_signal_exits_at_once(tmp_path):
  workdir = tmp_path / "run"
  run = _start(tmp_path, "run", steps=10_000)
  run.wait_for(lambda: _recorded_steps(workdir) >= 1, 300, "the first RL step")
  pid = run.procs[0].pid

  second = _start(tmp_path, "run", steps=10_000)   # the same command again, on the same workdir
  assert second.wait(120) == [1]
  line = _last_line(second.log(0))
  assert line.startswith(f"error: --workdir={workdir}: in use by pid {pid} on host "), line
  assert "Traceback" not in second.log(0)

  run.signal(signal.SIGTERM)
  run.wait_for(lambda: "SIGTERM received" in run.log(0), 120, "the first signal handled")
  run.signal(signal.SIGTERM)
  assert run.wait(60) == [-signal.SIGTERM]     # ended by the signal itself, not after a step
  assert _last_line(run.log(0)) == "SIGTERM again: exiting now, without a checkpoint"
  # Killed holding the lock: the file stays, and the next run takes it over (logged).
  holder = json.load(open(workdir / ".lock"))
  assert holder["pid"] == pid
  with WorkdirLock(str(workdir)) as lock:
    assert json.load(open(lock.path))["pid"] == os.getpid()
  assert not os.path.exists(workdir / ".lock")


# ----------------------------------------------------------------------------------------------------
# In-process: the signal handler, the lock, and write failures.
# ----------------------------------------------------------------------------------------------------

def test_preemption_handles_signals_only_inside_its_block():
  before = signal.getsignal(signal.SIGTERM)
  with Preemption() as p:
    assert not p.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)   # Python runs the handler at the next bytecode boundary
    assert p.signame == "SIGTERM" and p.should_stop()
    assert p.should_stop()   # once agreed, it stays
  assert signal.getsignal(signal.SIGTERM) is before


def test_lock_refuses_a_holder_in_another_process_and_takes_over_a_stale_file(tmp_path, caplog):
  code = ("import sys, time\nfrom rl_fusion_jax.orchestration.workdir_lock import WorkdirLock\n"
          f"WorkdirLock({str(tmp_path)!r}).acquire()\nprint('held', flush=True)\ntime.sleep(60)\n")
  holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=launch.ROOT)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ResumeError, match=rf"in use by pid {holder.pid} on host .*one run per workdir"):
      WorkdirLock(str(tmp_path)).acquire()
  finally:
    holder.kill()
    holder.wait()
  # The holder died without releasing: its record is still there, but no process holds the lock.
  assert json.load(open(tmp_path / ".lock"))["pid"] == holder.pid
  with WorkdirLock(str(tmp_path)):
    pass
  assert f"left by pid {holder.pid}" in caplog.text


def _tmp_folders(directory) -> list[str]:
  return glob.glob(os.path.join(directory, "*orbax-checkpoint-tmp*"))


def test_a_save_that_does_not_fit_is_refused_before_writing(tmp_path, monkeypatch):
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  tree = {"w": jnp.ones((256, 256))}
  ckpt.save(1, {"params": tree}, {"kind": "rl"})
  ckpt.wait()
  monkeypatch.setattr(checkpointing, "free_bytes", lambda d: 1000)
  with pytest.raises(WriteError) as e:
    ckpt.save(2, {"params": tree}, {"kind": "rl"})
  assert re.fullmatch(rf"cannot write checkpoint {tmp_path}/ckpt/2: No space left on device \(errno ENOSPC\); "
                      r"it needs up to 0\.3 MiB \(\d+ bytes\), 0\.0 MiB \(1000 bytes\) free there", str(e.value))
  assert int(re.search(r"\((\d+) bytes\), 0", str(e.value)).group(1)) >= 256 * 256 * 4
  ckpt.close()
  assert Checkpointer(str(tmp_path / "ckpt")).steps() == [1] and not _tmp_folders(tmp_path / "ckpt")


def test_enospc_while_writing_is_one_error_and_leaves_no_temporary_folder(tmp_path, monkeypatch, capfd):
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  tree = {"w": jnp.ones((8, 8))}
  ckpt.save(1, {"params": tree}, {"kind": "rl"})
  ckpt.wait()
  original = type(epath.Path(tmp_path)).write_text

  def full_disk(self, *args, **kwargs):   # orbax writes the JSON items (meta) through write_text
    if ".orbax-checkpoint-tmp" in str(self):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
    return original(self, *args, **kwargs)
  monkeypatch.setattr(type(epath.Path(tmp_path)), "write_text", full_disk)
  capfd.readouterr()
  with pytest.raises(WriteError, match=rf"cannot write checkpoint {tmp_path}/ckpt/2: No space left on device "
                     r"\(errno ENOSPC\); it needs up to"):
    ckpt.save(2, {"params": tree}, {"kind": "rl"})
    ckpt.close()
  monkeypatch.undo()
  ckpt.close()
  out, err = capfd.readouterr()
  assert "Traceback" not in out + err and "rror" not in out + err, out + err   # orbax's logs are dropped
  assert Checkpointer(str(tmp_path / "ckpt")).steps() == [1] and not _tmp_folders(tmp_path / "ckpt")


def test_a_full_disk_mid_run_stops_the_run_and_the_previous_checkpoint_resumes(tmp_path, monkeypatch):
  """The loop: the RL checkpoint of step 2 does not fit; the run stops with the WriteError, the step-0
  checkpoint stays the newest, and a resume (disk freed) continues from it."""
  cfg = tiny(**{"run.steps": 3, "run.checkpoint_every": 2, "run.eval_every": 0})
  workdir = str(tmp_path / "run")
  real = checkpointing.free_bytes
  monkeypatch.setattr(checkpointing, "free_bytes",
                      lambda d: 0 if os.path.isdir(os.path.join(d, "0")) and d.endswith("checkpoints")
                      and not d.endswith("warmup_checkpoints") else real(d))
  with pytest.raises(WriteError, match=r"cannot write checkpoint .*/checkpoints/2: No space left on device"):
    loop.run(cfg, workdir)
  rl = Checkpointer(os.path.join(workdir, "checkpoints"), create=False)
  assert rl.steps() == [0] and not _tmp_folders(rl.directory)
  assert not os.path.exists(os.path.join(workdir, ".lock"))   # released on the way out
  monkeypatch.setattr(checkpointing, "free_bytes", real)
  summary = loop.run(cfg, workdir)
  assert summary["steps"] == 3 and [r["step"] for r in _rows(workdir)] == [1, 2, 3]
