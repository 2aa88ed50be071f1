"""HF checkpoint import/export: parity with transformers logits, round trips, and errors that name the culprit.

The committed fixtures (rl_fusion_jax/testing/hf_fixtures, written by experiments/make_hf_fixtures.py)
carry reference logits computed by transformers, an implementation independent of ours. The one test
that runs transformers itself is marked slow and skips when torch / transformers are not importable.
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
from rl_fusion_jax.models import hf_io
from rl_fusion_jax.testing import fixture_paths

FIXTURES = ("qwen2_f32", "qwen2_tied_bf16", "llama_gqa_f32", "llama3_rope")
FORWARD = jax.jit(models.forward, static_argnums=0)
# Logits must match transformers' within this absolute bound (the fixtures' logits reach |5.7|). The
# committed references were computed by transformers (PyTorch) on the machine that wrote the fixtures, so
# what varies with the CPU is the float32 summation order of both libraries' kernels (each picks them by
# the processor's features: AVX2, AVX-512, AMX), a few last bits per op. Measured on an AMD EPYC (AVX2):
# at most 9.2e-6 (llama3_rope); moving every weight by 1e-7 relative (a few last bits) moved the
# logits by <= 1.5e-5. A real mistake is orders above: rounding the rotary inv_freq alone costs 5e-2.
TOLERANCE = 1e-4


_fixture, _copy_fixture = fixture_paths.fixture, fixture_paths.copy_fixture


def _max_error(cfg, params, folder):
  ref = np.load(os.path.join(folder, "reference.npz"))
  with jax.default_matmul_precision("highest"):  # a no-op on CPU; keeps GPUs from using TF32 here
    logits = np.asarray(FORWARD(cfg, params, jnp.asarray(ref["tokens"])))
  assert logits.shape == ref["logits"].shape
  return float(np.abs(logits - ref["logits"]).max())


def _tensors(path):
  with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
    return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("name", FIXTURES)
def test_load_hf_matches_transformers_logits(name):
  cfg, params = models.load_hf(_fixture(name))
  assert _max_error(cfg, params, _fixture(name)) < TOLERANCE


def test_loaded_configs_and_dtypes():
  cfg, params = models.load_hf(_fixture("qwen2_tied_bf16"))
  assert (cfg.model_type, cfg.qkv_bias, cfg.tie_word_embeddings) == ("qwen2", True, True)
  assert (cfg.param_dtype, cfg.dtype, cfg.rope_theta) == ("bfloat16", "float32", 1e6)
  assert "lm_head" not in params and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  cfg, params = models.load_hf(_fixture("llama_gqa_f32"))
  assert (cfg.qkv_bias, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (False, 4, 2, 16)
  assert params["layers"]["attn"]["q_proj"]["kernel"].shape == (cfg.num_layers, 32, 4, 16)
  assert "bias" not in params["layers"]["attn"]["q_proj"]
  cfg, _ = models.load_hf(_fixture("llama3_rope"))
  assert dict(cfg.rope_scaling) == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_parity_is_sensitive_to_rope_scaling():
  # Control: dropping llama3 scaling must break parity, so the parity tests can fail.
  cfg, params = models.load_hf(_fixture("llama3_rope"))
  assert _max_error(dataclasses.replace(cfg, rope_scaling=None), params, _fixture("llama3_rope")) > 1e-2


def test_hf_layout_of_heads():
  # HF q_proj.weight is [N*H, D] with row n*H + h for head n, dim h; ours is [D, N, H].
  cfg, params = models.load_hf(_fixture("qwen2_f32"))
  hf = _tensors(_fixture("qwen2_f32"))
  q_w = hf["model.layers.1.self_attn.q_proj.weight"]
  ours = np.asarray(params["layers"]["attn"]["q_proj"]["kernel"][1])
  n, h = 2, 5
  np.testing.assert_array_equal(ours[:, n, h], q_w[n * cfg.head_dim + h, :])
  o_w = hf["model.layers.1.self_attn.o_proj.weight"]  # [D, N*H]
  np.testing.assert_array_equal(np.asarray(params["layers"]["attn"]["o_proj"]["kernel"][1])[n, h],
                                o_w[:, n * cfg.head_dim + h])


@pytest.mark.parametrize("name", FIXTURES)
def test_save_hf_round_trip_is_exact(name, tmp_path):
  cfg, params = models.load_hf(_fixture(name))
  out = tmp_path / "ckpt"
  models.save_hf(cfg, params, out)
  cfg2, params2 = models.load_hf(out)
  assert cfg2 == cfg
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Same tensor names, shapes and values as the transformers-written checkpoint.
  original, saved = _tensors(_fixture(name)), _tensors(str(out))
  assert original.keys() == saved.keys()
  for key in original:
    np.testing.assert_array_equal(original[key], saved[key])
  written = json.loads((out / "config.json").read_text())
  assert written["architectures"] and written["torch_dtype"] == written["dtype"] == cfg.param_dtype


def test_save_hf_replaces_existing_folder_and_leaves_no_temp(tmp_path):
  cfg, params = models.load_hf(_fixture("qwen2_tied_bf16"))
  out = tmp_path / "ckpt"
  out.mkdir()
  (out / "stale.txt").write_text("old")
  models.save_hf(cfg, params, out, dtype="float32")
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  assert os.listdir(tmp_path) == ["ckpt"]
  cfg2, params2 = models.load_hf(out)
  assert cfg2.param_dtype == "float32" and params2["embed"]["embedding"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(params2["embed"]["embedding"]),
                                np.asarray(params["embed"]["embedding"], np.float32))


def test_save_hf_failure_keeps_old_checkpoint(tmp_path, monkeypatch):
  cfg, params = models.load_hf(_fixture("qwen2_tied_bf16"))
  out = tmp_path / "ckpt"
  models.save_hf(cfg, params, out)
  broken = dict(params, final_norm={"scale": jnp.ones((7,))})
  with pytest.raises(ValueError, match=r"\['final_norm'\]\['scale'\]: shape \(7,\)"):
    models.save_hf(cfg, broken, out)

  def crash(*args, **kwargs):
    raise OSError("disk full")
  monkeypatch.setattr(hf_io, "save_file", crash)  # a crash in the middle of writing
  with pytest.raises(OSError, match="disk full"):
    models.save_hf(dataclasses.replace(cfg, eos_token_id=5), params, out)
  assert models.load_hf(out)[0] == cfg and os.listdir(tmp_path) == ["ckpt"]


def test_save_hf_rejects_unexportable_config(tmp_path):
  cfg = models.ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=8, model_type="qwen2", qkv_bias=False)
  with pytest.raises(ValueError, match="qkv_bias"):
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), models.abstract_params(cfg))
    models.save_hf(cfg, params, tmp_path / "x")
  assert not os.path.exists(tmp_path / "x")


def test_load_hf_sharded_checkpoint(tmp_path):
  cfg, params = models.load_hf(_fixture("qwen2_f32"))
  tensors = _tensors(_fixture("qwen2_f32"))
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
  folder = tmp_path / "sharded"
  folder.mkdir()
  shutil.copy(os.path.join(_fixture("qwen2_f32"), "config.json"), folder)
  for file, keys in shards.items():
    save_file({k: tensors[k] for k in keys}, str(folder / file))
  index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
  (folder / "model.safetensors.index.json").write_text(json.dumps(index))
  cfg2, params2 = models.load_hf(folder)
  assert cfg2 == cfg
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)
  os.remove(folder / "model-00002-of-00002.safetensors")
  with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
    models.load_hf(folder)


def _rewrite_tensors(folder, edit):
  tensors = _tensors(folder)
  edit(tensors)
  save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def test_load_hf_errors_name_the_path(tmp_path):
  missing = tmp_path / "nowhere"
  with pytest.raises(FileNotFoundError, match=str(missing)):
    models.load_hf(missing)
  folder = _copy_fixture("qwen2_f32", tmp_path)
  os.remove(os.path.join(folder, "config.json"))
  with pytest.raises(FileNotFoundError, match=r"qwen2_f32/config\.json"):
    models.load_hf(folder)
  with open(os.path.join(folder, "config.json"), "w") as f:
    f.write('{"model_type": "qwen2", ')
  with pytest.raises(ValueError, match=r"qwen2_f32/config\.json: malformed JSON"):
    models.load_hf(folder)
  shutil.copy(os.path.join(_fixture("qwen2_f32"), "config.json"), folder)
  with open(os.path.join(folder, "model.safetensors"), "wb") as f:
    f.write(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
  with pytest.raises(ValueError, match=r"qwen2_f32/model\.safetensors: not a readable safetensors file"):
    models.load_hf(folder)
  os.remove(os.path.join(folder, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match=r"qwen2_f32: no \*\.safetensors files"):
    models.load_hf(folder)


@pytest.mark.parametrize("edit, error", [
    ({"model_type": "gpt2"}, r"config\.json: unsupported model_type 'gpt2'"),
    ({"architectures": ["Qwen2Model"]}, r"config\.json: unsupported architectures \['Qwen2Model'\]"),
    ({"hidden_size": None}, r"config\.json: .*ModelConfig\.hidden_size"),
    ({"use_sliding_window": True}, r"config\.json: use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"config\.json: .*rope_scaling\.rope_type"),
    ({"num_hidden_layers": "__delete__"}, r"config\.json: missing key 'num_hidden_layers'"),
])
def test_load_hf_config_errors_name_the_key(edit, error, tmp_path):
  folder = _copy_fixture("qwen2_f32", tmp_path)
  path = os.path.join(folder, "config.json")
  d = json.loads(open(path).read())
  for key, value in edit.items():
    if value == "__delete__":
      del d[key]
    else:
      d[key] = value
  with open(path, "w") as f:
    json.dump(d, f)
  with pytest.raises(ValueError, match=error):
    models.load_hf(folder)


def test_load_hf_tensor_errors_name_the_key(tmp_path):
  folder = _copy_fixture("llama_gqa_f32", tmp_path)
  _rewrite_tensors(folder, lambda t: t.pop("model.norm.weight"))
  with pytest.raises(ValueError, match=r"missing tensor 'model\.norm\.weight'"):
    models.load_hf(folder)
  folder = _copy_fixture("qwen2_f32", tmp_path / "b")
  _rewrite_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)}))
  with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' "
                                       r"has shape \(8, 32\), expected \(16, 32\)"):
    models.load_hf(folder)
  folder = _copy_fixture("qwen2_f32", tmp_path / "c")
  _rewrite_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)}))
  with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers\.0\.self_attn\.o_proj\.bias'\]"):
    models.load_hf(folder)


def test_load_hf_ignores_inv_freq_and_a_tied_head_copy(tmp_path):
  folder = _copy_fixture("qwen2_tied_bf16", tmp_path)
  def add(t):
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
  _rewrite_tensors(folder, add)
  cfg, params = models.load_hf(folder)
  assert _max_error(cfg, params, folder) < TOLERANCE
  _rewrite_tensors(folder, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] * 2}))
  with pytest.raises(ValueError, match=r"unexpected tensors \['lm_head\.weight'\]"):
    models.load_hf(folder)


def test_hf_config_reads_4x_and_5x_layouts_alike():
  v5 = json.loads(open(os.path.join(_fixture("llama3_rope"), "config.json")).read())
  v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "dtype")}
  scaling = {k: v for k, v in v5["rope_parameters"].items() if k != "rope_theta"}
  v4.update(rope_theta=v5["rope_parameters"]["rope_theta"], rope_scaling=scaling, torch_dtype="float32")
  cfg = models.ModelConfig.from_hf_dict(v5)
  assert models.ModelConfig.from_hf_dict(v4) == cfg
  assert cfg.rope_theta == 500000.0 and cfg.bos_token_id == 1 and cfg.eos_token_id == 2
  assert models.ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
  assert models.ModelConfig.from_hf_dict({**v5, "eos_token_id": [7, 9]}).eos_token_id == 7
  with pytest.raises(ValueError, match="attention_bias"):
    models.ModelConfig.from_hf_dict({**v5, "attention_bias": True})


FIXTURE_WRITER = os.path.join(os.path.dirname(__file__), "..", "experiments", "make_hf_fixtures.py")


def _fixture_writer():
  """experiments/make_hf_fixtures.py loaded by path (experiments/ is not a package); its flags are defined
  only when it runs as a binary."""
  spec = importlib.util.spec_from_file_location("make_hf_fixtures", FIXTURE_WRITER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_fixture_writer_refuses_before_writing_anything(tmp_path):
  """experiments/make_hf_fixtures.py: an unknown --only name, and (where torch or transformers is missing)
  the missing package, are refused before any folder is made; run from elsewhere, its default output is the
  repository's fixture folder, not a path under the working directory."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  binary = FIXTURE_WRITER
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, binary, "--only=qwen2_f32,nope", f"--out_dir={out}"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and "--only: unknown fixture(s) ['nope']" in proc.stderr, proc.stderr[-2000:]
  assert not out.exists()
  have = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
  if not have:
    proc = subprocess.run([sys.executable, binary, "--only=qwen2_f32"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "pip install -e '.[fixtures]'" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())           # nothing under the working directory
  assert os.path.samefile(_fixture_writer().DEFAULT_OUT_DIR, fixture_paths.FIXTURES_DIR)


@pytest.mark.slow
def test_fresh_transformers_models_and_export(tmp_path):
  torch = pytest.importorskip("torch", reason="needs torch to build fresh reference models")
  pytest.importorskip("transformers", reason="needs transformers to build fresh reference models")
  torch.set_num_threads(1)
  gen = _fixture_writer()
  fresh = {  # sizes unlike the committed fixtures: odd head counts, 3 layers, MQA, bf16 llama3
      "qwen2_3l": dict(model_type="qwen2", vocab_size=72, hidden_size=40, intermediate_size=56,
                       num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=1, rope_theta=20000.0,
                       rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False, dtype="float32"),
      "llama3_bf16": dict(model_type="llama", vocab_size=56, hidden_size=48, intermediate_size=80,
                          num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, rope_theta=50000.0,
                          rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=True,
                          dtype="bfloat16", rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0,
                                                              high_freq_factor=2.0,
                                                              original_max_position_embeddings=32)),
  }
  for name, model_spec in fresh.items():
    folder = str(tmp_path / name)
    gen.write_fixture(model_spec, folder, seed=3, shape=(3, 11))
    cfg, params = models.load_hf(folder)
    assert _max_error(cfg, params, folder) < TOLERANCE, name
    exported = str(tmp_path / f"{name}_export")
    models.save_hf(cfg, params, exported)
    ref = np.load(os.path.join(folder, "reference.npz"))
    with jax.default_matmul_precision("highest"):
      ours = np.asarray(FORWARD(cfg, params, jnp.asarray(ref["tokens"])))
    theirs = gen.reference_logits(exported, ref["tokens"])
    assert np.abs(theirs - ours).max() < TOLERANCE, name


