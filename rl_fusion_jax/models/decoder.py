"""The decoder as pure functions over a plain params dict: `init_params`, `forward`, `param_logical_axes`.

Parameters live outside the model as a nested dict of arrays (a pure pytree for optax, orbax and
`device_put`). The NNX module is only the program: its graph definition and abstract state are built
once per config (`nnx.eval_shape`, cached), and each call merges the caller's arrays into it, which
under `jit` is a trace-time rebinding, never a copy. This module must not place or shard anything.
"""
from __future__ import annotations

import collections
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models import moe
from rl_fusion_jax.models.block import DecoderLayer
from rl_fusion_jax.models.layers import (F32, PROJ_NAME, RMSNorm, half_as_words, make_param,
                                          mixed_matmul, mixed_matmul_nt, read_index, write_index)

Params = dict[str, Any]
# The stacked layer trees: every path under one of these has a leading layer axis.
STACKS = ("layers", "dense_layers")


class Embed(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, init_std: float, rngs: nnx.Rngs):
    shape = (cfg.vocab_size, cfg.hidden_size)
    self.embedding = make_param(rngs, "normal", shape, ("vocab", "embed"), cfg.weight_dtype, init_std)


class LMHead(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, init_std: float, rngs: nnx.Rngs):
    shape = (cfg.hidden_size, cfg.vocab_size)
    self.kernel = make_param(rngs, "normal", shape, ("embed", "vocab"), cfg.weight_dtype, init_std)


# `ModelConfig.remat` -> the checkpoint policy of one scanned layer (None: no rematerialization).
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "matmuls": jax.checkpoint_policies.save_only_these_names(PROJ_NAME)}


def _scan(graphdef, state, step, carry, first: int, count: int, remat: str, unroll: int,
          differentiable: bool = True):
  """One `lax.scan` of `step` over `count` stacked layers (global indices first, first + 1, ...).

  On the CPU backend, half-precision layer params take `_scan_words` (never differentiated) or, under
  remat='full', `_scan_full_remat_words`."""
  def body(carry, xs):
    layer_state, index = xs
    return step(nnx.merge(graphdef, layer_state), carry, index), None

  indices = jnp.arange(first, first + count, dtype=jnp.int32)
  unroll = _resolved_unroll(unroll, count, remat)
  if any(half_as_words(x.dtype) for x in jax.tree.leaves(state)):
    if not differentiable:
      return _scan_words(body, carry, state, indices, unroll)
    if remat == "full":
      return _scan_full_remat_words(body, carry, state, indices, unroll)
  if remat != "none":
    body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
  carry, _ = jax.lax.scan(body, carry, (state, indices), unroll=unroll)
  return carry


def _to_words(tree):
  """`half_as_words` leaves of `tree` as their raw 16-bit words (uint16); other leaves as they are."""
  return jax.tree.map(lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16) if half_as_words(x.dtype) else x, tree)


def _from_words(words, dtypes):
  """Inverse of `_to_words`, given the original leaves' dtypes."""
  return jax.tree.map(lambda w, d: jax.lax.bitcast_convert_type(w, d) if half_as_words(d) else w, words, dtypes)


def _layer_params(params, position):
  """Layer `position` of the stacked `params`, read behind an `optimization_barrier`: otherwise XLA:CPU
  hoists a float32 convert of every half-precision stack out of the layer loop and slices that."""
  params, position = jax.lax.optimization_barrier((params, position))
  return jax.tree.map(lambda stack: read_index(stack, position), params)


def _scan_words(body, carry, state, indices, unroll: int):
  """`_scan` of a pass that is never differentiated (prefill, decode), half-precision layer params on
  XLA:CPU: each layer's params are sliced as 16-bit words (`_layer_params`), not from a float32 copy
  of the stack (at SmolLM2-135M shapes in bfloat16, 0.5 GB converted on every call)."""
  positions = jnp.arange(indices.shape[0], dtype=jnp.int32)

  def step(c, xs):
    index, position = xs
    return body(c, (_layer_params(state, position), index))[0], None

  return jax.lax.scan(step, carry, (indices, positions), unroll=unroll)[0]


