"""Issue 9, item 4: a request's device state (stored hidden rows) is dropped when the
request finishes or is aborted, not when the next step is planned (float64, real model)."""

from __future__ import annotations

import functools
import math

import trio

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.channels import open_channel
from spectrio.core.messages import AbortRequest, Control, NewRequest, StepPlan, StepResult
from spectrio.stages.block_manager import BlockManager
from spectrio.stages.sampling import Sampler
from spectrio.stages.scheduler import run_scheduler
from spectrio.stages.scheduling import Scheduler
from spectrio.stages.workspace import Workspace


def config(**kw: object) -> RuntimeConfig:
    fields: dict[str, object] = {
        "dtype": "float64",
        "max_model_len": 64,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "speculative": SpeculativeConfig(num_speculative_tokens=2, adaptive=False),
    }
    fields.update(kw)
    return RuntimeConfig(**fields)  # type: ignore[arg-type]


async def test_finished_requests_leave_no_state_before_the_next_plan(bundled64: object) -> None:
    with trio.fail_after(120):
        async with open_runtime(config(), encoded_channels=True) as rt:
            ws, sched = rt.workspace, rt.scheduler
            stale: list[list[int]] = []  # ended sequences still held when a step is planned
            schedule = sched.schedule

            def checked() -> StepPlan | None:
                # Every sequence the workspace holds state for is one the scheduler runs.
                live = {s.seq_id for s in [*sched.running, *sched.waiting]}
                held = [i for i in range(1, 64) if ws.holds(i) and i not in live]
                if held:
                    stale.append(held)
                return schedule()

            sched.schedule = checked  # type: ignore[method-assign]

            async def one(prompt: str, max_tokens: int) -> None:
                async for _ in rt.generate(
                    prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                ):
                    pass

            async with trio.open_nursery() as nursery:
                for i, n in enumerate((3, 9, 17, 30)):  # they finish in different steps
                    nursery.start_soon(one, f"def f{i}(x):", n)
            await rt.wait_idle()
            assert stale == []
            # The last request finished with no step after it: nothing is left behind.
            assert ws.num_states == 0 and rt.sampler.num_states == 0
            steps = rt.num_steps
            async for _ in rt.generate("import os", SamplingParams(max_tokens=5)):
                pass
            await rt.wait_idle()
            assert rt.num_steps > steps and ws.num_states == 0


async def test_the_scheduler_drops_an_aborted_requests_state_before_planning(
    bundled64: object,
) -> None:
    """The scheduler actor with the workspace's ``release`` hook; the device side of each
    step (draft, verify, sampler) is run here by hand, with the stages' own code."""
    cfg = config()
    model = bundled64.model  # type: ignore[attr-defined]
    ws = Workspace(model, 32, cfg.block_size)
    sched = Scheduler(cfg, BlockManager(32, cfg.block_size))
    sampler = Sampler(model.config.vocab_size)
    control_tx, control_rx = open_channel(Control, math.inf, True)
    plan_tx, plan_rx = open_channel(StepPlan, 1, True)
    feedback_tx, feedback_rx = open_channel(StepResult, 1, True)

    def device(plan: StepPlan) -> StepResult:
        plan = ws.draft(plan)
        ws.verify(plan)
        return sampler.step(plan, ws.take_logits(plan.step))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(run_scheduler, release=ws.release),
                sched,
                control_rx,
                plan_tx,
                feedback_rx,
            )
            for seq_id in (1, 2):
                control_tx.send_nowait(
                    NewRequest(
                        seq_id=seq_id,
                        request_id=f"r{seq_id}",
                        prompt_ids=list(range(40, 50)),
                        params=SamplingParams(max_tokens=20),
                        eos_token_ids=[],
                        speculative=True,
                    )
                )
            for _ in range(2):
                await feedback_tx.send(device(await plan_rx.receive()))
            # Abort r1 while a step runs: its state goes once the step is back...
            plan = await plan_rx.receive()
            result = device(plan)
            assert ws.holds(1) and ws.holds(2)
            control_tx.send_nowait(AbortRequest(seq_id=1))
            await feedback_tx.send(result)
            plan = await plan_rx.receive()
            # ... and before the scheduler plans the next step.
            assert not ws.holds(1) and ws.holds(2)
            assert plan.aborted == ["r1"] and [w.seq_id for w in plan.seqs] == [2]
            await feedback_tx.send(device(plan))
            # The last request aborted: the abort-only step leaves nothing behind.
            plan = await plan_rx.receive()
            control_tx.send_nowait(AbortRequest(seq_id=2))
            await feedback_tx.send(device(plan))
            plan = await plan_rx.receive()
            assert ws.num_states == 0 and plan.seqs == [] and plan.aborted == ["r2"]
            await feedback_tx.send(device(plan))
            control_tx.close()
    assert sched.blocks.num_used_blocks == 0
