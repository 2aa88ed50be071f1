"""HF interoperability of the Qwen3 and MoE (Qwen2-MoE / Qwen3-MoE) decoders: parity with transformers
logits, the per-expert Hub layout in both layer stacks, config.json round trips, and errors that name the
field or tensor.

The committed fixtures (rl_fusion_jax/testing/hf_fixtures, written by experiments/make_hf_fixtures.py)
carry reference logits computed by transformers. The one test that runs transformers itself is marked slow
and skips when torch / transformers are not importable.
"""
import dataclasses
import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from rl_fusion_jax import models
from rl_fusion_jax.models import decoder, hf_io
from rl_fusion_jax.testing import fixture_paths

FIXTURES = ("qwen3_f32", "qwen2_moe_f32", "qwen3_moe_bf16")
FORWARD = jax.jit(models.forward, static_argnums=0)
# Logits must match transformers' within this absolute bound (the fixtures' logits reach |4.6|). The
# committed references were computed by transformers (PyTorch) on the machine that wrote the fixtures, so
# what varies with the CPU is the float32 summation order of both libraries' kernels (each picks them by
# the processor's features: AVX2, AVX-512, AMX), a few last bits per op. Measured on an AMD EPYC (AVX2):
# at most 3.9e-6; moving every weight by 1e-7 relative (a few last bits) moved the logits by <= 9.3e-6,
# and by 1e-5 relative by <= 5.1e-4, in proportion: no top-k expert choice flipped, none of these
# fixtures' is near a tie (a flipped choice would move logits by far more than 1e-4).
TOLERANCE = 1e-4


_fixture, _copy_fixture = fixture_paths.fixture, fixture_paths.copy_fixture


def _config_json(name):
  with open(os.path.join(_fixture(name), "config.json")) as f:
    return json.load(f)


def _tensors(path):
  with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
    return {k: f.get_tensor(k) for k in f.keys()}


def _rewrite_tensors(folder, edit):
  tensors = _tensors(folder)
  edit(tensors)
  save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _max_error(cfg, params, folder):
  ref = np.load(os.path.join(folder, "reference.npz"))
  with jax.default_matmul_precision("highest"):  # a no-op on CPU; keeps GPUs from using TF32 here
    logits = np.asarray(FORWARD(cfg, params, jnp.asarray(ref["tokens"])))
  assert logits.shape == ref["logits"].shape
  return float(np.abs(logits - ref["logits"]).max())


def _mixed_moe_config(**kw):
  """Qwen2-MoE with both stacks: sparse layers 1 and 5 (decoder_sparse_step=2, layer 3 mlp-only)."""
  fields = dict(vocab_size=48, hidden_size=16, num_layers=6, num_heads=2, num_kv_heads=1, intermediate_size=24,
                model_type="qwen2_moe", qkv_bias=True, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8, shared_expert_intermediate_size=12, decoder_sparse_step=2,
                mlp_only_layers=(3,), norm_topk_prob=False)
  return models.ModelConfig(**(fields | kw))


# ------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("name", FIXTURES)
def test_load_hf_matches_transformers_logits(name):
  # The bf16 fixture computes in float32 from its bfloat16 weights (load_hf's default precision policy).
  cfg, params = models.load_hf(_fixture(name))
  assert _max_error(cfg, params, _fixture(name)) < TOLERANCE


def test_parity_is_sensitive_to_routing_and_expert_order():
  # Controls: the fixtures must be able to fail. Not renormalising the top-k weights, or swapping two
  # experts of one projection in one layer, moves the logits far beyond the parity tolerance.
  cfg, params = models.load_hf(_fixture("qwen3_moe_bf16"))
  assert _max_error(dataclasses.replace(cfg, norm_topk_prob=False), params, _fixture("qwen3_moe_bf16")) > 1e-2
  cfg, params = models.load_hf(_fixture("qwen2_moe_f32"))
  up = params["layers"]["moe"]["experts"]["up_proj"].copy()
  up[2, [0, 1]] = up[2, [1, 0]]
  swapped = jax.tree.map(lambda x: x, params)
  swapped["layers"]["moe"]["experts"]["up_proj"] = up
  assert _max_error(cfg, swapped, _fixture("qwen2_moe_f32")) > 1e-2


