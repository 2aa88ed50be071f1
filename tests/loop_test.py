"""The GRPO loop end to end on 8 devices: bad input fails before anything is written; resume is exact."""
import dataclasses
import json
import os
import shutil

import pytest

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.orchestration import loop
from rl_fusion_jax.rewards import make_task
from rl_fusion_jax.testing.experiments import tiny
from rl_fusion_jax.testing.tiny import save_tiny_reward_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("overrides,match", [
    ({"task.name": "arithmetics"}, "unknown task 'arithmetics'"),
    ({"task.kwargs": {"max_digitz": 2}}, "max_digitz"),
    ({"mesh.fsdp": 3}, "config.mesh"),
    ({"rollout.num_prompts": 3}, "rollout.num_prompts"),
    ({"rollout.max_prompt_len": 3}, "max_prompt_len"),
    ({"model.vocab_size": 50}, "vocab_size"),
    ({"model.hf_path": "/nonexistent/model"}, "config.model.hf_path"),
    ({"task.tokenizer": "/nonexistent/tokenizer.json"}, "/nonexistent/tokenizer.json"),
])
def test_bad_input_fails_before_anything_is_written(tmp_path, overrides, match):
  workdir = str(tmp_path / "run")
  with pytest.raises((ValueError, FileNotFoundError), match=match):
    loop.run(tiny(**overrides), workdir)
  assert not os.path.exists(workdir)


def test_group_size_must_divide_batch():
  with pytest.raises(ValueError, match="micro_batches"):
    tiny(**{"optim.micro_batches": 3})


def test_run_writes_outputs(tmp_path):
  straight = str(tmp_path / "straight")
  summary = loop.run(tiny(**{"run.checkpoint_every": 1}), straight, export_hf=str(tmp_path / "final_hf"))
  records = metrics_lib.read_metrics(straight)
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3]
  for key in ("reward", "accuracy", "entropy", "response_len_mean", "generate_tokens_per_s",
              "train_tokens_per_s", "step_s", "grad_norm", "train_width", "engine/decode_chunks",
              "engine/prefill_calls", "engine/prefill_rows", "engine/reprefill_rows"):
    assert key in steps[0], key
  # Rows are cut to the longest sample, rounded up to a width bucket (step.train_width), never wider.
  assert all(r["train_width"] <= 12 and r["train_width"] % 4 == 0 for r in steps)
  assert json.load(open(os.path.join(straight, "summary.json"))) == summary
  assert json.load(open(os.path.join(straight, "config.json")))["rollout"]["num_prompts"] == 4
  assert sorted(os.listdir(os.path.join(straight, "checkpoints"))) == ["2", "3"]   # keep_checkpoints=2
  # Each evaluation (before RL and after step 3) writes its greedy responses to the held-out problems
  # (all 8: task.eval_examples defaults to 8); scored again here by the task, they give its accuracy.
  with open(metrics_lib.eval_examples_path(straight), encoding="utf-8") as f:
    examples = [json.loads(line) for line in f]
  held_out = make_task("arithmetic", max_digits=2, seed=tiny().task.eval_seed)
  for step, accuracy in ((0, summary["accuracy_before"]), (3, summary["accuracy_after"])):
    mine = [e for e in examples if e["step"] == step]
    assert [e["problem"] for e in mine] == list(range(8))
    problems = [held_out.problem(e["problem"]) for e in mine]
    assert [e["prompt"] for e in mine] == [p.prompt for p in problems]
    assert [e["answer"] for e in mine] == [p.answer for p in problems]
    assert [e["correct"] for e in mine] == [held_out.score(p, e["response"]).correct for p, e in zip(problems, mine)]
    assert sum(e["correct"] for e in mine) / 8 == pytest.approx(accuracy)
  assert len(examples) == 16

  # Resume (exact values, fallback, exactly-once outputs) is tested in resume_test.py.

  # The exported final policy loads (model.hf_path, no warm-up) and evaluates as the run's last
  # evaluation did: greedy decoding of the same held-out problems under the same weights.
  start = config_lib.as_dict(tiny(**{"warmup.steps": 0, "run.steps": 0}))
  start["model"] = {"hf_path": str(tmp_path / "final_hf"), "scan_unroll": 2}
  again = loop.run(config_lib.experiment_from_dict(start), str(tmp_path / "again"))
  assert again["eval_before"] == summary["eval_after"]


