"""The sampler stage: the step's decision, from the verify logits (:class:`Sampler`).

Runs on the device worker, right after verify: the next step's inputs depend on what it
emits. A request that finishes in the step has its workspace state dropped here, before
the result leaves: no later step can need it."""

from __future__ import annotations

from spectrio.core.messages import StepPlan, StepResult
from spectrio.stages.sampling import Sampler
from spectrio.stages.verify import Verified
from spectrio.stages.workspace import Workspace

__all__ = ["sample"]


def sample(sampler: Sampler, ws: Workspace, plan: StepPlan, verified: Verified) -> StepResult:
    result = sampler.step(plan, verified.logits, verified.prompt_logits, ws.draft_probs)
    ws.release([r.seq_id for r in result.results if r.finish_reason is not None])
    return result
