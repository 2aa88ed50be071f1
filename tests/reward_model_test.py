"""Reward model: the score reads the last real token, save/load round trips, and errors name the tensor.

The head position is checked two independent ways: against the decoder's own `models.forward` (an LM
head whose column 3 is the score kernel gives logits[b, len_b - 1, 3] == score_b), and against numpy
applied to the hidden states. The slow test compares with transformers' Qwen2ForSequenceClassification.
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
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.tiny import tiny_model_config

CFG = tiny_model_config(intermediate_size=48, max_position_embeddings=2048)
SCORE = jax.jit(rm.score, static_argnums=0)
HIDDEN = jax.jit(rm.hidden_states, static_argnums=0)
T = 10
LENGTHS = np.array([10, 4, 7, 1], np.int32)


def _perturbed(params, seed):
  """Moves every leaf (norm scales, zero biases too) off its init, so a misplaced piece shows."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                                      for x, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def params():
  return _perturbed(rm.init_reward_params(CFG, jax.random.key(0), init_std=0.2), 1)


def _tokens(seed=0):
  return np.random.RandomState(seed).randint(0, CFG.vocab_size, (len(LENGTHS), T)).astype(np.int32)


def test_score_ignores_tokens_at_and_after_length(params):
  tokens = _tokens(0)
  other = tokens.copy()
  after_bt = np.arange(T)[None, :] >= LENGTHS[:, None]
  other[after_bt] = (tokens[after_bt] + 1 + _tokens(1)[after_bt] % 60) % CFG.vocab_size  # always different
  assert (other != tokens).sum() == after_bt.sum() > 0
  base = np.asarray(SCORE(CFG, params, tokens, LENGTHS))
  assert base.shape == (4,) and base.dtype == np.float32
  np.testing.assert_allclose(np.asarray(SCORE(CFG, params, other, LENGTHS)), base, rtol=0, atol=1e-6)
  # Control: the last real token of row 1 (index 3) does change row 1, and only row 1.
  inside = tokens.copy()
  inside[1, LENGTHS[1] - 1] = (inside[1, LENGTHS[1] - 1] + 5) % CFG.vocab_size
  changed = np.asarray(SCORE(CFG, params, inside, LENGTHS))
  assert abs(changed[1] - base[1]) > 1e-3
  np.testing.assert_allclose(np.delete(changed, 1), np.delete(base, 1), rtol=0, atol=1e-6)


def test_packed_score_equals_the_padded_score(params):
  # Samples packed several to a row (positions restart, attention within a segment) score as on their
  # own padded rows; a sample without a row scores NaN.
  from rl_fusion_jax.train import packing
  tokens = _tokens(2)
  layout = packing.plan(LENGTHS, 16, (4,))
  assert layout.rows_used < len(LENGTHS)                  # some row holds two samples
  packed = jax.jit(rm.packed_score, static_argnums=0)(
      CFG, params, layout.pack(tokens), layout.positions_rw(), layout.segment_ids_rw(), layout.row_b,
      layout.start_b, layout.length_b)
  np.testing.assert_allclose(np.asarray(packed), np.asarray(SCORE(CFG, params, tokens, LENGTHS)),
                             rtol=1e-5, atol=1e-5)
  none = rm.packed_score(CFG, params, layout.pack(tokens), layout.positions_rw(), layout.segment_ids_rw(),
                         np.where(np.arange(4) == 2, -1, layout.row_b), layout.start_b, layout.length_b)
  assert np.isnan(np.asarray(none)[2]) and not np.isnan(np.asarray(none)[[0, 1, 3]]).any()