def _scan_full_remat_words(body, carry, state, indices, unroll: int):
  """`_scan` under remat='full' for half-precision layer params on XLA:CPU, with a hand-written backward.

  XLA:CPU has no bfloat16 / float16 dynamic-slice or dynamic-update-slice: it runs them on a float32
  convert of the operand, and for a loop's stacked operand it converts the whole stack ahead of the
  loop (at Qwen2.5-1.5B shapes, 5.2 GB of float32 layer weights) and rewrites a stacked output through
  float32. Here the loops slice and update their stacks as raw 16-bit words (`bitcast_convert_type`
  to uint16, a reinterpretation that XLA fuses into the slice): the layer params (read behind an
  `optimization_barrier`, so that XLA does not hoist a converted copy of the whole stack out of the
  loop), the carry saved at each layer's input (what `jax.checkpoint` saves under remat='full') and
  the stacked parameter gradient, which the backward loop carries and updates in place. The backward
  scans the layers in reverse and recomputes each layer's forward inside its `jax.vjp`, as
  `jax.checkpoint` does; the values are those of the `jax.checkpoint` path (`models_test` compares them).
  """
  carry_dtypes = jax.tree.map(lambda x: x.dtype, carry)
  positions = jnp.arange(indices.shape[0], dtype=jnp.int32)

  def forward(c, params, keep_inputs: bool):
    def step(c, xs):
      index, position = xs
      out = body(c, (_layer_params(params, position), index))[0]
      return out, (_to_words(c) if keep_inputs else None)
    return jax.lax.scan(step, c, (indices, positions), unroll=unroll)

  @jax.custom_vjp
  def scanned(c, params):
    return forward(c, params, False)[0]

  def scanned_fwd(c, params):
    out, inputs = forward(c, params, True)
    return out, (inputs, params)

  def scanned_bwd(residuals, ct_out):
    inputs, params = residuals

    def step(carry, xs):
      ct, grads = carry
      input_words, index, position = xs
      _, vjp = jax.vjp(lambda c, layer: body(c, (layer, index))[0], _from_words(input_words, carry_dtypes),
                       _layer_params(params, position))
      ct_in, ct_layer = vjp(ct)
      return (ct_in, jax.tree.map(lambda g, d: write_index(g, d, position), grads, ct_layer)), None

    grads = jax.tree.map(jnp.zeros_like, params)
    (ct_in, grads), _ = jax.lax.scan(step, (ct_out, grads), (inputs, indices, positions), reverse=True,
                                     unroll=unroll)
    return ct_in, grads

  scanned.defvjp(scanned_fwd, scanned_bwd)
  return scanned(carry, state)


def _stacked_layers(cfg: ModelConfig, count: int, sparse: bool, init_std: float,
                    rngs: nnx.Rngs) -> DecoderLayer:
  """`count` blocks as one module whose params carry a leading 'layers' axis (logical name too)."""
  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=0, out_axes=0, axis_size=count, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs):
    return DecoderLayer(cfg, init_std=init_std, rngs=rngs, sparse=sparse)
  return make(rngs)


def _default_unroll(num_layers: int, remat: str = "none") -> int:
  """`ModelConfig.scan_unroll=0`: every layer unrolled on the CPU backend, one layer per iteration elsewhere
  and wherever layers are rematerialized. Unrolled, XLA keeps every layer's activations for the backward
  pass whatever the remat policy (jax.grad of the summed log-probs, Qwen2.5-0.5B shapes cut to 6 layers,
  4 x 1,024 tokens, remat='full': 8.6 GB of temporaries unrolled, 2.2 GB rolled, 8.5 GB unrolled without
  remat; `jax.checkpoint(..., prevent_cse=True)` changes nothing)."""
  return num_layers if jax.default_backend() == "cpu" and remat == "none" else 1


def _overlay(tree: dict, over: dict) -> dict:
  """``tree`` with the leaves that the nested dict ``over`` holds replaced by them."""
  return {k: (_overlay(v, over[k]) if isinstance(v, dict) else over[k]) if k in over else v
          for k, v in tree.items()}


def _resolved_unroll(unroll: int, count: int, remat: str = "none") -> int:
  """Layers per loop iteration of a run of `count` layers: `scan_unroll` (0: `_default_unroll`), at most
  `count`."""
  return min(unroll or _default_unroll(count, remat), count)


def unrolled_without_grad(cfg: ModelConfig) -> bool:
  """Whether a pass that is never differentiated (prefill, decode) unrolls every layer of `cfg`: each run
  of `layer_runs` is one loop iteration (`_resolved_unroll`, as `_scan` resolves it)."""
  return all(_resolved_unroll(cfg.scan_unroll, count) == count for _, _, count, _ in layer_runs(cfg.layer_stacks))


