"""The publisher actor: packs and publishes each step (rank 0 only), feeds the scheduler."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from spectrio.core.channels import ChannelReceiver, ChannelSender
from spectrio.core.messages import PublishedStep, StepResult
from spectrio.stages.records import publish_step


async def run_publisher(
    inbox: ChannelReceiver[StepResult],
    deliver: Callable[[StepResult], None],
    publish: Callable[[PublishedStep], Awaitable[None]],
    feedback: ChannelSender[StepResult] | None,
    *,
    rank: int = 0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``deliver`` hands tokens to in-process subscribers and must not block;
    ``publish`` hands the packed step record to observers and awaits record sinks, so a
    slow sink (a wire consumer) holds the publisher and, through it, the pipeline. Only
    rank 0 delivers and publishes; every rank feeds its scheduler, unless ``feedback`` is
    None: with overlap scheduling the sampler feeds the scheduler and publishing lags
    behind the next step's compute.
    Cancellation while sending feedback drops that step's feedback (the scheduler is
    being cancelled with it)."""
    task_status.started()
    async for result in inbox:
        if rank == 0:
            deliver(result)
            await publish(publish_step(result))
        if feedback is not None:
            await feedback.send(result)
