"""Chat prompts: a checkpoint's template rendered as transformers renders it, its errors, and gsm8k_chat.py
end to end on a tiny chat checkpoint (rl_fusion_jax/testing/chat_fixture.py).

Every expected prompt here is written out by hand, never produced by the code under test.
"""
import json
import os
import runpy
import subprocess
import sys

import pytest
import tokenizers

from rl_fusion_jax import chat
from rl_fusion_jax import config as config_lib
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.orchestration import loop, setup
from rl_fusion_jax.rollout import engine as engine_lib
from rl_fusion_jax.testing import chat_fixture
from rl_fusion_jax.tokenizer import HFTokenizer, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_CHAT = os.path.join(ROOT, "experiments", "configs", "gsm8k_chat.py")
CUE = "\nEnd your answer with '#### <number>'."


@pytest.fixture(name="ckpt", scope="module")
def fixture_ckpt(tmp_path_factory):
  return chat_fixture.make_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")


def _edit_config(folder, **changes):
  path = os.path.join(folder, "tokenizer_config.json")
  config = json.load(open(path))
  config.update(changes)
  for key in [k for k, v in changes.items() if v is None]:
    del config[key]
  json.dump(config, open(path, "w"))
  return path


@pytest.fixture(name="copy")
def fixture_copy(ckpt, tmp_path):
  """A fresh copy of the checkpoint's tokenizer files, to edit."""
  folder = tmp_path / "tok"
  folder.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    (folder / name).write_bytes(open(os.path.join(ckpt, name), "rb").read())
  return str(folder)


# ----------------------------------------------------------------------------------------------------
# Rendering.
# ----------------------------------------------------------------------------------------------------

def test_render_matches_hand_written_chatml(ckpt):
  tok = HFTokenizer.from_file(ckpt)
  user = [{"role": "user", "content": "What is 2 plus 3?"}]
  assert tok.apply_chat_template(user) == (
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
      "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n"
      "<|im_start|>assistant\n")
  with_system = chat.one_turn("Hi", system_prompt="Be brief.")
  assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
  # Encoded as transformers' apply_chat_template(tokenize=True): no bos added, specials as single ids.
  ids = tok.encode_chat(user)
  assert ids[0] == tok.tokenizer.token_to_id("<|im_start|>")
  assert ids.count(tok.tokenizer.token_to_id("<|im_end|>")) == 2
  assert tok.decode(ids) == tok.apply_chat_template(user)


def test_environment_is_transformers(copy):
  """trim/lstrip blocks, loopcontrols, {% generation %}, tojson without HTML escapes, special tokens."""
  template = ("{{ bos_token }}\n"
              "{% for m in messages %}\n"
              "  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
              "{% generation %}[{{ m.role }}]{{ m.content | tojson }}{% endgeneration %}{{ eos_token }}\n"
              "{% endfor %}")
  _edit_config(copy, chat_template=template, bos_token="<|endoftext|>")
  tok = HFTokenizer.from_file(copy)
  messages = [{"role": "user", "content": "a<b>"}, {"role": "skip", "content": "x"}]
  # Newlines after block tags go (trim_blocks), as do the spaces before them (lstrip_blocks); a newline
  # after an expression stays.
  assert tok.apply_chat_template(messages) == '<|endoftext|>\n[user]"a<b>"<|im_end|>\n'


def test_named_templates_and_jinja_file(copy):
  _edit_config(copy, chat_template=[{"name": "tool_use", "template": "T"},
                                    {"name": "default", "template": "D{{ messages[0].content }}"}])
  assert HFTokenizer.from_file(copy).apply_chat_template(chat.one_turn("x")) == "Dx"
  # chat_template.jinja wins over tokenizer_config.json, as in transformers.
  with open(os.path.join(copy, "chat_template.jinja"), "w") as f:
    f.write("J{{ messages[0].content }}")
  tok = HFTokenizer.from_file(copy)
  assert tok.apply_chat_template(chat.one_turn("x")) == "Jx"
  assert tok.chat_template_source == os.path.join(copy, "chat_template.jinja")


