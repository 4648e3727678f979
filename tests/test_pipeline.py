"""The five-stage pipeline end to end: losslessness, batching, KV pressure, aborts.

Every pipeline here runs with encoded channels (each stage message round-trips through
msgpack) unless a test says otherwise, and under ``trio.fail_after``.
"""

from __future__ import annotations

import functools
import math

import pytest
import trio
from pipeline_helpers import collect, oracle, prompts

from spectrio import (
    InvalidRequest,
    RuntimeConfig,
    SamplingParams,
    SpeculativeConfig,
    open_runtime,
)
from spectrio.stages.planning.spec_policy import SpecPolicy

MAX_TOKENS = 24


METHODS = ["mtp", "ngram"]


def spec(k: int | str | None, method: str = "mtp") -> SpeculativeConfig:
    """None: no speculation; N: a fixed N drafts; "auto": the adaptive policy up to 3.
    n-gram looks suffixes of 1 to 3 tokens up."""
    if k is None:
        return SpeculativeConfig(method=None)
    lookup = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if k == "auto":
        return SpeculativeConfig(method=method, num_speculative_tokens=3, adaptive=True, **lookup)
    return SpeculativeConfig(method=method, num_speculative_tokens=int(k), adaptive=False, **lookup)


def config(k: int | str | None, method: str = "mtp", **kw: object) -> RuntimeConfig:
    fields: dict[str, object] = {
        "dtype": "float64",
        "max_model_len": 256,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 512,
        "speculative": spec(k, method),
    }
    fields.update(kw)
    return RuntimeConfig(**fields)  # type: ignore[arg-type]


