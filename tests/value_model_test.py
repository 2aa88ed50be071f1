"""Value model: values are aligned like log-probs and causal, the policy-initialised critic, save/load, errors.

The head position is checked two independent ways: against the decoder's own `models.forward` (an LM
head whose column 3 is the value kernel gives values[b, t] == logits[b, t - 1, 3] + bias), and against
numpy applied to the hidden states. The slow test compares with transformers' Qwen2ForTokenClassification.
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from rl_fusion_jax import models
from rl_fusion_jax.models import reward_model as rm
from rl_fusion_jax.models import value_model as vm
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.tiny import tiny_model_config

CFG = tiny_model_config(intermediate_size=48, max_position_embeddings=2048)
VALUES = jax.jit(vm.values, static_argnums=0)
HIDDEN = jax.jit(rm.hidden_states, static_argnums=0)
B, T = 3, 9


def _perturbed(params, seed):
  """Moves every leaf (norm scales, zero biases too) off its init, so a misplaced piece shows."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                                      for x, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def params():
  return _perturbed(vm.init_value_params(CFG, jax.random.key(0), init_std=0.2), 1)


def _tokens(seed=0, shape=(B, T)):
  return np.random.RandomState(seed).randint(0, CFG.vocab_size, shape).astype(np.int32)


def test_shapes_and_first_position_is_zero(params):
  values_bt = np.asarray(VALUES(CFG, params, _tokens()))
  assert values_bt.shape == (B, T) and values_bt.dtype == np.float32
  assert np.all(values_bt[:, 0] == 0) and np.all(np.abs(values_bt[:, 1:]) > 0)
  assert np.array_equal(np.asarray(vm.values(CFG, params, _tokens(0, (B, 1)))), np.zeros((B, 1), np.float32))


@pytest.mark.parametrize("t", [0, 4, T - 1])
def test_value_at_t_depends_only_on_tokens_before_t(params, t):
  tokens = _tokens(1)
  other = tokens.copy()
  other[:, t] = (other[:, t] + 7) % CFG.vocab_size
  base, changed = np.asarray(VALUES(CFG, params, tokens)), np.asarray(VALUES(CFG, params, other))
  np.testing.assert_allclose(changed[:, :t + 1], base[:, :t + 1], rtol=0, atol=1e-6)   # up to and at t
  if t + 1 < T:
    assert np.abs(changed[:, t + 1:] - base[:, t + 1:]).min() > 1e-4                   # every later one


def test_values_via_lm_forward(params):
  # An LM whose body is the value body and whose head column 3 is the value kernel: its logit 3 at
  # position t - 1, plus the bias, is the value at t. The other columns are arbitrary.
  lm_cfg = dataclasses.replace(CFG, tie_word_embeddings=False)
  lm_head_dv = jax.random.normal(jax.random.key(7), (CFG.hidden_size, CFG.vocab_size))
  lm_head_dv = lm_head_dv.at[:, 3].set(params["score"]["kernel"][:, 0])
  tokens = _tokens(2)
  logits_btv = np.asarray(jax.jit(models.forward, static_argnums=0)(
      lm_cfg, {**params["body"], "lm_head": {"kernel": lm_head_dv}}, tokens))
  expected = logits_btv[:, :-1, 3] + float(params["score"]["bias"][0])
  values_bt = np.asarray(VALUES(CFG, params, tokens))
  np.testing.assert_allclose(values_bt[:, 1:], expected, rtol=1e-5, atol=1e-5)
  # Control: without the shift the numbers differ, so the comparison can tell positions apart.
  assert np.abs(values_bt[:, 1:-1] - expected[:, 1:]).min() > 1e-4


def test_values_via_numpy(params):
  tokens = _tokens(3)
  hidden_btd = np.asarray(HIDDEN(CFG, params, tokens), np.float64)
  kernel_d = np.asarray(params["score"]["kernel"], np.float64)[:, 0]
  expected = hidden_btd[:, :-1] @ kernel_d + float(params["score"]["bias"][0])
  np.testing.assert_allclose(np.asarray(VALUES(CFG, params, tokens))[:, 1:], expected, rtol=1e-5, atol=1e-5)