def test_for_chat_has_no_bos_and_stops_where_a_turn_ends(copy):
  tok = HFTokenizer.from_file(copy).for_chat()
  im_end, pad = (tok.tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.eos_ids) == (None, im_end, pad, (im_end, pad))
  # Gemma's case: the configured eos is not what ends an assistant turn, but generation_config lists it.
  _edit_config(copy, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
  plain = HFTokenizer.from_file(copy)
  assert (plain.eos_id, plain.bos_id) == (pad, pad)
  assert plain.for_chat().eos_id == im_end
  assert plain.for_chat().bos_id is None


def test_chat_task_renders_the_plain_prompt_as_one_user_turn(ckpt, tmp_path):
  from rl_fusion_jax.rewards.gsm8k import GSM8KTask
  task = GSM8KTask(chat_fixture.write_gsm8k(tmp_path / "p.jsonl"))
  tok = HFTokenizer.from_file(ckpt).for_chat()
  wrapped = chat.chat_task(task, tok.apply_chat_template, system_prompt="Solve it.")
  assert len(wrapped) == len(task) and wrapped.name == "gsm8k"
  plain, problem = task.problem(3), wrapped.problem(3)
  question = plain.prompt.split("\n")[0]
  assert problem.prompt == ("<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n" + question + CUE
                            + "<|im_end|>\n<|im_start|>assistant\n")
  assert (problem.answer, problem.target, problem.meta) == (plain.answer, plain.target, plain.meta)
  assert wrapped.score(problem, "x #### " + plain.answer).correct


# ----------------------------------------------------------------------------------------------------
# Errors name the file or the field.
# ----------------------------------------------------------------------------------------------------

def test_syntax_error_names_tokenizer_config(copy):
  path = _edit_config(copy, chat_template="{% for m in messages %}{{ m.content }")
  tok = HFTokenizer.from_file(copy)   # plain prompts never need the template
  with pytest.raises(ValueError, match=f"chat template in {path}: jinja syntax error at line 1"):
    tok.for_chat()


def test_raise_exception_names_tokenizer_config(copy):
  path = _edit_config(copy, chat_template="{% if messages[0].role != 'system' %}"
                                           "{{ raise_exception('needs a system message') }}{% endif %}ok")
  tok = HFTokenizer.from_file(copy).for_chat()   # the probe conversation fails: eos stays as configured
  with pytest.raises(ValueError, match=f"chat template in {path} failed to render .*needs a system message"):
    tok.apply_chat_template(chat.one_turn("x"))
  assert tok.apply_chat_template(chat.one_turn("x", system_prompt="s")) == "ok"


def test_missing_template_names_both_files(copy):
  _edit_config(copy, chat_template=None)
  tok = HFTokenizer.from_file(copy)
  with pytest.raises(ValueError, match=r"no chat template: neither .*chat_template\.jinja nor a "
                                       r"'chat_template' field in .*tokenizer_config\.json"):
    tok.for_chat()
  _edit_config(copy, chat_template=[{"name": "tool_use", "template": "T"}])
  with pytest.raises(ValueError, match=r"lists chat templates \['tool_use'\] but none named 'default'"):
    HFTokenizer.from_file(copy).apply_chat_template(chat.one_turn("x"))
  _edit_config(copy, chat_template=7)
  with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template must be a string"):
    HFTokenizer.from_file(copy)


def _chat_config(ckpt, gsm8k_path, **overrides):
  """gsm8k_chat.py as `--config.model.hf_path=ckpt --config.task.kwargs.path=...` gives it, shrunk."""
  c = runpy.run_path(GSM8K_CHAT)["get_config"]()
  c.model.hf_path = ckpt
  c.model.dtype = "float32"
  c.task.kwargs = dict(path=gsm8k_path)
  c.task.eval_problems = 8
  c.rollout.num_prompts, c.rollout.group_size = 4, 2
  c.mesh.tensor = 2    # 4 batch shards of the 8 devices: each holds a group (optim.shared_prompts)
  c.rollout.max_prompt_len, c.rollout.max_new_tokens, c.rollout.chunk_steps = 48, 8, 8
  c.optim.warmup_steps = 0
  c.run.steps, c.run.checkpoint_every, c.run.eval_every = 2, 2, 0
  for path, value in overrides.items():
    section, name = path.split(".")
    c[section][name] = value
  return config_lib.experiment_from_dict(c)


def test_config_fields_are_validated():
  with pytest.raises(ValueError, match=r"config\.task\.prompt_format: 'chat' .* task\.tokenizer='char'"):
    config_lib.TaskConfig(prompt_format="chat", tokenizer="char")
  with pytest.raises(ValueError, match=r"config\.task\.prompt_format: must be one of \('plain', 'chat'\)"):
    config_lib.TaskConfig(prompt_format="chatml")
  with pytest.raises(ValueError, match=r"config\.task\.system_prompt: .*only with task\.prompt_format="):
    config_lib.TaskConfig(system_prompt="Be brief.")


def test_gsm8k_chat_without_hf_path_says_to_pass_it():
  with pytest.raises(ValueError, match=r"config\.model\.hf_path is empty .*pass --config\.model\.hf_path="):
    config_lib.experiment_from_dict(runpy.run_path(GSM8K_CHAT)["get_config"]())


def test_grpo_main_without_hf_path_fails_in_one_line(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "grpo_main.py"), f"--config={GSM8K_CHAT}",
         f"--workdir={tmp_path / 'run'}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "error: config.model.hf_path is empty" in proc.stderr
  assert "pass --config.model.hf_path=DIR" in proc.stderr and "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists()


def test_bad_template_fails_at_start_naming_the_file(ckpt, tmp_path):
  folder = tmp_path / "ckpt"
  folder.mkdir()
  for name in os.listdir(ckpt):
    (folder / name).write_bytes(open(os.path.join(ckpt, name), "rb").read())
  gsm8k = chat_fixture.write_gsm8k(tmp_path / "p.jsonl")
  config_path = _edit_config(str(folder), chat_template="{{ raise_exception('no tools given') }}")
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=f"chat template in {config_path} failed to render.*no tools given"):
    loop.run(_chat_config(str(folder), gsm8k), str(workdir))
  assert not workdir.exists()
  _edit_config(str(folder), chat_template=None)
  with pytest.raises(ValueError, match=r"config\.task\.prompt_format='chat': .*no chat template"):
    loop.run(_chat_config(str(folder), gsm8k), str(workdir))
  assert not workdir.exists()