def test_head_is_read_at_length_minus_one_via_lm_forward(params):
  # An LM whose body is the reward body and whose head column 3 is the score kernel: its logit 3 at
  # position len_b - 1 is the reward of row b. The other columns are arbitrary.
  lm_cfg = dataclasses.replace(CFG, tie_word_embeddings=False)
  lm_head_dv = jax.random.normal(jax.random.key(7), (CFG.hidden_size, CFG.vocab_size))
  lm_head_dv = lm_head_dv.at[:, 3].set(params["score"]["kernel"][:, 0])
  lm_params = {**params["body"], "lm_head": {"kernel": lm_head_dv}}
  tokens = _tokens(2)
  logits_btv = np.asarray(jax.jit(models.forward, static_argnums=0)(lm_cfg, lm_params, tokens))
  expected_b = logits_btv[np.arange(4), LENGTHS - 1, 3]
  np.testing.assert_allclose(np.asarray(SCORE(CFG, params, tokens, LENGTHS)), expected_b, rtol=1e-5, atol=1e-5)
  # Control: one position earlier is a different number, so the comparison can tell positions apart.
  assert np.abs(logits_btv[np.arange(1, 3), LENGTHS[1:3] - 2, 3] - expected_b[1:3]).min() > 1e-3


def test_head_is_read_at_length_minus_one_via_numpy(params):
  tokens = _tokens(3)
  hidden_btd = np.asarray(HIDDEN(CFG, params, tokens), np.float64)
  kernel_d = np.asarray(params["score"]["kernel"], np.float64)[:, 0]
  expected_b = np.array([hidden_btd[b, LENGTHS[b] - 1] @ kernel_d for b in range(4)])
  np.testing.assert_allclose(np.asarray(SCORE(CFG, params, tokens, LENGTHS)), expected_b, rtol=1e-5, atol=1e-5)


def test_jit_matches_eager_and_compiles_once(params):
  traces = []

  def counted(p, tokens_bt, lengths_b):
    traces.append(1)
    return rm.score(CFG, p, tokens_bt, lengths_b)

  jitted = jax.jit(counted)
  tokens = _tokens(4)
  eager = np.asarray(rm.score(CFG, params, jnp.asarray(tokens), jnp.asarray(LENGTHS)))
  np.testing.assert_allclose(np.asarray(jitted(params, tokens, LENGTHS)), eager, rtol=1e-6, atol=1e-6)
  jitted(params, _tokens(5), LENGTHS[::-1].copy())   # new contents, same shapes: no retrace
  assert len(traces) == 1


def test_bad_lengths(params):
  tokens = _tokens(0)
  for bad in ([0, 1, 2, 3], [1, 2, 3, 11]):
    with pytest.raises(ValueError, match=r"lengths_b: every length must be in \[1, T=10\]"):
      rm.score(CFG, params, tokens, np.array(bad, np.int32))
  with pytest.raises(ValueError, match="lengths_b: expected integer shape"):
    rm.score(CFG, params, tokens, np.array([1, 2], np.int32))
  with pytest.raises(ValueError, match="tokens_bt"):
    rm.score(CFG, params, tokens[0], LENGTHS)
  # Inside jit values cannot raise: the bad row is NaN, the others are untouched.
  out = np.asarray(SCORE(CFG, params, tokens, np.array([0, 4, 7, 1], np.int32)))
  base = np.asarray(SCORE(CFG, params, tokens, LENGTHS))
  assert np.isnan(out[0]) and np.array_equal(out[1:], base[1:])


def test_bad_params_name_the_entry(params):
  with pytest.raises(ValueError, match=r"params: expected keys \['body', 'score'\]"):
    rm.score(CFG, params["body"], _tokens(), LENGTHS)
  wrong_head = {**params, "score": {"kernel": jnp.zeros((CFG.hidden_size, 2))}}
  with pytest.raises(ValueError, match=r"params\['score'\]\['kernel'\]: shape \(32, 2\)"):
    rm.score(CFG, wrong_head, _tokens(), LENGTHS)
  with_lm_head = {**params, "body": {**params["body"], "lm_head": {"kernel": jnp.zeros((32, 64))}}}
  with pytest.raises(ValueError, match=r"params\['body'\]: .*lm_head"):
    rm.score(CFG, with_lm_head, _tokens(), LENGTHS)


def test_logical_axes_match_params_and_shard():
  abstract = rm.abstract_reward_params(CFG)
  axes = rm.reward_logical_axes(CFG)
  assert jax.tree.structure(abstract) == jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple))
  assert "lm_head" not in abstract["body"]
  assert jax.tree.structure(abstract) == jax.tree.structure(rm.init_reward_params(CFG, jax.random.key(0)))
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  shardings = param_shardings(abstract, axes, mesh, TRAIN_RULES)
  assert tuple(shardings["score"]["kernel"].spec) == ("fsdp", None)


