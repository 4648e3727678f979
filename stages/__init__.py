"""spectrio.stages: one module per pipeline actor (scheduler, draft, verify, sampler,
publisher) plus the pure logic each needs: scheduling and the KV block manager, logits
processing, rejection sampling, stops, the sampler's per-request state, record packing."""

from spectrio.stages.block_manager import BlockManager, OutOfBlocks
from spectrio.stages.logits_processing import History, process_rows, sampling_probs, token_logprobs
from spectrio.stages.records import publish_step
from spectrio.stages.rejection import rejection_sample
from spectrio.stages.sampling import Sampler
from spectrio.stages.scheduling import Scheduler, Sequence
from spectrio.stages.stops import StopStringMatcher, Truncation, truncate_run

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
