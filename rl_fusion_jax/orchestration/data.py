"""Host-side data: problems -> fixed-shape token arrays, and arrays -> global device batches.

Everything here is numpy on the host; ``to_global`` builds device arrays shard by shard from a host
batch that every process holds whole (per-process reads from the queue: ``queue/global_batch.py``).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rl_fusion_jax.rewards.base import Problem
from rl_fusion_jax.sharding.mesh import batch_sharding
from rl_fusion_jax.tokenizer import Tokenizer


def encode_prompts(tokenizer: Tokenizer, problems: Sequence[Problem], width: int):
  """Right-padded prompt tokens [N, width] int32 and lengths [N]; raises if one does not fit."""
  tokens = np.full((len(problems), width), tokenizer.pad_id, np.int32)
  lengths = np.zeros((len(problems),), np.int32)
  for i, problem in enumerate(problems):
    ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(problem.prompt)
    if not 1 <= len(ids) <= width:
      raise ValueError(f"prompt {problem.prompt!r} has {len(ids)} tokens; config.rollout.max_prompt_len "
                       f"is {width}")
    tokens[i, :len(ids)] = ids
    lengths[i] = len(ids)
  return tokens, lengths


def encode_sft(tokenizer: Tokenizer, problems: Sequence[Problem], seq_len: int):
  """prompt + target + EOS per row, right-padded to seq_len; the mask marks target and EOS tokens."""
  prompts, prompt_lens = encode_prompts(tokenizer, problems, seq_len)
  tokens = np.full((len(problems), seq_len), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(problems), seq_len), np.float32)
  for i, problem in enumerate(problems):
    target = tokenizer.encode(problem.target) + [tokenizer.eos_id]
    start, end = prompt_lens[i], prompt_lens[i] + len(target)
    if end > seq_len:
      raise ValueError(f"prompt + target of {problem.prompt!r} needs {end} tokens > {seq_len} "
                       "(config.rollout.max_prompt_len + max_new_tokens)")
    tokens[i, :start] = prompts[i, :start]
    tokens[i, start:end] = target
    mask[i, start:end] = 1.0
  return tokens, mask


def decode_responses(tokenizer: Tokenizer, tokens_bt: np.ndarray, prompt_len_b: np.ndarray,
                     response_len_b: np.ndarray) -> list[str]:
  """Response text per row, without the EOS token."""
  out = []
  for row, start, n in zip(tokens_bt, prompt_len_b, response_len_b):
    ids = [int(t) for t in row[start:start + n] if t != tokenizer.eos_id]
    out.append(tokenizer.decode(ids))
  return out


def to_global(mesh: Mesh, host: np.ndarray) -> jax.Array:
  """A host batch -> a global array split over the batch axes (dimension 0).

  Built shard by shard: each device receives only its own rows (never a replicated copy of the batch).
  The caller holds the WHOLE host batch, though: with several processes each one needs the full ``host``
  and copies only its devices' rows. Reading only a process's own rows from the queue is
  ``queue/global_batch.py`` (one read per row slice).
  """
  host = np.asarray(host)
  sharding = batch_sharding(mesh, host.ndim)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
