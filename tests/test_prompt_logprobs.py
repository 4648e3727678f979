"""Prompt logprobs (``SamplingParams.prompt_logprobs``), end to end: the pure reduction and
planning rules, the real pipeline (float64, bundled model) against a dense float64
forward's log-softmax with speculation off, MTP and n-gram, chunked prefill, overlap, the
prefix cache and preemption; the ZeroMQ wire with real sockets; and the HTTP completions
endpoint's ``echo`` with ``logprobs`` (``max_tokens`` 1 as lm-evaluation-harness sends it,
and 0), through httpx. Every pipeline test runs under ``trio.fail_after``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import paddle
import pytest
import trio
import zmq
from scheduler_helpers import seq_result

from spectrio import InvalidRequest, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.messages import (
    NewRequest,
    PublishedStep,
    SeqResult,
    StepPlan,
    StepResult,
    TokenLogprob,
)
from spectrio.http_api.front import HttpFront
from spectrio.http_api.server import serve_http
from spectrio.models import LoadedModel
from spectrio.runtime.api import Runtime
from spectrio.stages.device.logits_processing import log_softmax, prompt_logprobs, token_logprobs
from spectrio.stages.planning.block_manager import BlockManager
from spectrio.stages.planning.scheduler import Scheduler
from spectrio.stages.planning.scheduler import Sequence as SchedSeq
from spectrio.wire.async_client import open_client
from spectrio.wire.server import WireServer, default_endpoints, serve

TIMEOUT = 240
TOP = 4
TEXT = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n\n    def pop(self):\n"
    "        return self.items.pop()\n"
)


def reference(model: object, ids: Sequence[int]) -> np.ndarray:
    """float64 [P, V]: the dense forward's log-softmax; row i scores prompt token i + 1."""
    with paddle.no_grad():
        logits, _, _ = model.forward_dense(paddle.to_tensor(np.asarray([list(ids)])))  # type: ignore[attr-defined]
    return log_softmax(logits.numpy()[0].astype(np.float64))


def check_against(
    ref: np.ndarray, ids: Sequence[int], got: Sequence[TokenLogprob], top: int
) -> None:
    """``got`` scores prompt tokens 1 .. P-1 as the dense forward does (float64: exact up
    to rounding), with the same top alternatives."""
    assert [e.token_id for e in got] == list(ids[1:])
    want = token_logprobs(ref[: len(ids) - 1], ids[1:], top)
    np.testing.assert_allclose([e.logprob for e in got], want.token_logprobs, rtol=0, atol=1e-9)
    assert [e.rank for e in got] == want.ranks.tolist()
    assert [[t for t, _ in e.top] for e in got] == want.top_ids.tolist()
    for e, row in zip(got, want.top_logprobs.tolist(), strict=True):
        np.testing.assert_allclose([v for _, v in e.top], row, rtol=0, atol=1e-9)


def config(k: int | None = 2, method: str = "mtp", **kw: object) -> RuntimeConfig:
    spec = (
        SpeculativeConfig(method=None)
        if k is None
        else SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=False)  # type: ignore[arg-type]
    )
    fields: dict[str, object] = {
        "dtype": "float64",
        "max_model_len": 256,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 512,
        "speculative": spec,
    }
    fields.update(kw)
    return RuntimeConfig(**fields)  # type: ignore[arg-type]


# ---- pure: the reduction and the planning rule ------------------------------------------------


def test_the_reduction_is_the_sampled_tokens_log_softmax_whatever_the_block() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(11, 50)).astype(np.float32)
    logits[4, :] = 0.0  # ties: broken by the lower id
    ids = rng.integers(0, 50, size=11).tolist()
    want = token_logprobs(log_softmax(logits), ids, 3)
    for block in (1, 4, 64):
        got = prompt_logprobs(logits, ids, 3, block_rows=block)
        assert [e.logprob for e in got] == want.token_logprobs.tolist()
        assert [e.rank for e in got] == want.ranks.tolist()
        assert [[t for t, _ in e.top] for e in got] == want.top_ids.tolist()
    assert [e.top for e in prompt_logprobs(logits, ids, 0)] == [[]] * 11
    with pytest.raises(ValueError, match="logit rows"):
        prompt_logprobs(logits, ids[:3], 1)


