"""The shipped configs (experiments/configs/*.py) as the binaries read them: through absl's flag parser.

The configs start from ``config.default_config_dict()`` (every field at its dataclass default) and set only
what they change. Checked here, without building a model (config parsing only):

  * every config x variant converts to the typed config recorded in tests/data/shipped_configs.json,
    recorded from the hand-written configs before they were rebuilt on the defaults (after an intended
    change to a shipped config, ``python tests/shipped_configs_test.py`` records the configs anew);
  * every field of every shipped config can be overridden on the command line, ``--config.<path>=<value>``
    parsed by ``config_flags.DEFINE_config_file(lock_config=True)`` as the binaries define it, and the
    value reaches the typed config;
  * the default ConfigDict holds every dataclass field and converts to the dataclass defaults;
  * the old names of renamed fields are refused, naming the new ones.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys
import typing

import pytest
from absl import flags
from ml_collections import ConfigDict, config_flags

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import hf_config
from rl_fusion_jax.errors import ConfigError
from rl_fusion_jax.model_config import ModelConfig, normalize_rope_scaling

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"
EXPECTED = ROOT / "tests" / "data" / "shipped_configs.json"
FIXTURE = ROOT / "rl_fusion_jax" / "testing" / "hf_fixtures" / "qwen2_f32"

_FAMILY = ["", "drgrpo", "ppo", "dapo", "kl", "stalesync", "steps", "steps_long"]
# Every config file and the variants its get_config takes (arithmetic.py's, passed on by countdown and gsm8k).
VARIANTS = {
    "arithmetic": _FAMILY + ["moe"] + [f"moe,{v}" for v in _FAMILY if v],
    "countdown": _FAMILY + ["moe"] + [f"moe,{v}" for v in _FAMILY if v],
    "gsm8k": _FAMILY + ["moe"] + [f"moe,{v}" for v in _FAMILY if v],
    "gsm8k_chat": ["", "cpu"],
    "smollm2_word_problems": ["", "gpu"],
    "stalesync_longtail": [""],
    "tiny_grpo": ["", "kl"],
}
CHAT_CONFIGS = ("gsm8k_chat", "smollm2_word_problems")   # architecture from model.hf_path


def parse(argv: list[str]) -> ConfigDict:
  """The ConfigDict a binary's ``config_flags.DEFINE_config_file("config", lock_config=True)`` holds after
  parsing ``argv`` (on a fresh FlagValues; the overrides are read from ``argv``, not sys.argv)."""
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "Experiment config file.", flag_values=values,
                                  lock_config=True, sys_argv=["prog", *argv])
  values(["prog", *argv])
  return values.config


def write_checkpoint_config(folder: pathlib.Path, hf_dict: dict) -> str:
  """A folder holding only config.json: all ``model.hf_path`` needs to convert a config (no weights)."""
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(hf_dict))
  return str(folder)


def chat_checkpoint(folder: pathlib.Path) -> str:
  """qwen2_f32's config.json with room for gsm8k_chat.py's 384 + 512 positions."""
  return write_checkpoint_config(folder, {**json.loads((FIXTURE / "config.json").read_text()),
                                          "max_position_embeddings": 1024})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
  return chat_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _plain(cfg: config_lib.ExperimentConfig, ckpt: str) -> dict:
  """JSON types, and the machine's paths replaced by <CKPT> / <ROOT>."""
  text = json.dumps(config_lib.as_dict(cfg), sort_keys=True)
  return json.loads(text.replace(ckpt, "<CKPT>").replace(str(ROOT), "<ROOT>"))


def typed_configs(ckpt: str) -> dict[str, dict]:
  """'name:variant' -> the typed config (as JSON) of every shipped config and variant, read from the
  command line as grpo_main.py reads it (the chat configs with --config.model.hf_path=ckpt)."""
  out = {}
  for name, variants in VARIANTS.items():
    for variant in variants:
      argv = [f"--config={CONFIGS / name}.py" + (f":{variant}" if variant else "")]
      if name in CHAT_CONFIGS:
        argv.append(f"--config.model.hf_path={ckpt}")
      out[f"{name}:{variant}"] = _plain(config_lib.experiment_from_dict(parse(argv)), ckpt)
  return out


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and key != "kwargs":
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


