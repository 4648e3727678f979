"""spectrio.stages: one module per pipeline actor (scheduler, draft, verify, sampler,
publisher) plus the pure logic each needs: scheduling and the KV block manager, logits
processing, rejection sampling, stops, the sampler's per-request state, record packing."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

_EXPORTS = {
    "BlockManager": "spectrio.stages.block_manager",
    "OutOfBlocks": "spectrio.stages.block_manager",
    "History": "spectrio.stages.logits_processing",
    "process_rows": "spectrio.stages.logits_processing",
    "sampling_probs": "spectrio.stages.logits_processing",
    "token_logprobs": "spectrio.stages.logits_processing",
    "publish_step": "spectrio.stages.records",
    "rejection_sample": "spectrio.stages.rejection",
    "Sampler": "spectrio.stages.sampling",
    "Scheduler": "spectrio.stages.scheduling",
    "Sequence": "spectrio.stages.scheduling",
    "StopStringMatcher": "spectrio.stages.stops",
    "Truncation": "spectrio.stages.stops",
    "truncate_run": "spectrio.stages.stops",
}

__all__ = [
    "BlockManager",
    "History",
    "OutOfBlocks",
    "Sampler",
    "Scheduler",
    "Sequence",
    "StopStringMatcher",
    "Truncation",
    "process_rows",
    "publish_step",
    "rejection_sample",
    "sampling_probs",
    "token_logprobs",
    "truncate_run",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.stages.block_manager import BlockManager, OutOfBlocks
    from spectrio.stages.logits_processing import (
        History,
        process_rows,
        sampling_probs,
        token_logprobs,
    )
    from spectrio.stages.records import publish_step
    from spectrio.stages.rejection import rejection_sample
    from spectrio.stages.sampling import Sampler
    from spectrio.stages.scheduling import Scheduler, Sequence
    from spectrio.stages.stops import StopStringMatcher, Truncation, truncate_run