def _scheduler(chunk: int, *, caching: bool = False) -> Scheduler:
    cfg = RuntimeConfig(
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=chunk,
        num_kv_blocks=32,
        enable_prefix_caching=caching,
        speculative=SpeculativeConfig(method=None),
    )
    return Scheduler(cfg, BlockManager(32, cfg.block_size, enable_caching=caching))


def _add(sched: Scheduler, seq_id: int, prompt: list[int], top: int | None) -> SchedSeq:
    msg = NewRequest(
        seq_id=seq_id, request_id=f"r{seq_id}", prompt_ids=prompt,
        params=SamplingParams(max_tokens=4, prompt_logprobs=top), eos_token_ids=[],
        speculative=False,
    )  # fmt: skip
    seq = SchedSeq(msg)
    sched.add(seq)
    return seq


def test_chunks_score_every_prompt_row_once_through_preemption() -> None:
    """Chunked prefill plans prompt rows 0 .. P-2 for scoring exactly once, each against
    the next prompt token; a recompute after preemption (even of a chunk already planned)
    scores nothing again."""
    sched = _scheduler(8)
    prompt = list(range(100, 121))  # 21 tokens: rows 0..19 score tokens 1..20
    seq = _add(sched, 1, prompt, TOP)
    scored: dict[int, int] = {}
    plan = sched.schedule()
    assert plan is not None
    (w,) = plan.seqs
    assert (w.start_pos, w.score_start, w.score_ids) == (0, 0, prompt[1:9])
    scored.update(enumerate(w.score_ids, start=w.score_start))
    sched._preempt(seq)  # the planned chunk's result is still published: nothing is lost
    sched.update(_result(plan, [seq_result(w, 0, [])]))
    while True:
        plan = sched.schedule()
        assert plan is not None
        (w,) = plan.seqs
        for i, tok in enumerate(w.score_ids):
            assert w.score_start + i not in scored
            scored[w.score_start + i] = tok
        done = w.sample
        sched.update(_result(plan, [seq_result(w, 0, [7] if done else [])]))
        if done:
            break
    assert scored == {p: prompt[p + 1] for p in range(len(prompt) - 1)}


def _result(plan: StepPlan, results: list[SeqResult]) -> StepResult:
    return StepResult(step=plan.step, results=results)


def test_a_request_that_scores_its_prompt_takes_no_prefix_hit_on_rows_it_must_score() -> None:
    sched = _scheduler(64, caching=True)
    prompt = list(range(200, 240))  # 40 tokens: two full blocks of 16
    _add(sched, 1, prompt, None)
    plan = sched.schedule()
    assert plan is not None
    (w,) = plan.seqs
    sched.update(_result(plan, [seq_result(w, 0, [5], "length")]))
    _add(sched, 2, prompt, None)  # the same prompt without scoring: a hit of 32 positions
    plan = sched.schedule()
    assert plan is not None and plan.seqs[0].start_pos == 32
    sched.update(_result(plan, [seq_result(plan.seqs[0], 0, [5], "length")]))
    _add(sched, 3, prompt, 0)  # with prompt_logprobs: computed from position 0
    plan = sched.schedule()
    assert plan is not None
    (w,) = plan.seqs
    assert (w.start_pos, w.score_start, w.score_ids) == (0, 0, prompt[1:])


