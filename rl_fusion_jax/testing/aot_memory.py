"""Compiled memory of the real-scale programs, without running or allocating them.

Each probe lowers one program at Qwen2.5-0.5B / 1.5B shapes with abstract arguments
(`jax.ShapeDtypeStruct` with the run's shardings), compiles it ahead of time and reads
`memory_analysis()`: per-device temporary, argument and output bytes. `experiments/aot_memory_main.py`
tabulates them (BENCHMARKS.md, "Real-scale compiled memory"); `tests/aot_memory_test.py` asserts the
bounds `update_bound` and friends derive. Programs: the RL update (`step.make_rl_step`: forward, backward,
AdamW), the reference log-probs (`step.make_logprob_fn`) and one decode chunk of the generation engine
(`slots.SlotPrograms.decode`), on the project's default mesh over the given devices (data-parallel over
all of them; `fsdp` / `tensor` can be set).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rl_fusion_jax import models
from rl_fusion_jax.config import AlgoConfig, OptimConfig
from rl_fusion_jax.rollout import slots as slots_lib
from rl_fusion_jax.rollout.decode import GenerateSpec
from rl_fusion_jax.rollout.sampling import SamplingParams
from rl_fusion_jax.sharding import rules as rules_lib
from rl_fusion_jax.testing import USER_COMPILER_OPTIONS
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.types import TrainBatch

# Hugging Face Qwen2.5-*-Instruct shapes (config.json): vocabulary, width, depth, heads, MLP; tied heads.
PRESETS = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                 intermediate_size=4864, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                 intermediate_size=8960, tie_word_embeddings=True),
}


def preset_config(name: str, **overrides) -> models.ModelConfig:
  """Qwen2.5 shape `name` with float32 master weights and bfloat16 compute (override any field)."""
  fields = dict(PRESETS[name], qkv_bias=True, max_position_embeddings=32768, dtype="bfloat16",
                param_dtype="float32", remat="full", logits_chunk=1024, scan_unroll=1)
  fields.update(overrides)
  return models.ModelConfig(**fields)


def make_mesh(devices: int, fsdp: int = 1, tensor: int = 1) -> Mesh:
  """(data, fsdp, tensor) mesh over the first `devices` devices, data taking what is left."""
  data = devices // (fsdp * tensor)
  grid = np.asarray(jax.devices()[:devices]).reshape(data, fsdp, tensor)
  return Mesh(grid, ("data", "fsdp", "tensor"))


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _compiled_memory(lowered) -> dict[str, int]:
  """`_memory` of `lowered` compiled as users compile it (XLA's default fusion emitters, whatever the
  process's XLA_FLAGS)."""
  return _memory(lowered.compile(compiler_options=USER_COMPILER_OPTIONS))


def _memory(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  return {"temp": int(m.temp_size_in_bytes), "args": int(m.argument_size_in_bytes),
          "out": int(m.output_size_in_bytes), "alias": int(m.alias_size_in_bytes)}


def _param_shardings(cfg: models.ModelConfig, mesh: Mesh, rules):
  return rules_lib.param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, rules)


def update_memory(cfg: models.ModelConfig, mesh: Mesh, rows: int, width: int) -> dict[str, int]:
  """Per-device bytes of the compiled RL update (GRPO, one micro-batch) on `rows` x `width` tokens."""
  optim = OptimConfig(learning_rate=1e-6, micro_batches=1)
  tx = state_lib.make_optimizer(optim)
  abstract = models.abstract_params(cfg)
  shardings = state_lib.state_shardings(tx, abstract, _param_shardings(cfg, mesh, rules_lib.TRAIN_RULES), mesh)
  state = jax.eval_shape(lambda p: state_lib.TrainState(step=jnp.int32(0), params=p, opt_state=tx.init(p),
                                                        policy_version=jnp.int32(0)), abstract)
  f32, i32 = jnp.float32, jnp.int32
  batch = TrainBatch(tokens_bt=jax.ShapeDtypeStruct((rows, width), i32),
                     mask_bt=jax.ShapeDtypeStruct((rows, width), f32),
                     advantages_bt=jax.ShapeDtypeStruct((rows, width), f32),
                     behaviour_logp_bt=jax.ShapeDtypeStruct((rows, width), f32),
                     ref_logp_bt=jax.ShapeDtypeStruct((rows, width), f32),
                     version_bt=jax.ShapeDtypeStruct((rows, width), i32))
  step = step_lib.make_rl_step(cfg, AlgoConfig(), 1.0, tx, 1, mesh, width, shardings)
  batch = _abstract(batch, step_lib.batch_shardings(mesh))
  return _compiled_memory(step.lower(_abstract(state, shardings), batch))


def logprob_memory(cfg: models.ModelConfig, mesh: Mesh, rows: int, width: int) -> dict[str, int]:
  """Per-device bytes of the compiled reference log-probs on `rows` x `width` tokens."""
  shardings = _param_shardings(cfg, mesh, rules_lib.TRAIN_RULES)
  fn = step_lib.make_logprob_fn(cfg, 1.0, mesh, shardings)
  tokens = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=step_lib.batch_shardings(mesh).tokens_bt)
  return _compiled_memory(fn.lower(_abstract(models.abstract_params(cfg), shardings), tokens))


