"""plot_metrics: loading, grouping seeds, bands, smoothing, the summary, bad input, and the binary.

Three synthetic runs: config "grpo" with seeds 0 and 1 (seed 1 stopped after step 3 and saved checkpoints
at another cadence, which must not split the group) and config "dr_grpo" without a reference model (no kl).
Expected bands and averages are worked out by hand in the comments.
"""
import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLOT_PATH = ROOT / "experiments" / "plot_metrics.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pm():
  spec = importlib.util.spec_from_file_location("plot_metrics", PLOT_PATH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module   # dataclasses look their module up while the file executes
  spec.loader.exec_module(module)
  yield module
  del sys.modules[spec.name]


def _config(advantage, seed, checkpoint_every=2):
  return {"algo": {"advantage": advantage, "kl_coef": 0.0}, "model": {"name": "tiny"},
          "run": {"seed": seed, "steps": 4, "eval_every": 2, "checkpoint_every": checkpoint_every}}


def _write(folder, config, rows):
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(config))
  (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(folder)


def _train(step, reward, kl=None, **more):
  row = {"step": step, "reward": reward, "accuracy": reward / 10, "entropy": 1.0, "response_len_mean": 20.0}
  return row | ({"kl": kl} if kl is not None else {}) | more


@pytest.fixture
def workdirs(tmp_path):
  a0 = _write(tmp_path / "grpo_s0", _config("grpo", 0), [
      {"step": 0, "eval/accuracy": 0.2, "eval/pass@1": 0.2, "eval/pass@8": 0.5, "eval/format_rate": 0.9},
      _train(1, 1.0, kl=0.0), _train(2, 2.0, kl=0.1, **{"eval/accuracy": 0.5, "eval/pass@8": 0.7}),
      _train(3, 3.0, kl=0.2), _train(4, 4.0, kl=0.3, **{"eval/accuracy": 0.8, "eval/pass@8": 0.9})])
  a1 = _write(tmp_path / "grpo_s1", _config("grpo", 1, checkpoint_every=4), [
      {"step": 0, "eval/accuracy": 0.4, "eval/pass@1": 0.4, "eval/pass@8": 0.6},
      _train(1, 3.0, kl=0.0), _train(2, 4.0, kl="nan", **{"eval/accuracy": 0.6}), _train(3, 5.0, kl=0.4)])
  b = _write(tmp_path / "drgrpo", _config("dr_grpo", 0), [
      {"step": 0, "eval/accuracy": 0.1}, _train(1, 0.5), _train(2, 1.5, **{"eval/accuracy": 0.3})])
  return [a0, a1, b]


# -------------------------------------------------------------------------------------------- loading


def test_load_run(pm, workdirs):
  run = pm.load_run(workdirs[1])
  assert run.steps.tolist() == [0, 1, 2, 3]
  assert run.config["run"]["seed"] == 1
  np.testing.assert_array_equal(run.metrics["reward"], [math.nan, 3.0, 4.0, 5.0])   # absent at step 0
  np.testing.assert_array_equal(run.metrics["eval/accuracy"], [0.4, math.nan, 0.6, math.nan])
  assert math.isnan(run.metrics["kl"][2])   # written as the string "nan"
  assert "step" not in run.metrics


# ------------------------------------------------------------------------------------------- grouping


def test_groups_seeds_of_one_config(pm, workdirs):
  groups = pm.group_runs([pm.load_run(w) for w in workdirs])
  # grpo_s0 and grpo_s1 differ only in run.seed and run.checkpoint_every: one group, in order of appearance.
  assert [[r.workdir for r in g.runs] for g in groups] == [workdirs[:2], workdirs[2:]]
  assert [g.label for g in groups] == ["algo.advantage=grpo", "algo.advantage=dr_grpo"]
  named = pm.group_runs([pm.load_run(w) for w in workdirs], ["GRPO", "Dr. GRPO"])
  assert [(g.label, len(g.runs)) for g in named] == [("GRPO", 2), ("Dr. GRPO", 1)]
  # One group: no field tells groups apart, so the label is the common start of the folder names.
  assert [g.label for g in pm.group_runs([pm.load_run(w) for w in workdirs[:2]])] == ["grpo"]


def test_band_by_hand(pm, workdirs):
  grpo = pm.group_runs([pm.load_run(w) for w in workdirs[:2]])[0]
  b = pm.band(grpo, "reward")
  # reward seed 0: 1 2 3 4 (steps 1-4); seed 1: 3 4 5 (steps 1-3). Step 1: mean (1 + 3) / 2 = 2, 1..3;
  # step 4 only seed 0 has: 4, 4..4 over one seed.
  assert b.steps.tolist() == [1, 2, 3, 4]
  np.testing.assert_allclose(b.mean, [2.0, 3.0, 4.0, 4.0])
  np.testing.assert_allclose(b.lo, [1.0, 2.0, 3.0, 4.0])
  np.testing.assert_allclose(b.hi, [3.0, 4.0, 5.0, 4.0])
  assert b.count.tolist() == [2, 2, 2, 1]
  # kl at step 2: seed 1 logged NaN, so the band there is seed 0's 0.1 alone; step 3: (0.2 + 0.4) / 2 = 0.3.
  kl = pm.band(grpo, "kl")
  np.testing.assert_allclose(kl.mean, [0.0, 0.1, 0.3, 0.3])
  assert kl.count.tolist() == [2, 1, 2, 1]
  # eval/accuracy only at eval steps: 0 -> (0.2 + 0.4) / 2 = 0.3, 2 -> (0.5 + 0.6) / 2 = 0.55, 4 -> 0.8.
  ev = pm.band(grpo, "eval/accuracy")
  assert ev.steps.tolist() == [0, 2, 4]
  np.testing.assert_allclose(ev.mean, [0.3, 0.55, 0.8])
  assert pm.band(grpo, "no_such_metric") is None
  assert pm.pass_at_k(grpo) == "eval/pass@8"


def test_smoothing_by_hand(pm, workdirs):
  np.testing.assert_allclose(pm.smooth(np.array([1.0, 2.0, 3.0, 4.0, 10.0]), 3),
                             [1.0, 1.5, 2.0, 3.0, 17 / 3])   # (1)/1, (1+2)/2, (1+2+3)/3, (2+3+4)/3, (3+4+10)/3
  np.testing.assert_array_equal(pm.smooth(np.array([5.0, 7.0]), 1), [5.0, 7.0])
  grpo = pm.group_runs([pm.load_run(w) for w in workdirs[:2]])[0]
  # Each seed smoothed over 2 points first: seed 0 -> 1, 1.5, 2.5, 3.5; seed 1 -> 3, 3.5, 4.5.
  b = pm.band(grpo, "reward", 2)
  np.testing.assert_allclose(b.mean, [2.0, 2.5, 3.5, 3.5])
  np.testing.assert_allclose(b.lo, [1.0, 1.5, 2.5, 3.5])
  np.testing.assert_allclose(b.hi, [3.0, 3.5, 4.5, 3.5])


def test_summary(pm, workdirs):
  grpo, dr = pm.group_runs([pm.load_run(w) for w in workdirs], ["grpo", "dr"])
  s = pm.summarise(grpo)
  assert s["first"] == dict(step=0, mean=pytest.approx(0.3), min=0.2, max=0.4, seeds=2)
  assert s["last"] == dict(step=4, mean=0.8, min=0.8, max=0.8, seeds=1)
  assert pm.format_summary(s) == ("grpo (2 seeds): eval/accuracy step 0: 0.300 [0.200..0.400] -> "
                                  "step 4: 0.800 (1 of 2 seeds)")
  assert pm.format_summary(pm.summarise(dr)) == "dr (1 seed): eval/accuracy step 0: 0.100 -> step 2: 0.300"


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("content, match", [
    (None, r"metrics.jsonl: no metrics file"),
    ("", r"metrics.jsonl: empty metrics file"),
    ('{"step": 0, "eval/accuracy": 0.1}\n{"step": 1, "reward": \n', r"metrics.jsonl:2: malformed JSON"),
    ('{"step": 0, "eval/accuracy": 0.1}\n\n{"reward": 1.0}\n', r"metrics.jsonl:3: expected an object with"),
    ('{"step": 1, "reward": [1]}\n', r"metrics.jsonl:1: reward: not a number"),
    ('{"step": 0, "eval/accuracy": 0.1}\n', r"metrics.jsonl: no RL steps"),
])
def test_bad_metrics_name_the_file(pm, tmp_path, content, match):
  (tmp_path / "config.json").write_text(json.dumps(_config("grpo", 0)))
  if content is not None:
    (tmp_path / "metrics.jsonl").write_text(content)
  with pytest.raises(ValueError, match=match) as info:
    pm.load_run(str(tmp_path))
  assert str(tmp_path / "metrics.jsonl") in str(info.value)


def test_bad_config_and_labels(pm, tmp_path, workdirs):
  (tmp_path / "grpo_s0" / "config.json").unlink()
  with pytest.raises(ValueError, match=r"grpo_s0/config.json: no config file"):
    pm.load_run(workdirs[0])
  (tmp_path / "grpo_s0" / "config.json").write_text("{oops")
  with pytest.raises(ValueError, match=r"grpo_s0/config.json: malformed JSON"):
    pm.load_run(workdirs[0])
  with pytest.raises(ValueError, match=r"--label: got 1 labels for 2 run groups"):
    pm.group_runs([pm.load_run(w) for w in workdirs[1:]], ["only one"])


# ----------------------------------------------------------------------------------------------- plot


def _assert_png(path):
  data = pathlib.Path(path).read_bytes()
  assert data[:8] == PNG_MAGIC
  assert len(data) > 20_000   # an empty 15x8-inch figure is a few KB; five panels of curves add more


def test_render_without_reference_model(pm, tmp_path, workdirs):
  groups = pm.group_runs([pm.load_run(workdirs[2])])   # no kl anywhere: the panel says so instead
  _assert_png(pm.render(groups, str(tmp_path / "sub" / "b.png")))


def test_binary(tmp_path, workdirs):
  out = tmp_path / "curves.png"
  cmd = [sys.executable, str(PLOT_PATH), *(f"--workdir={w}" for w in workdirs), f"--out={out}", "--smooth=2"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  _assert_png(out)
  assert proc.stdout.splitlines() == [
      "algo.advantage=grpo (2 seeds): eval/accuracy step 0: 0.300 [0.200..0.400] -> step 4: 0.800 (1 of 2 seeds)",
      "algo.advantage=dr_grpo (1 seed): eval/accuracy step 0: 0.100 -> step 2: 0.300",
      f"wrote {out}"]
  # Bad input: one line on stderr naming the file, exit status 1, nothing drawn.
  (tmp_path / "drgrpo" / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "reward": oops}\n')
  bad = tmp_path / "bad.png"
  proc = subprocess.run(cmd[:-2] + [f"--out={bad}"], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr == (
      f"error: {tmp_path / 'drgrpo' / 'metrics.jsonl'}:2: malformed JSON (Expecting value)\n")
  assert not bad.exists()
