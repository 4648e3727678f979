"""spectrio.stages: the pipeline's actors and their pure logic, grouped by the thread that
runs them.

- ``planning/`` (the Trio event loop): the scheduler actor and the scheduler, the KV
  block manager, the adaptive speculation policy, the request lifecycle;
- ``device/`` (the device-worker thread): the workspace, overlap resolution, the draft
  stage and its proposers (``device/draft/``), verify, the sampler with its logits
  processing, rejection sampling and stops;
- ``output/`` (the publisher's task and the streams): the publisher, record packing, and
  the output processor (text, logprobs, per-request statistics).

Old module paths (``spectrio.stages.scheduling`` ...) still import, with a warning that
names the new one."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports
from spectrio._moved import moved_modules

_EXPORTS = {
    "BlockManager": "spectrio.stages.planning.block_manager",
    "OutOfBlocks": "spectrio.stages.planning.block_manager",
    "History": "spectrio.stages.device.logits_processing",
    "process_rows": "spectrio.stages.device.logits_processing",
    "sampling_probs": "spectrio.stages.device.logits_processing",
    "token_logprobs": "spectrio.stages.device.logits_processing",
    "publish_step": "spectrio.stages.output.records",
    "rejection_sample": "spectrio.stages.device.rejection",
    "Sampler": "spectrio.stages.device.sampler",
    "Scheduler": "spectrio.stages.planning.scheduler",
    "Sequence": "spectrio.stages.planning.sequence",
    "StopStringMatcher": "spectrio.stages.device.stops",
    "Truncation": "spectrio.stages.device.stops",
    "truncate_run": "spectrio.stages.device.stops",
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

# Where each module of the flat layout went (importing an old path warns and works).
MOVED = {
    "spectrio.stages.scheduler": "spectrio.stages.planning.scheduler_actor",
    "spectrio.stages.scheduling": "spectrio.stages.planning.scheduler",
    "spectrio.stages.block_manager": "spectrio.stages.planning.block_manager",
    "spectrio.stages.spec_policy": "spectrio.stages.planning.spec_policy",
    "spectrio.stages.lifecycle": "spectrio.stages.planning.lifecycle",
    "spectrio.stages.workspace": "spectrio.stages.device.workspace",
    "spectrio.stages.overlap": "spectrio.stages.device.overlap",
    "spectrio.stages.verify": "spectrio.stages.device.verify",
    "spectrio.stages.sampling": "spectrio.stages.device.sampler",
    "spectrio.stages.sampler": "spectrio.stages.device.sampler",
    "spectrio.stages.logits_processing": "spectrio.stages.device.logits_processing",
    "spectrio.stages.rejection": "spectrio.stages.device.rejection",
    "spectrio.stages.stops": "spectrio.stages.device.stops",
    "spectrio.stages.draft": "spectrio.stages.device.draft",
    "spectrio.stages.draft.base": "spectrio.stages.device.draft.base",
    "spectrio.stages.draft.mtp": "spectrio.stages.device.draft.mtp",
    "spectrio.stages.draft.ngram": "spectrio.stages.device.draft.ngram",
    "spectrio.stages.draft.draft_model": "spectrio.stages.device.draft.draft_model",
    "spectrio.stages.publisher": "spectrio.stages.output.publisher",
    "spectrio.stages.records": "spectrio.stages.output.records",
    "spectrio.stages.output_processor": "spectrio.stages.output.output_processor",
}
moved_modules(MOVED)

if TYPE_CHECKING:
    from spectrio.stages.device.logits_processing import (
        History,
        process_rows,
        sampling_probs,
        token_logprobs,
    )
    from spectrio.stages.device.rejection import rejection_sample
    from spectrio.stages.device.sampler import Sampler
    from spectrio.stages.device.stops import StopStringMatcher, Truncation, truncate_run
    from spectrio.stages.output.records import publish_step
    from spectrio.stages.planning.block_manager import BlockManager, OutOfBlocks
    from spectrio.stages.planning.scheduler import Scheduler
    from spectrio.stages.planning.sequence import Sequence