async def run_all(
    cfg: RuntimeConfig, batch: list[list[int]], max_tokens: int = MAX_TOKENS, encoded: bool = True
) -> tuple[list[list[int]], object]:
    results: list[list[int]] = [[] for _ in batch]
    with trio.fail_after(300):
        async with open_runtime(cfg, encoded_channels=encoded) as rt:

            async def one(i: int) -> None:
                results[i] = await collect(rt, batch[i], SamplingParams(max_tokens=max_tokens))

            async with trio.open_nursery() as nursery:
                for i in range(len(batch)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0
            rt.blocks.check_invariants()
            return results, rt


@pytest.mark.parametrize(
    "k,method",
    [(k, m) for m in METHODS for k in (1, 2, 3, "auto")] + [(None, None)],
    ids=[f"{m}-k{k}" for m in METHODS for k in (1, 2, 3, "auto")] + ["no-spec"],
)
async def test_greedy_output_equals_reference_in_float64(
    k: int | str | None, method: str | None, bundled64: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    if k == "auto":
        # These requests are short: time every step, and make every draft look worthless
        # (acceptance pinned near 0 by the prior), so the policy's own exploration walks k
        # down from 3 one draft at a time, each k timed beside the one before. With the
        # measured acceptance (about 0.9) a run this short may settle on k = 3 after one
        # timing of k = 2 and never try a third k.
        monkeypatch.setattr(
            "spectrio.stages.planning.scheduler.SpecPolicy",
            functools.partial(
                SpecPolicy,
                warmup_steps=0,
                acceptance_warmup=0,
                prior_acceptance=0.0,
                prior_weight=1e9,
            ),
        )
    batch = prompts(bundled64.tokenizer)  # type: ignore[attr-defined]
    assert len(batch) >= 20
    results, rt = await run_all(config(k, method or "mtp"), batch)
    for prompt, got in zip(batch, results, strict=True):
        assert got == oracle("float64", prompt, MAX_TOKENS)
    if k is None:
        assert rt.num_drafts_proposed == 0  # type: ignore[attr-defined]
    else:
        # Speculation really ran: drafts were proposed and accepted; MTP's a fair share.
        # (n-gram's share on these prompts depends on which k the timing-driven policy
        # picks, so with k = "auto" it moves with the host's load: only some must land.)
        proposed, accepted = rt.num_drafts_proposed, rt.num_drafts_accepted  # type: ignore[attr-defined]
        assert proposed > 0 and accepted > 0
        if method == "mtp" or k != "auto":
            assert accepted > 0.2 * proposed
        assert rt.workspace.proposer.method == method  # type: ignore[attr-defined]
    if k == "auto":
        # The policy really varied k: it measured steps with several draft counts.
        tried = {kk for _, kk in rt.scheduler.policy.step_times()}  # type: ignore[attr-defined]
        # n-gram drafts only where a suffix repeats, so fewer steps are timed at each k:
        # on a loaded host its walk down may not reach a third k in a run this short.
        assert len(tried) >= (3 if method == "mtp" else 2), tried


async def test_batching_invariance_32_concurrent(bundled64: object) -> None:
    base = prompts(bundled64.tokenizer)  # type: ignore[attr-defined]
    batch = [base[i % len(base)][: 3 + (7 * i) % 37] for i in range(32)]
    together, _ = await run_all(config(2), batch)
    alone = []
    with trio.fail_after(300):
        async with open_runtime(config(2), encoded_channels=True) as rt:
            for prompt in batch:
                alone.append(await collect(rt, prompt, SamplingParams(max_tokens=MAX_TOKENS)))
    assert together == alone


async def test_kv_pressure_preempts_and_loses_nothing(bundled64: object) -> None:
    batch = prompts(bundled64.tokenizer)[:12]  # type: ignore[attr-defined]
    roomy, _ = await run_all(config(2), batch)
    # 12 sequences of up to ~64 positions need ~60 blocks of 16; give them 14.
    tight, rt = await run_all(config(2, num_kv_blocks=14, max_model_len=96), batch)
    assert tight == roomy
    assert rt.scheduler.num_preemptions > 0  # type: ignore[attr-defined]


async def test_abort_and_cancellation_free_blocks(bundled64: object) -> None:
    with trio.fail_after(120):
        async with open_runtime(config(2), encoded_channels=True) as rt:
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            # 1. explicit abort mid-stream
            seen = 0
            async for delta in rt.generate("def fib(n):", long, request_id="a1"):
                seen += len(delta.token_ids)
                if seen >= 5 and not delta.finished:
                    assert await rt.abort("a1")
                if delta.finished:
                    assert delta.finish_reason == "abort"
            # 2. the consumer stops iterating
            agen = rt.generate("import os\n", long)
            async for _ in agen:
                break
            await agen.aclose()
            # 3. the consumer is cancelled
            with trio.move_on_after(0.5):
                await collect(rt, "class A:\n", long)
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0
            assert not await rt.abort("never-submitted")


async def test_bad_requests_get_their_own_errors_and_others_continue(bundled64: object) -> None:
    good = prompts(bundled64.tokenizer)[:4]  # type: ignore[attr-defined]
    errors: list[str] = []
    results: dict[int, list[int]] = {}
    with trio.fail_after(120):
        async with open_runtime(config(2), encoded_channels=True) as rt:

            async def bad(prompt: object, params: SamplingParams) -> None:
                try:
                    await collect(rt, prompt, params)  # type: ignore[arg-type]
                except InvalidRequest as exc:
                    errors.append(str(exc))

            async def ok(i: int) -> None:
                results[i] = await collect(rt, good[i], SamplingParams(max_tokens=MAX_TOKENS))

            async with trio.open_nursery() as nursery:
                for i in range(len(good)):
                    nursery.start_soon(ok, i)
                nursery.start_soon(bad, [1] * 300, SamplingParams())  # too long
                nursery.start_soon(bad, "", SamplingParams())  # empty
                nursery.start_soon(bad, [10**6], SamplingParams())  # outside the vocabulary
                nursery.start_soon(bad, "x", SamplingParams(max_tokens=0))
    assert sorted(e.split(":")[0] for e in errors) == ["max_tokens", "prompt", "prompt", "prompt"]
    for i, prompt in enumerate(good):
        assert results[i] == oracle("float64", prompt, MAX_TOKENS)


async def test_plain_channels_give_the_same_tokens(bundled64: object) -> None:
    batch = prompts(bundled64.tokenizer)[:6]  # type: ignore[attr-defined]
    encoded, _ = await run_all(config(3), batch, encoded=True)
    plain, _ = await run_all(config(3), batch, encoded=False)
    assert encoded == plain


async def test_text_streams_whole_characters(bundled: object) -> None:
    with trio.fail_after(60):
        async with open_runtime(RuntimeConfig(max_model_len=256)) as rt:
            text, ids = "", []
            async for delta in rt.generate("s = 'héllo 世界'\n", SamplingParams(max_tokens=16)):
                assert "\ufffd" not in delta.text
                text += delta.text
                ids += delta.token_ids
            assert text == rt.tokenizer.decode(ids)


async def test_shutdown_aborts_in_flight_requests(bundled: object) -> None:
    reasons: list[str | None] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            async with open_runtime(RuntimeConfig(max_model_len=256)) as rt:
                started = trio.Event()

                async def consume() -> None:
                    async for delta in rt.generate(
                        "def f():", SamplingParams(max_tokens=200, ignore_eos=True)
                    ):
                        started.set()
                        if delta.finished:
                            reasons.append(delta.abort_reason)

                nursery.start_soon(consume)
                await started.wait()
    assert reasons == ["shutdown"]
    assert math.isfinite(len(reasons))


async def test_runtime_refuses_settings_it_cannot_honour() -> None:
    from spectrio import ConfigError

    with trio.fail_after(30):
        with pytest.raises(ConfigError, match="max_model_len"):
            async with open_runtime(RuntimeConfig(max_model_len=4096)):
                pass


async def test_overlap_scheduling_gives_identical_tokens_and_publishes_every_step(
    bundled64: object,
) -> None:
    """With enable_overlap the scheduler plans step N+1 from the sampler's result while
    the publisher still delivers step N; tokens and records must not change."""
    batch = prompts(bundled64.tokenizer)[:8]  # type: ignore[attr-defined]
    plain, _ = await run_all(config(2), batch)
    published: list[int] = []
    results: list[list[int]] = [[] for _ in batch]
    with trio.fail_after(120):
        async with open_runtime(config(2, enable_overlap=True), encoded_channels=True) as rt:
            rt.add_record_observer(lambda pub: published.append(pub.step))

            async def one(i: int) -> None:
                results[i] = await collect(rt, batch[i], SamplingParams(max_tokens=MAX_TOKENS))

            async with trio.open_nursery() as nursery:
                for i in range(len(batch)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0
            assert published == list(range(1, rt.num_steps + 1))
    assert results == plain
