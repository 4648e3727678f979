"""``spectrio serve --http`` as a process, reached with clients no one here wrote: the
official ``openai`` SDK (sync and async, streaming and not, ``n`` > 1, logprobs, stop,
seeds, usage) and raw httpx for every status, authentication, the body cap, SSE framing
and disconnects. One server (the bundled model, ZeroMQ and HTTP on one runtime, an API
key from ``SPECTRIO_API_KEY``) serves the module; others, HTTP alone, check the rate
limit, the drain on SIGTERM and a tensor-parallel rank killed under open streams."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio
from http_helpers import HttpServer, http_server, sse_events

from spectrio import RuntimeConfig, SamplingParams, open_runtime
from spectrio.http_api.logprobs import TokenStrings
from spectrio.models import LoadedModel
from spectrio.wire.sync_client import Client

KEY = "sk-test-123"
MODEL = "bundled"
PROMPT = "def fib(n):"
LOAD_S = float(os.environ.get("SPECTRIO_HTTP_LOAD_S", "8"))  # the soak: 60


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    tmp = tmp_path_factory.mktemp("http")
    run = tmp / "run"
    run.mkdir(mode=0o700)
    args = ("--run-dir", str(run), "--max-model-len", "512", "--max-num-seqs", "32")
    with http_server(tmp, *args, env={"SPECTRIO_API_KEY": KEY}) as srv:
        yield srv


@pytest.fixture
def client(server: HttpServer) -> Iterator[openai.OpenAI]:
    with server.sdk(api_key=KEY) as c:
        yield c


@pytest.fixture
def raw(server: HttpServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        yield c


def health(raw: httpx.Client) -> dict[str, object]:
    response = raw.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert isinstance(body, dict)
    return body


def error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert isinstance(body, dict)
    return body


# ---- both fronts on one runtime ---------------------------------------------------------


def test_zeromq_and_http_serve_one_runtime(server: HttpServer, raw: httpx.Client) -> None:
    ready = server.ready
    assert ready["http"].startswith("http://127.0.0.1:") and ready["requests"].startswith("ipc://")
    with Client(ready["requests"], ready["outputs"], timeout_s=60) as wire:
        tokens = [
            t for c in wire.generate(PROMPT, SamplingParams(max_tokens=4)) for t in c.token_ids
        ]
    assert len(tokens) == 4
    models = raw.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 512
    assert raw.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert error(raw.get("/v1/models/gpt-4"), 404)["code"] == "model_not_found"


# ---- the official client ----------------------------------------------------------------


async def embedding_greedy(prompt: str, max_tokens: int) -> list[int]:
    with trio.fail_after(120):
        async with open_runtime(RuntimeConfig(max_model_len=512), warmup=False) as rt:
            async with rt.generate(prompt, SamplingParams(max_tokens=max_tokens)) as stream:
                return [t async for d in stream for t in d.token_ids]


async def test_greedy_equals_the_embedding_api_token_for_token(
    client: openai.OpenAI, bundled: LoadedModel
) -> None:
    with trio.fail_after(180):
        want = await embedding_greedy(PROMPT, 24)
        check_greedy(client, bundled, want)


def check_greedy(client: openai.OpenAI, bundled: LoadedModel, want: list[int]) -> None:
    assert bundled.tokenizer is not None
    strings = TokenStrings(bundled.tokenizer)
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens == [strings.text(t) for t in want]
    assert choice.text == bundled.tokenizer.decode(want) and choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens == len(bundled.tokenizer.encode(PROMPT))
    drafts = (out.usage.model_extra or {})["spectrio"]
    assert 0 <= drafts["drafts_accepted"] <= drafts["drafts_proposed"]
    # the prompt as token ids: the same request
    ids = bundled.tokenizer.encode(PROMPT)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert again.choices[0].text == choice.text


def test_stop_strings_cut_the_text(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "@@@"]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeds_repeat_and_choices_differ(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234, n=3
        )
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1  # choice i samples with seed + i
    streamed = ["", "", ""]
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234, n=3, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == first


def test_several_prompts_echo_and_n(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=["def f(x):", "import os"], n=2, max_tokens=5, temperature=0, echo=True
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text.startswith("def f(x):") and out.choices[2].text.startswith("import")
    assert out.choices[0].text == out.choices[1].text  # greedy: the same twice
    assert out.usage is not None and out.usage.completion_tokens == 20


def test_async_streaming_with_logprobs_and_usage(server: HttpServer) -> None:
    async def run() -> tuple[list[str], list[list[str]], list[str | None], list[object]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
            texts, tokens, reasons, usages = ["", ""], [[], []], [None, None], []
            stream = await c.completions.create(
                model=MODEL, prompt=PROMPT, n=2, max_tokens=12, temperature=0.8, seed=5,
                logprobs=2, stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            async for chunk in stream:
                if not chunk.choices:
                    usages.append(chunk.usage)
                for ch in chunk.choices:
                    texts[ch.index] += ch.text
                    assert ch.logprobs is not None and ch.logprobs.top_logprobs is not None
                    tokens[ch.index] += ch.logprobs.tokens or []
                    for top in ch.logprobs.top_logprobs:
                        assert 1 <= len(top) <= 3  # two alternatives and the sampled token
                    reasons[ch.index] = ch.finish_reason or reasons[ch.index]
            return texts, tokens, reasons, usages

    texts, tokens, reasons, usages = asyncio.run(run())
    assert reasons == ["length", "length"]
    assert [len(t) for t in tokens] == [12, 12]
    assert ["".join(t) for t in tokens] == texts  # ASCII output: the tokens spell the text
    [last] = usages
    assert isinstance(last, openai.types.CompletionUsage) and last.completion_tokens == 24


def test_sdk_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert "temperature: must be a finite number >= 0, got -1.0" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()


# ---- raw HTTP ---------------------------------------------------------------------------


def test_sse_framing(raw: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    response = raw.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1


@pytest.mark.parametrize(
    "version, header", [("HTTP/1.1", "Connection: close\r\n"), ("HTTP/1.0", "")]
)
def test_a_stream_ends_the_connection_a_client_asked_to_close(
    server: HttpServer, version: str, header: str
) -> None:
    """A client that does not keep connections alive (curl -0, many scripts and health
    checkers) reads a stream to the socket's end: the server must close it after
    [DONE], not wait for the client to hang up."""
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True})
    request = (
        f"POST /v1/completions {version}\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{header}\r\n{body}"
    )
    received = b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request.encode())
        while data := sock.recv(65536):  # a timeout here is the failure
            received += data
    assert received.startswith(b"HTTP/1.1 200")  # h11 answers in HTTP/1.1 either way
    assert b"data: [DONE]" in received


def test_authentication(server: HttpServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        missing = anonymous.post("/v1/completions", json={"prompt": "x"})
        assert error(missing, 401)["code"] == "invalid_api_key"
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = anonymous.get("/v1/models", headers={"Authorization": f"Bearer {KEY}x"})
        error(wrong, 401)
        scheme = anonymous.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})
        assert scheme.status_code == 200
        assert anonymous.get("/health").status_code == 200  # probes and scrapers need no key
        metrics = anonymous.get("/metrics")
        assert metrics.status_code == 200 and "spectrio_time_to_first_token_seconds" in metrics.text


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b'{"prompt": "x", ', 400, None, "invalid_json"),
        (b'["x"]', 400, None, "wrong_type"),
        (b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens", "wrong_type"),
        (b'{"prompt": "x", "n": 1.5}', 400, "n", "wrong_type"),
        (b'{"prompt": "x", "colour": "red"}', 400, "colour", "unknown_field"),
        (b'{"max_tokens": 3}', 400, "prompt", "missing_field"),
        (b'{"prompt": "x", "suffix": "y"}', 400, "suffix", "invalid_field"),
        (b'{"prompt": [1, "x"]}', 400, "prompt", "wrong_type"),
        (b'{"prompt": [99999999]}', 400, "prompt", "invalid_field"),
        (b'{"prompt": ""}', 400, "prompt", "empty_prompt"),
        (b'{"prompt": "x", "model": "gpt-4"}', 404, "model", "model_not_found"),
    ],
)
def test_status_of_a_bad_body(
    raw: httpx.Client, body: bytes, status: int, param: str | None, code: str
) -> None:
    err = error(raw.post("/v1/completions", content=body), status)
    assert (err["param"], err["code"]) == (param, code)
    assert err["type"] == "invalid_request_error"


def test_the_rule_text_is_the_runtimes(raw: httpx.Client) -> None:
    err = error(raw.post("/v1/completions", json={"prompt": "x", "top_p": 0}), 400)
    assert err["message"] == "top_p: must be a finite number in (0, 1], got 0.0"
    assert err["param"] == "top_p" and err["code"] == "invalid_params"


def test_a_body_over_the_cap_is_413(raw: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    assert error(raw.post("/v1/completions", content=big), 413)["code"] == "request_too_large"
    chunked = raw.post("/v1/completions", content=iter([big[:1000], big[1000:]]))  # no length
    error(chunked, 413)
    assert raw.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_routes_and_methods(raw: httpx.Client) -> None:
    assert error(raw.get("/v1/nothing"), 404)["code"] == "not_found"
    assert error(raw.get("/v1/completions"), 405)["code"] == "method_not_allowed"


def test_a_disconnect_aborts_the_request_and_frees_its_blocks(raw: httpx.Client) -> None:
    before = health(raw)["finished"]
    assert isinstance(before, dict)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with raw.stream("POST", "/v1/completions", json=body) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n == 4:
                assert health(raw)["running"] == 1
                break
    t0 = time.monotonic()
    while True:
        now = health(raw)
        finished = now["finished"]
        assert isinstance(finished, dict)
        if now["free_kv_blocks"] == now["num_kv_blocks"] and now["running"] == 0:
            break
        assert time.monotonic() - t0 < 2.0, now
        time.sleep(0.01)
    assert finished.get("abort", 0) == before.get("abort", 0) + 1


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_bounded_load_with_random_disconnects(server: HttpServer, raw: httpx.Client) -> None:
    """The async SDK at concurrency 32 (``SPECTRIO_HTTP_LOAD_S`` seconds, two halves):
    every request completes or is cancelled by its client, no 5xx, and afterwards every
    KV block is back and RSS grew little over the second half."""
    statuses: dict[str, int] = {"done": 0, "cut": 0}
    rng = random.Random(0)

    async def worker(c: openai.AsyncOpenAI, until: float) -> None:
        while time.monotonic() < until:
            kind = rng.random()
            request = c.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=rng.randint(4, 24),
                temperature=rng.choice([0.0, 0.8]), stream=kind < 0.5,
            )  # fmt: skip
            try:
                if kind < 0.3:  # a client that leaves mid-way
                    await asyncio.wait_for(request, timeout=rng.uniform(0.01, 0.3))
                else:
                    out = await request
                    if isinstance(out, openai.AsyncStream):
                        async for _ in out:
                            pass
                statuses["done"] += 1
            except TimeoutError:
                statuses["cut"] += 1

    async def phase(seconds: float) -> None:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60
        ) as c:
            until = time.monotonic() + seconds
            await asyncio.gather(*(worker(c, until) for _ in range(32)))

    asyncio.run(phase(LOAD_S / 2))  # warm: the allocator settles
    rss = _rss_kb(server.pid)
    asyncio.run(phase(LOAD_S / 2))  # any 5xx raises openai.InternalServerError here
    grown_mb = (_rss_kb(server.pid) - rss) / 1024
    assert statuses["done"] > 32 and statuses["cut"] > 0, statuses
    t0 = time.monotonic()
    while True:
        now = health(raw)
        if now["running"] == 0 and now["free_kv_blocks"] == now["num_kv_blocks"]:
            break
        assert time.monotonic() - t0 < 5, now
        time.sleep(0.05)
    assert now["open_http_requests"] == 0
    assert grown_mb < 32, f"RSS grew {grown_mb:.1f} MB under load"


# ---- HTTP alone: the rate limit and the drain -------------------------------------------


def test_http_alone_rate_limit_and_drain_on_sigterm(tmp_path: Path) -> None:
    args = ("--no-zmq", "--max-requests-per-s", "0.001", "--grace", "0.5")
    with http_server(tmp_path, *args) as srv:
        assert srv.ready["requests"] is None and srv.ready["outputs"] is None
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            codes = [
                c.post("/v1/completions", json={"prompt": "x", "model": "m"}).status_code
                for _ in range(66)
            ]
            assert codes[:64] == [404] * 64 and codes[64:] == [429, 429]
            limited = c.post("/v1/completions", json={"prompt": "x"})
            err = error(limited, 429)
            assert err["type"] == "rate_limit_error" and int(limited.headers["retry-after"]) >= 1
        # another client has a bucket of its own; SIGTERM ends its stream cleanly
        other = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=srv.url, timeout=30, transport=other) as c:
            body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as response:
                lines = []
                for line in response.iter_lines():
                    lines.append(line)
                    if len(lines) == 1:
                        srv.server.proc.send_signal(signal.SIGTERM)
        events = [json.loads(e) for e in sse_events("\n".join(lines) + "\n")[:-1]]
        assert lines[-2:] == ["data: [DONE]", ""]
        assert events[-1]["choices"][0]["finish_reason"] == "abort"  # cut after the grace
        assert srv.server.proc.wait(30) == 0


def test_serve_refuses_bad_http_flags_before_loading() -> None:
    cli = [sys.executable, "-m", "spectrio.tools.cli", "serve"]
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    for flags, message in (
        (["--http", str(port), "--no-zmq"], f"--http: cannot serve on {port}"),
        (["--no-zmq"], "--no-zmq: nothing left to serve"),
        (["--http", "0.0.0.0:0"], "--http: 0.0.0.0 is not loopback"),
        (["--api-key", "k"], "--api-key: HTTP settings need --http"),
        (["--http", "0", "--no-zmq", "--tap", "tcp://127.0.0.1:*"], "--no-zmq: --tap"),
    ):
        done = subprocess.run([*cli, *flags], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert "model loaded" not in done.stderr
    taken.close()


def test_killing_a_tensor_parallel_rank_ends_every_http_stream(tmp_path: Path) -> None:
    """The issue's reproduction over HTTP: ``serve --http --tensor-parallel-size 2``, five
    streaming requests, ``kill -9`` on rank 1. Each stream gets an ``engine_dead`` error
    event and then ``[DONE]`` within 2 s, and the server exits with status 1."""
    from test_engine_death_wire import _children

    args = ("--no-zmq", "--tensor-parallel-size", "2", "--threads", "1", "--max-model-len", "1024")
    with http_server(tmp_path, *args) as srv:
        streaming = threading.Barrier(6)
        ends: dict[int, tuple[list[str], float]] = {}

        def one(i: int) -> None:
            body = {
                "prompt": f"def f{i}(x):",
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                with c.stream("POST", "/v1/completions", json=body) as response:
                    events: list[str] = []
                    for line in response.iter_lines():
                        if line:
                            events.append(line)
                            if len(events) == 1:
                                streaming.wait(60)
                    ends[i] = (events[-2:], time.monotonic())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        streaming.wait(60)
        followers = [p for p in _children(srv.pid) if p != srv.pid]
        assert followers, "no follower rank process"
        for pid in followers:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(30)
        assert srv.server.proc.wait(30) == 1
    assert sorted(ends) == list(range(5))
    for (error_event, done), when in ends.values():
        assert done == "data: [DONE]" and when - killed < 2.0
        err = json.loads(error_event.removeprefix("data: "))["error"]
        assert err["code"] == "engine_dead" and "rank 1" in err["message"]
