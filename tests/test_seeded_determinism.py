"""Issue 9, items 1 and 3: a seeded request's output is a function of (model, prompt,
sampling params, seed) only: not of its neighbours, admission order, chunking or
preemption; and its logprob alternatives do not depend on the batch either.

Every scenario runs the real five-stage pipeline in float64 and compares the seeded
request's tokens with the same request run alone. Each scenario also checks, from the
plans the scheduler really made, that it exercised what it claims (a one-token last
prefill chunk, a preemption, the admission order)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio
import trio.testing

from spectrio import Runtime, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.messages import StepPlan, TokenLogprob

BUDGET = 16  # max_num_batched_tokens: max_num_seqs * (k + 1) for k = 3
SEEDED_PROMPT = list(range(300, 311))  # 11 tokens: fits one step alone
NEIGHBOUR_PROMPT = list(range(500, 522))  # 22 tokens: 16 in step 1, 6 beside the seeded one
LONG_PROMPT = list(range(700, 722))
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, seed=20240613, ignore_eos=True)
NEIGHBOUR = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True)


def config(k: int | str, method: str = "mtp", **kw: object) -> RuntimeConfig:
    """k = 0: no speculation; N: a fixed N drafts; "auto": the adaptive policy up to 3."""
    lookup = {"prompt_lookup_min": 1}  # n-gram: a repeated token is enough to draft
    if k == "auto":
        spec = SpeculativeConfig(method=method, num_speculative_tokens=3, adaptive=True, **lookup)
    elif k == 0:
        spec = SpeculativeConfig(method=None)
    else:
        spec = SpeculativeConfig(
            method=method, num_speculative_tokens=int(k), adaptive=False, **lookup
        )
    fields: dict[str, object] = {
        "dtype": "float64",
        "max_model_len": 64,
        "max_num_seqs": 4,
        "max_num_batched_tokens": BUDGET,
        "block_size": 4,
        "speculative": spec,
    }
    fields.update(kw)
    return RuntimeConfig(**fields)  # type: ignore[arg-type]


def spy_plans(rt: Runtime) -> list[StepPlan]:
    """Every plan the scheduler makes from now on (the real method runs unchanged)."""
    plans: list[StepPlan] = []
    schedule = rt.scheduler.schedule

    def recording() -> StepPlan | None:
        plan = schedule()
        if plan is not None:
            plans.append(plan)
        return plan

    rt.scheduler.schedule = recording  # type: ignore[method-assign]
    return plans


def spy_preempted(rt: Runtime) -> list[str]:
    """Request ids each plan from now on reports preempted (its endings stay with the
    scheduler until the step is folded in: :meth:`Scheduler.reported`)."""
    preempted: list[str] = []
    schedule = rt.scheduler.schedule

    def recording() -> StepPlan | None:
        plan = schedule()
        if plan is not None:
            reported = rt.scheduler.reported(plan.step)
            preempted.extend(e.request_id for e in reported if e.why == "preempted")
        return plan

    rt.scheduler.schedule = recording  # type: ignore[method-assign]
    return preempted


async def run_in_order(
    rt: Runtime, requests: Sequence[tuple[str, list[int], SamplingParams]]
) -> dict[str, list[int]]:
    """Submit requests one after the other: each reaches the scheduler only once the
    previous one has been planned into a step (every task blocked: a step is in flight)."""
    out: dict[str, list[int]] = {}

    async def one(rid: str, prompt: list[int], params: SamplingParams) -> None:
        toks: list[int] = []
        async for delta in rt.generate(prompt, params, request_id=rid):
            toks.extend(delta.token_ids)
        out[rid] = toks

    async with trio.open_nursery() as nursery:
        for rid, prompt, params in requests:
            nursery.start_soon(one, rid, prompt, params)
            await trio.testing.wait_all_tasks_blocked()
    await rt.wait_idle()
    assert rt.blocks.num_used_blocks == 0
    return out


def chunks_of(plans: list[StepPlan], rid: str) -> list[tuple[int, int, bool, int]]:
    """(step, rows, sample, drafts) of every step that ran ``rid``."""
    return [
        (p.step, len(w.token_ids), w.sample, w.num_drafts)
        for p in plans
        for w in p.seqs
        if w.request_id == rid
    ]


@pytest.mark.parametrize("method", ["mtp", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 3])
async def test_seeded_output_is_independent_of_the_batch(k: int, method: str) -> None:
    with trio.fail_after(300):
        # The cases place chunk boundaries by prompt length in one runtime: with the
        # prefix cache, the repeated prompt would start past them (its output is the same:
        # tests/test_prefix_cache.py).
        cfg = config(k, method, enable_prefix_caching=False)
        async with open_runtime(cfg, encoded_channels=True) as rt:
            plans = spy_plans(rt)
            alone = (await run_in_order(rt, [("alone", SEEDED_PROMPT, SEEDED)]))["alone"]
            assert len(alone) == 24
            # (b) Admitted second, beside a request whose prefill leaves it 10 of the 16
            # budget tokens: its 11-token prompt ends in a one-token chunk.
            start = len(plans)
            got = await run_in_order(
                rt, [("n-b", NEIGHBOUR_PROMPT, NEIGHBOUR), ("s-b", SEEDED_PROMPT, SEEDED)]
            )
            assert got["s-b"] == alone
            prefill = chunks_of(plans[start:], "s-b")
            assert [rows for _, rows, _, _ in prefill[:2]] == [10, 1] and prefill[1][2]
            # (d) The same pair, the seeded request admitted first.
            start = len(plans)
            got = await run_in_order(
                rt, [("s-d", SEEDED_PROMPT, SEEDED), ("n-d", NEIGHBOUR_PROMPT, NEIGHBOUR)]
            )
            assert got["s-d"] == alone
            assert chunks_of(plans[start:], "s-d")[0][0] < chunks_of(plans[start:], "n-d")[0][0]
            assert chunks_of(plans[start:], "s-d")[0][1] == len(SEEDED_PROMPT)
    # (c) Beside a long request in a KV pool that cannot hold both: the seeded request,
    # admitted last, is preempted and recomputed.
    with trio.fail_after(300):
        async with open_runtime(config(k, method, num_kv_blocks=20), encoded_channels=True) as rt:
            preempted = spy_preempted(rt)
            got = await run_in_order(
                rt, [("long", LONG_PROMPT, LONG), ("s-c", SEEDED_PROMPT, SEEDED)]
            )
            assert got["s-c"] == alone
            assert rt.scheduler.num_preemptions >= 1
            assert "s-c" in preempted


async def test_seeded_output_is_independent_of_speculation_and_overlap() -> None:
    """MTP drafts are one-hot, so every emitted token is the keyed sample of the target at
    its position: the draft count k (0 = no speculation, "auto" = a count the adaptive
    policy varies from step to step) and overlap scheduling change nothing either. A
    greedy and a penalised, top-p request ride along."""
    requests = [
        ("seeded", SEEDED_PROMPT, SEEDED),
        ("greedy", NEIGHBOUR_PROMPT, SamplingParams(max_tokens=20, ignore_eos=True)),
        (
            "knobs",
            LONG_PROMPT,
            SamplingParams(
                max_tokens=20,
                temperature=0.8,
                top_p=0.9,
                repetition_penalty=1.2,
                seed=5,
                ignore_eos=True,
            ),
        ),
    ]
    outputs = []
    runs: list[tuple[int | str, bool, str]] = [
        (0, False, "mtp"),
        (1, False, "mtp"),
        (2, True, "mtp"),
        (3, False, "mtp"),
        (3, True, "mtp"),
        ("auto", False, "mtp"),
        (2, True, "ngram"),
        (3, False, "ngram"),
        ("auto", False, "ngram"),
    ]
    for k, overlap, method in runs:
        with trio.fail_after(120):
            async with open_runtime(
                config(k, method, enable_overlap=overlap), encoded_channels=True
            ) as rt:
                outputs.append(await run_in_order(rt, requests))
    assert all(out == outputs[0] for out in outputs[1:])


async def test_logprobs_do_not_depend_on_the_batch() -> None:
    """Issue 9, item 3, end to end: a request's top-N alternatives (here mostly -inf ties,
    top_k=3 in processed mode) are the same alone and beside requests asking for 20.
    Values agree to rounding (a batched forward pass rounds differently in the last bits)."""
    params = SamplingParams(
        max_tokens=16,
        temperature=0.7,
        top_k=3,
        seed=3,
        logprobs=5,
        logprobs_mode="processed",
        ignore_eos=True,
    )
    wide = SamplingParams(max_tokens=16, logprobs=20, ignore_eos=True)

    async def logprobs(
        rt: Runtime, requests: list[tuple[str, list[int], SamplingParams]]
    ) -> list[TokenLogprob]:
        got: list[TokenLogprob] = []

        async def one(rid: str, prompt: list[int], p: SamplingParams) -> None:
            async for delta in rt.generate(prompt, p, request_id=rid):
                if rid == "s":
                    got.extend(delta.logprobs or [])

        async with trio.open_nursery() as nursery:
            for request in requests:
                nursery.start_soon(one, *request)
                await trio.testing.wait_all_tasks_blocked()
        await rt.wait_idle()
        return got

    with trio.fail_after(120):
        async with open_runtime(config(2), encoded_channels=True) as rt:
            alone = await logprobs(rt, [("s", SEEDED_PROMPT, params)])
            batched = await logprobs(
                rt,
                [
                    ("n", NEIGHBOUR_PROMPT, wide),
                    ("s", SEEDED_PROMPT, params),
                    ("m", LONG_PROMPT, wide),
                ],
            )
    assert len(alone) == len(batched) == 16
    for a, b in zip(alone, batched, strict=True):
        assert (a.token_id, a.rank) == (b.token_id, b.rank)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-9)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-9)
    assert any(v == float("-inf") for e in alone for _, v in e.top)