def test_http_mapping_of_echo() -> None:
    """``echo`` asks for the prompt's logprobs with the same width as ``logprobs``;
    ``max_tokens`` 0 with echo runs one token, which the response drops."""
    from spectrio.http_api.mapping import check_completion, echo_only, sampling_params
    from spectrio.http_api.schema import CompletionRequest

    def params(**fields: object) -> SamplingParams:
        req = CompletionRequest(prompt="x", **fields)  # type: ignore[arg-type]
        check_completion(req)
        return sampling_params(req, vocab_size=100, default_max_tokens=16, logprobs=req.logprobs)

    assert params(echo=True, logprobs=3).prompt_logprobs == 3
    assert params(echo=True).prompt_logprobs is None
    assert params(logprobs=3).prompt_logprobs is None
    got = params(echo=True, logprobs=0, max_tokens=0)
    assert (got.max_tokens, got.prompt_logprobs, got.logprobs) == (1, 0, 0)
    assert echo_only(CompletionRequest(prompt="x", echo=True, max_tokens=0))
    assert not echo_only(CompletionRequest(prompt="x", echo=True))


# ---- the pipeline -------------------------------------------------------------------------------


async def run(
    cfg: RuntimeConfig,
    loaded: LoadedModel,
    requests: Sequence[tuple[Sequence[int], SamplingParams]],
    records: list[PublishedStep] | None = None,
) -> tuple[list[list[TokenLogprob] | None], list[list[int]], Runtime]:
    """Run the requests concurrently; each one's prompt logprobs (from its first delta:
    later deltas must carry none) and tokens."""
    plps: list[list[TokenLogprob] | None] = [None] * len(requests)
    tokens: list[list[int]] = [[] for _ in requests]
    with trio.fail_after(TIMEOUT):
        async with open_runtime(cfg, loaded=loaded, encoded_channels=True) as rt:
            if records is not None:
                rt.add_record_observer(records.append)

            async def one(i: int) -> None:
                prompt, params = requests[i]
                first = True
                async for d in rt.generate(list(prompt), params, request_id=f"q{i}"):
                    if first:
                        plps[i] = d.prompt_logprobs
                    else:
                        assert d.prompt_logprobs is None
                    first = False
                    tokens[i] += d.token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(requests)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0
    return plps, tokens, rt


@pytest.fixture(scope="module")
def prompt_ids(bundled64: LoadedModel) -> list[int]:
    assert bundled64.tokenizer is not None
    return bundled64.tokenizer.encode(TEXT)


@pytest.mark.parametrize(
    ("name", "cfg"),
    [
        ("no speculation", config(None)),
        ("mtp, 16-token chunks", config(2, max_num_batched_tokens=16)),
        (
            "ngram, 12-token chunks, overlap",
            config(2, "ngram", max_num_batched_tokens=12, enable_overlap=True),
        ),  # fmt: skip
        ("mtp, overlap", config(3, enable_overlap=True)),
    ],
)
async def test_prompt_logprobs_equal_the_dense_forward(
    name: str, cfg: RuntimeConfig, bundled64: LoadedModel, prompt_ids: list[int]
) -> None:
    ref = reference(bundled64.model, prompt_ids)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    plps, tokens, _ = await run(
        cfg,
        bundled64,
        [
            (prompt_ids, SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=TOP)),
            (prompt_ids[:9], SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=0)),
            (prompt_ids[:1], SamplingParams(max_tokens=3, prompt_logprobs=2)),
            (prompt_ids, greedy),
        ],
    )
    check_against(ref, prompt_ids, plps[0] or [], TOP)
    check_against(ref, prompt_ids[:9], plps[1] or [], 0)
    assert plps[2] == []  # one prompt token: nothing scores it
    assert plps[3] is None  # not asked for
    assert tokens[0] == tokens[3]  # scoring the prompt changes no output