def test_loaded_configs():
  cfg, params = models.load_hf(_fixture("qwen2_moe_f32"))
  assert (cfg.model_type, cfg.qkv_bias, cfg.qk_norm, cfg.norm_topk_prob) == ("qwen2_moe", True, False, False)
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 16)
  assert (cfg.shared_expert_intermediate_size, cfg.mlp_only_layers, cfg.intermediate_size) == (24, (2,), 48)
  assert cfg.layer_stacks == (("layers", 0), ("layers", 1), ("dense_layers", 0), ("layers", 2))
  assert params["dense_layers"]["mlp"]["gate_proj"]["kernel"].shape == (1, 32, 48)
  assert params["layers"]["moe"]["experts"]["down_proj"].shape == (3, 8, 16, 32)
  cfg, params = models.load_hf(_fixture("qwen3_moe_bf16"))
  assert (cfg.model_type, cfg.qkv_bias, cfg.qk_norm, cfg.norm_topk_prob) == ("qwen3_moe", False, True, True)
  assert (cfg.num_experts, cfg.shared_expert_intermediate_size, cfg.tie_word_embeddings) == (4, 0, True)
  assert cfg.param_dtype == "bfloat16" and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  assert "dense_layers" not in params and "shared_expert" not in params["layers"]["moe"]
  cfg, params = models.load_hf(_fixture("qwen3_f32"))
  assert (cfg.model_type, cfg.qkv_bias, cfg.qk_norm, cfg.head_dim, cfg.num_experts) == ("qwen3", False, True, 16, 0)
  assert params["layers"]["attn"]["q_norm"]["scale"].shape == (2, 16)


def test_hf_layout_of_experts_router_and_shared_expert():
  # Global layer 3 is entry 2 of `layers`; HF stores every expert projection as [out, in].
  _, params = models.load_hf(_fixture("qwen2_moe_f32"))
  hf = _tensors(_fixture("qwen2_moe_f32"))
  moe = jax.tree.map(np.asarray, params["layers"]["moe"])
  for e in (0, 5):
    for proj in ("gate_proj", "up_proj", "down_proj"):
      np.testing.assert_array_equal(moe["experts"][proj][2, e], hf[f"model.layers.3.mlp.experts.{e}.{proj}.weight"].T)
  np.testing.assert_array_equal(moe["router"][2], hf["model.layers.3.mlp.gate.weight"].T)
  np.testing.assert_array_equal(moe["shared_expert_gate"][2], hf["model.layers.3.mlp.shared_expert_gate.weight"].T)
  np.testing.assert_array_equal(moe["shared_expert"]["down_proj"]["kernel"][2],
                                hf["model.layers.3.mlp.shared_expert.down_proj.weight"].T)
  np.testing.assert_array_equal(np.asarray(params["dense_layers"]["mlp"]["up_proj"]["kernel"][0]),
                                hf["model.layers.2.mlp.up_proj.weight"].T)


@pytest.mark.parametrize("cfg", [_mixed_moe_config(), _mixed_moe_config(model_type="qwen3_moe", qkv_bias=False,
                                                                        qk_norm=True, shared_expert_intermediate_size=0)],
                         ids=["qwen2_moe", "qwen3_moe"])
def test_name_table_covers_every_param_once(cfg):
  names = hf_io.name_map(cfg)
  assert names.keys() == {path for path, _ in decoder.flatten(models.abstract_params(cfg))}
  all_names = [n for leaf in names.values() for n in leaf.hf_names]
  assert len(all_names) == len(set(all_names))
  experts = names[("layers", "moe", "experts", "up_proj")]
  assert experts.hf_names[:2] == ("model.layers.1.mlp.experts.0.up_proj.weight",
                                  "model.layers.1.mlp.experts.1.up_proj.weight")
  assert experts.hf_names[-1] == "model.layers.5.mlp.experts.3.up_proj.weight" and experts.index_dims == 2
  dense = names[("dense_layers", "mlp", "down_proj", "kernel")].hf_names
  assert dense == tuple(f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 2, 3, 4))


# ------------------------------------------------------------------------------------------- round trips


def test_save_hf_round_trip_is_exact_with_both_stacks(tmp_path):
  cfg = _mixed_moe_config(param_dtype="bfloat16")
  rng = np.random.default_rng(0)   # host arrays: no compile
  params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), models.abstract_params(cfg))
  models.save_hf(cfg, params, tmp_path / "ckpt")
  cfg2, params2 = models.load_hf(tmp_path / "ckpt")
  assert cfg2 == cfg
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  saved = _tensors(str(tmp_path / "ckpt"))
  assert "model.layers.5.mlp.experts.3.gate_proj.weight" in saved and "model.layers.4.mlp.up_proj.weight" in saved
  assert "model.layers.3.mlp.gate.weight" not in saved   # mlp-only layer: a dense MLP


