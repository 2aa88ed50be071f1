"""Pulse: the real binary, 2 GRPO steps of the main config, on the CPU default (one device per core)."""
import json
import os
import subprocess
import sys

import pytest
from rl_fusion_jax.testing import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The main job with two epochs over each batch: the second epoch's loss is the first update's batch
# scored after that update, so it falls when the update improved the objective it followed, and stays
# (or rises) when learning is broken: no gradient, no optimizer step, a flipped sign, all-zero advantages.
# 20 warm-up steps make the policy print integers often enough (the format reward) that every step's
# groups differ in reward. Measured with this command on a 2-core AMD EPYC (run.seed 0, 1, 2; steps 1 and
# 2 each): the loss fell by 4.0% to 14.5% of its value (rewards 0.085-0.110, mean |advantage| 0.29-0.63).
# MARGIN: a quarter of the smallest fall measured.
LEARNS = ["--config.algo.ppo_epochs=2", "--config.warmup.steps=20"]
MARGIN = 0.01


@pytest.mark.parametrize("variant", ["", ":moe"])
def test_grpo_main_runs_two_steps(tmp_path, variant):
  """The main job, and its MoE variant (experts over the 2 default devices in both phases; one of its four
  layers: the placement and the router's metrics are per layer alike, and the compile is a quarter)."""
  env = launch.child_env()
  workdir = tmp_path / "run"
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "grpo_main.py"),
         "--config=" + os.path.join(ROOT, "experiments", "configs", "arithmetic.py") + variant,
         f"--workdir={workdir}", "--config.run.steps=2", "--config.warmup.steps=2",
         "--config.task.eval_problems=16", f"--compilation_cache={launch.TEST_CACHE}",
         # Sampled evaluation (pass@k, the main job's task.eval_samples=8) in the main job's run; the MoE run
         # evaluates greedily only: its sampling is the rollout's, every RL step.
         *(LEARNS if not variant else ["--config.task.eval_samples=0", "--config.model.num_layers=1"])]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "accuracy before RL" in proc.stdout
  lines = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  rl = [l for l in lines if "loss" in l]
  assert [l["step"] for l in rl] == [1, 2]
  summary = json.load(open(workdir / "summary.json"))
  evals = [l for l in lines if "eval/accuracy" in l]
  assert (evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]) == (summary["accuracy_before"],
                                                                      summary["accuracy_after"])
  assert ("pass@8" in summary["eval_after"]) == (not variant)
  if not variant:      # the update moved the policy the way its advantages point
    for l in rl:
      assert l["advantage_abs_mean"] > 0, l
      assert l["ppo/epoch1/loss"] < l["ppo/epoch0/loss"] - MARGIN * abs(l["ppo/epoch0/loss"]), l
  config = json.load(open(workdir / "config.json"))
  assert config["run"]["steps"] == 2
  if variant == ":moe":
    assert config["model"]["config"]["num_experts"] == 8
    assert all(l["moe/load_balance_loss"] > 0 for l in lines if "loss" in l)


def test_grpo_main_rejects_config_typo(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "grpo_main.py"),
         "--config=" + os.path.join(ROOT, "experiments", "configs", "arithmetic.py"),
         f"--workdir={tmp_path / 'run'}", "--config.rollout.temprature=0.5"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: --config.rollout.temprature: config.rollout has no field 'temprature'; "
      "did you mean --config.rollout.temperature?")
  assert len(proc.stderr.strip().splitlines()) <= 3    # one line, not a traceback
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,error", [
    ("task.eval_problems=0", "config.task.eval_problems: must be >= 1, got 0"),
    # ModelConfig's own checks (tests/config_test.py tries every model field in-process).
    ("model.dtype=float16", "config.model.dtype: must be one of ('float32', 'bf16_matmul', 'bfloat16', "
                            "'auto'), got 'float16'"),
])
def test_grpo_main_reports_bad_values_in_one_line(tmp_path, override, error):
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "grpo_main.py"),
         "--config=" + os.path.join(ROOT, "experiments", "configs", "arithmetic.py"),
         f"--workdir={tmp_path / 'run'}", f"--config.{override}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == f"error: {error}"
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists()
