"""The precision policies of `ModelConfig.dtype`: 'float32', 'bf16_matmul' and 'bfloat16'.

`mixed_matmul` (the 'bf16_matmul' contraction) and `mixed_matmul_nt` (its form for a kernel stored
transposed: the tied lm head) are checked against float64 numpy on the bfloat16-rounded
inputs, forward and backward; the policies against float32 at the tolerance docs/models.md states
("Precision policy"); generation against the training forward under the same policy.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax import model_config, models
from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.models import layers
from rl_fusion_jax.rollout.decode import GenerateSpec
from rl_fusion_jax.rollout.engine import Engine, EngineConfig, Request
from rl_fusion_jax.rollout.sampling import SamplingParams
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.reference_generator import Generator
from rl_fusion_jax.testing.tiny import tiny_model_config
from rl_fusion_jax.train.logprobs import token_logprobs

CFG = tiny_model_config()


def _bf16_rounded(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("rows", [12, 13])    # 12: the weight gradient over split rows; 13 (prime): one dot
@pytest.mark.parametrize("transposed", [False, True])   # True: mixed_matmul_nt, the kernel stored [N, K]
def test_mixed_matmul_forward_and_gradients_equal_float64_on_rounded_inputs(rows, transposed):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((rows, 40)).astype(np.float32)
  w = rng.standard_normal((40, 24)).astype(np.float32)
  c = rng.standard_normal((rows, 24)).astype(np.float32)   # d loss / d y
  if transposed:
    matmul, w_arg = (lambda x, w: layers.mixed_matmul_nt(x, w, "bfloat16")), np.ascontiguousarray(w.T)
  else:
    matmul, w_arg = (lambda x, w: layers.mixed_matmul(x, w, "bfloat16")), w
  fn = lambda x, w: jnp.sum(matmul(x, w) * c)
  y = matmul(jnp.asarray(x), jnp.asarray(w_arg))
  dx, dw = jax.grad(fn, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w_arg))
  xr, wr, cr = _bf16_rounded(x), _bf16_rounded(w), _bf16_rounded(c)
  assert y.dtype == dx.dtype == dw.dtype == jnp.float32 and dw.shape == w_arg.shape
  np.testing.assert_allclose(np.asarray(y), xr @ wr, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dx), cr @ wr.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), (xr.T @ cr).T if transposed else xr.T @ cr, rtol=1e-5, atol=1e-5)
  # The rounding is real: the float32 product differs from the rounded-input one.
  assert np.abs(x.astype(np.float64) @ w - xr @ wr).max() > 1e-3


def _dot_operand_dtypes(cfg, params, tokens):
  jaxpr = jax.make_jaxpr(lambda p, t: token_logprobs(cfg, p, t))(params, tokens)
  found = []

  def walk(jp):
    for eqn in jp.eqns:
      if eqn.primitive.name == "dot_general":
        found.append((tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype)))
      for sub in jax.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr.jaxpr)
  return found


def test_bf16_matmul_runs_projections_in_bfloat16_and_the_rest_in_float32():
  cfg = dataclasses.replace(CFG, dtype="bf16_matmul")
  params = models.init_params(cfg, jax.random.key(0))
  tokens = jnp.zeros((2, 8), jnp.int32)
  dots = _dot_operand_dtypes(cfg, params, tokens)
  low = [d for d in dots if d[0] == ("bfloat16", "bfloat16")]
  # The scanned layer body traces once: 7 projections (q, k, v, o, gate, up, down), plus the lm head,
  # each accumulating in float32.
  assert len(low) == 7 + 1 and all(out == "float32" for _, out in low)
  # Attention scores and the probability-weighted sum stay float32.
  assert all(d[0] == ("float32", "float32") for d in dots if d not in low)
  assert len(dots) == len(low) + 2
  f32_dots = _dot_operand_dtypes(CFG, params, tokens)
  assert all(d[0] == ("float32", "float32") for d in f32_dots)


@pytest.mark.parametrize("policy,tolerance", [("bf16_matmul", 5e-3), ("bfloat16", 1e-2)])
def test_policy_logprobs_within_stated_tolerance_of_float32(policy, tolerance):
  """The tolerance docs/models.md states: token log-probs of a model at its initial scale (std 0.02) within 5e-3
  (bf16_matmul) and 1e-2 (bfloat16) of float32."""
  params = models.init_params(CFG, jax.random.key(0), init_std=0.02)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 24)), jnp.int32)
  ref = token_logprobs(CFG, params, tokens)
  got = token_logprobs(dataclasses.replace(CFG, dtype=policy), params, tokens)
  diff = float(jnp.max(jnp.abs(got - ref)))
  assert 0 < diff < tolerance, diff


def test_cpu_flags_read_the_first_processors_flags_line(tmp_path):
  info = tmp_path / "cpuinfo"
  info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                  "processor\t: 1\nflags\t\t: fpu\n")
  assert model_config.cpu_flags(str(info)) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
  assert model_config.cpu_flags(str(tmp_path / "missing")) == frozenset()
  (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
  assert model_config.cpu_flags(str(tmp_path / "arm")) == frozenset()


@pytest.mark.parametrize("backend,flags,expected", [
    ("cpu", {"avx2", "avx512f"}, "float32"),            # AVX-512 without its bfloat16 dot instructions
    ("cpu", {"avx2", "avx512f", "avx512_bf16"}, "bf16_matmul"),
    ("cpu", {"avx2", "amx_bf16", "amx_tile"}, "bf16_matmul"),
    ("cpu", set(), "float32"),                          # nothing known (not Linux, not x86)
    ("gpu", set(), "bf16_matmul")])
def test_auto_precision_follows_the_backend_and_the_cpus_bfloat16_instructions(monkeypatch, backend, flags,
                                                                              expected):
  monkeypatch.setattr(model_config, "cpu_flags", lambda: frozenset(flags))
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  model_config.default_precision.cache_clear()
  try:
    cfg = dataclasses.replace(CFG, dtype="auto")
    assert cfg.dtype == "auto" and cfg.precision == expected
    resolved = dataclasses.replace(CFG, dtype=expected)
    assert (cfg.compute_dtype, cfg.matmul_dtype) == (resolved.compute_dtype, resolved.matmul_dtype)
  finally:
    model_config.default_precision.cache_clear()


def test_auto_computes_exactly_what_its_resolved_policy_does():
  cfg = dataclasses.replace(CFG, dtype="auto")
  params = models.init_params(CFG, jax.random.key(0), init_std=0.02)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 12)), jnp.int32)
  got = token_logprobs(cfg, params, tokens)
  want = token_logprobs(dataclasses.replace(CFG, dtype=cfg.precision), params, tokens)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  other = "float32" if cfg.precision == "bf16_matmul" else "bf16_matmul"
  assert not np.array_equal(np.asarray(got), np.asarray(token_logprobs(dataclasses.replace(CFG, dtype=other),
                                                                        params, tokens)))


def test_unknown_policy_is_rejected_naming_the_field():
  with pytest.raises(ValueError, match=r"ModelConfig\.dtype.*bf16_matmul"):
    dataclasses.replace(CFG, dtype="bf16")


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=-1), MeshConfig(data=2, fsdp=2, tensor=2)],
                         ids=["data8", "data2_fsdp2_tensor2"])
def test_generation_logprobs_match_the_training_forward_under_bf16_matmul(mesh_cfg):
  cfg = dataclasses.replace(CFG, dtype="bf16_matmul")
  mesh = make_mesh(mesh_cfg)
  shardings = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  params = jax.device_put(models.init_params(cfg, jax.random.key(0)), shardings)
  p, n, b = 6, 10, 8
  gen = Generator(GenerateSpec(cfg, SamplingParams(1.0), p, n, -1), mesh, shardings)
  toks = jnp.asarray(np.random.default_rng(0).integers(3, 60, (b, p)), jnp.int32)
  out = jax.device_get(gen(params, toks, jnp.full((b,), p, jnp.int32), jnp.arange(b, dtype=jnp.int32),
                           jax.random.key(0), jnp.int32(0)))
  train_logp = np.asarray(jax.jit(lambda q, t: token_logprobs(cfg, q, t))(params, out.tokens_bt))
  np.testing.assert_allclose(out.logp_bt[:, p:], train_logp[:, p:], atol=1e-3)
  assert np.isfinite(out.logp_bt).all() and (out.logp_bt[:, p:] < 0).all()


def test_engine_under_bf16_matmul_samples_what_the_generator_does():
  # The engine's decode chunk casts each layer's kernels to bfloat16 once (`models.decoding_params`); the
  # reference Generator casts them in every matmul. Same tokens, the same log-probs, sharded over tensor.
  cfg = dataclasses.replace(CFG, dtype="bf16_matmul")
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  shardings = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  params = jax.device_put(models.init_params(cfg, jax.random.key(3), init_std=0.5), shardings)
  assert isinstance(models.decoding_params(cfg, params), models.DecodeParams)
  p, n, b = 6, 10, 8
  spec = GenerateSpec(cfg, SamplingParams(1.0), p, n, -1)
  toks = np.random.default_rng(2).integers(3, 60, (b, p)).astype(np.int32)
  ref = jax.device_get(Generator(spec, mesh, shardings)(params, jnp.asarray(toks), jnp.full((b,), p, jnp.int32),
                                                       jnp.arange(b, dtype=jnp.int32), jax.random.key(0),
                                                       jnp.int32(0)))
  engine = Engine(EngineConfig(spec, num_slots=4, chunk_steps=3), mesh, shardings)
  engine.add([Request(i, i, toks[i]) for i in range(b)])
  got = engine.run(params, 0).rollout
  order = np.argsort(got.sample_id_b)
  np.testing.assert_array_equal(got.tokens_bt[order], ref.tokens_bt)
  np.testing.assert_allclose(got.logp_bt[order], ref.logp_bt, atol=2e-5)


def test_micro_batch_gradients_accumulate_in_float32_for_bfloat16_params():
  # Nine micro-batches: gradient 1.0, then eight of 0.001 each. bfloat16 (8-bit mantissa, spacing 2**-7 at
  # 1.0) would round every 0.001 away and end at exactly 1.0; a float32 sum ends at 1.008, whose bfloat16
  # rounding is 1.0078125.
  from jax.sharding import Mesh
  from rl_fusion_jax.train import step as step_lib
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  params = {"w": jnp.ones((), jnp.bfloat16)}
  x = jnp.asarray([1.0] + [0.001] * 8, jnp.float32)

  def loss_fn(p, x_b, weights_b):
    loss = jnp.sum(p["w"].astype(jnp.float32) * x_b * weights_b)
    return loss, {"loss": loss}

  grads, sums = jax.jit(lambda p, x: step_lib._accumulate(loss_fn, p, x, jnp.ones_like(x), 9, mesh))(params, x)
  assert grads["w"].dtype == jnp.bfloat16
  assert float(grads["w"]) == float(jnp.bfloat16(1.008)) == 1.0078125
  np.testing.assert_allclose(float(sums["loss"]), 1.008, rtol=1e-6)


def test_bfloat16_generation_copy_generates_exactly_what_the_float32_masters_do():
  # Under 'bfloat16' every weight is cast to bfloat16 before use, so the half-size generation copy the
  # phase switch makes (ModelConfig.generation_dtype) must sample the same tokens with the same log-probs.
  cfg = dataclasses.replace(CFG, dtype="bfloat16")
  assert cfg.generation_dtype == jnp.bfloat16
  assert dataclasses.replace(CFG, dtype="bf16_matmul").generation_dtype == jnp.float32
  assert CFG.generation_dtype == jnp.float32
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  shardings = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  masters = jax.device_put(models.init_params(cfg, jax.random.key(4)), shardings)
  copy = jax.tree.map(lambda x: x.astype(jnp.bfloat16), masters)
  p, n, b = 6, 10, 8
  gen = Generator(GenerateSpec(cfg, SamplingParams(1.0), p, n, -1), mesh, shardings)
  toks = jnp.asarray(np.random.default_rng(1).integers(3, 60, (b, p)), jnp.int32)
  run = lambda params: jax.device_get(gen(params, toks, jnp.full((b,), p, jnp.int32),
                                          jnp.arange(b, dtype=jnp.int32), jax.random.key(2), jnp.int32(0)))
  a, c = run(masters), run(copy)
  np.testing.assert_array_equal(a.tokens_bt, c.tokens_bt)
  np.testing.assert_array_equal(a.logp_bt, c.logp_bt)
