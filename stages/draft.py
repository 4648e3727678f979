"""The draft actor: MTP catch-up and substeps, in the workspace's device thread."""

from __future__ import annotations

import trio

from spectrio.core.channels import ChannelReceiver, ChannelSender
from spectrio.core.messages import StepPlan
from spectrio.stages.workspace import Workspace


async def run_draft(
    ws: Workspace,
    limiter: trio.CapacityLimiter,
    inbox: ChannelReceiver[StepPlan],
    outbox: ChannelSender[StepPlan],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Forward every plan with its drafts filled in. Cancellation waits for the device call."""
    task_status.started()
    async for plan in inbox:
        if plan.released or any(w.mtp_token_ids for w in plan.seqs):
            plan = await trio.to_thread.run_sync(ws.draft, plan, limiter=limiter)
        await outbox.send(plan)