def test_load_hf_into_fsdp_never_holds_more_than_the_shards_plus_one_leaf(tmp_path, monkeypatch):
  """Each leaf goes from the file straight to its 8-way FSDP sharding (one ``reshard.move`` per leaf): at
  every placement each device holds its shards of the leaves placed so far plus its shard of the current
  one, never a whole leaf or the whole model on one device."""
  import gc

  from rl_fusion_jax.config import MeshConfig
  from rl_fusion_jax.sharding import memory, reshard
  from rl_fusion_jax.sharding.mesh import make_mesh
  from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
  from rl_fusion_jax.testing.tiny import tiny_model_config
  cfg = tiny_model_config(hidden_size=64, intermediate_size=128, vocab_size=128)
  models.save_hf(cfg, models.init_params(cfg, jax.random.key(3)), tmp_path / "ckpt")
  mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
  abstract = models.abstract_params(cfg)
  shardings = param_shardings(abstract, models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  stats, real_move = [], reshard.move

  def tracked_move(*args, **kwargs):
    out = real_move(*args, **(kwargs | {"track_memory": True}))
    stats.append(out[1])
    return out

  monkeypatch.setattr(reshard, "move", tracked_move)
  gc.collect()
  before = memory.per_device(memory.live_bytes())
  _, params = models.load_hf(tmp_path / "ckpt", shardings)
  # Per-device bytes from shapes and shardings alone (every device holds one shard of every leaf).
  shard_bytes = [int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
                 for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))]
  final, largest = sum(shard_bytes), max(shard_bytes)
  assert final < sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)) // 4   # really split
  assert len(stats) == len(shard_bytes)     # one move per leaf, each sampled
  for move_stats in stats:
    for d in range(8):
      assert move_stats.peak_per_device[d] - before.get(d, 0) <= final + largest
  _, host = models.load_hf(tmp_path / "ckpt")
  for x, y, s in zip(jax.tree.leaves(params), jax.tree.leaves(host), jax.tree.leaves(shardings)):
    assert x.sharding == s and np.array_equal(np.asarray(x), y)