async def test_the_prefix_cache_never_loses_prompt_logprobs(
    bundled64: LoadedModel, prompt_ids: list[int]
) -> None:
    """A prompt cached by an earlier request is still scored whole (its KV is computed
    again), and a later request without prompt_logprobs hits the cache as before."""
    ref = reference(bundled64.model, prompt_ids)
    cfg = config(2)
    with trio.fail_after(TIMEOUT):
        async with open_runtime(cfg, loaded=bundled64) as rt:
            warm = SamplingParams(max_tokens=2)
            deltas = [d async for d in rt.generate(prompt_ids, warm)]
            scored = [
                d
                async for d in rt.generate(
                    prompt_ids, SamplingParams(max_tokens=2, prompt_logprobs=TOP)
                )
            ]
            again = [d async for d in rt.generate(prompt_ids, warm)]
    assert deltas[-1].cached_tokens == 0
    check_against(ref, prompt_ids, scored[0].prompt_logprobs or [], TOP)
    assert scored[-1].cached_tokens == 0
    assert (again[-1].cached_tokens or 0) >= 16


async def test_preemption_neither_repeats_nor_loses_prompt_logprobs(
    bundled64: LoadedModel, prompt_ids: list[int]
) -> None:
    """Under KV pressure requests are preempted and recomputed; each request's prompt
    logprobs are published exactly once in all (the records of every step add up to
    P - 1 entries per request) and equal the dense forward's."""
    ref = reference(bundled64.model, prompt_ids)
    cfg = config(2, num_kv_blocks=14, max_model_len=96, max_num_batched_tokens=16)
    records: list[PublishedStep] = []
    params = SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    reqs = [(prompt_ids[: 20 + 3 * i], params) for i in range(5)]
    plps, _, rt = await run(cfg, bundled64, reqs, records)
    assert rt.stats().num_preemptions > 0
    for i, (ids, _) in enumerate(reqs):
        published = [e for r in records for e in r.prompt_logprobs.get(f"q{i}", [])]
        assert [e.token_id for e in published] == list(ids[1:])
        check_against(ref, ids, plps[i] or [], 1)


async def test_bad_prompt_logprobs_are_refused_as_logprobs_are(bundled: LoadedModel) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(max_model_len=128), loaded=bundled) as rt:
            for bad in (21, -1, 2.0, True, "3"):
                with pytest.raises(InvalidRequest) as info:
                    rt.generate("def f():", SamplingParams(prompt_logprobs=bad))  # type: ignore[arg-type]
                assert info.value.field == "prompt_logprobs", bad
                assert str(info.value).startswith(
                    "prompt_logprobs: must be None or an int in [0, 20], got"
                )


# ---- the wire -----------------------------------------------------------------------------------


async def test_prompt_logprobs_over_the_wire(
    bundled64: LoadedModel, prompt_ids: list[int], tmp_path: Path
) -> None:
    """Real ZeroMQ sockets: the chunks' prompt logprobs (gathered from each step's
    envelope) are the embedding API's; a request without them sends no key."""
    cfg = config(2, max_num_batched_tokens=16)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with trio.fail_after(TIMEOUT):
            async with open_runtime(cfg, loaded=bundled64) as rt:
                want = [
                    d
                    async for d in rt.generate(
                        prompt_ids, SamplingParams(max_tokens=4, prompt_logprobs=TOP)
                    )
                ][0].prompt_logprobs
                eps = default_endpoints(tmp_path / "run")
                async with trio.open_nursery() as nursery:
                    server = await nursery.start(
                        lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
                            rt, eps.requests, eps.outputs, context=ctx, task_status=task_status
                        )
                    )
                    assert isinstance(server, WireServer) and server.endpoints is not None
                    async with open_client(server.endpoints.requests, context=ctx) as client:
                        a = await client.submit(
                            prompt_ids, SamplingParams(max_tokens=4, prompt_logprobs=TOP)
                        )
                        b = await client.submit(prompt_ids, SamplingParams(max_tokens=4))
                        out = await client.collect([a, b])
                    nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
    assert out[a][0].prompt_logprobs == want
    assert all(c.prompt_logprobs is None for c in out[a][1:])
    assert all(c.prompt_logprobs is None for c in out[b])
    assert [t for c in out[a] for t in c.token_ids] == [t for c in out[b] for t in c.token_ids]


# ---- HTTP ---------------------------------------------------------------------------------------


