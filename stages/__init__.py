"""spectrio.stages: one module per pipeline actor (scheduler, draft, verify, sampler,
publisher) plus the pure logic each needs (scheduling, block manager, acceptance,
rejection sampling)."""

from spectrio.stages.acceptance import greedy_accept, truncate_at_stop
from spectrio.stages.block_manager import BlockManager, OutOfBlocks
from spectrio.stages.rejection import rejection_sample
from spectrio.stages.scheduling import Scheduler, Sequence

__all__ = [
    "BlockManager",
    "OutOfBlocks",
    "Scheduler",
    "Sequence",
    "greedy_accept",
    "rejection_sample",
    "truncate_at_stop",
]
