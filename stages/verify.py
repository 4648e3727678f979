"""The verify actor: one target pass over every sequence's rows of the step."""

from __future__ import annotations

import trio

from spectrio.core.channels import ChannelReceiver, ChannelSender
from spectrio.core.messages import StepPlan
from spectrio.stages.workspace import Workspace


async def run_verify(
    ws: Workspace,
    limiter: trio.CapacityLimiter,
    inbox: ChannelReceiver[StepPlan],
    outbox: ChannelSender[StepPlan],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Logits and hidden states stay in the workspace, keyed by step and sequence."""
    task_status.started()
    async for plan in inbox:
        await trio.to_thread.run_sync(ws.verify, plan, limiter=limiter)
        await outbox.send(plan)