def layer_runs(stacks: tuple[tuple[str, int], ...]) -> list[tuple[str, int, int, int]]:
  """Maximal runs of consecutive layers in one stack: (stack, first index in it, count, first layer)."""
  runs: list[list] = []
  for layer, (name, index) in enumerate(stacks):
    if runs and runs[-1][0] == name and runs[-1][1] + runs[-1][2] == index:
      runs[-1][2] += 1
    else:
      runs.append([name, index, 1, layer])
  return [tuple(r) for r in runs]


class Decoder(nnx.Module):
  """Token embedding, `num_layers` blocks stacked in `layers` (run by `lax.scan`), final norm, lm head.

  With `tie_word_embeddings` there is no `lm_head`: logits use the embedding transposed. A model mixing
  dense and sparse (MoE) blocks keeps its sparse blocks in `layers` and its dense ones in `dense_layers`
  (`ModelConfig.layer_stacks`); each run of consecutive blocks of one kind is its own scan.
  """

  def __init__(self, cfg: ModelConfig, *, init_std: float = 0.02, rngs: nnx.Rngs):
    self.num_layers, self.remat, self.scan_unroll = cfg.num_layers, cfg.remat, cfg.scan_unroll
    self.dtype, self.matmul_dtype = cfg.compute_dtype, cfg.matmul_dtype
    self.layer_stacks, self.num_experts = cfg.layer_stacks, cfg.num_experts
    self.embed = Embed(cfg, init_std=init_std, rngs=rngs)
    counts = collections.Counter(name for name, _ in cfg.layer_stacks)
    main_sparse = "moe" in cfg.layer_kinds
    self.layers = _stacked_layers(cfg, counts["layers"], main_sparse, init_std, rngs)
    if counts["dense_layers"]:
      self.dense_layers = _stacked_layers(cfg, counts["dense_layers"], False, init_std, rngs)
    self.final_norm = RMSNorm(cfg, rngs=rngs)
    if not cfg.tie_word_embeddings:
      self.lm_head = LMHead(cfg, init_std=init_std, rngs=rngs)

  def scan_layers(self, step: Callable[[DecoderLayer, Any, jax.Array], Any], carry: Any, *,
                  differentiable: bool = True, layers: Sequence[dict] | None = None) -> Any:
    """Folds `carry = step(layer_i, carry, i)` over the layers in order with `lax.scan` (one traced layer
    per run of `layer_runs`; `scan_unroll` layers per loop iteration); `i` is the global layer index.

    Where the result is differentiated, each layer is rematerialized under the `remat` policy;
    `differentiable=False` (cached decoding) skips the checkpoint wrapper. With `layers` (never
    differentiated; `kv_cache.decoding_params`: per layer, params that replace its reads, its prepared kernels)
    every layer is unrolled as a Python loop, `i` a Python int, the rest of each layer's params read from
    the stacks at that constant index (`layers.read_index`).
    """
    if layers is not None:
      split = {name: nnx.split(getattr(self, name)) for name in {name for name, _ in self.layer_stacks}}
      for i, (name, index) in enumerate(self.layer_stacks):
        graphdef, stacked = split[name]
        pure = jax.tree.map(lambda x: read_index(x, index), nnx.to_pure_dict(stacked))
        state = jax.tree.map(lambda v: v, stacked)
        nnx.replace_by_pure_dict(state, _overlay(pure, layers[i]))
        carry = step(nnx.merge(graphdef, state), carry, i)
      return carry
    for name, start, count, first in layer_runs(self.layer_stacks):
      graphdef, state = nnx.split(getattr(self, name))
      total = jax.tree.leaves(state)[0].shape[0]
      if count != total:
        state = jax.tree.map(lambda x: jax.lax.slice_in_dim(x, start, start + count), state)
      carry = _scan(graphdef, state, step, carry, first, count,
                    self.remat if differentiable else "none", self.scan_unroll, differentiable)
    return carry

  def hidden_with_aux(self, tokens_bt, positions_bt, mask_btt, valid_bt=None) -> tuple[jax.Array, dict]:
    """`hidden` and the router aux (`moe.AUX_KEYS`, means over the sparse layers; {} for a dense model)."""
    x_btd = self.embed_tokens(tokens_bt)
    num_sparse = sum(name == "layers" for name, _ in self.layer_stacks) if self.num_experts else 0
    acc = moe.empty_aux(self.num_experts) if num_sparse else {}

    def step(layer, carry, _):
      x_btd, acc = carry
      x_btd, aux = layer.call_with_aux(x_btd, positions_bt, mask_btt, valid_bt)
      return x_btd, ({k: acc[k] + aux[k] for k in acc} if aux else acc)

    x_btd, acc = self.scan_layers(step, (x_btd, acc))
    return self.final_norm(x_btd), {k: v / num_sparse for k, v in acc.items()}

  def layer(self, index: int) -> DecoderLayer:
    """Block `index` on its own (its slice of the stacked params), e.g. to inspect one layer."""
    name, i = self.layer_stacks[index]
    graphdef, state = nnx.split(getattr(self, name))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))

  def embed_tokens(self, tokens_bt: jax.Array) -> jax.Array:
    # Gather first, then cast: never materializes a converted copy of the whole table.
    return jnp.take(self.embed.embedding[...], tokens_bt, axis=0).astype(self.dtype)

  def hidden(self, tokens_bt, positions_bt, mask_btt) -> jax.Array:
    """The final-norm hidden states [B, T, D] in the compute dtype (what the lm head reads)."""
    if self.num_experts:
      return self.hidden_with_aux(tokens_bt, positions_bt, mask_btt)[0]
    x_btd = self.embed_tokens(tokens_bt)
    x_btd = self.scan_layers(lambda layer, x, _: layer(x, positions_bt, mask_btt), x_btd)
    return self.final_norm(x_btd)

  def head(self, x_nd: jax.Array) -> jax.Array:
    """Float32 logits [..., V] of final-norm hidden states [..., D], whatever the compute dtype."""
    lead, d = x_nd.shape[:-1], x_nd.shape[-1]
    x_md = x_nd.reshape(-1, d)
    if self.matmul_dtype != self.dtype:   # 'bf16_matmul': low-precision inputs, float32 accumulation
      if hasattr(self, "lm_head"):
        logits_mv = mixed_matmul(x_md, self.lm_head.kernel[...], self.matmul_dtype.name)
      else:
        logits_mv = mixed_matmul_nt(x_md, self.embed.embedding[...], self.matmul_dtype.name)
    elif hasattr(self, "lm_head"):
      logits_mv = jnp.einsum("MD,DV->MV", x_md, self.lm_head.kernel[...].astype(self.dtype),
                             preferred_element_type=F32)
    else:
      logits_mv = jnp.einsum("MD,VD->MV", x_md, self.embed.embedding[...].astype(self.dtype),
                             preferred_element_type=F32)
    return logits_mv.reshape(lead + (-1,))

  def logits(self, x_btd: jax.Array) -> jax.Array:
    """Final norm and lm head; float32 logits whatever the compute dtype."""
    return self.head(self.final_norm(x_btd))

  def __call__(self, tokens_bt, positions_bt, mask_btt):
    return self.head(self.hidden(tokens_bt, positions_bt, mask_btt))


