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

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rl_fusion_jax.model_config import DTYPES, ModelConfig
from rl_fusion_jax.models.decoder import Params, _check_tokens, bind

KVCache = dict[str, jax.Array]


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

  Token (b, t) sits at absolute position p = positions_bt[b, t]: its k/v are written at cache index p of
  row b, then it attends to row b's entries with index <= p (higher entries are stale and masked).
  Prefill: right-padded prompts with positions arange(P) in every row (pads write garbage past each
  prompt, which later decode writes overwrite). Decode: tokens [B, 1] at positions = current lengths.
  The caller guarantees 0 <= p < S; writes outside that range are dropped (never wrap onto other
  entries), and the logits of such a token are meaningless.
  """
  _check_tokens(tokens_bt, positions_bt=positions_bt)
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
  x_btd, cache = model.scan_layers(step, (x_btd, cache), differentiable=False)
  return model.logits(x_btd), cache
