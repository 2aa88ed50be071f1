"""Host stages that run beside the devices: decoding and verifying finished samples while generation goes on.

The engine reports each batch of newly finished samples at the end of a decode chunk
(``Engine.on_finished``); :class:`VerifyStage` decodes and scores them on worker threads while the
engine dispatches the next chunks (XLA runs without the GIL), so by the end of a rollout phase most
rewards are already known. ``scores`` returns, for any batch, exactly what ``rewards.base.score_batch``
returns for it (the verifier is a pure function of problem and text): results computed early are
looked up by sample id, the rest are computed on the spot. A sample's problem is the task's problem of
its group id, as everywhere in the loop.

In a run of several processes (``share``), each process decodes and scores only the samples it owns
(``processes.Share``: the process holding its row under ``Engine.local_rows``, else sample id mod process
count) and ``scores`` exchanges the results, so every process returns the whole batch's scores while the
host work is split, not repeated.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence

import numpy as np

from rl_fusion_jax.orchestration import data, processes
from rl_fusion_jax.rewards.base import Problem, Task, score_batch
from rl_fusion_jax.tokenizer import Tokenizer
from rl_fusion_jax.types import Rollout


class VerifyStage:
  """Decode + verify of finished samples on ``workers`` threads; ``workers == 0`` scores only on demand."""

  def __init__(self, task: Task, tokenizer: Tokenizer, group_size: int, workers: int = 1,
               share: processes.Share = processes.Share()):
    if workers < 0:
      raise ValueError(f"VerifyStage: workers must be >= 0, got {workers}")
    self.task, self.tokenizer, self.group_size, self.share = task, tokenizer, group_size, share
    self._pool = (concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="verify")
                  if workers else None)
    self._lock = threading.Lock()
    self._pending: dict[int, tuple[concurrent.futures.Future, int]] = {}   # sample id -> (future, row)
    self._busy_s = 0.0

  # -- producer side (the engine's listener) --------------------------------------------------------

  def submit(self, rollout: Rollout, group_id_b: np.ndarray, shard_b=None) -> None:
    """Starts scoring finished samples (host arrays) in the background; a no-op without workers.
    ``shard_b`` (the engine's batch shards that generated them) is not needed here."""
    del shard_b
    mine = np.flatnonzero(self.share.owns(rollout.sample_id_b))
    if self._pool is None or not len(mine):
      return
    args = (np.array(rollout.tokens_bt[mine]), np.array(rollout.prompt_len_b[mine]),
            np.array(rollout.response_len_b[mine]), [int(group_id_b[i]) for i in mine])
    future = self._pool.submit(self._score, *args)
    with self._lock:
      for row, i in enumerate(mine):
        self._pending[int(rollout.sample_id_b[i])] = (future, row)

  def _score(self, tokens_bt, prompt_len_b, response_len_b, group_ids):
    start = time.perf_counter()
    texts = data.decode_responses(self.tokenizer, tokens_bt, prompt_len_b, response_len_b)
    out = score_batch(self.task, [self.task.problem(g) for g in group_ids], texts)
    with self._lock:
      self._busy_s += time.perf_counter() - start
    return out

  # -- consumer side ----------------------------------------------------------------------------------

  def scores(self, rollout: Rollout, problems: Sequence[Problem]):
    """(rewards f32[B], format_ok bool[B], correct bool[B], metrics) for ``rollout`` (host, sample-id order).

    ``problems``: one per group of ``group_size`` consecutive rows. Samples scored in the background are
    taken from there (waiting for the ones still running); the others are scored here (of several
    processes, each scores the samples it owns and the results are exchanged).
    """
    n = len(rollout.sample_id_b)
    rewards, fmt, correct = np.zeros((n,), np.float32), np.zeros((n,), bool), np.zeros((n,), bool)
    with self._lock:
      found = {i: self._pending.pop(int(s)) for i, s in enumerate(rollout.sample_id_b)
               if int(s) in self._pending}
    start = time.perf_counter()
    for i, (future, row) in found.items():
      r, f, c = future.result()
      rewards[i], fmt[i], correct[i] = r[row], f[row], c[row]
    wait_s = time.perf_counter() - start
    owned = self.share.owns(rollout.sample_id_b)
    rest = [i for i in range(n) if i not in found and owned[i]]
    if rest:
      texts = data.decode_responses(self.tokenizer, rollout.tokens_bt[rest], rollout.prompt_len_b[rest],
                                    rollout.response_len_b[rest])
      r, f, c = score_batch(self.task, [problems[i // self.group_size] for i in rest], texts)
      rewards[rest], fmt[rest], correct[rest] = r, f, c
    rewards, fmt, correct = processes.gather_rows("verify", self.share, rollout.sample_id_b,
                                                    (rewards, fmt, correct))
    with self._lock:
      busy, self._busy_s = self._busy_s, 0.0
    return rewards, fmt, correct, {"verify/early_frac": len(found) / max(int(owned.sum()), 1),
                                   "verify/wait_s": wait_s,
                                   "verify/background_s": busy}

  def forget(self, sample_ids) -> None:
    """Drops background results that will never be asked for (e.g. discarded stale samples)."""
    with self._lock:
      for s in sample_ids:
        self._pending.pop(int(s), None)

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
