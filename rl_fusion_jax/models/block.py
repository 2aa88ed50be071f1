"""The decoder block: pre-norm attention and a dense (SwiGLU) or sparse (MoE) MLP, and the KV-cache write.

Built from `layers.py` (attention, MLP, norms) and `moe.py` (the sparse MLP); `decoder.py` stacks these
blocks and scans over them. Placement is never decided here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models.layers import MLP, Attention, RMSNorm, attend, half_as_words, read_index
from rl_fusion_jax.models.moe import MoE


class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); `sparse` blocks have a `moe` (models/moe.py)
  where dense ones have an `mlp`.

  `__call__` attends over the block's own keys; `with_cache` first writes them into a stacked KV cache
  and attends over that layer's cache entries instead (prefill and decode share it).
  """

  def __init__(self, cfg: ModelConfig, *, init_std: float, rngs: nnx.Rngs, sparse: bool = False):
    self.input_norm = RMSNorm(cfg, rngs=rngs)
    self.attn = Attention(cfg, init_std=init_std, rngs=rngs)
    self.post_attn_norm = RMSNorm(cfg, rngs=rngs)
    if sparse:
      self.moe = MoE(cfg, init_std=init_std, rngs=rngs)
    else:
      self.mlp = MLP(cfg, init_std=init_std, rngs=rngs)

  def ffn(self, x_btd: jax.Array, valid_bt: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """(MLP or MoE output, the MoE's aux dict: empty for a dense block)."""
    if hasattr(self, "moe"):
      return self.moe(x_btd, valid_bt)
    return self.mlp(x_btd), {}

  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, mask_btt: jax.Array) -> jax.Array:
    return self.call_with_aux(x_btd, positions_bt, mask_btt)[0]

  def call_with_aux(self, x_btd, positions_bt, mask_btt, valid_bt=None) -> tuple[jax.Array, dict]:
    """`__call__` that also returns the sparse block's router aux over ``valid_bt`` tokens ({} if dense)."""
    q_btnh, k_btkh, v_btkh = self.attn.qkv(self.input_norm(x_btd), positions_bt)
    x_btd = x_btd + self.attn.out(attend(q_btnh, k_btkh, v_btkh, mask_btt))
    y_btd, aux = self.ffn(self.post_attn_norm(x_btd), valid_bt)
    return x_btd + y_btd, aux

  def with_cache(self, x_btd, positions_bt, mask_bts, cache, layer, write_bt):
    """Like `__call__`, reading and writing layer `layer` (an int or a traced scalar) of `cache`
    ({'k','v'}: [L,B,K,S,H])."""
    q_btnh, k_btkh, v_btkh = self.attn.qkv(self.input_norm(x_btd), positions_bt)
    cache = {name: write_rows(cache[name], layer, write_bt, new)
             for name, new in (("k", k_btkh), ("v", v_btkh))}
    attn_btnh = attend(q_btnh, read_index(cache["k"], layer).astype(q_btnh.dtype),
                       read_index(cache["v"], layer).astype(q_btnh.dtype), mask_bts, kv_axes="BKSH")
    x_btd = x_btd + self.attn.out(attn_btnh)
    return x_btd + self.ffn(self.post_attn_norm(x_btd))[0], cache


def write_rows(cache_lbksh: jax.Array, layer, write_bt: jax.Array, new_btkh: jax.Array) -> jax.Array:
  """Scatters new_btkh[b, t] to cache[layer, b, :, write_bt[b, t]]; out-of-range indices are dropped.

  B is a batching dimension of the scatter (row b of the updates only ever goes to cache row b), so with
  B sharded each shard writes its own rows, without gathering every row's update onto every device. A
  half-precision cache on the CPU backend is written as 16-bit words (`layers.half_as_words`).
  """
  layer_bt1 = jnp.full(write_bt.shape + (1,), layer, jnp.int32)
  index_bt2 = jnp.concatenate([layer_bt1, write_bt[..., None].astype(jnp.int32)], axis=-1)
  dims = jax.lax.ScatterDimensionNumbers(
      update_window_dims=(2, 3), inserted_window_dims=(0, 3), scatter_dims_to_operand_dims=(0, 3),
      operand_batching_dims=(1,), scatter_indices_batching_dims=(0,))
  new_btkh = new_btkh.astype(cache_lbksh.dtype)
  if not half_as_words(cache_lbksh.dtype):
    return jax.lax.scatter(cache_lbksh, index_bt2, new_btkh, dims, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
  words = jax.lax.scatter(jax.lax.bitcast_convert_type(cache_lbksh, jnp.uint16), index_bt2,
                          jax.lax.bitcast_convert_type(new_btkh, jnp.uint16), dims,
                          mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
  return jax.lax.bitcast_convert_type(words, cache_lbksh.dtype)
