"""The sampler actor: greedy acceptance and exact stops for every sampling sequence."""

from __future__ import annotations

import trio

from spectrio.runtime.channels import ChannelReceiver, ChannelSender
from spectrio.runtime.messages import SeqResult, StepPlan, StepResult
from spectrio.runtime.workspace import Workspace
from spectrio.stages.acceptance import greedy_accept, truncate_at_stop


def decide(plan: StepPlan, target_argmax: dict[int, list[int]]) -> StepResult:
    results = []
    for w in plan.seqs:
        accepted, tokens, reason = 0, [], None
        if w.sample:
            accepted, emitted = greedy_accept(w.drafts, target_argmax[w.slot])
            tokens, reason = truncate_at_stop(emitted, w.eos_token_ids, w.max_new_tokens)
        results.append(
            SeqResult(
                slot=w.slot,
                seq_id=w.seq_id,
                request_id=w.request_id,
                num_drafts=len(w.drafts) if w.sample else 0,
                num_accepted=accepted,
                token_ids=tokens,
                finish_reason=reason,
            )
        )
    return StepResult(step=plan.step, results=results, preempted=plan.preempted)


async def run_sampler(
    ws: Workspace,
    limiter: trio.CapacityLimiter,
    inbox: ChannelReceiver[StepPlan],
    outbox: ChannelSender[StepResult],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    task_status.started()
    async for plan in inbox:
        argmax = await trio.to_thread.run_sync(ws.target_argmax, plan.step, limiter=limiter)
        await outbox.send(decide(plan, argmax))