# ------------------------------------------------------------------------------------------ checkpoints


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_save_load_round_trip_is_bitwise(tmp_path, params, param_dtype):
  cfg = dataclasses.replace(CFG, param_dtype=param_dtype)
  p = jax.tree.map(lambda x: x.astype(cfg.weight_dtype), params)
  rm.save_reward_model(cfg, p, tmp_path / "rm")
  cfg2, p2 = rm.load_reward_model(tmp_path / "rm")
  assert cfg2 == cfg
  assert jax.tree.structure(p2) == jax.tree.structure(p)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p2)):
    assert a.dtype == b.dtype and np.array_equal(_bits(a), _bits(b))
  config = json.load(open(tmp_path / "rm" / "config.json"))
  assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["id2label"] == {"0": "LABEL_0"}
  with safe_open(str(tmp_path / "rm" / "model.safetensors"), framework="numpy") as f:
    names = set(f.keys())
    head = f.get_tensor("score.weight")
  assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
  assert head.shape == (1, 32)   # HF sequence-classification layout [num_labels, D]
  np.testing.assert_array_equal(_bits(head[0]), _bits(p["score"]["kernel"][:, 0]))


def _rewrite(folder, edit):
  file = os.path.join(folder, "model.safetensors")
  with safe_open(file, framework="numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  edit(tensors)
  save_file(tensors, file)
  return file


@pytest.mark.parametrize("name", ["score.weight", "model.layers.1.mlp.up_proj.weight"])
def test_shape_mismatch_names_file_and_tensor(tmp_path, params, name):
  folder = str(tmp_path / "rm")
  rm.save_reward_model(CFG, params, folder)
  file = _rewrite(folder, lambda t: t.__setitem__(name, np.zeros(t[name].shape[:-1] + (33,), np.float32)))
  with pytest.raises(ValueError, match=f"tensor '{name}' has shape") as info:
    rm.load_reward_model(folder)
  assert file in str(info.value) and "expected" in str(info.value)


def test_missing_and_unexpected_tensors(tmp_path, params):
  folder = str(tmp_path / "rm")
  rm.save_reward_model(CFG, params, folder)
  _rewrite(folder, lambda t: t.pop("score.weight"))
  with pytest.raises(ValueError, match="missing tensor 'score.weight'"):
    rm.load_reward_model(folder)
  rm.save_reward_model(CFG, params, folder)   # replaces the folder
  _rewrite(folder, lambda t: t.__setitem__("lm_head.weight", np.zeros((64, 32), np.float32)))
  with pytest.raises(ValueError, match=r"unexpected tensors \['lm_head.weight'\]"):
    rm.load_reward_model(folder)


def test_causal_lm_checkpoint_is_not_a_reward_model():
  folder = os.path.join(os.path.dirname(models.__file__), "..", "testing", "hf_fixtures", "qwen2_f32")
  with pytest.raises(ValueError, match=r"config.json: architectures \['Qwen2ForCausalLM'\] is not a reward"):
    rm.load_reward_model(folder)


@pytest.mark.slow
def test_matches_transformers_sequence_classification(tmp_path, params):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.set_num_threads(1)
  rm.save_reward_model(CFG, params, tmp_path / "rm")
  model = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"),
                                                                            dtype=torch.float32)
  assert type(model).__name__ == "Qwen2ForSequenceClassification"
  # transformers scores the last token that is not padding: pad with an id no real token uses.
  pad = 0
  tokens = 1 + _tokens(6) % (CFG.vocab_size - 1)
  tokens[np.arange(T)[None, :] >= LENGTHS[:, None]] = pad
  model.config.pad_token_id = pad
  with torch.no_grad():
    ref_b = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()[:, 0]
  np.testing.assert_allclose(np.asarray(SCORE(CFG, params, tokens, LENGTHS)), ref_b, rtol=1e-4, atol=1e-4)
