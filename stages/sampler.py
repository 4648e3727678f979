"""The sampler actor: fetch the step's logits from the workspace, let :class:`Sampler` decide."""

from __future__ import annotations

import trio

from spectrio.core.channels import ChannelReceiver, ChannelSender
from spectrio.core.messages import StepPlan, StepResult
from spectrio.stages.sampling import Sampler
from spectrio.stages.workspace import Workspace


async def run_sampler(
    ws: Workspace,
    sampler: Sampler,
    limiter: trio.CapacityLimiter,
    inbox: ChannelReceiver[StepPlan],
    outbox: ChannelSender[StepResult],
    *,
    feedback: ChannelSender[StepResult] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One StepResult per plan. The logits copy and the NumPy decision share one worker
    thread hop (a hop costs ~0.1 ms, a real share of a small model's step); it holds the
    device limiter, which nothing else needs while the step's result is pending. A
    request that finishes in the step has its workspace state dropped in the same hop,
    before the result leaves: no later step can need it.
    Cancellation waits for the running call."""

    def decide(plan: StepPlan) -> StepResult:
        result = sampler.step(plan, ws.take_logits(plan.step))
        ws.release([r.seq_id for r in result.results if r.finish_reason is not None])
        return result

    task_status.started()
    async for plan in inbox:
        result = await trio.to_thread.run_sync(decide, plan, limiter=limiter)
        if feedback is not None:  # overlap: the scheduler plans the next step right away
            await feedback.send(result)
        await outbox.send(result)