def test_bf16_matmul_policy_is_close_to_float32(params):
  tokens = _tokens(4)
  low = np.asarray(VALUES(dataclasses.replace(CFG, dtype="bf16_matmul"), params, tokens))
  np.testing.assert_allclose(low, np.asarray(VALUES(CFG, params, tokens)), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_value_params_from_policy(param_dtype):
  cfg = dataclasses.replace(CFG, param_dtype=param_dtype)
  policy = jax.tree.map(lambda x: x.astype(cfg.weight_dtype),
                        _perturbed(models.init_params(cfg, jax.random.key(3)), 4))
  before = jax.tree.map(np.array, policy)
  critic = vm.value_params_from_policy(cfg, policy)
  vm.check_value_params(cfg, critic)
  assert set(critic["score"]) == {"kernel", "bias"} and "lm_head" not in critic["body"]
  assert all(x.dtype == cfg.weight_dtype for x in jax.tree.leaves(critic))
  assert np.array_equal(np.asarray(VALUES(cfg, critic, _tokens(5))), np.zeros((B, T), np.float32))
  body = {k: v for k, v in policy.items() if k != "lm_head"}
  assert jax.tree.structure(critic["body"]) == jax.tree.structure(body)
  for a, b in zip(jax.tree.leaves(critic["body"]), jax.tree.leaves(body)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()      # a copy, not a shared buffer
  # Donating (deleting) the critic's buffers leaves the policy intact, lm_head included.
  for x in jax.tree.leaves(critic):
    x.delete()
  assert jax.tree.structure(policy) == jax.tree.structure(before)
  for a, b in zip(jax.tree.leaves(policy), jax.tree.leaves(before)):
    assert np.array_equal(np.asarray(a), b)


def test_value_params_from_policy_rejects_a_mismatched_policy():
  policy = models.init_params(dataclasses.replace(CFG, hidden_size=48), jax.random.key(0))
  with pytest.raises(ValueError, match=r"policy_params: params\['embed'\]\['embedding'\]: shape \(64, 48\)"):
    vm.value_params_from_policy(CFG, policy)


def test_check_value_params_names_the_entry(params):
  # A critic whose hidden size disagrees with the policy config: the first body entry is named.
  wide = vm.init_value_params(dataclasses.replace(CFG, hidden_size=48), jax.random.key(0))
  with pytest.raises(ValueError, match=r"params\['body'\]: params\['embed'\]\['embedding'\]: shape \(64, 48\), "
                                       r"expected \(64, 32\)"):
    vm.check_value_params(CFG, wide)
  no_bias = {**params, "score": {"kernel": params["score"]["kernel"]}}
  with pytest.raises(ValueError, match=r"params\['score'\]: expected keys \['bias', 'kernel'\].*got \['kernel'\]"):
    vm.check_value_params(CFG, no_bias)
  with pytest.raises(ValueError, match=r"params: expected keys \['body', 'score'\], got \['body'\]"):
    vm.values(CFG, {"body": params["body"]}, _tokens())
  wrong_bias = {**params, "score": {**params["score"], "bias": jnp.zeros((2,))}}
  with pytest.raises(ValueError, match=r"params\['score'\]\['bias'\]: shape \(2,\), expected \(1,\)"):
    vm.values(CFG, wrong_bias, _tokens())
  with_lm_head = {**params, "body": {**params["body"], "lm_head": {"kernel": jnp.zeros((32, 64))}}}
  with pytest.raises(ValueError, match=r"params\['body'\]: .*lm_head"):
    vm.check_value_params(CFG, with_lm_head)
  with pytest.raises(ValueError, match="tokens_bt"):
    vm.values(CFG, params, _tokens()[0])


def test_logical_axes_match_params_and_shard():
  abstract = vm.abstract_value_params(CFG)
  axes = vm.value_logical_axes(CFG)
  assert jax.tree.structure(abstract) == jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple))
  assert jax.tree.structure(abstract) == jax.tree.structure(vm.init_value_params(CFG, jax.random.key(0)))
  assert jax.tree.map(lambda s: (s.shape, s.dtype), abstract) == jax.tree.map(
      lambda x: (x.shape, x.dtype), vm.init_value_params(CFG, jax.random.key(0)))
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  shardings = param_shardings(abstract, axes, mesh, TRAIN_RULES)
  assert tuple(shardings["score"]["kernel"].spec) == ("fsdp", None)
  assert tuple(shardings["score"]["bias"].spec) == (None,)


# ------------------------------------------------------------------------------------------ checkpoints


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_save_load_round_trip_is_bitwise(tmp_path, params, param_dtype):
  cfg = dataclasses.replace(CFG, param_dtype=param_dtype)
  p = jax.tree.map(lambda x: x.astype(cfg.weight_dtype), params)
  vm.save_value_model(cfg, p, tmp_path / "vm")
  cfg2, p2 = vm.load_value_model(tmp_path / "vm")
  assert cfg2 == cfg
  assert jax.tree.structure(p2) == jax.tree.structure(p)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p2)):
    assert a.dtype == b.dtype and np.array_equal(_bits(a), _bits(b))
  config = json.load(open(tmp_path / "vm" / "config.json"))
  assert config["architectures"] == ["Qwen2ForTokenClassification"] and config["id2label"] == {"0": "LABEL_0"}
  with safe_open(str(tmp_path / "vm" / "model.safetensors"), framework="numpy") as f:
    names = set(f.keys())
    kernel, bias = f.get_tensor("score.weight"), f.get_tensor("score.bias")
  assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
  assert kernel.shape == (1, 32) and bias.shape == (1,)   # HF token-classification layout
  np.testing.assert_array_equal(_bits(kernel[0]), _bits(p["score"]["kernel"][:, 0]))
  np.testing.assert_array_equal(_bits(bias), _bits(p["score"]["bias"]))


