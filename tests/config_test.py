"""Every experiment config loads into the typed config; typos and bad values fail naming the field."""
import dataclasses
import glob
import importlib.util
import os
import re

import pytest

from rl_fusion_jax import config as config_lib
from rl_fusion_jax.errors import ConfigError
from rl_fusion_jax.model_config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "experiments", "configs", "*.py")))


def load(path, arg=""):
  spec = importlib.util.spec_from_file_location("cfg_" + os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def variants(path):
  """The ablation variants a config's docstring names as `:name`."""
  spec = importlib.util.spec_from_file_location("doc", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  doc = module.__doc__ or ""
  import re
  return sorted(set(re.findall(r"\.py:(\w+)", doc)) | set(re.findall(r"``:(\w+)``", doc)))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_and_variant_loads(path):
  assert CONFIGS, "no configs found"
  for arg in [""] + variants(path):
    c = load(path, arg)
    if c.model.hf_path and not os.path.isdir(c.model.hf_path):
      # A fetched model's folder (smollm2_word_problems.py) that this machine lacks: one error naming it.
      with pytest.raises((ValueError, OSError), match="config.model.hf_path: .*checkpoint folder does not exist"):
        config_lib.experiment_from_dict(c)
      continue
    if not c.model.hf_path and c.model.vocab_size is None:
      # The checkpoint comes from the command line (gsm8k_chat.py): without it, one error saying so.
      with pytest.raises(ValueError, match="pass --config.model.hf_path=DIR"):
        config_lib.experiment_from_dict(c)
      continue
    cfg = config_lib.experiment_from_dict(c)
    cfg.check_devices(8)
    assert cfg.rollout.batch_size % cfg.rollout.group_size == 0


def base():
  return load(os.path.join(ROOT, "experiments", "configs", "arithmetic.py"))


@pytest.mark.parametrize("path,value,match", [
    ("rollout.temprature", 1.0, "config.rollout.temprature"),
    ("model.hiden_size", 3, "config.model.hiden_size"),
    ("nonsense", 1, "config.nonsense"),
])
def test_unknown_fields_are_named(path, value, match):
  c = base().to_dict()
  node = c
  *parents, leaf = path.split(".")
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ValueError, match=match.replace(".", r"\.")):
    config_lib.experiment_from_dict(c)


@pytest.mark.parametrize("field,value,match", [
    ("algo.policy_loss", "ppo_clipp", "algo.policy_loss"),
    ("algo.advantage", "gpro", "algo.advantage"),
    ("algo.aggregation", "mean", "algo.aggregation"),
    ("rollout.top_p", 0.0, "rollout.top_p"),
    ("rollout.max_new_tokens", 0, "rollout.max_new_tokens"),
    ("optim.micro_batches", 3, "optim.micro_batches"),
    ("optim.tokens_per_micro_batch", -1, "optim.tokens_per_micro_batch"),
    ("mesh.tensor", 0, "mesh.tensor"),
    ("model.num_kv_heads", 3, "num_kv_heads"),
    ("rollout.max_new_tokens", 500, "max_position_embeddings"),
    ("algo.gamma", 1.5, r"config.algo.gamma: must be a number in \[0, 1\], got 1.5"),
    ("algo.lam", -0.1, r"config.algo.lam: must be a number in \[0, 1\], got -0.1"),
    ("rollout.group_size", 1, "config.rollout.group_size: the group-relative advantage 'grpo'"),
    ("task.pass_k", 16, "config.task.pass_k: pass@16 needs at least 16 samples per problem"),
    ("task.eval_samples", -1, "config.task.eval_samples"),
    ("task.eval_examples", -1, r"config.task.eval_examples: must be an int >= 0"),
    ("algo.overlong_buffer", 7, "config.algo.overlong_buffer: 7 exceeds rollout.max_new_tokens = 6"),
    ("algo.dynamic_sampling_rounds", -1, "config.algo.dynamic_sampling_rounds"),
    ("critic.learning_rate", 0.0, "config.critic.learning_rate"),
    ("critic.value_clip", -0.2, "config.critic.value_clip"),
    ("critic.init", "/some/value_model", "config.critic.init: is set but algo.advantage='grpo'"),
])
def test_bad_values_are_named(field, value, match):
  c = base()
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(ValueError, match=match):
    config_lib.experiment_from_dict(c)


# One bad value per ModelConfig field (against the arithmetic config's model and against the qwen2_f32
# checkpoint fixture: each differs from both).
BAD_MODEL_VALUES = {
    "vocab_size": 0, "hidden_size": -8, "num_layers": 0, "num_heads": 0, "num_kv_heads": 3,
    "intermediate_size": 0, "head_dim": 7, "rope_theta": 0.0, "rope_scaling": {"rope_type": "yarn"},
    "rms_norm_eps": -1e-6, "qkv_bias": "yes", "tie_word_embeddings": "no", "max_position_embeddings": 0,
    "model_type": "gpt2", "dtype": "float16", "param_dtype": "float16", "bos_token_id": -1,
    "eos_token_id": -1, "remat": "all", "scan_unroll": -1, "logits_chunk": 0, "num_experts": -1,
    "num_experts_per_tok": -1, "moe_intermediate_size": -1, "shared_expert_intermediate_size": -1,
    "norm_topk_prob": "yes", "decoder_sparse_step": 0, "mlp_only_layers": (4,), "qk_norm": "no",
    "moe_impl": "fast", "moe_capacity_factor": 0.0, "router_aux_loss_coef": -0.1, "router_z_loss_coef": -1.0,
}
HF_FIXTURE = os.path.join(ROOT, "rl_fusion_jax", "testing", "hf_fixtures", "qwen2_f32")


@pytest.mark.parametrize("hf_path", ["", HF_FIXTURE], ids=["fields", "checkpoint"])
def test_bad_value_of_every_model_field_is_one_line_naming_it(hf_path):
  """A ConfigError is what the binaries print as one `error:` line (exit 1), without a traceback; a
  checkpoint's runtime fields (dtype, remat, ...) are validated, any other field must agree with it."""
  assert set(BAD_MODEL_VALUES) == {f.name for f in dataclasses.fields(ModelConfig)}, "give each field a value"
  for field, value in BAD_MODEL_VALUES.items():
    c = base().to_dict()
    if hf_path:
      c["model"] = {"hf_path": hf_path, "scan_unroll": 2}
    c["model"][field] = value
    with pytest.raises(ConfigError) as error:
      config_lib.experiment_from_dict(c)
    message = str(error.value)
    assert re.match(rf"config\.model\.{field}[.:=]", message) and "\n" not in message, (field, message)


def test_device_checks():
  cfg = config_lib.experiment_from_dict(base())
  assert cfg.check_devices(8) == {"stage": 1, "data": 8, "fsdp": 1, "tensor": 1}
  c = base()
  c.rollout.num_prompts, c.rollout.group_size = 3, 2     # 6 sequences over 4 devices
  c.task.eval_problems = 8
  with pytest.raises(ValueError, match="rollout.num_prompts"):
    config_lib.experiment_from_dict(c).check_devices(4)
  c = base()
  c.mesh.data = 3
  with pytest.raises(ValueError, match="config.mesh"):
    config_lib.experiment_from_dict(c).check_devices(8)
  c = base()
  c.optim.tokens_per_micro_batch = c.rollout.max_prompt_len     # less than one row per device
  with pytest.raises(ValueError, match=r"config.optim.tokens_per_micro_batch: 8 positions per device .* 14"):
    config_lib.experiment_from_dict(c).check_devices(8)
  c.optim.micro_batches = 2                                          # a fixed count wins: no budget check
  config_lib.experiment_from_dict(c).check_devices(8)


def test_as_dict_round_trips():
  cfg = config_lib.experiment_from_dict(base())
  plain = config_lib.as_dict(cfg)
  model = plain.pop("model")
  plain["model"] = {**model["config"], "hf_path": model["hf_path"], "init_std": model["init_std"]}
  assert config_lib.experiment_from_dict(plain) == cfg


def test_dynamic_sampling_combinations_are_refused():
  c = base()
  c.algo.dynamic_sampling = True
  c.stalesync.enabled, c.stalesync.max_staleness, c.stalesync.train_fraction = True, 1, 0.5
  with pytest.raises(ValueError, match="config.algo.dynamic_sampling: runs in the synchronous loop"):
    config_lib.experiment_from_dict(c)
  c = base()
  c.algo.dynamic_sampling, c.algo.advantage = True, "gae"
  with pytest.raises(ValueError, match="config.algo.dynamic_sampling: drops groups"):
    config_lib.experiment_from_dict(c)


def test_fixed_row_count_needs_packed_rows_without_pipeline_stages():
  c = base()
  c.optim.fixed_row_count = True
  with pytest.raises(ValueError, match="^config.optim.fixed_row_count: .* set optim.pack_rows=True$"):
    config_lib.experiment_from_dict(c)
  c.optim.pack_rows, c.mesh.stage = True, 2
  with pytest.raises(ValueError, match="^config.optim.fixed_row_count: .*without pipeline stages; mesh.stage=2$"):
    config_lib.experiment_from_dict(c)


def test_gae_allows_groups_of_one():
  c = base()
  c.algo.advantage, c.rollout.group_size = "gae", 1
  assert config_lib.experiment_from_dict(c).algo.uses_critic
