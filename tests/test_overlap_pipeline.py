"""Overlap scheduling in the real pipeline (float64, bundled model): with two steps in
flight, greedy and seeded output equal the one-step-in-flight output for k = 0..3, under
KV pressure (preemptions), with aborts while steps are in flight and stops inside an
accepted run; every request ends exactly once and every block comes back."""

from __future__ import annotations

import pytest
import trio

from spectrio import Runtime, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.messages import PublishedStep

PROMPTS = [list(range(300 + 17 * i, 300 + 17 * i + 6 + 3 * i)) for i in range(8)]


def config(k: int, overlap: bool, blocks: int | None, method: str = "mtp") -> RuntimeConfig:
    spec = (
        SpeculativeConfig(method=None)
        if k == 0
        else SpeculativeConfig(
            method=method, num_speculative_tokens=k, adaptive=False, prompt_lookup_min=1
        )
    )
    return RuntimeConfig(
        dtype="float64",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        num_kv_blocks=blocks,
        speculative=spec,
        enable_overlap=overlap,
    )


def params(i: int) -> SamplingParams:
    if i % 2:  # seeded, with a stop token that may land inside an accepted run
        return SamplingParams(
            max_tokens=20 + i, temperature=1.0, seed=1000 + i, stop_token_ids=[11]
        )
    return SamplingParams(max_tokens=20 + i, ignore_eos=True)


async def run_all(
    rt: Runtime, abort: set[int]
) -> tuple[dict[int, list[int]], dict[str, list[str]]]:
    out: dict[int, list[int]] = {}
    ends: dict[str, list[str]] = {}

    def observe(pub: PublishedStep) -> None:
        for rid, reason in zip(pub.request_ids, pub.finish_reasons, strict=True):
            if reason is not None:
                ends.setdefault(rid, []).append(reason)

    rt.add_record_observer(observe)

    async def one(i: int) -> None:
        toks: list[int] = []
        async with rt.generate(PROMPTS[i], params(i), request_id=f"q{i}") as stream:
            async for delta in stream:
                toks += delta.token_ids
                if i in abort and len(toks) >= 3:
                    assert await rt.abort(f"q{i}")
                    n = len(toks)
                    async for late in stream:  # only the final abort delta may follow
                        assert not late.token_ids and late.finish_reason == "abort"
                    assert len(toks) == n
                    break
        out[i] = toks

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    await rt.wait_idle()
    assert rt.blocks.num_used_blocks == 0
    assert rt.workspace.num_states == 0
    return out, ends


@pytest.mark.parametrize(
    "k,method", [(0, "mtp"), (1, "mtp"), (2, "mtp"), (3, "mtp"), (1, "ngram"), (3, "ngram")]
)
async def test_overlap_on_and_off_give_the_same_tokens(
    bundled: object, k: int, method: str
) -> None:
    with trio.fail_after(300):
        runs = {}
        for overlap in (False, True):
            async with open_runtime(config(k, overlap, 26, method)) as rt:
                runs[overlap] = await run_all(rt, set())
                assert rt.scheduler.num_preemptions > 0  # KV pressure was real
        assert runs[True][0] == runs[False][0]
        for ends in (runs[True][1], runs[False][1]):
            assert all(len(v) == 1 for v in ends.values()), ends
            assert len(ends) == len(PROMPTS)


async def test_aborts_with_two_steps_in_flight(bundled: object) -> None:
    with trio.fail_after(300):
        async with open_runtime(config(2, False, None)) as rt:
            full, _ = await run_all(rt, set())
        async with open_runtime(config(2, True, None)) as rt:
            got, ends = await run_all(rt, {1, 2, 5})
        for i in range(len(PROMPTS)):
            if i in (1, 2, 5):
                assert got[i] == full[i][: len(got[i])] and len(got[i]) < len(full[i])
                assert ends[f"q{i}"] == ["abort"]
            else:
                assert got[i] == full[i]
                assert len(ends[f"q{i}"]) == 1
