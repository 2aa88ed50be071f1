"""README.md's and docs/*.md's commands run as written, with their steps cut down (slow: several minutes;
``-m slow``).

Every ``python experiments/<binary>.py`` command that ``readme_test.documents_commands`` finds (README.md,
then docs/*.md in name order) is run once, in that order, as a subprocess on the CPU default, with only
these changes: placeholders (DIR, DIR_OUT, RUN_DIR, ...) become folders this test made (a run of an
earlier command, a tiny chat checkpoint, a GSM8K-format file; DIR_S0..2 and DIR_PPO of the curves command
are the main job with seeds 0-2 and its PPO variant), ``--workdir`` / ``--out`` / ``--results`` point into
the test's folder, and the steps are cut: ``CUT`` appended to a ``--config`` command (the last value of a
flag wins), ``--quick`` to the ablation, fewer measured steps to the step-time benchmark; then every
``<config>.py:<variant>`` the documents name, as grpo_main.py cut the same way. The commands that cannot
run here are listed in ``NOT_RUN`` with the reason and the test that runs their shape instead; a command
that is neither run nor listed fails the test.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import readme_test
from rl_fusion_jax.testing import chat_fixture
from rl_fusion_jax.testing import launch

ROOT = readme_test.ROOT
CUT = ["--config.run.steps=6", "--config.warmup.steps=4", "--config.task.eval_problems=8",
       "--config.task.eval_samples=0", "--config.run.eval_every=0", "--config.run.checkpoint_every=3"]
# Commands not run here (a substring of the command -> why, and what runs its shape).
NOT_RUN = {
    "fetch_model_main.py": "downloads from the package registry; tests/real_model_test.py (-m real_model) "
                           "runs on its output",
    "gguf_parity_main.py": "needs transformers in its own environment; tests/gguf_io_test.py checks the import",
    "benchmark_real_generate.py": "needs the fetched SmolLM2 folder and transformers in its own environment (a "
                                  "benchmark: BENCHMARKS.md); tests/engine_test.py runs the engine it times",
    "smollm2_word_problems.py": "needs the fetched SmolLM2 folder (an hour's RL run: BENCHMARKS.md); "
                                "tests/real_model_test.py (-m real_model) runs one step of the config on it",
    "--num_processes=2": "two processes of one run: tests/multihost_run_test.py (-m multihost)",
    "--config=...": "any config under srun: the grpo_main.py commands run here",
    "report_main.py --workdir=/tmp/report --results": "the full report (~50 min); its --quick shape runs here",
    "report_main.py --workdir=/tmp/report_q --quick": "tests/report_test.py runs it",
    "report_main.py --from_results": "renders RESULTS.md from results/ (~7 min, the simulator's cluster tables "
                                     "included); tests/report_test.py renders its quick report's data the "
                                     "same way and checks RESULTS.md's Table 1 against results/runs",
    "simulate_main.py --ablation=results/runs/ablation.json": "exits with status 1 as written (by design: the "
                                                             "worst held-out error on the committed runs, 16.1%, "
                                                             "exceeds the default --tolerance of 15%); "
                                                             "tests/sim_test.py runs the validation",
    "simulate_main.py --cluster --out": "the cluster tables (~5 min); the --cluster --quick command runs here",
}


def _not_run(argv: list[str]) -> str | None:
  line = " ".join(argv)
  return next((why for key, why in NOT_RUN.items() if key in line), None)


@pytest.mark.slow
def test_readme_commands_run_cut_down(tmp_path):
  commands = readme_test.documents_commands()
  ckpt = chat_fixture.make_chat_checkpoint(tmp_path / "chat_ckpt")
  gsm8k = chat_fixture.write_gsm8k(tmp_path / "train.jsonl")
  env = launch.child_env()
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  runs: list[str] = []      # workdirs of the grpo_main runs so far (what DIR means for the tools)
  made: dict[str, str] = {}

  def run_for(placeholder: str) -> str:
    """DIR_S<k>: the main job with run.seed k; DIR_PPO: its PPO variant (the curves command's groups);
    any other placeholder: the last run."""
    seed = re.fullmatch(r"DIR_S(\d)", placeholder)
    if not (seed or placeholder == "DIR_PPO"):
      return runs[-1]
    if placeholder not in made:
      config = "arithmetic.py" + ("" if seed else ":ppo")
      workdir = tmp_path / placeholder
      extra = [f"--config.run.seed={seed.group(1)}"] if seed else []
      proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "grpo_main.py"),
                             f"--config={ROOT / 'experiments' / 'configs' / config}", f"--workdir={workdir}",
                             *CUT, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
      assert proc.returncode == 0, (placeholder, proc.stderr[-3000:])
      made[placeholder] = str(workdir)
    return made[placeholder]

  ran = 0
  # Then every <config>.py:<variant> the documents name (grpo_main.py, cut the same way), unless a command
  # above already ran it.
  variants = [v for v in readme_test.readme_variants(readme_test.documents_text())
              if not any(v[1] in " ".join(c) for c in commands)]
  for i, argv in enumerate(commands + variants):
    if _not_run(argv):
      continue
    binary = argv[0]
    args = []
    for arg in argv[1:]:
      name, _, value = arg.partition("=")
      if name == "--workdir" and binary.endswith(("grpo_main.py", "separated_main.py", "ablation_main.py")):
        value = str(tmp_path / f"run{i}")
      elif name == "--config.model.hf_path":
        value = ckpt
      elif name == "--config.task.kwargs.path":
        value = gsm8k
      elif name in ("--out", "--results"):
        value = str(tmp_path / f"out{i}" / pathlib.Path(value).name)
      elif readme_test.PLACEHOLDER.fullmatch(value or ""):
        value = run_for(value)
      args.append(f"{name}={value}" if _ or value else name)
    if any(a.startswith("--config=") for a in args):
      args += CUT
      if "gsm8k_chat" in " ".join(args):
        args += ["--config.model.dtype=float32", "--config.rollout.num_prompts=4",
                 "--config.rollout.group_size=2", "--config.rollout.max_prompt_len=48",
                 "--config.rollout.max_new_tokens=8"]
        # A variant named in prose (gsm8k_chat.py:cpu) runs on the short problems too: the config's own
        # sample file renders past 48 tokens with the tiny checkpoint's tokenizer.
        if not any(a.startswith("--config.task.kwargs.path=") for a in args):
          args.append(f"--config.task.kwargs.path={gsm8k}")
    if binary.endswith("ablation_main.py"):
      args.append("--quick")
    if binary.endswith("simulate_main.py"):
      args = [a for a in args if not a.startswith("--warm_steps")] + ["--warm_steps=2"]
    if binary.endswith("benchmark_main.py"):
      args += ["--steps=2", "--warmup_steps=0"]
    os.makedirs(tmp_path / f"out{i}", exist_ok=True)
    proc = subprocess.run([sys.executable, str(ROOT / binary), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (binary, args, proc.stderr[-3000:])
    if binary.endswith(("grpo_main.py", "separated_main.py")):
      runs.append(str(tmp_path / f"run{i}"))
    ran += 1
  assert ran >= 10 and runs
