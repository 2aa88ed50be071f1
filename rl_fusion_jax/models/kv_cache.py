"""Fixed-shape KV cache and the one cached forward that serves both prefill and decode.

`KVCache` is a plain dict `{'k': [L, B, K, S, H], 'v': [L, B, K, S, H]}` (layers stacked, one array
each), so it shards, donates and offloads like any pytree. Each layer's slice [B, K, S, H] is the layout
attention reads (batch and kv head outermost, positions then head dim), so a decode step reads the cache
without transposing it. Shapes never change, so each generation program compiles once.
Like the parameters, the cache carries logical axis names (`cache_logical_axes`), and the rule tables in
`rl_fusion_jax.sharding.rules` decide its layout (`rules.cache_sharding`); this module never places it.
This module never allocates a second cache: writes are scatters into the (donated) input buffers, batched
over the rows (`layers.write_rows`), so a cache sharded over B is written shard-locally.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rl_fusion_jax.model_config import DTYPES, ModelConfig
from rl_fusion_jax.models.decoder import Params, _check_tokens, bind, unrolled_without_grad
from rl_fusion_jax.models.layers import read_index

KVCache = dict[str, jax.Array]
# `decoding_params` prepares params (True) or returns them as given (False: every projection slices and casts
# its kernel from the stacks, as before). Read while tracing: for A/B runs
# (experiments/benchmark_real_generate.py --cast_once_ab) and the tests' equality checks.
CAST_ONCE = True


@functools.partial(jax.tree_util.register_dataclass, data_fields=("params", "layers"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class DecodeParams:
  """Params prepared once for many cached forwards (`decoding_params`): ``layers`` holds, per global layer
  index, that layer's projection kernels sliced out of the stacks, cast to the matmul dtype where it is
  narrower (a nested dict of the kernels only); ``params`` the params as given (everything else is read
  from them, as without preparation)."""
  params: Params
  layers: tuple


def decoding_params(cfg: ModelConfig, params: Params) -> Params | DecodeParams:
  """``params`` prepared for the cached forwards of one program (a decode chunk: every decode step and
  refill of it): where every layer is unrolled (`decoder.unrolled_without_grad`: the CPU default) and the
  compute is float32, each layer's projection kernels are sliced out of the stacks once, cast to the matmul
  dtype where it is narrower than the kernel ('bf16_matmul' over float32 weights), and the cached forwards
  run the layers as a Python loop that reads them (a constant layer index).

  Without it XLA:CPU copies each layer's slice of a stacked kernel before its matmul in every decode step
  (and, under 'bf16_matmul', every refill's prefill casts every kernel again: a branch of the decode loop's
  conditional, out of which XLA hoists nothing); SmolLM2-135M-Instruct, batch 32: BENCHMARKS.md. The cast is
  the one each projection makes of its kernel (`layers.Projection`: a `mixed_matmul` casts both inputs to
  the matmul dtype), so the results are the same bit for bit. While it runs the program holds a second copy
  of the projection kernels, in the narrower of their dtype and the matmul dtype (half the float32 kernels'
  bytes under 'bf16_matmul', all of them in float32). Other weights (norms, biases, an MoE's router and
  routed experts) are read from ``params`` as before. Otherwise ``params`` is returned as it is: under
  'bfloat16' compute a loop in place of the layer scan would move XLA's fusion boundaries, and with them
  where bfloat16 intermediates are rounded."""
  low = jnp.dtype(cfg.matmul_dtype)
  if not (CAST_ONCE and unrolled_without_grad(cfg) and jnp.dtype(cfg.compute_dtype) == jnp.float32):
    return params
  layers = tuple(_layer_kernels(params[name], index, low) for name, index in cfg.layer_stacks)
  return DecodeParams(params, layers) if any(layers) else params


def _layer_kernels(tree: dict, index: int, low) -> dict:
  """The ``kernel`` leaves of one stack's ``tree`` at layer ``index``, those wider than ``low`` cast to it
  (nested like ``tree``; subtrees without one left out)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      if sub := _layer_kernels(value, index, low):
        out[key] = sub
    elif key == "kernel":
      layer = read_index(value, index)   # a half-precision stack as 16-bit words on CPU
      out[key] = layer.astype(low) if low.itemsize < jnp.dtype(value.dtype).itemsize else layer
  return out