def decode_memory(cfg: models.ModelConfig, mesh: Mesh, slots: int, prompt_len: int,
                  max_new_tokens: int) -> dict[str, int]:
  """Per-device bytes of one compiled decode chunk over `slots` slots (generation layout), refills on the
  device included (`slots.run_chunk`, the engine's default refill rows: a quarter of the slots).

  Lowered with `cfg.param_dtype` weights (float32 at the presets). Under model.dtype='bfloat16' the engine
  gets the switch's bfloat16 copy (`preset_config(..., param_dtype='bfloat16')`); the layer scans read
  such stacks as 16-bit words on the CPU (`layers.half_as_words`), where XLA:CPU would otherwise slice a
  float32 copy of every weight stack made ahead of the decode loop (BENCHMARKS.md, "Real-scale compiled
  memory").
  """
  spec = GenerateSpec(cfg, SamplingParams(1.0), prompt_len, max_new_tokens, 0)
  shardings = _param_shardings(cfg, mesh, rules_lib.GENERATE_RULES)
  programs = slots_lib.SlotPrograms(spec, slots, refill_rows(mesh, slots), mesh, shardings)
  cache = jax.eval_shape(lambda: models.init_cache(cfg, slots, spec.seq_len))
  state = jax.eval_shape(lambda: slots_lib.empty_slots(slots, spec.seq_len))
  rep = programs.replicated
  q, g = programs.pending_rows, programs.num_groups
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)
  flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=rep)
  pending = slots_lib.Pending(prompt_qp=i32(q, prompt_len), prompt_len_q=i32(q), sample_id_q=i32(q),
                              forced_len_q=i32(q), group_q=i32(q), source_q=i32(q), count=i32())
  target = slots_lib.ChunkTarget(remaining_g=i32(g), awaited_g=jax.ShapeDtypeStruct((g,), jnp.bool_, sharding=rep),
                                 need_groups=i32(), need_samples=i32(), blocked=flag, armed=flag, more_queued=flag)
  group_s = jax.ShapeDtypeStruct((slots,), jnp.int32, sharding=programs.state_shardings.done_s)
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
  lowered = programs.chunk.lower(_abstract(models.abstract_params(cfg), shardings),
                                 jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                             sharding=programs.cache_sharding),
                                              cache),
                                 _abstract(state, programs.state_shardings), group_s, pending, target, i32(), rng,
                                 i32())
  return _compiled_memory(lowered)