def test_llama_architecture_name(tmp_path):
  cfg = dataclasses.replace(CFG, model_type="llama", qkv_bias=False)
  p = vm.init_value_params(cfg, jax.random.key(2))
  vm.save_value_model(cfg, p, tmp_path / "vm")
  assert json.load(open(tmp_path / "vm" / "config.json"))["architectures"] == ["LlamaForTokenClassification"]
  assert vm.load_value_model(tmp_path / "vm")[0] == cfg


def _rewrite(folder, edit):
  file = os.path.join(folder, "model.safetensors")
  with safe_open(file, framework="numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  edit(tensors)
  save_file(tensors, file)
  return file


def test_missing_unexpected_and_misshaped_tensors(tmp_path, params):
  folder = str(tmp_path / "vm")
  vm.save_value_model(CFG, params, folder)
  _rewrite(folder, lambda t: t.pop("score.bias"))
  with pytest.raises(ValueError, match="missing tensor 'score.bias'"):
    vm.load_value_model(folder)
  vm.save_value_model(CFG, params, folder)   # replaces the folder
  file = _rewrite(folder, lambda t: t.__setitem__("score.bias", np.zeros((2,), np.float32)))
  with pytest.raises(ValueError, match=r"tensor 'score.bias' has shape \(2,\), expected \(1,\)") as info:
    vm.load_value_model(folder)
  assert file in str(info.value)
  vm.save_value_model(CFG, params, folder)
  _rewrite(folder, lambda t: t.__setitem__("lm_head.weight", np.zeros((64, 32), np.float32)))
  with pytest.raises(ValueError, match=r"unexpected tensors \['lm_head.weight'\]"):
    vm.load_value_model(folder)


def test_reward_model_folder_is_refused(tmp_path):
  folder = tmp_path / "rm"
  rm.save_reward_model(CFG, rm.init_reward_params(CFG, jax.random.key(0)), folder)
  with pytest.raises(ValueError, match=r"config.json: architectures \['Qwen2ForSequenceClassification'\] is a "
                                       r"reward model .*not a value model.*load_reward_model"):
    vm.load_value_model(folder)
  # And the other way round: a value model is not a reward model.
  vm.save_value_model(CFG, vm.init_value_params(CFG, jax.random.key(0)), tmp_path / "vm")
  with pytest.raises(ValueError, match=r"architectures \['Qwen2ForTokenClassification'\] is not a reward model"):
    rm.load_reward_model(tmp_path / "vm")


def test_causal_lm_checkpoint_and_wrong_label_count_are_refused(tmp_path, params):
  folder = os.path.join(os.path.dirname(models.__file__), "..", "testing", "hf_fixtures", "qwen2_f32")
  with pytest.raises(ValueError, match=r"config.json: architectures \['Qwen2ForCausalLM'\] is not a value model"):
    vm.load_value_model(folder)
  vm.save_value_model(CFG, params, tmp_path / "vm")
  config_path = tmp_path / "vm" / "config.json"
  config = json.load(open(config_path))
  json.dump({**config, "id2label": {"0": "A", "1": "B"}}, open(config_path, "w"))
  with pytest.raises(ValueError, match="id2label has 2 labels, a value model has 1"):
    vm.load_value_model(tmp_path / "vm")
  with pytest.raises(FileNotFoundError):
    vm.load_value_model(tmp_path / "nowhere")


@pytest.mark.slow
def test_matches_transformers_token_classification(tmp_path, params):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.set_num_threads(1)
  vm.save_value_model(CFG, params, tmp_path / "vm")
  model = transformers.AutoModelForTokenClassification.from_pretrained(str(tmp_path / "vm"), dtype=torch.float32)
  assert type(model).__name__ == "Qwen2ForTokenClassification"
  tokens = _tokens(6)
  with torch.no_grad():
    ref_bt = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()[..., 0]
  np.testing.assert_allclose(np.asarray(VALUES(CFG, params, tokens))[:, 1:], ref_bt[:, :-1], rtol=1e-4, atol=1e-4)
