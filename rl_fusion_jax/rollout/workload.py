"""Synthetic long-tail generation workloads and the three schedules the generation benchmark compares.

Response lengths are forced per request (``Request.forced_len``: the sample ends there, EOS ignored) and
drawn from a clipped log-normal, so the cost of a schedule can be measured on a random-init model:
  * ``static``: fill every slot, wait until all of them finish, then the next batch (one run each);
  * ``continuous``: refill a slot as soon as its sample finishes;
  * ``partial``: every request queued up front, then phases (runs) that each stop once ``phase_samples``
    samples finished; slots are refilled within a phase, and the unfinished tail is carried into the
    next phase (re-prefilled under that phase's weights, here the same ones);
  * ``partial_keep_cache``: the same phases, keeping the KV cache between them instead (no re-prefill).
Nothing here measures anything but wall-clock and token counts; it never looks at token values.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import numpy as np

from rl_fusion_jax.rollout.engine import Engine, EngineConfig, Request

SCHEDULES = ("static", "continuous", "partial", "partial_keep_cache")


def long_tail_lengths(rng: np.random.Generator, n: int, *, median: float, sigma: float,
                      max_len: int) -> np.ndarray:
  """int32 [n]: round(median * exp(sigma * z)), z ~ N(0, 1), clipped to [1, max_len].

  The log-normal's median is ``median`` and its p99 is ``median * exp(2.326 * sigma)``; sigma = 0.8
  gives p99 / p50 ~ 6.4 before clipping.
  """
  if n < 1 or median <= 0 or sigma < 0 or max_len < 1:
    raise ValueError(f"long_tail_lengths: need n >= 1, median > 0, sigma >= 0, max_len >= 1; got "
                     f"n={n}, median={median}, sigma={sigma}, max_len={max_len}")
  lengths = np.rint(median * np.exp(sigma * rng.standard_normal(n)))
  return np.clip(lengths, 1, max_len).astype(np.int32)


def make_requests(rng: np.random.Generator, forced_lens: Sequence[int], *, group_size: int,
                  prompt_len: int, vocab_size: int, first_id: int = 0) -> list[Request]:
  """GRPO-style requests: consecutive ``group_size`` samples share a random prompt of ``prompt_len``."""
  if len(forced_lens) % group_size:
    raise ValueError(f"make_requests: {len(forced_lens)} samples is not a multiple of group_size "
                     f"{group_size}")
  requests = []
  for g in range(len(forced_lens) // group_size):
    prompt = rng.integers(0, vocab_size, size=prompt_len)
    for j in range(group_size):
      i = g * group_size + j
      requests.append(Request(first_id + i, (first_id + i) // group_size, prompt, int(forced_lens[i])))
  return requests


def schedule_config(base: EngineConfig, schedule: str) -> EngineConfig:
  """The engine config a schedule runs with (static decodes each batch to the end in one chunk)."""
  if schedule == "static":
    return dataclasses.replace(base, refill="static", chunk_steps=base.spec.max_new_tokens)
  if schedule in ("continuous", "partial", "partial_keep_cache"):
    return dataclasses.replace(base, refill="continuous", keep_cache=schedule == "partial_keep_cache")
  raise ValueError(f"schedule: must be one of {SCHEDULES}, got {schedule!r}")


def run_schedule(schedule: str, engine: Engine, params, requests: Sequence[Request], *,
                 phase_samples: int) -> dict:
  """Generates every request under ``schedule``; returns seconds, tokens, tokens/s and phase times."""
  t0 = time.perf_counter()
  results = []
  if schedule.startswith("partial"):
    engine.add(requests)
    while engine.num_queued or engine.num_in_flight or engine.num_unreturned:
      results.append(engine.run(params, len(results), target_samples=phase_samples))
  elif schedule == "static":
    for start in range(0, len(requests), engine.cfg.num_slots):   # one batch of full slots per run
      engine.add(requests[start:start + engine.cfg.num_slots])
      results.append(engine.run(params, 0))
  else:
    engine.add(requests)
    results.append(engine.run(params, 0))
  seconds = time.perf_counter() - t0
  returned = sum(len(r.group_id_b) for r in results)
  if returned != len(requests):
    raise RuntimeError(f"schedule {schedule}: {returned} samples returned, {len(requests)} requested")
  tokens = sum(int(r.rollout.response_len_b.sum()) for r in results)
  steps = sum(r.stats.get("decode_steps", 0) for r in results)
  out = {"schedule": schedule, "seconds": seconds, "generated_tokens": tokens,
         "tokens_per_s": tokens / seconds, "decode_steps": steps,
         "slot_utilization": tokens / max(1, steps * engine.cfg.num_slots),
         "prefill_calls": sum(r.stats.get("prefill_calls", 0) for r in results),
         "reprefill_rows": sum(r.stats.get("reprefill_rows", 0) for r in results)}
  if schedule != "continuous":    # time until one batch is ready for the learner
    out["median_phase_s"] = statistics.median(r.stats["seconds"] for r in results)
  return out
