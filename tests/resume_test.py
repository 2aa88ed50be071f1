"""Failures and resume: divergence stops cleanly, resume is checked first, corrupt checkpoints fall back,
and every step is recorded exactly once (also after SIGKILL at a random point of a StaleSync subprocess
run, whose checkpoints carry the queue and the in-flight samples)."""
import glob
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax import timeline as timeline_lib
from rl_fusion_jax.checkpointing import Checkpointer
from rl_fusion_jax.errors import ConfigError, DivergenceError, ResumeError
from rl_fusion_jax.orchestration import loop, resume
from rl_fusion_jax.orchestration.programs import make_placement
from rl_fusion_jax.testing import launch
from rl_fusion_jax.testing.experiments import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("reward", "loss", "grad_norm", "entropy", "response_len_mean", "accuracy")
REFERENCE_CFG = {"run.steps": 4, "run.checkpoint_every": 2, "run.eval_every": 2}


def snapshot(workdir):
  """{relative path: sha256} of every file under workdir."""
  out = {}
  for path in glob.glob(os.path.join(workdir, "**"), recursive=True):
    if os.path.isfile(path):
      out[os.path.relpath(path, workdir)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
  return out


def step_rows(workdir):
  return [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]


def assert_same_values(rows_a, rows_b):
  assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
  for a, b in zip(rows_a, rows_b):
    for key in KEYS:
      assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


def stored_arrays_finite(step_dir):
  """Reads every saved tree of a checkpoint folder with orbax directly (no targets) and checks it."""
  for item in ("params", "opt_state", "counters"):
    tree = ocp.StandardCheckpointer().restore(os.path.join(step_dir, item))
    for leaf in __import__("jax").tree.leaves(tree):
      leaf = np.asarray(leaf)
      if np.issubdtype(leaf.dtype, np.floating) and not np.all(np.isfinite(leaf)):
        return False
  return True


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted 4-step run with a checkpoint every 2 steps and evaluation every 2 steps."""
  workdir = str(tmp_path_factory.mktemp("reference") / "run")
  summary = loop.run(tiny(**REFERENCE_CFG), workdir)
  return workdir, summary


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
  """A finished 1-step run (checkpoints at steps 0 and 1); tests resume copies of it."""
  workdir = str(tmp_path_factory.mktemp("one_step") / "run")
  loop.run(tiny(**{"run.steps": 1}), workdir)
  return workdir


def copy_of(source, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(source, workdir)
  return workdir


# ----------------------------------------------------------------------------------------------------
# Divergence guard.
# ----------------------------------------------------------------------------------------------------

# lr 1e20 overflows float32 activations after one update. (At 1e8 whether the run reaches inf or saturates
# every hidden state to zero after the final norm, uniform logits and zero gradients, depends on the init.)


def test_diverging_run_stops_naming_the_step_and_writes_no_nonfinite_checkpoint(tmp_path):
  workdir = str(tmp_path / "run")
  with pytest.raises(DivergenceError, match=r"RL step \d+: non-finite .*the update was not applied"):
    loop.run(tiny(**{"optim.learning_rate": 1e20, "algo.entropy_coef": 0.01, "run.steps": 12,
                     "run.keep_checkpoints": 20}), workdir)
  steps = Checkpointer(os.path.join(workdir, "checkpoints"), create=False).steps()
  assert steps, "the run should have checkpointed before diverging"
  for step in steps:
    assert stored_arrays_finite(os.path.join(workdir, "checkpoints", str(step))), step


def test_diverging_warmup_stops_too(tmp_path):
  workdir = str(tmp_path / "run")
  with pytest.raises(DivergenceError, match=r"warm-up step \d+: non-finite"):
    loop.run(tiny(**{"warmup.learning_rate": 1e8, "warmup.steps": 40, "warmup.checkpoint_every": 2,
                     "run.keep_checkpoints": 50}), workdir)
  warm = Checkpointer(os.path.join(workdir, "warmup_checkpoints"), create=False)
  for step in warm.steps():
    assert stored_arrays_finite(warm.step_path(step)), step
  assert not os.path.exists(os.path.join(workdir, "checkpoints", "0"))   # RL never started


def test_skip_policy_counts_skips_and_stops_after_n_in_a_row(tmp_path):
  workdir = str(tmp_path / "run")
  with pytest.raises(DivergenceError,
                     match=r"2 non-finite updates in a row \(config.run.max_consecutive_skips=2\)"):
    loop.run(tiny(**{"optim.learning_rate": 1e20, "algo.entropy_coef": 0.01, "run.steps": 20,
                     "run.on_nonfinite": "skip",
                     "run.max_consecutive_skips": 2}), workdir)
  rows = step_rows(workdir)
  skipped = [r for r in rows if r["update_skipped"] == 1.0]
  assert len(skipped) == 1                              # the second skip in a row stopped the run (unwritten)
  assert skipped[0]["updates_skipped_total"] == 1.0
  assert all(r["update_skipped"] == 0.0 for r in rows if r is not skipped[0])


# ----------------------------------------------------------------------------------------------------
# Resume is checked before anything is written or compiled.
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,fields", [
    ({"rollout.num_prompts": 8}, ["config.rollout.num_prompts: 4 in the saved run, 8 now"]),
    ({"run.seed": 5}, ["config.run.seed"]),
    ({"model.hidden_size": 64}, ["config.model.hidden_size"]),
    ({"task.kwargs": {"max_digits": 1}, "algo.advantage": "rloo"},
     ["config.task.kwargs.max_digits", "config.algo.advantage"]),
])
def test_meaning_changing_resume_is_refused_before_writing(tmp_path, monkeypatch, one_step, overrides,
                                                         fields):
  workdir = copy_of(one_step, tmp_path)
  before = snapshot(workdir)
  monkeypatch.setattr(loop, "make_placement", lambda *a: pytest.fail("built programs before refusing"))
  with pytest.raises(ResumeError) as e:
    loop.run(tiny(**{"run.steps": 2, **overrides}), workdir)
  for field in fields:
    assert field in str(e.value)
  assert "--resume_override=" in str(e.value)
  assert snapshot(workdir) == before


def test_override_allows_a_changed_batch_and_keeps_the_data_position(tmp_path, one_step):
  workdir = copy_of(one_step, tmp_path)
  loop.run(tiny(**{"run.steps": 3, "rollout.num_prompts": 8}), workdir,
           resume_overrides=["config.rollout.num_prompts"])
  log = [json.loads(l) for l in open(os.path.join(workdir, "resume_log.jsonl"))]
  assert log[-1]["overridden"] == ["rollout.num_prompts"]
  assert log[-1]["changed"]["rollout.num_prompts"] == [4, 8]
  assert json.load(open(os.path.join(workdir, "config.json")))["rollout"]["num_prompts"] == 8
  meta = Checkpointer(os.path.join(workdir, "checkpoints"), create=False).read_meta(3)
  assert meta["data_position"] == 4 + 8 + 8      # problems 0-3, then 4-11, then 12-19: none drawn twice
  with pytest.raises(ResumeError, match="no config field 'rollout.num_prompt'"):
    loop.run(tiny(**{"run.steps": 3, "rollout.num_prompts": 8}), workdir,
             resume_overrides=["rollout.num_prompt"])


def test_overridden_model_size_is_a_named_shape_error_not_an_orbax_trace(tmp_path, one_step):
  workdir = copy_of(one_step, tmp_path)
  before = snapshot(workdir)
  with pytest.raises(ResumeError, match=r"does not fit this config: params/embed/embedding has shape "
                                        r"\(96, 32\) float32 in the checkpoint, \(96, 64\) float32 in "
                                        r"this config"):
    loop.run(tiny(**{"run.steps": 2, "model.hidden_size": 64}), workdir,
             resume_overrides=["model"])
  assert snapshot(workdir) == before


def test_harmless_changes_are_allowed_and_logged(tmp_path, one_step):
  workdir = copy_of(one_step, tmp_path)
  loop.run(tiny(**{"run.steps": 2, "run.eval_every": 1, "rollout.chunk_steps": 4}), workdir)
  log = [json.loads(l) for l in open(os.path.join(workdir, "resume_log.jsonl"))]
  assert sorted(log[-1]["changed"]) == ["rollout.chunk_steps", "run.eval_every", "run.steps"]
  assert log[-1]["overridden"] == []
  assert [r["step"] for r in step_rows(workdir)] == [1, 2]


@pytest.mark.parametrize("make_bad", ["file", "parent_file"])
def test_bad_workdir_names_the_flag(tmp_path, make_bad):
  target = tmp_path / "x"
  target.write_text("not a folder")
  workdir = str(target if make_bad == "file" else target / "run")
  with pytest.raises(ResumeError, match=r"--workdir=.*(not a directory|cannot be created)"):
    loop.run(tiny(), workdir)


def test_program_sizes_are_validated_before_writing(tmp_path):
  workdir = str(tmp_path / "run")
  with pytest.raises(ConfigError, match="config.task.eval_problems: must be >= 1"):
    loop.run(tiny(**{"task.eval_problems": 0}), workdir)
  assert not os.path.exists(workdir)


# ----------------------------------------------------------------------------------------------------
# Fallback to the newest intact checkpoint.
# ----------------------------------------------------------------------------------------------------

def _data_files(step_dir):
  return sorted(f for f in glob.glob(os.path.join(step_dir, "params", "**", "d", "*"), recursive=True)
                if os.path.isfile(f))


def corrupt(step_dir, how):
  if how == "params_deleted":
    shutil.rmtree(os.path.join(step_dir, "params"))
  elif how == "meta_corrupt":
    open(os.path.join(step_dir, "meta", "metadata"), "w").write('{"step": 4, "chec')
  else:
    for path in _data_files(step_dir):
      data = bytearray(open(path, "rb").read())
      if how == "truncated":
        data = data[:len(data) // 3]
      else:   # one flipped bit in the middle of every data file
        data[len(data) // 2] ^= 0x04
      open(path, "wb").write(bytes(data))


def test_corrupt_latest_checkpoint_falls_back_and_is_moved_aside(tmp_path, reference):
  ref_dir, ref_summary = reference
  workdir = str(tmp_path / "run")
  shutil.copytree(ref_dir, workdir)
  corrupt(os.path.join(workdir, "checkpoints", "4"), "params_deleted")
  summary = loop.run(tiny(**REFERENCE_CFG), workdir)
  aside = os.listdir(os.path.join(workdir, "checkpoints_corrupt"))
  assert len([a for a in aside if a.startswith("4.") and not a.endswith(".txt")]) == 1
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
  assert_same_values(step_rows(workdir), step_rows(ref_dir))      # steps 3-4 redone, each once
  assert summary["accuracy_after"] == ref_summary["accuracy_after"]


@pytest.mark.parametrize("how,reason", [("meta_corrupt", "meta record unreadable"),
                                        ("truncated", ""), ("bit_flip", "")])
def test_each_kind_of_corruption_is_detected_and_the_previous_checkpoint_restores(tmp_path, reference, how,
                                                                                  reason):
  """The restore step alone (the full resumed run is the test above): step 4 fails, step 2 restores."""
  workdir = str(tmp_path / "run")
  shutil.copytree(reference[0], workdir)
  corrupt(os.path.join(workdir, "checkpoints", "4"), how)
  cfg = tiny(**REFERENCE_CFG)
  prior = resume.inspect(workdir, cfg)
  restored = resume.restore(prior, loop._targets(cfg, make_placement(cfg)))
  assert (restored.kind, restored.step) == ("rl", 2)
  aside = [a for a in os.listdir(os.path.join(workdir, "checkpoints_corrupt")) if a.endswith(".reason.txt")]
  assert len(aside) == 1 and reason in open(os.path.join(workdir, "checkpoints_corrupt", aside[0])).read()
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]


def test_no_intact_checkpoint_is_an_error_and_nothing_moves(tmp_path, reference):
  workdir = str(tmp_path / "run")
  shutil.copytree(reference[0], workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
  for step in ("2", "4"):
    corrupt(os.path.join(workdir, "checkpoints", step), "params_deleted")
  before = snapshot(workdir)
  with pytest.raises(ResumeError,
                     match=r"no checkpoint restores intact(.|\n)*checkpoints/4(.|\n)*checkpoints/2"):
    loop.run(tiny(**REFERENCE_CFG), workdir)
  assert snapshot(workdir) == before


def test_keep_checkpoints_holds_after_a_crash(tmp_path, reference):
  workdir = str(tmp_path / "run")
  shutil.copytree(reference[0], workdir)
  # As if killed between a save and its clean-up: three checkpoints with keep_checkpoints=2.
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
  shutil.copytree(os.path.join(workdir, "checkpoints", "2"), os.path.join(workdir, "checkpoints", "1"))
  loop.run(tiny(**REFERENCE_CFG), workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]


# ----------------------------------------------------------------------------------------------------
# Exactly-once outputs.
# ----------------------------------------------------------------------------------------------------

class Crash(Exception):
  pass


def test_crash_mid_run_then_resume_records_every_step_once(tmp_path, monkeypatch, reference):
  ref_dir, _ = reference
  workdir = str(tmp_path / "run")
  real = loop.phases.rl_step

  def crashing(setup, programs, state, ref, step, *args):
    if step == 3:        # steps 1-3 done (checkpoint at 2, metrics row 3 written), crash inside step 4
      raise Crash()
    return real(setup, programs, state, ref, step, *args)

  cfg = tiny(**REFERENCE_CFG)
  monkeypatch.setattr(loop.phases, "rl_step", crashing)
  with pytest.raises(Crash):
    loop.run(cfg, workdir)
  assert [r["step"] for r in step_rows(workdir)] == [1, 2, 3]
  monkeypatch.setattr(loop.phases, "rl_step", real)
  loop.run(cfg, workdir)
  rows = metrics_lib.read_metrics(workdir)
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 4]   # the final evaluation: once
  with open(metrics_lib.eval_examples_path(workdir), encoding="utf-8") as f:   # and its held-out responses
    assert [json.loads(line)["step"] for line in f] == [0] * 8 + [2] * 8 + [4] * 8
  assert_same_values(step_rows(workdir), step_rows(ref_dir))
  trains = [i.step for i in timeline_lib.load_timeline(timeline_lib.timeline_path(workdir)).intervals
            if i.name == "train"]
  assert trains == [0, 1, 2, 3]


def test_warmup_is_checkpointed_and_a_resume_continues_it(tmp_path, monkeypatch):
  cfg = tiny(**{"warmup.steps": 4, "warmup.checkpoint_every": 2, "run.steps": 1})
  straight = str(tmp_path / "straight")
  loop.run(cfg, straight)

  workdir = str(tmp_path / "run")
  real = loop.phases.step_lib.make_sft_step
  calls = {"n": 0}

  def crashing_step(*args, **kwargs):
    step = real(*args, **kwargs)

    def wrapped(*a):
      calls["n"] += 1
      if calls["n"] == 4:     # warm-up steps 1-3 done, checkpoint at 2
        raise Crash()
      return step(*a)
    return wrapped

  monkeypatch.setattr(loop.phases.step_lib, "make_sft_step", crashing_step)
  with pytest.raises(Crash):
    loop.run(cfg, workdir)
  assert Checkpointer(os.path.join(workdir, "warmup_checkpoints"), create=False).steps() == [2]
  calls["n"] = -100        # the resumed warm-up runs steps 3 and 4 only
  loop.run(cfg, workdir)
  assert calls["n"] == -98
  a, b = metrics_lib.read_metrics(straight), metrics_lib.read_metrics(workdir)
  assert a[0]["eval/accuracy"] == b[0]["eval/accuracy"]
  assert_same_values(step_rows(workdir), step_rows(straight))


# ----------------------------------------------------------------------------------------------------
# SIGKILL at a random point of the real binary, then resume.
# ----------------------------------------------------------------------------------------------------

BINARY_FLAGS = ["--config.model.hidden_size=32", "--config.model.num_layers=1", "--config.model.scan_unroll=1",
                "--config.model.num_heads=4",
                "--config.model.num_kv_heads=2", "--config.model.intermediate_size=64",
                "--config.task.eval_problems=16", "--config.rollout.num_prompts=4",
                "--config.rollout.group_size=4", "--config.warmup.steps=6", "--config.warmup.batch_size=16",
                "--config.warmup.checkpoint_every=2", "--config.run.steps=6", "--config.run.checkpoint_every=2",
                "--config.run.eval_every=3", "--config.run.progress_every_s=0",
                # StaleSync (s = 1, f = 0.5): the checkpoints carry the queue and in-flight samples.
                "--config.stalesync.enabled=True", "--config.stalesync.max_staleness=1",
                "--config.stalesync.train_fraction=0.5", "--config.rollout.num_slots=32"]


def _binary(workdir, log=None):
  """The binary on ``workdir``; its output to pipes, or to the open file ``log`` (for a run nothing reads
  while it runs: a full pipe would stall it)."""
  env = launch.child_env()
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "grpo_main.py"),
         "--config=" + os.path.join(ROOT, "experiments", "configs", "arithmetic.py"),
         f"--workdir={workdir}", f"--compilation_cache={launch.TEST_CACHE}", *BINARY_FLAGS]
  out = log or subprocess.PIPE
  return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                          text=True)


def _finish(proc):
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  return out


RUN_STEPS = 6   # --config.run.steps above


def _complete_metric_rows(workdir):
  """The rows of metrics.jsonl that are whole lines (one still being written is left out)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  return [json.loads(line) for line in open(path).read().split("\n")[:-1] if line.strip()]


def _finished_checkpoint_steps(folder):
  """Steps of the finished checkpoints in ``folder`` (orbax writes into '<step>.orbax-checkpoint-tmp' first)."""
  return sorted(int(name) for name in os.listdir(folder) if name.isdigit()) if os.path.isdir(folder) else []


def test_sigkill_at_a_random_point_then_resume_equals_uninterrupted(tmp_path):
  seed = int(os.environ.get("RLFJ_KILL_SEED", time.time_ns()))
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  _finish(_binary(straight))
  # The kill point, at random: 0 = in the warm-up (once its checkpoint folder exists), m >= 1 = once m
  # metric rows are complete (row 1: the eval before RL; row m: RL step m - 1). m <= RUN_STEPS leaves at
  # least the last step, its checkpoint and the summary to do. After rows 3 and 5 the run is writing a
  # checkpoint asynchronously: the kill lands in it or just after.
  point = random.Random(seed).randint(0, RUN_STEPS)
  reached = ((lambda: os.path.isdir(os.path.join(killed, "warmup_checkpoints"))) if point == 0 else
             (lambda: len(_complete_metric_rows(killed)) >= point))
  log_path = tmp_path / "killed.log"
  with open(log_path, "w") as log:
    proc = _binary(killed, log)
  deadline = time.monotonic() + 300
  while not reached():
    assert proc.poll() is None, f"the run ended before kill point {point}: {log_path.read_text()[-3000:]}"
    assert time.monotonic() < deadline, f"kill point {point} not reached in 300 s"
    time.sleep(0.01)
  # Stopped first, so that what it wrote by the moment of the kill can be checked: the kill must land
  # mid-run, or resuming below would prove nothing.
  proc.send_signal(signal.SIGSTOP)
  try:
    assert proc.poll() is None, f"the run had finished before it was stopped (kill point {point})"
    steps = [r["step"] for r in _complete_metric_rows(killed)]
    checkpoints = _finished_checkpoint_steps(os.path.join(killed, "checkpoints"))
    assert not os.path.exists(os.path.join(killed, "summary.json")), (point, steps, checkpoints)
    assert max(checkpoints, default=-1) < RUN_STEPS, (point, steps, checkpoints)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
  assert proc.returncode == -signal.SIGKILL
  print(f"killed at point {point}: metric rows of steps {steps}, checkpoints {checkpoints} "
        f"(RLFJ_KILL_SEED={seed} repeats the point)")
  out = _finish(_binary(killed))
  assert "accuracy before RL" in out
  rows = metrics_lib.read_metrics(killed)
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
  assert_same_values(step_rows(killed), step_rows(straight))
  for a, b in zip(step_rows(killed), step_rows(straight)):
    for key in ("stalesync/generated_groups_total", "stalesync/trained_groups_total", "data_position",
                "stalesync/staleness_mean"):
      assert a[key] == b[key], (a["step"], key)
  last = step_rows(killed)[-1]      # nothing lost or duplicated: every generated group is accounted for
  assert last["stalesync/generated_groups_total"] == (last["stalesync/trained_groups_total"]
                                                      + last["stalesync/discarded_groups_total"]
                                                      + last["stalesync/waiting_samples_after"] / 4)
  assert json.load(open(os.path.join(killed, "summary.json"))) == \
      json.load(open(os.path.join(straight, "summary.json")))


def test_a_run_saved_before_a_rename_or_a_new_field_compares_equal():
  # stalesync.rollout_fraction became stalesync.train_fraction; algo.ppo_epochs did not exist then: at its
  # default (1) it is no change, at 2 it is one.
  from rl_fusion_jax.orchestration import resume as resume_lib
  saved = {"stalesync": {"rollout_fraction": 0.5}, "algo": {"clip_low": 0.2}}
  assert resume_lib.compare(saved, {"stalesync": {"train_fraction": 0.5},
                                    "algo": {"clip_low": 0.2, "ppo_epochs": 1}}) == {}
  assert resume_lib.compare(saved, {"stalesync": {"train_fraction": 0.25}, "algo": {"clip_low": 0.2, "ppo_epochs": 2}}
                            ) == {"stalesync.train_fraction": (0.5, 0.25), "algo.ppo_epochs": ("<absent>", 2)}