@asynccontextmanager
async def http_client(rt: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    front = HttpFront(rt, model_name="bundled")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, front, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            yield client
        front.stop()


def sse(body: str) -> list[dict[str, object]]:
    events = [b.removeprefix("data: ") for b in body.split("\n\n") if b]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_http_echo_with_logprobs_scores_the_prompt(
    bundled64: LoadedModel, prompt_ids: list[int]
) -> None:
    """lm-evaluation-harness's loglikelihood request (token ids, ``echo``, ``logprobs``
    1, ``max_tokens`` 1, temperature 0): the prompt's tokens come first, the first with a
    null logprob, then the one generated token. ``max_tokens`` 0 returns the scored
    prompt alone; streaming sends the echoed prompt, with its logprobs, first."""
    ref = reference(bundled64.model, prompt_ids)
    lm_eval = {"prompt": [prompt_ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}  # fmt: skip
    strings = None
    with trio.fail_after(TIMEOUT):
        async with open_runtime(config(2), loaded=bundled64) as rt, http_client(rt) as client:
            from spectrio.http_api.logprobs import TokenStrings

            strings = TokenStrings(rt.tokenizer)
            r = await client.post("/v1/completions", json=lm_eval)
            assert r.status_code == 200, r.text
            one = r.json()
            r = await client.post("/v1/completions", json={**lm_eval, "max_tokens": 0})
            assert r.status_code == 200, r.text
            zero = r.json()
            r = await client.post(
                "/v1/completions", json={**lm_eval, "prompt": TEXT, "max_tokens": 0, "stream": True}
            )
            assert r.status_code == 200, r.text
            streamed = sse(r.text)
            r = await client.post(
                "/v1/completions", json={"prompt": TEXT, "max_tokens": 0, "echo": True}
            )
            assert r.status_code == 200, r.text
            plain = r.json()
            refusals = {}
            for field, body in {
                "max_tokens": {"prompt": TEXT, "max_tokens": 0},
                "logprobs": {**lm_eval, "logprobs": 21},
                "min_tokens": {**lm_eval, "max_tokens": 0, "min_tokens": 1},
            }.items():
                r = await client.post("/v1/completions", json=body)
                refusals[field] = (r.status_code, r.json()["error"]["param"])
    p = len(prompt_ids)
    choice = one["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == p + 1 and choice["finish_reason"] == "length"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [float(ref[i - 1, prompt_ids[i]]) for i in range(1, p)]
    np.testing.assert_allclose(lp["token_logprobs"][1:p], want, rtol=0, atol=1e-9)
    assert lp["tokens"][:p] == [strings.text(t) for t in prompt_ids]
    assert lp["text_offset"][:2] == [0, len(strings.text(prompt_ids[0]))]
    # lm-eval's own reading: the continuation is scored by token_logprobs[ctxlen:-1]
    assert choice["text"].startswith(rt.tokenizer.decode(prompt_ids))
    assert one["usage"]["completion_tokens"] == 1

    choice = zero["choices"][0]
    assert choice["logprobs"]["token_logprobs"] == lp["token_logprobs"][:p]
    assert choice["text"] == rt.tokenizer.decode(prompt_ids)
    assert choice["finish_reason"] == "length"
    assert zero["usage"]["completion_tokens"] == 0

    first, *rest = streamed
    head = first["choices"][0]  # type: ignore[index]
    assert head["text"] == TEXT
    assert head["logprobs"]["token_logprobs"][0] is None
    assert len(head["logprobs"]["tokens"]) == len(rt.tokenizer.encode(TEXT))
    assert [c["choices"][0]["text"] for c in rest] == [""]  # type: ignore[index]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]

    assert plain["choices"][0]["text"] == TEXT and plain["choices"][0]["logprobs"] is None
    assert refusals == {
        "max_tokens": (400, "max_tokens"),
        "logprobs": (400, "logprobs"),
        "min_tokens": (400, "min_tokens"),
    }
