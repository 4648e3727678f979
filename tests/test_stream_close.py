"""Issue 9 item 12 (fifth bullet): stopping a stream is prompt and obvious.

``rt.generate`` returns a :class:`RequestStream`. Leaving its ``async with`` block after
``break``, or ``await stream.aclose()`` on a stream held in a variable, or dropping it,
aborts the request at once: the next published step carries its abort, and its KV
blocks are back in the pool as soon as the pipeline is idle.
"""

from __future__ import annotations

import gc

import trio

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.messages import SeqResult, StepResult
from spectrio.runtime import PublishedStep, RequestStream, Runtime

LONG = SamplingParams(max_tokens=200, ignore_eos=True)
# Steps published between the close and the step that carries the abort. The consumer wakes
# when step N is delivered; by then the scheduler may have folded in N+1 (waiting in the
# publisher's one-step inbox) and planned N+2, so the abort rides on N+3 at the latest
# (one more with overlap). A stream left running would go on for ~100 more steps.
MAX_STEPS_AFTER_CLOSE = 3


class Ends:
    """Records, per request, the pipeline step that published its finish reason."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.step_of: dict[str, int] = {}
        self.reason_of: dict[str, str] = {}
        rt.add_record_observer(self)

    def __call__(self, published: PublishedStep) -> None:
        for rid, reason in zip(published.request_ids, published.finish_reasons, strict=True):
            if reason is not None:
                self.step_of[rid] = self.rt.num_steps
                self.reason_of[rid] = reason

    async def check_aborted_promptly(self, rid: str, closed_at: int) -> None:
        with trio.fail_after(30):
            await self.rt.wait_idle()
        assert rid in self.step_of
        assert self.reason_of[rid] == "abort"
        late = self.step_of[rid] - closed_at
        assert late <= MAX_STEPS_AFTER_CLOSE, (self.step_of[rid], closed_at)
        assert self.rt.blocks.num_used_blocks == 0


async def test_break_out_of_async_with_aborts_at_once(bundled: object) -> None:
    cfg = RuntimeConfig(max_model_len=256, speculative=SpeculativeConfig(num_speculative_tokens=2))
    with trio.fail_after(120):
        async with open_runtime(cfg) as rt:
            ends = Ends(rt)
            # The documented way: the block's exit aborts the request.
            async with rt.generate("def fib(n):", LONG, request_id="with") as stream:
                assert isinstance(stream, RequestStream) and stream.request_id == "with"
                async for delta in stream:
                    if delta.token_ids:
                        break
                assert not stream.finished
                held = stream  # still referenced after the block: must not matter
            closed_at = rt.num_steps
            assert held.finished
            await ends.check_aborted_promptly("with", closed_at)
            assert [d async for d in held] == []  # a closed stream yields nothing more

            # A stream held in a variable, closed with aclose().
            stream = rt.generate("import os\n", LONG, request_id="aclose")
            async for delta in stream:
                if delta.token_ids:
                    break
            await stream.aclose()
            await ends.check_aborted_promptly("aclose", rt.num_steps)

            # A stream dropped unfinished: the finaliser aborts it.
            stream = rt.generate("class A:\n", LONG, request_id="dropped")
            async for delta in stream:
                if delta.token_ids:
                    break
            del stream
            gc.collect()
            await ends.check_aborted_promptly("dropped", rt.num_steps)

            # A held stream that is neither closed nor dropped keeps running: the hazard
            # the documented way avoids (and the id is not reusable meanwhile).
            stream = rt.generate(
                "x = 1\n", SamplingParams(max_tokens=12, ignore_eos=True), request_id="held"
            )
            async for _ in stream:
                break
            await rt.wait_idle()
            assert ends.reason_of["held"] == "length"
            await stream.aclose()


async def test_stream_errors_are_raised_by_generate_itself(bundled: object) -> None:
    """A web app learns of a bad request when it calls generate(), before it has sent
    anything to its own client (issue 15, item 11)."""
    with trio.fail_after(120):
        async with open_runtime(RuntimeConfig(max_model_len=256)) as rt:
            from spectrio import InvalidRequest

            for bad, field in (([1, 2.0], "prompt"), (None, "prompt"), ({"a": 1}, "prompt")):
                try:
                    rt.generate(bad, SamplingParams())  # type: ignore[arg-type]
                    raise AssertionError(f"generate accepted {bad!r}")
                except InvalidRequest as exc:
                    assert exc.field == field
            try:
                rt.generate("x", SamplingParams(max_tokens=0))
                raise AssertionError("generate accepted max_tokens=0")
            except InvalidRequest as exc:
                assert exc.field == "max_tokens"
            async with rt.generate("def f():", SamplingParams(max_tokens=4)) as ok:
                rid = ok.request_id
                assert rid is not None
                try:
                    rt.generate("y", SamplingParams(), request_id=rid)
                    raise AssertionError("a running request id was reused")
                except InvalidRequest as exc:
                    assert exc.field == "request_id"
                assert sum([len(d.token_ids) async for d in ok]) == 4
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0


async def test_a_reused_request_id_gets_only_its_own_tokens(bundled: object) -> None:
    """A stream closed mid-request frees its id at once, while steps of its request may
    still be on their way to the publisher. A result reaches a stream only when its
    sequence id is the stream's, so the request the id names next never gets the closed
    one's tokens (the step is handed to delivery directly, as the publisher would)."""
    with trio.fail_after(120):
        async with open_runtime(RuntimeConfig(max_model_len=256)) as rt:
            greedy = SamplingParams(max_tokens=6, ignore_eos=True)
            first = rt.generate("def fib(n):", LONG, request_id="x")
            await first.__anext__()
            closed = rt._requests["x"].seq_id
            await first.aclose()
            again = rt.generate("import os", greedy, request_id="x")
            late = SeqResult(
                slot=0, seq_id=closed, request_id="x", num_drafts=0, num_accepted=0,
                token_ids=[1, 2, 3], finish_reason="length",
            )  # fmt: skip
            rt._deliver(StepResult(step=10**6, results=[late]))
            got: list[int] = []
            async for delta in again:
                got += delta.token_ids
            assert len(got) == 6 and got[:3] != [1, 2, 3]
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0 and not rt._requests
