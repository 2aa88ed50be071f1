"""Seconds from counts: the cost model of one device group's phases.

A rollout phase costs ``GenCost.seconds(counts)``: a linear function of the ``engine.PhaseCounts`` (decode
steps, chunks, prefill calls and tokens, generated tokens, context tokens read per step). On CPU the
engine's programs have fixed shapes over all slots, so steps, chunks and calls carry the cost; on an
accelerator decode is bandwidth-bound and the per-token terms matter (``cluster.py`` sets them from the
hardware). A train phase costs ``TrainCost.seconds(tokens)``. Everything else a step does on a lane
(phase switch, reward, publish, host work between phases) is a fixed ``other_s`` per step, and in the
separated schedule the named transfer phases have their own fixed seconds.

``Sharing`` is the one effect that is not a count: the separated deployment measured here runs its two
processes on one machine's cores, so a phase that runs while the other side is busy is slowed by how many
threads compete for the cores (processor sharing, with thread counts stated up front, not fitted).
"""
from __future__ import annotations

import dataclasses
import math

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
  # Separated, two processes on one machine's cores: how the phases slow each other (None: dedicated
  # devices, as at cluster scale).
  sharing: Sharing | None = None


@dataclasses.dataclass(frozen=True)
class Sharing:
  """Processor sharing between the separated deployment's activities on one machine.

  Three activities compete for the ``cores``: generation (the rollout process), the update and the
  weight push (a background thread of the trainer that encodes the weights and writes them to the
  coordinator's key-value store). While a set of them runs, every runnable thread gets an equal share of
  the cores (the OS's fair scheduler): an activity of n threads among N runnable ones runs at
  ``min(n, cores * n / N) / min(n, cores)`` of its speed alone. The thread counts are stated, not fitted:
  a fit could only use the StaleSync runs (the only ones in which the sides overlap), which the held-out
  validation predicts. They were chosen from the code's structure after the StaleSync runs' residuals had
  been seen; ``experiments/simulate_main.py --sharing_sweep`` prints the held-out errors under other counts.
    * ``cores``: the machine the committed runs were measured on has 2 (RESULTS.md: 2-core AMD EPYC);
    * ``gen_threads`` 1: one engine loop whose decode steps of a 4-layer model are dispatch-bound
      (ASSUMPTION: the host thread, not XLA's intra-op pool, is busy);
    * ``train_threads`` 2: the update's matmuls run on XLA:CPU's intra-op pool, one thread per core
      (ASSUMPTION: the pool's size is the core count, XLA's default);
    * ``push_threads`` 1: ``orchestration/separated.py::KVPublisher``'s one writer thread.
  Measured since (``experiments/benchmark_main.py``'s ``generate_cores`` / ``train_cores``: a phase's
  process CPU seconds per wall second, one device, the phase alone; a 2-core AMD EPYC with AVX-512, in a
  later session than the committed runs): generation keeps 1.35 cores busy on the long-tail workload and
  the update 1.70, so the first ASSUMPTION does not hold (XLA's pool works during decode too). The
  defaults are left as stated: taken as thread counts, the measured figures do not predict the committed
  runs better (RESULTS.md, the thread-count table). Nor does a measurement against known competitors
  (``benchmark_main.py --spinners=K``: K processes each keeping a core busy, ``threads_from_slowdown``; long
  tail, one device, same machine kind): beside one of them the update took 1.29-2.08x its time alone in
  three runs, more than processor sharing allows any thread count (1.5x; a pool whose threads wait for the
  slowest one would do that, not verified), and generation 1.00-1.41x; repeats moved by a third, too much
  to set a count from.
  ``cores`` = 0: no sharing (dedicated devices)."""
  cores: float = 0.0
  gen_threads: float = 1.0
  train_threads: float = 2.0
  push_threads: float = 1.0

  def rate(self, own: float, others: float) -> float:
    """Speed of an activity of ``own`` threads while ``others`` other threads run, relative to alone."""
    if self.cores <= 0 or others <= 0:
      return 1.0
    return min(own, self.cores * own / (own + others)) / min(own, self.cores)

  def threads_from_slowdown(self, slowdown: float, others: float) -> float:
    """The thread count an activity must have for ``rate`` to predict ``slowdown`` (its seconds with
    ``others`` always-runnable threads beside it over its seconds alone): the inverse of ``rate`` over
    (0, cores], where it falls from 1 to cores / (cores + others), by bisection. 0 when it was not slowed
    (any count up to ``cores - others`` fits); ``cores`` when it was slowed more than the model allows."""
    target = 1.0 / slowdown
    if target >= 1.0:
      return 0.0
    if self.rate(self.cores, others) >= target:
      return float(self.cores)
    lo, hi = 1e-9, float(self.cores)
    for _ in range(100):
      mid = (lo + hi) / 2
      lo, hi = (mid, hi) if self.rate(mid, others) > target else (lo, mid)
    return (lo + hi) / 2

  def work(self, span: tuple[float, float], own: float, others: list[tuple[float, float, float]]) -> float:
    """Seconds of work-alone done in ``span`` while ``others`` ((start, end, threads) each) run."""
    a, b = span
    cuts = sorted({a, b} | {x for p, q, _ in others for x in (p, q) if a < x < b})
    return sum((y - x) * self.rate(own, _running(others, (x + y) / 2)) for x, y in zip(cuts, cuts[1:]))

  def finish(self, start: float, work: float, own: float, others: list[tuple[float, float, float]]) -> float:
    """When an activity that starts at ``start`` and needs ``work`` seconds alone ends."""
    cuts = sorted({x for p, q, _ in others for x in (p, q) if x > start}) + [math.inf]
    t = start
    for c in cuts:
      r = self.rate(own, _running(others, t if c == math.inf else (t + c) / 2))
      if c == math.inf or (c - t) * r >= work:
        return t + work / r
      work -= (c - t) * r
      t = c
    return t


def _running(others, t: float) -> float:
  return sum(n for p, q, n in others if p <= t < q)
