"""The sparse MLP of Qwen2-MoE / Qwen3-MoE: a top-k softmax router, routed SwiGLU experts, an optional
shared expert behind a sigmoid gate, and the router's auxiliary losses.

Numerics follow transformers (`Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`): router softmax in
float32, top-k of the probabilities, optional renormalisation of the k weights, weights cast to the
activations' dtype, each token's output the weighted sum of its k experts' outputs (plus the gated shared
expert). Expert weights are stacked over a leading 'expert' axis ([E, D, F], [E, F, D]) so expert
parallelism is a rule-table entry.

How the routed tokens meet their experts (`ModelConfig.moe_impl`, `moe_capacity_factor`):

* dropless, 'ragged_dot': the k * T assignments sorted by expert, one `jax.lax.ragged_dot` per
  projection over the expert groups, unsorted back.
* dropless, 'blocked': the same sort, each expert's group padded to whole blocks, one matmul per block
  with that block's expert (`lax.map`); at most E - 1 partly filled blocks of extra work. XLA:CPU
  lowers ragged_dot to a dense masked product over every expert (E times the work), so 'auto' takes
  this on the CPU backend.
* capacity: each expert takes at most C = ceil(factor * T * k / E) assignments (top-1 choices first,
  then in token order), computed as one batched [E, C] matmul; the rest add nothing from that expert.

Under an expert-parallel context (`expert_parallel`, set by the program builders from the rule tables)
the routed part runs sharded instead: tokens travel to the devices holding their experts and back
(`sharding/expert_parallel.py`). This module decides nothing about placement.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models.layers import F32, MLP, make_param

# Keys of one sparse layer's auxiliary outputs (float32): the two losses are scalars, the per-expert
# load a [E] vector (fraction of the layer's routed assignments each expert received; sums to 1), the
# dropped fraction a scalar (0 when dropless).
AUX_KEYS = ("load_balance_loss", "router_z_loss", "expert_load", "dropped_fraction")

# The routed computation an expert-parallel context substitutes: (x_td, experts_idx_tk, weights_tk,
# gate_edf, up_edf, down_efd, cfg) -> (y_td, dropped assignments per token-choice mask or None).
RoutedFn = Callable[..., tuple[jax.Array, jax.Array | None]]
_ROUTED: contextvars.ContextVar[RoutedFn | None] = contextvars.ContextVar("moe_routed", default=None)


@contextlib.contextmanager
def routed_override(fn: RoutedFn | None) -> Iterator[None]:
  """While active (at trace time), sparse layers compute their routed experts with ``fn``."""
  token = _ROUTED.set(fn)
  try:
    yield
  finally:
    _ROUTED.reset(token)


def resolve_impl(cfg: ModelConfig) -> str:
  if cfg.moe_impl != "auto":
    return cfg.moe_impl
  return "blocked" if jax.default_backend() == "cpu" else "ragged_dot"


class Experts(nnx.Module):
  """E SwiGLU experts, stacked: gate/up [E, D, F], down [E, F, D]."""

  def __init__(self, cfg: ModelConfig, *, init_std: float, rngs: nnx.Rngs):
    e, d, f, wd = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.weight_dtype
    self.gate_proj = make_param(rngs, "normal", (e, d, f), ("expert", "embed", "moe_mlp"), wd, init_std)
    self.up_proj = make_param(rngs, "normal", (e, d, f), ("expert", "embed", "moe_mlp"), wd, init_std)
    self.down_proj = make_param(rngs, "normal", (e, f, d), ("expert", "moe_mlp", "embed"), wd, init_std)


class MoE(nnx.Module):
  """Router [D, E] + routed experts (+ shared expert [D, F_s] with its gate [D, 1])."""

  def __init__(self, cfg: ModelConfig, *, init_std: float, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype, self.matmul_dtype = cfg.compute_dtype, cfg.matmul_dtype
    self.router = make_param(rngs, "normal", (cfg.hidden_size, cfg.num_experts), ("embed", "router"),
                             cfg.weight_dtype, init_std)
    self.experts = Experts(cfg, init_std=init_std, rngs=rngs)
    if cfg.shared_expert_intermediate_size:
      shared_cfg = _shared_cfg(cfg)
      self.shared_expert = MLP(shared_cfg, init_std=init_std, rngs=rngs)
      self.shared_expert_gate = make_param(rngs, "normal", (cfg.hidden_size, 1), ("embed", None),
                                           cfg.weight_dtype, init_std)

  def __call__(self, x_btd: jax.Array, valid_bt: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """(output [B, T, D], aux) where aux holds `AUX_KEYS` over the tokens with ``valid_bt`` (all if None)."""
    b, t, d = x_btd.shape
    x_td = x_btd.reshape(b * t, d)
    logits_te = jnp.dot(x_td.astype(self.matmul_dtype), self.router[...].astype(self.matmul_dtype),
                        preferred_element_type=F32)
    weights_tk, idx_tk = route(logits_te, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
    weights_tk = weights_tk.astype(self.dtype)
    e = self.experts
    fn = _ROUTED.get() or routed_local
    y_td, kept_tk = fn(x_td, idx_tk, weights_tk, e.gate_proj[...], e.up_proj[...], e.down_proj[...], self.cfg)
    if hasattr(self, "shared_expert"):
      gate_t1 = jax.nn.sigmoid(jnp.dot(x_td.astype(self.matmul_dtype),
                                       self.shared_expert_gate[...].astype(self.matmul_dtype),
                                       preferred_element_type=F32)).astype(self.dtype)
      y_td = y_td + gate_t1 * self.shared_expert(x_td[None])[0]
    valid_t = jnp.ones((b * t,), F32) if valid_bt is None else valid_bt.reshape(-1).astype(F32)
    return y_td.reshape(b, t, d).astype(self.dtype), router_aux(logits_te, idx_tk, kept_tk, valid_t)


def _shared_cfg(cfg: ModelConfig) -> ModelConfig:
  """The config whose `MLP` is the shared expert (only its intermediate size differs)."""
  return dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size, num_experts=0)


def route(logits_te: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
  """(weights [T, k] float32, expert ids [T, k]): top-k of softmax(logits), renormalised if asked."""
  probs_te = jax.nn.softmax(logits_te.astype(F32), axis=-1)
  weights_tk, idx_tk = jax.lax.top_k(probs_te, k)
  if renormalize:
    weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
  return weights_tk, idx_tk.astype(jnp.int32)


def router_aux(logits_te: jax.Array, idx_tk: jax.Array, kept_tk: jax.Array | None,
               valid_t: jax.Array) -> dict[str, jax.Array]:
  """One sparse layer's `AUX_KEYS` over the valid tokens.

  load_balance_loss = E * sum_e (sum_k frac_{k,e}) * P_e, with frac_{k,e} the fraction of valid tokens
  whose k-th choice is e and P_e their mean router probability of e: transformers'
  `load_balancing_loss_func` for one layer (k at perfect balance). router_z_loss = mean logsumexp(logits)^2
  (ST-MoE, Zoph et al. 2022).
  """
  num_experts = logits_te.shape[-1]
  n = jnp.maximum(jnp.sum(valid_t), 1.0)
  onehot_tke = jax.nn.one_hot(idx_tk, num_experts, dtype=F32) * valid_t[:, None, None]
  frac_e = jnp.sum(onehot_tke, axis=(0, 1)) / n
  probs_te = jax.nn.softmax(logits_te.astype(F32), axis=-1)
  mean_prob_e = jnp.sum(probs_te * valid_t[:, None], axis=0) / n
  z_t = jax.nn.logsumexp(logits_te.astype(F32), axis=-1)
  k = idx_tk.shape[-1]
  dropped = (jnp.float32(0.0) if kept_tk is None
             else jnp.sum((1.0 - kept_tk.astype(F32)) * valid_t[:, None]) / (n * k))
  return {"load_balance_loss": num_experts * jnp.sum(frac_e * mean_prob_e),
          "router_z_loss": jnp.sum(jnp.square(z_t) * valid_t) / n,
          "expert_load": frac_e / k, "dropped_fraction": dropped}


def empty_aux(num_experts: int) -> dict[str, jax.Array]:
  return {"load_balance_loss": jnp.float32(0.0), "router_z_loss": jnp.float32(0.0),
          "expert_load": jnp.zeros((num_experts,), F32), "dropped_fraction": jnp.float32(0.0)}


# ---------------------------------------------------------------------------------------------------
# The routed experts on one device (or under GSPMD): dropless (ragged_dot / blocked) or with capacity.


def _swiglu(gate, up):
  return jax.nn.silu(gate) * up


def _mm(cfg: ModelConfig):
  """Matmul dtype and activation dtype under the precision policy."""
  return cfg.matmul_dtype, cfg.compute_dtype


def routed_local(x_td, idx_tk, weights_tk, gate_edf, up_edf, down_efd, cfg: ModelConfig):
  """sum_k weights[t, k] * expert_{idx[t, k]}(x[t]) -> ([T, D], kept mask [T, k] or None if dropless)."""
  if cfg.moe_capacity_factor is not None:
    return _routed_capacity(x_td, idx_tk, weights_tk, gate_edf, up_edf, down_efd, cfg)
  y_nd, order_n = grouped_ffn(x_td, idx_tk.reshape(-1), gate_edf, up_edf, down_efd, cfg)
  return combine(y_nd, order_n, weights_tk), None


def grouped_ffn(x_td, experts_n, gate_edf, up_edf, down_efd, cfg: ModelConfig, group_sizes_e=None):
  """Every assignment n (token n // k to expert experts_n[n]) through its expert, dropless.

  Returns (y [N, D] in sorted order, the sort order [N]); `combine` brings them back to tokens. With
  ``group_sizes_e`` the assignments are already sorted by expert (ids in [0, E)), and ``x_td`` holds
  one row per assignment; rows past ``sum(group_sizes_e)`` (padding of a fixed-size buffer) get
  unspecified outputs that the caller must mask.
  """
  num_experts = gate_edf.shape[0]
  if group_sizes_e is None:
    k = experts_n.shape[0] // x_td.shape[0]
    order_n = jnp.argsort(experts_n, stable=True)
    rows_nd = jnp.take(x_td, order_n // k, axis=0)
    sorted_n = jnp.take(experts_n, order_n)
    group_sizes_e = jnp.bincount(experts_n, length=num_experts).astype(jnp.int32)
  else:
    order_n, rows_nd, sorted_n = None, x_td, experts_n
  low, dtype = _mm(cfg)
  if resolve_impl(cfg) == "ragged_dot":
    mm = lambda a, w: jax.lax.ragged_dot(a.astype(low), w.astype(low), group_sizes_e,
                                         preferred_element_type=F32).astype(dtype)
    h = _swiglu(mm(rows_nd, gate_edf), mm(rows_nd, up_edf))
    return mm(h, down_efd), order_n
  return _blocked_ffn(rows_nd, sorted_n, group_sizes_e, gate_edf, up_edf, down_efd, low, dtype), order_n


def block_size(num_rows: int, num_experts: int) -> int:
  """Rows per block of the 'blocked' implementation: about half an expert's fair share, in [8, 256]."""
  fair = max(num_rows // max(2 * num_experts, 1), 1)
  return int(min(256, max(8, 2 ** math.floor(math.log2(fair)))))


def _blocked_ffn(rows_nd, sorted_n, group_sizes_e, gate_edf, up_edf, down_efd, low, dtype):
  """SwiGLU of rows sorted by expert: each expert's group starts a new block of `block_size` rows."""
  n, d = rows_nd.shape
  num_experts = gate_edf.shape[0]
  blk = block_size(n, num_experts)
  num_blocks = -(-n // blk) + num_experts - 1      # worst case: every group leaves one block part-filled
  padded_e = -(-group_sizes_e // blk) * blk
  block_start_e = jnp.cumsum(padded_e) - padded_e
  group_start_e = jnp.cumsum(group_sizes_e) - group_sizes_e
  dest_n = block_start_e[sorted_n] + jnp.arange(n) - group_start_e[sorted_n]
  blocks_bld = jnp.zeros((num_blocks * blk, d), rows_nd.dtype).at[dest_n].set(rows_nd)
  blocks_bld = blocks_bld.reshape(num_blocks, blk, d)
  # The expert whose padded span holds each block's first row (searchsorted, side='right', written as a
  # count: jnp.searchsorted inside a partly manual shard_map trips an assertion in this JAX version).
  ends_e = jnp.cumsum(padded_e)
  block_expert_b = jnp.sum(ends_e[None, :] <= (jnp.arange(num_blocks) * blk)[:, None], axis=1)
  block_expert_b = jnp.minimum(block_expert_b, num_experts - 1).astype(jnp.int32)

  def one(args):
    x_ld, e = args
    dot = lambda a, w: jnp.dot(a.astype(low), w[e].astype(low), preferred_element_type=F32).astype(dtype)
    return dot(_swiglu(dot(x_ld, gate_edf), dot(x_ld, up_edf)), down_efd)

  y_bld = jax.lax.map(one, (blocks_bld, block_expert_b))
  return jnp.take(y_bld.reshape(num_blocks * blk, -1), dest_n, axis=0)


def combine(y_nd, order_n, weights_tk):
  """Token outputs from sorted assignment outputs: y_t = sum_k weights[t, k] * y[assignment (t, k)]."""
  t, k = weights_tk.shape
  unsorted_nd = jnp.zeros_like(y_nd).at[order_n].set(y_nd)
  return jnp.einsum("TKD,TK->TD", unsorted_nd.reshape(t, k, -1), weights_tk.astype(y_nd.dtype))


def capacity(num_tokens: int, k: int, num_experts: int, factor: float) -> int:
  return max(1, math.ceil(factor * num_tokens * k / num_experts))


def _routed_capacity(x_td, idx_tk, weights_tk, gate_edf, up_edf, down_efd, cfg: ModelConfig):
  """Capacity-factor routing: assignment slots e * C + (rank within e), top-1 choices ranked first."""
  t, k = idx_tk.shape
  num_experts = gate_edf.shape[0]
  cap = capacity(t, k, num_experts, cfg.moe_capacity_factor)
  idx_kt = idx_tk.T
  onehot_kte = jax.nn.one_hot(idx_kt, num_experts, dtype=jnp.int32)
  rank_kte = jnp.cumsum(onehot_kte.reshape(k * t, num_experts), axis=0).reshape(k, t, num_experts) - 1
  rank_kt = jnp.sum(rank_kte * onehot_kte, axis=-1)
  kept_kt = rank_kt < cap
  slot_kt = jnp.where(kept_kt, idx_kt * cap + rank_kt, num_experts * cap)   # out of range: dropped
  rows_kt = jnp.broadcast_to(jnp.arange(t)[None], (k, t))
  slots_cd = jnp.zeros((num_experts * cap, x_td.shape[1]), x_td.dtype).at[slot_kt.reshape(-1)].set(
      x_td[rows_kt.reshape(-1)], mode="drop")
  low, dtype = _mm(cfg)
  mm = lambda a, w, spec: jnp.einsum(spec, a.astype(low), w.astype(low), preferred_element_type=F32).astype(dtype)
  x_ecd = slots_cd.reshape(num_experts, cap, -1)
  h_ecf = _swiglu(mm(x_ecd, gate_edf, "ECD,EDF->ECF"), mm(x_ecd, up_edf, "ECD,EDF->ECF"))
  y_cd = mm(h_ecf, down_efd, "ECF,EFD->ECD").reshape(num_experts * cap, -1)
  y_ktd = jnp.take(y_cd, jnp.minimum(slot_kt, num_experts * cap - 1), axis=0)
  y_ktd = jnp.where(kept_kt[..., None], y_ktd, 0)
  y_td = jnp.einsum("KTD,TK->TD", y_ktd, weights_tk.astype(y_ktd.dtype))
  return y_td, kept_kt.T


def stacked_aux(aux_list: list[dict[str, Any]]) -> dict[str, jax.Array]:
  """Per-layer aux dicts -> means over the sparse layers ('expert_load' [E] averaged too)."""
  return {key: jnp.mean(jnp.stack([a[key] for a in aux_list]), axis=0) for key in AUX_KEYS}
