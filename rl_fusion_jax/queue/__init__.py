"""The data plane between stages: DistQueue (packed column store), StaleSync admission, global batches.

``distqueue`` and ``staleness`` are host-only and import no jax; ``global_batch`` is the one place queue
data becomes device arrays. Nothing here runs a model or changes parameters.
"""
from __future__ import annotations

from rl_fusion_jax.queue.distqueue import (Batch, DistQueue, FieldSpec, NotReady, Packed, QueueFull,
                                           check_capacity, pack, unpack)
from rl_fusion_jax.queue.staleness import (Admission, Candidate, WaitingGroup, admissible, admit, admit_groups,
                                           at_risk_groups, check_max_staleness, stale_groups, staleness,
                                           waiting_groups)

__all__ = ["Admission", "Batch", "Candidate", "DistQueue", "FieldSpec", "NotReady", "Packed", "QueueFull",
           "WaitingGroup", "admissible", "admit", "admit_groups", "at_risk_groups", "check_capacity",
           "check_max_staleness", "pack", "stale_groups", "staleness", "unpack", "waiting_groups"]
