r"""What reading a layer's weights out of the stacked layer tree costs a memory-bound decode step on CPU.

  python experiments/benchmark_stacked_weights.py                       # SmolLM2-135M's MLP shapes
  python experiments/benchmark_stacked_weights.py --hf_path=DIR         # ... and DIR's real decode step

The decoder keeps its layers as one stacked tree (leading axis 'layers') run by a layer loop. A decode
step multiplies a few rows by every weight once, so it is bound by reading the weights. Times, on one
device, the MLP of ``--layers`` layers (x @ gate, x @ up, their product @ down; [batch, hidden] rows)
with the weights held three ways: one buffer per weight (``separate``), stacked and read by a rolled
``lax.scan`` (``stacked_scan``: a dynamic slice per layer), stacked and read by an unrolled loop
(``stacked_unrolled``: a static slice per layer, the CPU default ``scan_unroll=0``). Prints one JSON line
per form (median ms of ``--repeats``, GB/s of weights read) and the machine's streaming rate (a numpy
sum over a buffer as large as the weights). With ``--hf_path`` (or ``--decode_random``: SmolLM2-135M's
shapes, random weights), also one decode step (``kv_cache.forward_with_cache``, [batch, 1] tokens) per
``--decode`` setting (``model.dtype:param_dtype:scan_unroll``), the settings called in turn for
``--repeats`` rounds, with the step's compiled temporaries:

  python experiments/benchmark_stacked_weights.py --decode_random \
      --decode=float32:float32:1,bf16_matmul:bfloat16:1,bfloat16:bfloat16:1

Every decode step here donates its cache and takes the one the previous call returned, as the engine's decode
loop holds it (a step that does not would copy the whole cache every call). ``--decode_parts`` times the float32
step at SmolLM2-135M's shapes beside the parts of it that read weights (the 30 MLPs, the attention
projections, the tied lm head), each alone, all called in turn; and the tied
head under ``bf16_matmul`` over a bfloat16 embedding written as ``mixed_matmul(x, embedding.T)`` and as
``mixed_matmul_nt(x, embedding)``.
"""
import json
import time

import numpy as np
from absl import app, flags

import common

_LAYERS = flags.DEFINE_integer("layers", 30, "Layers.")
_HIDDEN = flags.DEFINE_integer("hidden", 576, "Hidden size.")
_MLP = flags.DEFINE_integer("mlp", 1536, "MLP hidden size.")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows (sequences decoded at once).")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls per form.")
_HF_PATH = flags.DEFINE_string("hf_path", "", "A Hugging Face folder: also time its decode step.")
_CACHE_LEN = flags.DEFINE_integer("cache_len", 160, "KV cache positions of the decode step.")
_DECODE_RANDOM = flags.DEFINE_bool("decode_random", False,
                                   "Time the decode step at SmolLM2-135M's shapes with random weights (no --hf_path).")
_PARTS = flags.DEFINE_bool("decode_parts", False,
                            "With --decode_random: also time the float32 step's weight-reading parts alone "
                            "(the 30 MLPs, the attention projections, the tied lm head), in turn with the step.")
_DECODE = flags.DEFINE_list("decode", ["float32:float32:0", "float32:float32:1"],
                            "Decode-step settings, each model.dtype:param_dtype:scan_unroll.")