def cache_logical_axes() -> tuple[str, ...]:
  """Logical names of the dimensions of `cache['k']` and `cache['v']` ([L, B, K, S, H]).

  The layer and head-dim names are those of the stacked parameters; 'kv_heads' is also the name of the
  k/v projections' head axis, so a rule table splits the cache's heads exactly like the projections that
  write them.
  """
  return ("layers", "cache_batch", "kv_heads", "cache_seq", "head_dim")


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
  """Zeroed cache for `batch` rows of `max_len` positions; dtype defaults to the compute dtype."""
  for name, value in (("batch", batch), ("max_len", max_len)):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"{name}: must be a positive int, got {value!r}")
  dtype = cfg.compute_dtype if dtype is None else jnp.dtype(DTYPES.get(dtype, dtype))
  shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _check_cache(cfg: ModelConfig, cache: KVCache, batch: int) -> int:
  if not isinstance(cache, dict) or set(cache) != {"k", "v"}:
    raise ValueError(f"cache: expected a dict with keys 'k' and 'v', got {type(cache).__name__}")
  shape = jnp.shape(cache["k"])
  expected = (cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim)
  if len(shape) != 5 or (shape[0], shape[1], shape[2], shape[4]) != expected or jnp.shape(cache["v"]) != shape:
    raise ValueError(f"cache['k'] / cache['v']: shape {shape} / {jnp.shape(cache['v'])}, expected "
                     f"[L={expected[0]}, B={batch}, K={expected[2]}, S, H={expected[3]}] for both")
  return shape[3]


def forward_with_cache(cfg: ModelConfig, params: Params, tokens_bt: Int[Array, "B T"],
                       positions_bt: Int[Array, "B T"], cache: KVCache
                       ) -> tuple[Float[Array, "B T V"], KVCache]:
  """Float32 logits [B, T, V] and the updated cache. Jit with `cfg` static and the cache donated.
  ``params``: the params, or `decoding_params`' preparation of them (the same results).

  Token (b, t) sits at absolute position p = positions_bt[b, t]: its k/v are written at cache index p of
  row b, then it attends to row b's entries with index <= p (higher entries are stale and masked).
  Prefill: right-padded prompts with positions arange(P) in every row (pads write garbage past each
  prompt, which later decode writes overwrite). Decode: tokens [B, 1] at positions = current lengths.
  The caller guarantees 0 <= p < S; writes outside that range are dropped (never wrap onto other
  entries), and the logits of such a token are meaningless.
  """
  _check_tokens(tokens_bt, positions_bt=positions_bt)
  layers = None
  if isinstance(params, DecodeParams):
    params, layers = params.params, params.layers
  max_len = _check_cache(cfg, cache, tokens_bt.shape[0])
  positions_bt = positions_bt.astype(jnp.int32)
  in_range_bt = (positions_bt >= 0) & (positions_bt < max_len)
  # Index max_len is out of bounds, so mode="drop" discards it; a negative index would wrap instead.
  write_bt = jnp.where(in_range_bt, positions_bt, max_len)
  mask_bts = jnp.arange(max_len)[None, None, :] <= positions_bt[:, :, None]
  model = bind(cfg, params)
  x_btd = model.embed_tokens(tokens_bt)

  def step(layer, carry, index):
    x_btd, cache = carry
    return layer.with_cache(x_btd, positions_bt, mask_bts, cache, index, write_bt)

  # The cache rides in the scan carry, so each layer's writes update the (donated) buffers in place.
  x_btd, cache = model.scan_layers(step, (x_btd, cache), differentiable=False, layers=layers)
  return model.logits(x_btd), cache
