"""The sampler actor: fetch the step's logits from the workspace, let :class:`Sampler` decide."""

from __future__ import annotations

import trio

from spectrio.runtime.channels import ChannelReceiver, ChannelSender
from spectrio.runtime.messages import StepPlan, StepResult
from spectrio.runtime.workspace import Workspace
from spectrio.stages.sampling import Sampler


async def run_sampler(
    ws: Workspace,
    sampler: Sampler,
    limiter: trio.CapacityLimiter,
    inbox: ChannelReceiver[StepPlan],
    outbox: ChannelSender[StepResult],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One StepResult per plan. The device copy runs behind the device limiter, the NumPy
    decision in a worker thread of its own. Cancellation waits for the running call."""
    task_status.started()
    async for plan in inbox:
        logits = await trio.to_thread.run_sync(ws.take_logits, plan.step, limiter=limiter)
        result = await trio.to_thread.run_sync(sampler.step, plan, logits)
        await outbox.send(result)