ARCHITECTURE = {"vocab_size": 96, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                "intermediate_size": 64}


def test_every_config_file_is_covered():
  assert sorted(VARIANTS) == sorted(p.stem for p in CONFIGS.glob("*.py"))


def test_every_config_and_variant_is_unchanged(ckpt):
  """Field by field; a field added to a dataclass after the recording must hold its default there."""
  expected, actual = json.loads(EXPECTED.read_text()), typed_configs(ckpt)
  assert sorted(actual) == sorted(expected)
  c = config_lib.default_config_dict()
  c.model.update(ARCHITECTURE)
  defaults = _flatten(_plain(config_lib.experiment_from_dict(c), ckpt))
  for key in expected:
    want, got = _flatten(expected[key]), _flatten(actual[key])
    assert not set(want) - set(got), f"{key}: fields gone: {sorted(set(want) - set(got))}"
    changed = {p: (want[p], got[p]) for p in want if want[p] != got[p]}
    changed |= {p: ("<default>", got[p]) for p in set(got) - set(want) if got[p] != defaults[p]}
    assert not changed, f"{key}: (recorded, now) {changed}"


def test_default_config_dict_is_every_field_at_its_default():
  c = config_lib.default_config_dict()
  sections = typing.get_type_hints(config_lib.ExperimentConfig)
  assert set(c) == set(sections)
  assert set(c.model) == {f.name for f in dataclasses.fields(ModelConfig)} | {"hf_path", "init_std"}
  for name in set(sections) - {"model"}:
    assert set(c[name]) == {f.name for f in dataclasses.fields(sections[name])}, name
  c.model.update(ARCHITECTURE)
  assert config_lib.experiment_from_dict(c) == config_lib.ExperimentConfig(
      model=config_lib.ModelSource(ModelConfig(**ARCHITECTURE)))
  with pytest.raises(AttributeError, match="temprature"):
    c.rollout.temprature = 0.5     # locked: a typo in a config file fails where it is written


