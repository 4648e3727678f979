"""The publisher actor: delivers each step's tokens (rank 0 only) and feeds the scheduler."""

from __future__ import annotations

from collections.abc import Callable

import trio

from spectrio.runtime.channels import ChannelReceiver, ChannelSender
from spectrio.runtime.messages import StepResult


async def run_publisher(
    inbox: ChannelReceiver[StepResult],
    deliver: Callable[[StepResult], None],
    feedback: ChannelSender[StepResult],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``deliver`` must not block; it hands tokens to in-process subscribers."""
    task_status.started()
    async for result in inbox:
        deliver(result)
        await feedback.send(result)
