"""Seconds from counts: the cost model of one device group's phases.

A rollout phase costs ``GenCost.seconds(counts)``: a linear function of the ``engine.PhaseCounts`` (decode
steps, chunks, prefill calls and tokens, generated tokens, context tokens read per step). On CPU the
engine's programs have fixed shapes over all slots, so steps, chunks and calls carry the cost; on an
accelerator decode is bandwidth-bound and the per-token terms matter (``cluster.py`` sets them from the
hardware). A train phase costs ``TrainCost.seconds(tokens)``. Everything else a step does on a lane
(phase switch, reward, publish, host work between phases) is a fixed ``other_s`` per step, and in the
separated schedule the named transfer phases have their own fixed seconds.
"""
from __future__ import annotations

import dataclasses

from rl_fusion_jax.sim.engine import PhaseCounts

GEN_TERMS = ("phase", "decode_steps", "decode_chunks", "prefill_calls", "refill_prefills", "prefill_tokens",
             "generated_tokens", "kv_token_steps")


@dataclasses.dataclass(frozen=True)
class GenCost:
  """Seconds per unit of each count (``phase``: per rollout phase)."""
  phase: float = 0.0
  decode_steps: float = 0.0
  decode_chunks: float = 0.0
  prefill_calls: float = 0.0
  refill_prefills: float = 0.0
  prefill_tokens: float = 0.0
  generated_tokens: float = 0.0
  kv_token_steps: float = 0.0

  def seconds(self, counts: PhaseCounts) -> float:
    return self.phase + sum(getattr(self, k) * getattr(counts, k) for k in GEN_TERMS[1:])


@dataclasses.dataclass(frozen=True)
class TrainCost:
  """An update over ``tokens`` real tokens: ``fixed + per_token * tokens`` seconds."""
  fixed: float = 0.0
  per_token: float = 0.0

  def seconds(self, tokens: float) -> float:
    return self.fixed + self.per_token * tokens


@dataclasses.dataclass(frozen=True)
class Costs:
  """One deployment's costs.

  Colocated: one lane runs everything; ``gen``, ``train``, ``other_s`` (switches, reward, publish) and
  ``gap_s`` (host work between phases, idle on the lane) per step. Separated: ``gen`` on the rollout lane plus ``rollout_other_s`` (loading weights,
  scoring, shipping the batch), ``train`` on the training lane plus ``other_s`` (receiving the batch,
  publishing), and ``push_s``: the weights' trip to the rollout side after each update (off the
  trainer's critical path, on a background thread)."""
  gen: GenCost
  train: TrainCost
  other_s: float = 0.0
  rollout_other_s: float = 0.0
  push_s: float = 0.0
  gap_s: float = 0.0     # colocated: host time per step outside every phase (the lane shows it idle)
  # Separated, two processes sharing one machine's processors: a phase runs this many times slower
  # while the other side is busy (1: dedicated devices, as at cluster scale).
  gen_contention: float = 1.0
  train_contention: float = 1.0
  push_contention: float = 1.0
