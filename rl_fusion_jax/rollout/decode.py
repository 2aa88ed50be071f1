"""What every generation program shares: its static spec, the per-row decode state, and one decode step.

The engine's slot programs (``slots.py``) and the reference batch generator of the tests
(``rl_fusion_jax.testing.reference_generator``) both advance a ``SlotState`` with ``decode_step``, so a
sample's token t is drawn the same way in both: from the logits of its newest token, with key
(rng, sample id, t). Everything here except ``state_shardings`` is a pure function of arrays, to be
called inside a jitted program; this module never moves arrays and never touches the host.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from rl_fusion_jax import models
from rl_fusion_jax.rollout.sampling import SamplingParams, sample, sample_keys
from rl_fusion_jax.sharding.mesh import batch_sharding


@dataclasses.dataclass(frozen=True)
class GenerateSpec:
  """Everything static about a generation program (hashable: part of the jit cache key)."""
  model: models.ModelConfig
  sampling: SamplingParams
  max_prompt_len: int
  max_new_tokens: int
  eos_id: int

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.max_prompt_len < 1:
      raise ValueError(f"max_prompt_len must be >= 1, got {self.max_prompt_len}")

  @property
  def seq_len(self) -> int:
    return self.max_prompt_len + self.max_new_tokens


@flax.struct.dataclass
class SlotState:
  """One row per slot, laid out like types.Rollout: prompt + response back to back, zero after."""
  tokens_st: Int[Array, "S T"]
  logp_st: Float[Array, "S T"]
  version_st: Int[Array, "S T"]
  prompt_len_s: Int[Array, "S"]
  response_len_s: Int[Array, "S"]
  forced_len_s: Int[Array, "S"]     # > 0: the response ends at this length and EOS is ignored
  finished_s: Bool[Array, "S"]      # ended by EOS (or, when forced, by reaching the forced length)
  done_s: Bool[Array, "S"]          # finished or at max_new_tokens; also True for an empty slot
  sample_id_s: Int[Array, "S"]


def state_shardings(mesh: Mesh) -> SlotState:
  """A SlotState of shardings: every field split over the mesh batch axes by its slot dimension."""
  b1, b2 = batch_sharding(mesh, 1), batch_sharding(mesh, 2)
  return SlotState(tokens_st=b2, logp_st=b2, version_st=b2, prompt_len_s=b1, response_len_s=b1,
                   forced_len_s=b1, finished_s=b1, done_s=b1, sample_id_s=b1)


def empty_slots(num_slots: int, seq_len: int) -> SlotState:
  """Every slot empty (done, so decode leaves it alone)."""
  zeros_s = jnp.zeros((num_slots,), jnp.int32)
  return SlotState(
      tokens_st=jnp.zeros((num_slots, seq_len), jnp.int32),
      logp_st=jnp.zeros((num_slots, seq_len), jnp.float32),
      version_st=jnp.full((num_slots, seq_len), -1, jnp.int32),
      prompt_len_s=zeros_s, response_len_s=zeros_s, forced_len_s=zeros_s,
      finished_s=jnp.zeros((num_slots,), bool), done_s=jnp.ones((num_slots,), bool), sample_id_s=zeros_s)


def new_rows(seq_len: int, prompt_rp, prompt_len_r, sample_id_r, forced_len_r) -> SlotState:
  """Fresh samples, one per row: the right-padded prompts [R, P] in rows of ``seq_len``, nothing sampled."""
  num_rows, width = prompt_rp.shape
  zeros_r = jnp.zeros((num_rows,), jnp.int32)
  return SlotState(
      tokens_st=jnp.zeros((num_rows, seq_len), jnp.int32).at[:, :width].set(prompt_rp),
      logp_st=jnp.zeros((num_rows, seq_len), jnp.float32),
      version_st=jnp.full((num_rows, seq_len), -1, jnp.int32),
      prompt_len_s=prompt_len_r, response_len_s=zeros_r, forced_len_s=forced_len_r,
      finished_s=jnp.zeros((num_rows,), bool), done_s=jnp.zeros((num_rows,), bool),
      sample_id_s=sample_id_r)


def put_at(buf_bt, pos_b, value_b, active_b):
  """buf[b, pos_b] = value_b where active_b; positions outside [0, T) write nothing.

  A select over the whole [B, T] buffer rather than a scatter: the buffers are small, and a scatter
  whose row index is data makes a batch-sharded program gather every row's indices and values onto
  every device.
  """
  hit_bt = active_b[:, None] & (jnp.arange(buf_bt.shape[1]) == pos_b[:, None])
  return jnp.where(hit_bt, jnp.asarray(value_b, buf_bt.dtype)[:, None], buf_bt)


def take_at(buf_bt, pos_b):
  """buf[b, pos_b] per row, 0 where pos_b is outside [0, T) (a masked sum: no gather, as in `put_at`)."""
  hit_bt = jnp.arange(buf_bt.shape[1]) == pos_b[:, None]
  return jnp.sum(jnp.where(hit_bt, buf_bt, 0), axis=1, dtype=buf_bt.dtype)


def append(spec: GenerateSpec, state: SlotState, pos_s, token_s, logp_s, version) -> SlotState:
  """Appends one sampled token at ``pos_s`` to every active slot and updates finished / done."""
  active_s = ~state.done_s
  response_len_s = state.response_len_s + active_s.astype(jnp.int32)
  forced_s = state.forced_len_s > 0
  eos_s = active_s & ~forced_s & (token_s == spec.eos_id)
  finished_s = state.finished_s | eos_s | (active_s & forced_s & (response_len_s >= state.forced_len_s))
  return state.replace(
      tokens_st=put_at(state.tokens_st, pos_s, token_s, active_s),
      logp_st=put_at(state.logp_st, pos_s, logp_s, active_s),
      version_st=put_at(state.version_st, pos_s, jnp.broadcast_to(version, token_s.shape), active_s),
      response_len_s=response_len_s, finished_s=finished_s,
      done_s=state.done_s | finished_s | (response_len_s >= spec.max_new_tokens))


def decode_step(spec: GenerateSpec, params, state: SlotState, cache, rng, version):
  """One token for every active slot: runs each slot's newest token through the model (writing its KV),
  samples the next one with key (rng, sample id, response length) and appends it -> (state, cache).

  Inactive slots still run (shapes are fixed) but write no KV and append nothing.
  """
  seq_len = state.tokens_st.shape[1]
  pos_s = state.prompt_len_s + state.response_len_s - 1          # each slot's newest token
  last_s = take_at(state.tokens_st, pos_s)
  write_s = jnp.where(state.done_s, seq_len, pos_s)              # out of range: writes nothing
  logits_s1v, cache = models.forward_with_cache(spec.model, params, last_s[:, None], write_s[:, None],
                                                cache)
  keys_s = sample_keys(rng, state.sample_id_s, state.response_len_s)
  token_s, logp_s = sample(logits_s1v[:, 0], keys_s, spec.sampling)
  return append(spec, state, pos_s + 1, token_s, logp_s, version), cache