def test_prompt_too_long_names_the_field(ckpt, tmp_path):
  cfg = _chat_config(ckpt, chat_fixture.write_gsm8k(tmp_path / "p.jsonl"), **{"rollout.max_prompt_len": 20})
  with pytest.raises(ValueError, match=r"<\|im_start\|>system.* config\.rollout\.max_prompt_len is 20"):
    setup.validate(cfg, 8)


# ----------------------------------------------------------------------------------------------------
# gsm8k_chat.py end to end.
# ----------------------------------------------------------------------------------------------------

def test_gsm8k_chat_runs_grpo_on_chat_prompts(ckpt, tmp_path, monkeypatch):
  seen = []
  original_add = engine_lib.Engine.add

  def recording_add(self, requests):
    requests = list(requests)
    seen.extend(r.prompt for r in requests)
    return original_add(self, requests)

  monkeypatch.setattr(engine_lib.Engine, "add", recording_add)
  cfg = _chat_config(ckpt, chat_fixture.write_gsm8k(tmp_path / "p.jsonl"))
  assert cfg.model.config.vocab_size == 448 and cfg.task.tokenizer == ""
  summary = loop.run(cfg, str(tmp_path / "run"))

  steps = [r for r in metrics_lib.read_metrics(str(tmp_path / "run")) if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2]
  assert 0 <= summary["accuracy_after"] <= 1
  # Every prompt the engine saw is the ChatML rendering of a fixture question, decoded by tokenizers itself.
  raw = tokenizers.Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
  expected = {"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
              + p["question"] + CUE + "<|im_end|>\n<|im_start|>assistant\n" for p in chat_fixture.PROBLEMS}
  decoded = [raw.decode(list(prompt), skip_special_tokens=False) for prompt in seen]
  # Evaluation before and after (8 each) and 2 steps x 4 prompts x 2 samples.
  assert len(decoded) == 8 + 8 + 2 * 4 * 2
  assert set(decoded) <= expected and len(set(decoded)) == len(expected)
  assert all(prompt[0] == raw.token_to_id("<|im_start|>") for prompt in seen)   # no bos before it


def test_chat_setup_uses_chat_tokenizer(ckpt, tmp_path):
  built = setup.validate(_chat_config(ckpt, chat_fixture.write_gsm8k(tmp_path / "p.jsonl")), 8)
  assert built.tokenizer.eos_id == built.tokenizer.tokenizer.token_to_id("<|im_end|>")
  assert built.tokenizer.bos_id is None
  for task in (built.train_task, built.warmup_task, built.eval_task):
    assert task.problem(0).prompt.startswith("<|im_start|>system\n")
  assert load_tokenizer(ckpt).bos_id is None
