"""The data plane between stages: DistQueue (packed column store), StaleSync admission, global batches.

``distqueue`` and ``staleness`` are host-only and import no jax; ``global_batch`` is the one place queue
data becomes device arrays. Nothing here runs a model or changes parameters.
"""
from __future__ import annotations

from rl_fusion_jax.queue.distqueue import (Batch, DistQueue, FieldSpec, NotReady, Packed, QueueFull,
                                           check_capacity, pack, unpack)
from rl_fusion_jax.queue.staleness import (Admission, Candidate, admissible, admit, check_max_staleness,
                                           staleness)

__all__ = ["Admission", "Batch", "Candidate", "DistQueue", "FieldSpec", "NotReady", "Packed", "QueueFull",
           "admissible", "admit", "check_capacity", "check_max_staleness", "pack", "staleness", "unpack"]