@pytest.mark.parametrize("name", FIXTURES)
def test_save_hf_writes_what_transformers_wrote(name, tmp_path):
  cfg, params = models.load_hf(_fixture(name))
  models.save_hf(cfg, params, tmp_path / "ckpt")
  original, saved = _tensors(_fixture(name)), _tensors(str(tmp_path / "ckpt"))
  assert original.keys() == saved.keys()
  for key in original:
    np.testing.assert_array_equal(original[key], saved[key])
  assert models.load_hf(tmp_path / "ckpt")[0] == cfg


def test_load_hf_places_both_stacks_on_their_shardings():
  from rl_fusion_jax.config import MeshConfig
  from rl_fusion_jax.sharding.mesh import make_mesh
  from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
  folder = _fixture("qwen2_moe_f32")
  cfg = hf_io.read_config(folder)
  mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
  shardings = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  _, placed = models.load_hf(folder, shardings)
  _, host = models.load_hf(folder)
  for x, y, s in zip(jax.tree.leaves(placed), jax.tree.leaves(host), jax.tree.leaves(shardings)):
    assert x.sharding == s and np.array_equal(np.asarray(x), y)


@pytest.mark.parametrize("name", FIXTURES)
def test_config_json_round_trip(name):
  cfg = models.ModelConfig.from_hf_dict(_config_json(name))
  d = cfg.to_hf_dict()
  assert d["architectures"] == _config_json(name)["architectures"]
  assert models.ModelConfig.from_hf_dict(d) == cfg
  # A transformers 4.x layout: top-level rope_theta, torch_dtype, and Qwen3-MoE's count as num_experts.
  v4 = {k: v for k, v in _config_json(name).items() if k not in ("rope_parameters", "dtype", "num_local_experts")}
  v4.update(rope_theta=cfg.rope_theta, torch_dtype=cfg.param_dtype)
  if cfg.num_experts:
    v4["num_experts"] = cfg.num_experts
  assert models.ModelConfig.from_hf_dict(v4) == cfg


def test_config_defaults_of_omitted_keys():
  d = _config_json("qwen3_moe_bf16")
  for key in ("num_key_value_heads", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "head_dim"):
    del d[key]
  cfg = models.ModelConfig.from_hf_dict(d)   # Qwen3MoeConfig defaults
  assert (cfg.num_kv_heads, cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers) == (4, False, 1, ())
  assert cfg.head_dim == 32 // 4
  d = _config_json("qwen3_f32")
  del d["head_dim"]
  assert models.ModelConfig.from_hf_dict(d).head_dim == 128     # Qwen3Config's default, not hidden / heads
  d = {k: v for k, v in _config_json("qwen2_moe_f32").items() if k != "qkv_bias"}
  assert models.ModelConfig.from_hf_dict(d).qkv_bias            # transformers 4.x: always biased
  assert not models.ModelConfig.from_hf_dict({**d, "qkv_bias": False}).qkv_bias


# ------------------------------------------------------------------------------------------- errors


def test_missing_and_misshapen_expert_tensors_fail_from_the_headers(tmp_path, monkeypatch):
  def no_reads(*args):
    raise AssertionError("tensor data read before the headers were checked")
  monkeypatch.setattr(hf_io, "read_tensor", no_reads)
  folder = _copy_fixture("qwen2_moe_f32", tmp_path / "a")
  _rewrite_tensors(folder, lambda t: t.pop("model.layers.3.mlp.experts.5.down_proj.weight"))
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.3\.mlp\.experts\.5\.down_proj\.weight' "
                                       r"\(for params\['layers'\]\['moe'\]\['experts'\]\['down_proj'\]\)"):
    models.load_hf(folder)
  folder = _copy_fixture("qwen3_moe_bf16", tmp_path / "b")
  _rewrite_tensors(folder, lambda t: t.update({"model.layers.1.mlp.experts.2.up_proj.weight": t[
      "model.layers.1.mlp.experts.2.up_proj.weight"].T.copy()}))
  with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight'"
                                       r" has shape \(32, 24\), expected \(24, 32\)"):
    models.load_hf(folder)
  folder = _copy_fixture("qwen3_moe_bf16", tmp_path / "c")
  _rewrite_tensors(folder, lambda t: t.update({"model.layers.0.mlp.experts.4.up_proj.weight": np.zeros((24, 32))}))
  with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers\.0\.mlp\.experts\.4\.up_proj\.weight'\]"):
    models.load_hf(folder)


