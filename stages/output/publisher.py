"""The publisher actor: delivers and packs each step's results (rank 0 only)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from spectrio.core.channels import ChannelReceiver
from spectrio.core.messages import PublishedStep, StepResult
from spectrio.stages.output.records import publish_step


async def run_publisher(
    inbox: ChannelReceiver[StepResult],
    deliver: Callable[[StepResult], None],
    publish: Callable[[PublishedStep], Awaitable[None]],
    *,
    prepare: Callable[[StepResult], StepResult] = lambda result: result,
    rank: int = 0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Ends when ``inbox`` ends. ``deliver`` hands tokens to in-process subscribers and
    must not block; ``publish`` hands the packed step record to observers and awaits
    record sinks, so a slow sink holds the publisher and, through its bounded inbox, the
    scheduler (the wire server's sink never waits; the runtime's watchdog logs one that
    does). Only rank 0 delivers
    and publishes. ``prepare`` (the scheduler's ``published``) drops requests aborted
    while the step waited in the inbox."""
    task_status.started()
    async for result in inbox:
        result = prepare(result)
        if rank == 0:
            deliver(result)
            await publish(publish_step(result))