def refill_rows(mesh: Mesh, slots: int) -> int:
  """The engine's default refill rows: a quarter of the slots, rounded up to the mesh's batch shards."""
  shards = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
  return -(-max(1, slots // 4) // shards) * shards


# ------------------------------------------------------------------------------------------- bounds
# What a program may hold at its peak, per device, derived from the shapes alone as a sum of named parts.
# tests/aot_memory_test.py asserts temp <= the sum; BENCHMARKS.md prints the parts next to the bytes.

F32_BYTES = 4


def param_bytes(cfg: models.ModelConfig) -> int:
  """Bytes of the params in their storage dtype (float32 master weights at the presets)."""
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(models.abstract_params(cfg)))


def activation_parts(cfg: models.ModelConfig, rows: int, width: int) -> dict[str, int]:
  """The model's share of a backward pass over `rows` x `width` tokens under remat='full', in parts.

  saved: each layer's input, [tokens, D] in the compute dtype, for every layer (what remat keeps).
  layer: recomputing and differentiating one layer: 8 float32 [tokens, max(D, F, N*H)] tensors
  (projections, MLP, their gradients).
  attention: 4 float32 [rows, heads, width, width] tensors (scores, probabilities, their gradients).
  logits: one chunk of float32 logits, probabilities and their gradient: 3 x [logits_chunk, V].
  """
  tokens = rows * width
  wide = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
  return {"saved": cfg.num_layers * tokens * cfg.hidden_size * cfg.compute_dtype.itemsize,
          "layer": 8 * tokens * wide * F32_BYTES,
          "attention": 4 * rows * cfg.num_heads * width * width * F32_BYTES,
          "logits": 3 * min(cfg.logits_chunk, tokens) * cfg.vocab_size * F32_BYTES}


def update_parts(cfg: models.ModelConfig, rows: int, width: int, param_shards: int = 1) -> dict[str, int]:
  """`activation_parts` plus the optimizer's working set: 3 float32 copies of (this device's) params —
  the gradients, and the new moments / params computed before the finiteness guard picks them."""
  return {**activation_parts(cfg, rows, width), "optimizer": 3 * param_bytes(cfg) // param_shards}


def logprob_parts(cfg: models.ModelConfig, rows: int, width: int) -> dict[str, int]:
  """A forward pass only: the hidden states, one layer's working set, half the attention, one chunk."""
  parts = activation_parts(cfg, rows, width)
  return {"hidden": rows * width * cfg.hidden_size * cfg.compute_dtype.itemsize, "layer": parts["layer"],
          "attention": parts["attention"] // 2, "logits": parts["logits"]}


def decode_parts(cfg: models.ModelConfig, slots: int, seq_len: int, cache_shards: int = 1, *,
                 refill_rows: int = 0, refill_width: int = 0, outbox_rows: int = 0) -> dict[str, int]:
  """One decode chunk: the cache rewritten once in float32 (XLA:CPU scatters a bfloat16 cache through a
  float32 copy; a GPU writes it in place), per step the slots' float32 logits and probabilities, and the
  lm-head weight cast once to the compute dtype (hoisted out of the chunk's steps: `decode_memory` lowers
  float32 weights). A refill on the device adds its prefill over `refill_rows` x `refill_width` tokens
  (its own float32 cache rows, and 8 float32 [tokens, max(D, F, N*H)] activations, as `activation_parts`
  counts a layer) and the outbox of finished rows with the packed slot rows it is filled from (int32
  [outbox_rows + slots, 3T + 4])."""
  cache = 2 * cfg.num_layers * slots * cfg.num_kv_heads * seq_len * cfg.head_dim // cache_shards
  tokens = refill_rows * refill_width
  widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
  return {"cache_f32": 2 * cache * F32_BYTES, "logits": 4 * slots * cfg.vocab_size * F32_BYTES,
          "lm_head": cfg.vocab_size * cfg.hidden_size * cfg.compute_dtype.itemsize,
          "refill_cache_f32": 2 * cfg.num_layers * tokens * cfg.num_kv_heads * cfg.head_dim * F32_BYTES,
          "refill_activations": 8 * tokens * widest * F32_BYTES,
          "outbox": (outbox_rows + slots) * (3 * seq_len + 4) * 4}


def grad_logprobs_memory(cfg: models.ModelConfig, rows: int, width: int) -> dict[str, int]:
  """One-device bytes of `jax.grad` of the summed `token_logprobs` (the model's part of an update)."""
  from rl_fusion_jax.train.logprobs import token_logprobs  # pylint: disable=g-import-not-at-top
  tokens = jnp.zeros((rows, width), jnp.int32)
  fn = jax.jit(jax.grad(lambda p: jnp.sum(token_logprobs(cfg, p, tokens))))
  return _compiled_memory(fn.lower(models.abstract_params(cfg)))