@pytest.mark.parametrize("name, edit, error", [
    ("qwen3_moe_bf16", {"num_experts_per_tok": 5}, r"num_experts_per_tok: must be in \[1, num_experts=4\]"),
    ("qwen3_moe_bf16", {"attention_bias": True}, r"config\.json: attention_bias=true is not supported"),
    ("qwen3_f32", {"attention_bias": True}, r"config\.json: attention_bias=true is not supported"),
    ("qwen3_f32", {"use_sliding_window": True}, r"config\.json: use_sliding_window"),
    ("qwen2_moe_f32", {"use_sliding_window": True}, r"config\.json: use_sliding_window"),
    ("qwen2_moe_f32", {"shared_expert_intermediate_size": 0}, r"config\.json: shared_expert_intermediate_size=0"),
    ("qwen2_moe_f32", {"mlp_only_layers": [7]}, r"ModelConfig\.mlp_only_layers"),
    ("qwen3_moe_bf16", {"num_experts": 6}, r"config\.json: num_experts=6 disagrees with num_local_experts=4"),
    ("qwen3_moe_bf16", {"architectures": ["Qwen3ForCausalLM"]}, r"unsupported architectures \['Qwen3ForCausalLM'\]"),
])
def test_config_errors_name_the_key(name, edit, error, tmp_path):
  folder = _copy_fixture(name, tmp_path)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(_config_json(name) | edit, f)
  with pytest.raises(ValueError, match=error):
    models.load_hf(folder)


@pytest.mark.parametrize("changes, error", [
    (dict(model_type="qwen3_moe", qkv_bias=False, qk_norm=True), "shared_expert_intermediate_size"),
    (dict(model_type="qwen3_moe", qk_norm=True), "qkv_bias"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(model_type="qwen2"), "num_experts"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
])
def test_to_hf_dict_rejects_what_transformers_cannot_express(changes, error):
  with pytest.raises(ValueError, match=rf"ModelConfig\.{error}"):
    _mixed_moe_config(**changes).to_hf_dict()


# ------------------------------------------------------------------------------------------- transformers


@pytest.mark.slow
def test_fresh_transformers_moe_models_and_export(tmp_path):
  torch = pytest.importorskip("torch", reason="needs torch to build fresh reference models")
  pytest.importorskip("transformers", reason="needs transformers to build fresh reference models")
  torch.set_num_threads(1)
  spec = importlib.util.spec_from_file_location(
      "make_hf_fixtures", os.path.join(os.path.dirname(__file__), "..", "experiments", "make_hf_fixtures.py"))
  gen = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gen)
  common = dict(vocab_size=56, hidden_size=40, num_attention_heads=5, num_key_value_heads=1, rms_norm_eps=1e-6,
                max_position_embeddings=64, rope_theta=20000.0)
  fresh = {  # sizes unlike the committed fixtures: odd head counts, dense first layers, top-3 of 6
      "qwen3_moe_step2": dict(common, model_type="qwen3_moe", intermediate_size=56, num_hidden_layers=4,
                              head_dim=8, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
                              norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[],
                              tie_word_embeddings=False, dtype="float32"),
      "qwen2_moe_bf16": dict(common, model_type="qwen2_moe", intermediate_size=48, num_hidden_layers=3,
                             num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
                             shared_expert_intermediate_size=28, norm_topk_prob=False, decoder_sparse_step=1,
                             mlp_only_layers=[0], tie_word_embeddings=True, dtype="bfloat16"),
      "qwen3_3l": dict(common, model_type="qwen3", intermediate_size=72, num_hidden_layers=3, head_dim=12,
                       tie_word_embeddings=True, dtype="float32"),
  }
  for name, model_spec in fresh.items():
    folder = str(tmp_path / name)
    gen.write_fixture(model_spec, folder, seed=3, shape=(3, 11))
    cfg, params = models.load_hf(folder)
    assert _max_error(cfg, params, folder) < TOLERANCE, name
    if cfg.is_moe:   # both dropless implementations ('auto' is 'blocked' on CPU)
      assert _max_error(dataclasses.replace(cfg, moe_impl="ragged_dot"), params, folder) < TOLERANCE, name
    exported = str(tmp_path / f"{name}_export")
    models.save_hf(cfg, params, exported)
    ref = np.load(os.path.join(folder, "reference.npz"))
    with jax.default_matmul_precision("highest"):
      ours = np.asarray(FORWARD(cfg, params, jnp.asarray(ref["tokens"])))
    theirs = gen.reference_logits(exported, ref["tokens"])
    assert np.abs(theirs - ours).max() < TOLERANCE, name