FIXTURES = os.path.join(ROOT, "rl_fusion_jax", "testing", "hf_fixtures")


def hf_config(path, **overrides):
  """tiny() with the model read from an HF folder (hf_path, and scan_unroll: the fixtures' 2 layers
  unrolled, as tiny() does, see rl_fusion_jax/testing/experiments.py)."""
  c = config_lib.as_dict(tiny())
  c["model"] = {"hf_path": path, "scan_unroll": 2}
  c.update(overrides)
  return c


def test_run_from_hf_checkpoint(tmp_path):
  cfg = config_lib.experiment_from_dict(hf_config(os.path.join(FIXTURES, "qwen2_f32")))
  assert cfg.model.config.vocab_size == 96 and cfg.model.config.model_type == "qwen2"
  summary = loop.run(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, steps=1)),
                     str(tmp_path / "run"))
  assert 0 <= summary["accuracy_after"] <= 1


def test_hf_config_disagreement_is_named():
  c = hf_config(os.path.join(FIXTURES, "qwen2_f32"))
  c["model"]["hidden_size"] = 7
  with pytest.raises(ValueError, match="config.model.hidden_size=7 disagrees"):
    config_lib.experiment_from_dict(c)


def test_malformed_hf_checkpoint_fails_before_writing(tmp_path):
  bad = tmp_path / "bad_model"
  shutil.copytree(os.path.join(FIXTURES, "qwen2_f32"), bad)
  (bad / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="config.json: malformed JSON"):
    config_lib.experiment_from_dict(hf_config(str(bad)))
  # Valid config.json but a truncated weights file: caught by validate() before the workdir exists.
  shutil.copy(os.path.join(FIXTURES, "qwen2_f32", "config.json"), bad / "config.json")
  weights = bad / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:1000])
  cfg = config_lib.experiment_from_dict(hf_config(str(bad)))
  with pytest.raises(ValueError, match="model.safetensors"):
    loop.run(cfg, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode", ["colocated", "full", "hybrid"])
def test_learned_reward_model_adds_its_score(tmp_path, mode):
  rm_path = str(tmp_path / "rm")
  save_tiny_reward_model(rm_path)
  cfg = tiny(**{"task.reward_model": rm_path, "task.reward_model_weight": 0.5, "run.steps": 1,
                "fusion.mode": mode, **({"fusion.aux_devices": 4} if mode == "hybrid" else {})})
  loop.run(cfg, str(tmp_path / "run"))
  row = [r for r in metrics_lib.read_metrics(str(tmp_path / "run")) if "loss" in r][0]
  assert row["reward_model_score"] != 0.0
  # reward = verifier reward (format 0.1 + correct 1.0) + 0.5 * score, averaged over the batch.
  assert row["reward"] == pytest.approx(0.1 * row["format_rate"] + row["accuracy"]
                                        + 0.5 * row["reward_model_score"], abs=1e-5)
  if mode == "hybrid":
    # The aux stage scored every sample on the aux devices as it finished, inside the generate phase.
    from rl_fusion_jax.timeline import load_timeline, timeline_path  # pylint: disable=g-import-not-at-top
    data = load_timeline(timeline_path(str(tmp_path / "run")))
    scored = [i for i in data.intervals if i.name == "reward_model" and i.step == 0]
    gen = next(i for i in data.intervals if i.name == "generate" and i.step == 0)
    assert scored and {i.group for i in scored} == {"aux"} and any(i.start < gen.end for i in scored)
    assert row["aux_stage/early_frac"] == 1.0


def test_reward_model_on_packed_rows_equals_the_padded_rows(tmp_path):
  # With optim.pack_rows the reward model scores the packed rows (no padded batch): the same first step.
  rm_path = str(tmp_path / "rm")
  save_tiny_reward_model(rm_path)
  over = {"task.reward_model": rm_path, "task.reward_model_weight": 0.5, "run.steps": 1, "algo.kl_coef": 0.05}
  loop.run(tiny(**over), str(tmp_path / "padded"))
  loop.run(tiny(**over, **{"optim.pack_rows": True}), str(tmp_path / "packed"))
  a, b = ([r for r in metrics_lib.read_metrics(str(tmp_path / w)) if "loss" in r][0] for w in ("padded", "packed"))
  assert "pack/rows" in b and "pack/rows" not in a
  for key in ("reward_model_score", "reward", "loss", "grad_norm", "kl"):
    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_reward_model_with_wrong_shapes_fails_at_start(tmp_path):
  import safetensors.numpy
  rm_path = tmp_path / "rm"
  save_tiny_reward_model(str(rm_path))
  tensors = safetensors.numpy.load_file(str(rm_path / "model.safetensors"))
  tensors["score.weight"] = tensors["score.weight"][:, :-1]
  safetensors.numpy.save_file(tensors, str(rm_path / "model.safetensors"))
  with pytest.raises(ValueError, match="score.weight"):
    loop.run(tiny(**{"task.reward_model": str(rm_path)}), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_tensorboard_without_tensorboardx_fails_before_writing(tmp_path, monkeypatch):
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "tensorboardX" else real(name, *a))
  with pytest.raises(ValueError, match="tensorboardX"):
    loop.run(tiny(), str(tmp_path / "run"), tensorboard=True)
  assert not (tmp_path / "run").exists()


def test_prompt_length_is_checked_for_every_problem_not_a_sample(tmp_path):
  """Countdown index 0..31 fit in 16 tokens, later ones ("10 10 10 -> 110:") do not: refused at start."""
  from rl_fusion_jax.rewards.registry import make_task
  from rl_fusion_jax.tokenizer import CharTokenizer
  task, tok = make_task("countdown", seed=0, max_number=10), CharTokenizer()
  assert max(1 + len(tok.encode(task.problem(i).prompt)) for i in range(32)) <= 16
  over = {"task.name": "countdown", "task.kwargs": {"max_number": 10}, "rollout.max_prompt_len": 16,
          "rollout.max_new_tokens": 12}
  with pytest.raises(ValueError, match="config.rollout.max_prompt_len=16: task 'countdown' has prompts of "
                                       "up to 18 tokens"):
    loop.run(tiny(**over), str(tmp_path / "run"))
  over["rollout.max_prompt_len"] = 18
  with pytest.raises(ValueError, match="config.rollout.max_new_tokens=12: warm-up rows"):
    loop.run(tiny(**over), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_packed_rows_update_equals_the_padded_update(tmp_path):
  """Same first update (same data, same params) with optim.pack_rows; rows really hold several samples."""
  # Rows of 16 + 8 tokens; after a short warm-up, samples of ~6-10 tokens: two or three share a row.
  over = {"rollout.num_prompts": 16, "run.steps": 1, "rollout.max_prompt_len": 16, "rollout.max_new_tokens": 8,
          "model.max_position_embeddings": 32, "warmup.steps": 40, "warmup.learning_rate": 3e-3}
  padded, packed = str(tmp_path / "padded"), str(tmp_path / "packed")
  loop.run(tiny(**over), padded)
  loop.run(tiny(**{**over, "optim.pack_rows": True}), packed)
  a = [r for r in metrics_lib.read_metrics(padded) if "loss" in r][0]
  b = [r for r in metrics_lib.read_metrics(packed) if "loss" in r][0]
  for key in ("loss", "grad_norm", "entropy", "ratio", "reward"):
    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
  assert b["pack/rows_used"] < 32 and b["pack/rows"] % 8 == 0 and "pack/rows" not in a
  # The samples went straight from the host as one byte stream per data-parallel group (8 here), with 6
  # 16-bit numbers per sample, the version base and the rewards (float32); the padded update would place
  # [32, train_width] rows of tokens, log-probs and versions (int32 / float32).
  per_sample = 16 * 32 + 4
  assert b["queue/link_bytes/host_to_device"] == 8 * b["pack/stream_bytes"] + per_sample
  assert b["queue/link_bytes/host_to_device_padded"] == 12 * 32 * b["train_width"] + per_sample
  assert b["pack/stream_used_bytes"] <= 8 * b["pack/stream_bytes"]
  assert b["queue/link_bytes/host_to_device"] < b["queue/link_bytes/host_to_device_padded"]
  assert a["queue/link_bytes/engine_to_host"] < a["queue/link_bytes/engine_to_host_padded"]
  with pytest.raises(ValueError, match="config.optim.pack_rows"):
    tiny(**{"optim.pack_rows": True, "algo.policy_loss": "tis_seq"})


def test_sampled_evaluation_reports_pass_at_k(tmp_path):
  # At temperature 0 the sampling engine decodes greedily: every one of the n samples of a problem is the
  # greedy response, so pass@1 = pass@k = greedy accuracy exactly (the estimator and the bookkeeping of
  # sample ids, problems and counts all have to line up for that to hold).
  cfg = tiny(**{"task.eval_samples": 4, "task.pass_k": 2, "rollout.temperature": 0.0, "run.steps": 1,
                "task.kwargs": {"max_digits": 1, "ops": "+"}, "warmup.steps": 60, "warmup.batch_size": 32,
                "warmup.learning_rate": 1e-2})
  summary = loop.run(cfg, str(tmp_path / "greedy"))
  for when in ("eval_before", "eval_after"):
    ev = summary[when]
    assert ev["pass@1"] == ev["pass@2"] == ev["accuracy"], ev
  assert summary["eval_before"]["accuracy"] > 0     # the check above is not 0 == 0
  # Both are in the metrics of step 0 and of the last step, as in the summary.
  rows = metrics_lib.read_metrics(str(tmp_path / "greedy"))
  assert (rows[0]["eval/pass@2"], rows[-1]["eval/pass@2"]) == (summary["eval_before"]["pass@2"],
                                                               summary["eval_after"]["pass@2"])


def test_group_relative_advantages_refuse_groups_of_one():
  with pytest.raises(ValueError, match="config.rollout.group_size: the group-relative advantage 'grpo'"):
    tiny(**{"rollout.group_size": 1})


def test_a_fixed_warmup_seed_gives_every_run_seed_the_same_start(tmp_path):
  # warmup.seed fixes the init and the warm-up data: runs that differ only in run.seed evaluate the same
  # warmed-up policy before RL, then part ways (the RL problems and sampling streams follow run.seed).
  runs = {}
  for seed in (1, 2):
    cfg = tiny(**{"run.seed": seed, "warmup.seed": 0, "warmup.steps": 4, "run.steps": 1,
                  "task.eval_samples": 2, "task.pass_k": 2})
    loop.run(cfg, str(tmp_path / f"s{seed}"))
    runs[seed] = metrics_lib.read_metrics(str(tmp_path / f"s{seed}"))
  assert runs[1][0] == runs[2][0]               # the step-0 line: evaluation of the warmed-up policy
  assert runs[1][1]["entropy"] != runs[2][1]["entropy"]   # other RL problems and samples


def test_rl_warmup_and_heldout_problem_streams_are_distinct():
  from rl_fusion_jax.orchestration.setup import validate
  setup = validate(tiny(**{"run.seed": 1, "warmup.seed": 0}), 8)
  assert (setup.train_task.seed, setup.warmup_task.seed, setup.eval_task.seed) == (2, 1, 10_000)
  with pytest.raises(ValueError, match="config.task.eval_seed=2: the held-out problems would be"):
    validate(tiny(**{"run.seed": 1, "task.eval_seed": 2}), 8)
