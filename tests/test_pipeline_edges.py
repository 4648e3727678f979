"""Pipeline edge cases: the shortest prompts and the longest sequences."""

from __future__ import annotations

import trio
from pipeline_helpers import collect, oracle

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.models import LoadedModel, reference


async def test_one_token_prompt_and_max_model_len(bundled64: LoadedModel) -> None:
    cfg = RuntimeConfig(
        dtype="float64",
        max_model_len=40,
        speculative=SpeculativeConfig(num_speculative_tokens=3, adaptive=False),
    )
    with trio.fail_after(120):
        async with open_runtime(cfg, encoded_channels=True) as rt:
            got = await collect(rt, [42], SamplingParams(max_tokens=12))
            assert got == oracle("float64", [42], 12)
            # A request that runs into max_model_len stops there with reason "length".
            prompt = list(range(100, 130))
            ids, reasons = [], []
            async for delta in rt.generate(prompt, SamplingParams(max_tokens=64, ignore_eos=True)):
                ids += delta.token_ids
                reasons.append(delta.finish_reason)
            assert len(prompt) + len(ids) == 40 and reasons[-1] == "length"
            # The reference runs on a full copy: the runtime's own is serving-only.
            expected = reference.greedy_generate(bundled64.model, prompt, 10, eos_token_id=None)
            assert ids == expected.token_ids
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0


async def test_abort_of_the_only_request_is_published(bundled64: object) -> None:
    from spectrio.core.record import unpack

    cfg = RuntimeConfig(dtype="float64", max_model_len=128)
    marks: list[tuple[list[str], list[int]]] = []
    with trio.fail_after(60):
        async with open_runtime(cfg, encoded_channels=True) as rt:
            rt.add_record_observer(
                lambda pub: marks.append((pub.request_ids, unpack(pub.record).accept_num.tolist()))
            )
            async for delta in rt.generate(
                "def f():", SamplingParams(max_tokens=100, ignore_eos=True), request_id="only"
            ):
                if not delta.finished:
                    await rt.abort("only")
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0 and rt.sampler.num_states == 0
    assert (["only"], [-9]) in marks