@functools.lru_cache(maxsize=64)
def _abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and abstract (shape-only) state of the model, built once per config."""
  return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def flatten(tree: Mapping, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
  """(path, leaf) pairs of a nested dict, depth first in insertion order."""
  for key, value in tree.items():
    if isinstance(value, Mapping):
      yield from flatten(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def unflatten(flat: Mapping[tuple, Any]) -> dict[str, Any]:
  """Inverse of `flatten`."""
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


def path_str(path: tuple) -> str:
  return "params" + "".join(f"[{k!r}]" for k in path)


@functools.lru_cache(maxsize=64)
def _expected_shapes(cfg: ModelConfig) -> dict[tuple, tuple[int, ...]]:
  return {path: leaf.shape for path, leaf in flatten(abstract_params(cfg))}


def check_params(cfg: ModelConfig, params: Params) -> None:
  """Raises ValueError naming the first missing, unexpected or wrongly shaped entry of `params`."""
  if not isinstance(params, Mapping):
    raise ValueError(f"params: expected a nested dict of arrays, got {type(params).__name__}")
  expected = _expected_shapes(cfg)
  given = dict(flatten(params))
  missing, extra = expected.keys() - given.keys(), given.keys() - expected.keys()
  if missing:
    raise ValueError(f"{path_str(sorted(missing, key=str)[0])}: missing ({len(missing)} missing in total)")
  if extra:
    raise ValueError(f"{path_str(sorted(extra, key=str)[0])}: unexpected for this ModelConfig")
  for path, leaf in given.items():
    if tuple(jnp.shape(leaf)) != expected[path]:
      raise ValueError(f"{path_str(path)}: shape {tuple(jnp.shape(leaf))}, expected {expected[path]}")


def bind(cfg: ModelConfig, params: Params) -> Decoder:
  """The module with `params` as its state (shared arrays, no copy); checks the structure first."""
  check_params(cfg, params)
  graphdef, abstract_state = _abstract(cfg)
  state = jax.tree.map(lambda v: v, abstract_state)  # fresh Variables: the cached state stays abstract
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def _init_rules(cfg: ModelConfig) -> dict[str, Any]:
  """The `init` metadata ('normal' / 'zeros' / 'ones') the modules recorded, per param."""
  return nnx.to_pure_dict(_abstract(cfg)[1], extract_fn=lambda v: v.get_metadata()["init"])


# Normals are drawn in flat chunks of up to this many elements (1 GiB of float32): tiny models get one
# random call, large ones a bounded transient.
_NOISE_CHUNK = 1 << 28


def _noise_chunks(shapes: dict[tuple, tuple[int, ...]]) -> list[list[tuple]]:
  """Groups param paths, in order, into chunks whose total size stays under `_NOISE_CHUNK`."""
  chunks, total = [], _NOISE_CHUNK
  for path, shape in shapes.items():
    size = math.prod(shape)
    if total + size > _NOISE_CHUNK:
      chunks.append([])
      total = 0
    chunks[-1].append(path)
    total += size
  return chunks


def _per_layer_order(normal_shapes: dict[tuple, tuple[int, ...]], num_layers: int) -> dict[tuple, tuple[int, ...]]:
  """The normal params as one entry per layer ('layers_0', 'layers_1', ... in string order, each layer's
  params together), among the others in sorted order of their top-level names.

  This is the order of the unstacked model (one module per layer), so the draws below give every layer
  the values it had before the layers were stacked: the same seed initializes the same model.
  """
  groups: dict[str, dict[tuple, tuple[int, ...]]] = {}
  for path, shape in normal_shapes.items():
    if path[0] in STACKS:
      for i in range(shape[0]):
        groups.setdefault(f"{path[0]}_{i}", {})[(f"{path[0]}_{i}",) + path[1:]] = shape[1:]
    else:
      groups.setdefault(path[0], {})[path] = shape
  return {p: shape for name in sorted(groups) for p, shape in groups[name].items()}


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(cfg: ModelConfig, rng: jax.Array, init_std: float) -> Params:
  # Normals come from a few flat draws sliced per tensor: every separate random call costs a fraction
  # of a second of CPU compile, which for a per-tensor init adds up to many seconds.
  leaves, rules = dict(flatten(abstract_params(cfg))), dict(flatten(_init_rules(cfg)))
  flat = {p: jnp.full(leaf.shape, 1.0 if rules[p] == "ones" else 0.0, leaf.dtype)
          for p, leaf in leaves.items() if rules[p] != "normal"}
  normal_shapes = _per_layer_order({p: leaf.shape for p, leaf in leaves.items() if rules[p] == "normal"},
                                   cfg.num_layers)
  drawn = {}
  for index, chunk in enumerate(_noise_chunks(normal_shapes)):
    sizes = [math.prod(normal_shapes[p]) for p in chunk]
    noise = jax.random.normal(jax.random.fold_in(rng, index), (sum(sizes),), F32) * init_std
    for path, offset, size in zip(chunk, itertools.accumulate([0] + sizes), sizes):
      drawn[path] = noise[offset:offset + size].reshape(normal_shapes[path])
  for path, leaf in leaves.items():
    if rules[path] == "normal":
      x = (jnp.stack([drawn[(f"{path[0]}_{i}",) + path[1:]] for i in range(leaf.shape[0])])
           if path[0] in STACKS else drawn[path])
      flat[path] = x.astype(leaf.dtype)
  return unflatten({p: flat[p] for p in leaves})


def init_params(cfg: ModelConfig, rng: jax.Array, *, init_std: float = 0.02) -> Params:
  """Random params: kernels and embedding ~ N(0, init_std), biases 0, norm scales 1, in param_dtype.

  Same distribution as constructing `Decoder(cfg, init_std=..., rngs=...)`, though not the same draws.
  """
  if not init_std > 0:
    raise ValueError(f"init_std: must be > 0, got {init_std!r}")
  return _init_params(cfg, rng, float(init_std))


def param_logical_axes(cfg: ModelConfig) -> dict[str, Any]:
  """Logical axis names per param: same dict structure as the params, a tuple (one name per dim) per leaf."""
  return nnx.to_pure_dict(_abstract(cfg)[1], extract_fn=lambda v: tuple(v.get_metadata()["out_sharding"]))


def abstract_params(cfg: ModelConfig) -> Params:
  """`jax.ShapeDtypeStruct` per param (same structure as `init_params`), without allocating anything."""
  return nnx.to_pure_dict(_abstract(cfg)[1])


def num_params(params: Params) -> int:
  return sum(int(jnp.size(leaf)) for leaf in jax.tree.leaves(params))


def attention_mask(positions_bt: jax.Array, segment_ids_bt: jax.Array | None) -> jax.Array:
  """mask[b, q, k]: key position <= query position and, with segment ids, the same segment."""
  mask_btt = positions_bt[:, None, :] <= positions_bt[:, :, None]
  if segment_ids_bt is not None:
    mask_btt &= segment_ids_bt[:, None, :] == segment_ids_bt[:, :, None]
  return mask_btt


def _check_tokens(tokens_bt, **others) -> None:
  if jnp.ndim(tokens_bt) != 2:
    raise ValueError(f"tokens_bt: expected shape [B, T], got {jnp.shape(tokens_bt)}")
  for name, value in others.items():
    if value is not None and jnp.shape(value) != jnp.shape(tokens_bt):
      raise ValueError(f"{name}: shape {jnp.shape(value)} must equal tokens_bt shape {jnp.shape(tokens_bt)}")


def forward(cfg: ModelConfig, params: Params, tokens_bt: Int[Array, "B T"], *,
            positions_bt: Int[Array, "B T"] | None = None,
            segment_ids_bt: Int[Array, "B T"] | None = None) -> Float[Array, "B T V"]:
  """Float32 logits [B, T, V] of a full sequence (training, scoring). Jit with `cfg` static.

  Attention is causal by position: token q sees token k iff positions[k] <= positions[q]
  (positions default to arange(T)). With `segment_ids_bt`, a token also only sees its own segment, so a
  packed row of several sequences (positions restarting at 0 per segment) equals running them apart.
  Segment id 0 is conventionally padding; it is masked like any other id, so real tokens never see
  padding and padding logits are garbage the loss must mask.
  """
  _check_tokens(tokens_bt, positions_bt=positions_bt, segment_ids_bt=segment_ids_bt)
  if positions_bt is None:
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
  model = bind(cfg, params)
  return model(tokens_bt, positions_bt, attention_mask(positions_bt, segment_ids_bt))


def hidden(cfg: ModelConfig, params: Params, tokens_bt: Int[Array, "B T"], *,
           positions_bt: Int[Array, "B T"] | None = None,
           segment_ids_bt: Int[Array, "B T"] | None = None) -> Float[Array, "B T D"]:
  """`forward` up to the lm head: final-norm hidden states [B, T, D] in the compute dtype."""
  _check_tokens(tokens_bt, positions_bt=positions_bt, segment_ids_bt=segment_ids_bt)
  if positions_bt is None:
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
  model = bind(cfg, params)
  return model.hidden(tokens_bt, positions_bt, attention_mask(positions_bt, segment_ids_bt))


def hidden_with_aux(cfg: ModelConfig, params: Params, tokens_bt: Int[Array, "B T"], *,
                    positions_bt: Int[Array, "B T"] | None = None,
                    segment_ids_bt: Int[Array, "B T"] | None = None) -> tuple[Float[Array, "B T D"], dict]:
  """`hidden` and the MoE router aux ({} for a dense model): `moe.AUX_KEYS`, averaged over the sparse
  layers, over the tokens whose segment id is not 0 (padding) when segment ids are given."""
  _check_tokens(tokens_bt, positions_bt=positions_bt, segment_ids_bt=segment_ids_bt)
  if positions_bt is None:
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
  valid_bt = None if segment_ids_bt is None else segment_ids_bt != 0
  model = bind(cfg, params)
  return model.hidden_with_aux(tokens_bt, positions_bt, attention_mask(positions_bt, segment_ids_bt), valid_bt)