def _median_ms(fn, *args) -> float:
  return 1000 * common.median_seconds(fn, *args, repeats=_REPEATS.value)


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  n, d, f = _LAYERS.value, _HIDDEN.value, _MLP.value
  rng = np.random.default_rng(0)
  weights = [jnp.asarray(rng.standard_normal((d, f), np.float32) * 0.02) for _ in range(3 * n)]
  stacked = jnp.stack(weights).reshape(n, 3, d, f)
  x = jnp.ones((_BATCH.value, d), jnp.float32)
  mlp = lambda x, g, u, w: x + ((x @ g) * (x @ u)) @ w.T

  def separate(ws, x):
    for i in range(n):
      x = mlp(x, *ws[3 * i:3 * i + 3])
    return x

  def stacked_scan(stack, x):
    return jax.lax.scan(lambda x, w: (mlp(x, w[0], w[1], w[2]), None), x, stack)[0]

  def stacked_unrolled(stack, x):
    for i in range(n):
      x = mlp(x, stack[i, 0], stack[i, 1], stack[i, 2])
    return x

  nbytes = 3 * n * d * f * 4
  big = np.ones((nbytes // 4,), np.float32)
  t0 = time.perf_counter()
  for _ in range(5):
    big.sum()
  seconds = (time.perf_counter() - t0) / 5
  print(json.dumps({"form": "numpy_sum", "ms": round(1000 * seconds, 2), "gb_per_s": round(nbytes / seconds / 1e9, 2)}),
        flush=True)
  for name, fn, arg in (("separate", separate, weights), ("stacked_scan", stacked_scan, stacked),
                        ("stacked_unrolled", stacked_unrolled, stacked)):
    ms = _median_ms(jax.jit(fn), arg, x)
    print(json.dumps({"form": name, "layers": n, "batch": _BATCH.value, "weights_mb": round(nbytes / 1e6, 1),
                      "ms": round(ms, 2), "gb_per_s": round(nbytes / ms / 1e6, 2)}), flush=True)
  if _HF_PATH.value or _DECODE_RANDOM.value:
    _decode_steps(jax, jnp)
  if _PARTS.value:
    _decode_parts(jax, jnp)


def _donated_step(jax, kv_cache, cfg, cache):
  """(call(params, tokens, positions) -> logits, lower(params, tokens, positions)): one cached decode step
  with the cache donated and carried from call to call, as the engine's decode loop holds it (a step that
  does not donate it copies the whole cache into a new buffer every call: 59 MB at SmolLM2's shapes, batch
  8, 160 positions, float32)."""
  step = jax.jit(lambda p, c, t, q: kv_cache.forward_with_cache(cfg, p, t[:, None], q[:, None], c),
                 donate_argnums=(1,))
  held = {"cache": cache}

  def call(params, tokens, positions):
    logits, held["cache"] = step(params, held["cache"], tokens, positions)
    return logits

  return call, lambda params, tokens, positions: step.lower(params, held["cache"], tokens, positions)


def _smollm2_config(models):
  """SmolLM2-135M-Instruct's shapes (float32 params)."""
  return models.ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                            intermediate_size=1536, tie_word_embeddings=True, rope_theta=1e5)


def _decode_parts(jax, jnp):
  """The float32 decode step at SmolLM2-135M's shapes and the parts of it that read weights, each alone
  (a rolled scan over the 30 layers' stacked weights, [batch, hidden] rows), called in turn."""
  import dataclasses
  from rl_fusion_jax import models
  from rl_fusion_jax.models import kv_cache
  from rl_fusion_jax.models.layers import mixed_matmul, mixed_matmul_nt
  cfg = dataclasses.replace(_smollm2_config(models), dtype="float32", scan_unroll=1)
  params = models.init_params(cfg, jax.random.key(0))
  b, d = _BATCH.value, cfg.hidden_size
  x = jnp.ones((b, d), jnp.float32)
  layers = params["layers"]

  def mlps(stack, x):
    def body(x, w):
      m = w["mlp"]
      return x + (jax.nn.silu(x @ m["gate_proj"]["kernel"]) * (x @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"], None
    return jax.lax.scan(body, x, stack)[0]

  def projections(stack, x):
    def body(x, w):
      a = w["attn"]
      q, k, v = (x @ a[n]["kernel"].reshape(d, -1) for n in ("q_proj", "k_proj", "v_proj"))
      return x + q @ a["o_proj"]["kernel"].reshape(-1, d) + jnp.sum(k) + jnp.sum(v), None
    return jax.lax.scan(body, x, stack)[0]

  step, lower_step = _donated_step(jax, kv_cache, cfg, kv_cache.init_cache(cfg, b, _CACHE_LEN.value))
  weights = lambda tree: sum(v.nbytes for v in jax.tree.leaves(tree))
  embedding_bf16 = params["embed"]["embedding"].astype(jnp.bfloat16)
  parts = {"decode_step": (step, (params, jnp.ones((b,), jnp.int32), jnp.full((b,), 50, jnp.int32)), 0),
           "mlps": (jax.jit(mlps), (layers, x), weights(layers["mlp"])),
           "attention_projections": (jax.jit(projections), (layers, x),
                                     weights({n: layers["attn"][n]["kernel"] for n in ("q_proj", "k_proj", "v_proj",
                                                                                        "o_proj")})),
           "lm_head": (jax.jit(lambda e, x: jnp.einsum("MD,VD->MV", x, e)), (params["embed"]["embedding"], x),
                       params["embed"]["embedding"].nbytes),
           # The tied head under bf16_matmul over a bfloat16 embedding, written both ways.
           "lm_head_bf16_x_at_embedding_T": (jax.jit(lambda e, x: mixed_matmul(x, e.T, "bfloat16")),
                                             (embedding_bf16, x), embedding_bf16.nbytes),
           "lm_head_bf16_mixed_matmul_nt": (jax.jit(lambda e, x: mixed_matmul_nt(x, e, "bfloat16")),
                                            (embedding_bf16, x), embedding_bf16.nbytes)}
  for fn, args, _ in parts.values():
    for _ in range(3):
      jax.block_until_ready(fn(*args))
  seconds = {name: [] for name in parts}
  for _ in range(_REPEATS.value):
    for name, (fn, args, _) in parts.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      seconds[name].append(time.perf_counter() - start)
  for name, (fn, args, nbytes) in parts.items():
    ms = 1000 * float(np.median(seconds[name]))
    temp = (lower_step if fn is step else fn.lower)(*args).compile().memory_analysis().temp_size_in_bytes
    line = {"form": "decode_part", "part": name, "batch": b, "ms": round(ms, 2), "temp_mb": round(temp / 1e6, 1)}
    if nbytes:
      line.update(weights_mb=round(nbytes / 1e6, 1), gb_per_s=round(nbytes / ms / 1e6, 2))
    print(json.dumps(line), flush=True)


def _decode_steps(jax, jnp):
  """One decode step ([batch, 1] tokens over `--cache_len` positions) per `--decode` setting, the settings
  called in turn (round robin, `--repeats` rounds) so that the machine's drift hits each alike."""
  import dataclasses
  from rl_fusion_jax import models
  from rl_fusion_jax.models import hf_io, kv_cache
  if _HF_PATH.value:
    cfg0, host = hf_io.load_hf(_HF_PATH.value)
    params0 = jax.tree.map(jnp.asarray, host)
  else:   # SmolLM2-135M-Instruct's shapes, random weights: the step's cost does not depend on the values
    cfg0 = _smollm2_config(models)
    params0 = models.init_params(cfg0, jax.random.key(0))
  b = _BATCH.value
  steps = {}
  for setting in _DECODE.value:
    dtype, param_dtype, unroll = setting.split(":")
    cfg = dataclasses.replace(cfg0, dtype=dtype, param_dtype=param_dtype, scan_unroll=int(unroll))
    params = jax.tree.map(lambda x, d=param_dtype: x.astype(d), params0)
    step, lower_step = _donated_step(jax, kv_cache, cfg, kv_cache.init_cache(cfg, b, _CACHE_LEN.value))
    args = (params, jnp.ones((b,), jnp.int32), jnp.full((b,), 50, jnp.int32))
    for _ in range(3):
      jax.block_until_ready(step(*args))
    temp = lower_step(*args).compile().memory_analysis().temp_size_in_bytes
    steps[setting] = (step, args, temp, [])
  for _ in range(_REPEATS.value):
    for step, args, _, seconds in steps.values():
      start = time.perf_counter()
      jax.block_until_ready(step(*args))
      seconds.append(time.perf_counter() - start)
  for setting, (_, _, temp, seconds) in steps.items():
    dtype, param_dtype, unroll = setting.split(":")
    ms = 1000 * float(np.median(seconds))
    print(json.dumps({"form": "decode_step", "dtype": dtype, "param_dtype": param_dtype, "scan_unroll": int(unroll),
                      "batch": b, "ms": round(ms, 2), "p25_ms": round(1000 * float(np.percentile(seconds, 25)), 2),
                      "p75_ms": round(1000 * float(np.percentile(seconds, 75)), 2),
                      "tokens_per_s": round(1000 * b / ms, 1), "temp_mb": round(temp / 1e6, 1)}), flush=True)


if __name__ == "__main__":
  app.run(main)