# ----------------------------------------------------------------------------------------------------
# Every field from the command line.
# ----------------------------------------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
# Fields checked against a list or a range: valid values, the first that differs from the config's is used.
# Every other field takes a value by its type (_by_type).
CHOICES = {
    "fusion.mode": ("hybrid", "colocated"),
    "fusion.train_rules": ((("embed", "fsdp"),),),
    "fusion.generate_rules": ((("mlp", None),),),
    "task.prompt_format": ("chat", "plain"),
    "task.eval_samples": (16, 32),
    "task.pass_k": (1, 2),
    "rollout.num_slots": (64, 32),
    "algo.advantage": ("dr_grpo", "grpo"),
    "algo.policy_loss": ("decoupled_ppo", "ppo_clip"),
    "algo.kl_estimator": ("k1", "k3"),
    "algo.kl_mode": ("reward", "loss"),
    "algo.aggregation": ("seq-mean-token-sum-norm", "token-mean"),
    "algo.dual_clip": (3.0,),
    "algo.plugins": ("rl_fusion_jax.algorithms.losses",),
    "algo.loss_kwargs": ("clip_low=0.1",),
    "algo.advantage_kwargs": ("gamma=0.9",),
    "critic.init": ("/checkpoints/value_model",),
    "run.on_nonfinite": ("skip", "stop"),
    "model.model_type": ("llama", "qwen2"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("bfloat16", "float32"),
    "model.remat": ("full", "none"),
    "model.moe_impl": ("blocked", "auto"),
    "model.max_position_embeddings": (1024, 2048),
    "model.head_dim": (16, 8),
    "model.rope_scaling": (LLAMA3,),
    "model.mlp_only_layers": ((0,), (1,)),
}
# Fields valid to change only together with others: these overrides go with them.
COMPANIONS = {
    "critic.init": {"algo.advantage": "gae"},
    "stalesync.train_fraction": {"stalesync.max_staleness": 1},
    "task.prompt_format": {"task.tokenizer": str(FIXTURE)},
    "task.system_prompt": {"task.prompt_format": "chat", "task.tokenizer": str(FIXTURE)},
    "algo.loss_kwargs": {"algo.policy_loss": "ppo_clip"},
    "algo.advantage_kwargs": {"algo.advantage": "gae"},
    "model.num_experts": {"model.num_experts_per_tok": 2, "model.moe_intermediate_size": 32,
                          "optim.shared_prompts": False},
    "optim.fixed_row_count": {"optim.pack_rows": True, "optim.shared_prompts": False},
    "mesh.stage": {"optim.fixed_row_count": False},
    "optim.pack_rows": {"optim.fixed_row_count": False, "optim.shared_prompts": False},
    "algo.mini_batches": {"optim.shared_prompts": False},
    "optim.shared_prompts": {"optim.pack_rows": False, "optim.fixed_row_count": False, "mesh.stage": 1,
                             "model.num_experts": 0, "algo.mini_batches": 1},
}
# The chat configs take their architecture from model.hf_path (smollm2_word_problems.py names the fetched
# model's folder, absent here): given here instead (random init), so that every model field can be
# overridden without a checkpoint.
_CHAT_ARCHITECTURE = {f"model.{k}": v for k, v in {**ARCHITECTURE, "max_position_embeddings": 1024}.items()}
BASE_ARGS = {"gsm8k_chat": _CHAT_ARCHITECTURE,
             "smollm2_word_problems": {"model.hf_path": "", **_CHAT_ARCHITECTURE}}


def _by_type(kind: type, current):
  """A valid value of an unchecked (or range-checked) field other than ``current``."""
  if kind is bool:
    return not current
  if kind is int:
    if current is None or current == 0:
      return 1 if current == 0 else 2
    return 2 if current == -1 else current // 2 if current > 1 and current % 2 == 0 else current + 1
  if kind is float:
    return 0.5 if not current else current / 2
  if kind is str:
    return f"{current}_x" if current else "x"
  raise AssertionError(f"no value for a {kind} field (add it to CHOICES)")


def _leaves(node: ConfigDict, prefix: str = ""):
  """(path, type, value) of every field; ``task.kwargs`` both as a whole and key by key."""
  for key in node.keys():
    value, path = node[key], f"{prefix}{key}"
    if isinstance(value, ConfigDict):
      if path == "task.kwargs":
        yield path, dict, value.to_dict()
      yield from _leaves(value, f"{path}.")
    else:
      yield path, node.get_type(key), value


def _value(path: str, kind: type, current):
  if path == "task.kwargs":
    return {"max_digits": 3} if current != {"max_digits": 3} else {"max_digits": 4}
  if path in CHOICES:
    return next(v for v in CHOICES[path] if v != current)
  return _by_type(kind, current)


def _arg(path: str, value) -> str:
  return f"--config.{path}={value if isinstance(value, str) else repr(value)}"


def typed_value(cfg: config_lib.ExperimentConfig, path: str):
  section, name, *key = path.split(".")
  if section == "model":
    return getattr(cfg.model if name in ("hf_path", "init_std") else cfg.model.config, name)
  value = getattr(getattr(cfg, section), name)
  return value[key[0]] if key else dict(value) if name == "kwargs" else value


def _expected(path: str, value):
  return normalize_rope_scaling(value) if path == "model.rope_scaling" else value


def override_cases(name: str, tmp_path: pathlib.Path):
  """(path, argv, expected typed value) for every field of the config file ``name``."""
  config = f"--config={CONFIGS / name}.py"
  base = BASE_ARGS.get(name, {})
  current = parse([config] + [_arg(p, v) for p, v in base.items()])
  for path, kind, value in _leaves(current):
    if path == "model.hf_path":   # a checkpoint that agrees with the config's model (or gsm8k_chat's)
      folder = tmp_path / name
      hf_path = (chat_checkpoint(folder) if name in CHAT_CONFIGS else write_checkpoint_config(
          folder, hf_config.to_hf_dict(config_lib.experiment_from_dict(current).model.config)))
      yield path, [config, _arg(path, hf_path)], hf_path
      continue
    new = _value(path, kind, value)
    given = {p: v for p, v in {**base, **COMPANIONS.get(path, {})}.items() if p != path}
    yield path, [config] + [_arg(p, v) for p, v in given.items()] + [_arg(path, new)], _expected(path, new)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_field_overrides_from_the_command_line(name, tmp_path):
  count = 0
  for path, argv, expected in override_cases(name, tmp_path):
    try:
      cfg = config_lib.experiment_from_dict(parse(argv))
    except Exception as e:  # pylint: disable=broad-except
      raise AssertionError(f"{name}: {' '.join(argv[1:])}: {type(e).__name__}: {e}") from e
    assert typed_value(cfg, path) == expected, (name, path, typed_value(cfg, path), expected)
    count += 1
  assert count > 100, count


# ----------------------------------------------------------------------------------------------------
# Renamed fields.
# ----------------------------------------------------------------------------------------------------

def _common():
  """experiments/common.py (loaded by path: experiments/ is not a package)."""
  spec = importlib.util.spec_from_file_location("experiments_common", ROOT / "experiments" / "common.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("old,new", sorted(config_lib.RENAMED_FIELDS.items()))
def test_renamed_fields_are_refused_naming_the_new_one(old, new):
  section, name = old.split(".")
  c = parse([f"--config={CONFIGS / 'arithmetic'}.py"]).to_dict()
  c[section][name] = 0.5
  with pytest.raises(ConfigError, match=rf"^config\.{old} was renamed: use config\.{new}$"):
    config_lib.experiment_from_dict(c)
  argv = ["grpo_main.py", f"--config={CONFIGS / 'arithmetic'}.py", f"--config.{old}=0.5"]
  with pytest.raises(AttributeError):   # the config is locked; the binaries then print common's line
    parse(argv[1:])
  assert _common().unknown_override(argv) == f"--config.{old} was renamed: use --config.{new}"


def test_every_binary_with_a_config_flag_requires_it():
  """A binary defining ``--config`` (default None) must mark it required: absl then refuses a run without
  it, naming the flag, instead of a traceback from the config conversion of None."""
  import ast  # pylint: disable=g-import-not-at-top
  missing = []
  for path in sorted((ROOT / "experiments").glob("*.py")):
    tree = ast.parse(path.read_text())
    defines = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
               and c.func.attr == "DEFINE_config_file" and c.args and getattr(c.args[0], "value", None) == "config"
               and len(c.args) > 1 and getattr(c.args[1], "value", 0) is None]
    required = {getattr(e, "value", None) for c in ast.walk(tree)
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                and c.func.attr == "mark_flags_as_required" and c.args and isinstance(c.args[0], ast.List)
                for e in c.args[0].elts}
    required |= {getattr(c.args[0], "value", None) for c in ast.walk(tree)
                 if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                 and c.func.attr == "mark_flag_as_required" and c.args}
    if defines and "config" not in required:
      missing.append(path.name)
  assert not missing, f"--config defined without a default and not marked required in {missing}"


if __name__ == "__main__":
  # Records the shipped configs' typed configs: only after an intended change to a shipped config.
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    records = typed_configs(chat_checkpoint(pathlib.Path(tmp)))
  EXPECTED.parent.mkdir(exist_ok=True)
  EXPECTED.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
  sys.stdout.write(f"wrote {EXPECTED} ({len(records)} configs)\n")
