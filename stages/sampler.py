"""The sampler stage: the step's decision, from the verify logits (:class:`Sampler`).

Runs on the device worker, right after verify: the next step's inputs depend on what it
emits. The worker then ends the step (:meth:`.workspace.Workspace.end_step`), dropping the
state of the requests it finished."""

from __future__ import annotations

from spectrio.core.messages import StepPlan, StepResult
from spectrio.stages.sampling import Sampler
from spectrio.stages.verify import Verified
from spectrio.stages.workspace import Workspace

__all__ = ["sample"]


def sample(sampler: Sampler, ws: Workspace, plan: StepPlan, verified: Verified) -> StepResult:
    return sampler.step(plan, verified.logits, verified.prompt_logits, ws.draft_probs)
