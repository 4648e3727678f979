"""The HTTP front's cost: the same workload through ``spectrio serve --http`` (streaming
completions on loopback) and through the embedding API in this process, rounds
alternated.

Both sides run the same runtime configuration and the same prompts (held-out code, as
``spectrio bench`` uses), greedy with ``ignore_eos`` and a fixed ``--max-tokens``, at most
``--batch`` requests at once. Reported per side: output tokens per second (first
submission to last token) and time to first token (p50, p90) per request, each the median
over ``--rounds``; and the ratios HTTP / in-process. Each round then sends ``--alone``
prompts one at a time, each three ways in turn: in-process, through httpx, and over a
plain socket with a hand-written request (which leaves the client library's own time
out). Their TTFT is what the front adds to a request's latency, free of the queueing that
a batch's TTFT also holds; each request is compared with the in-process one sent next to
it, since the machine's speed drifts between rounds by more than the front costs, and the
median difference over all rounds is reported with its 95% interval.

The client shares the machine with the server, so its CPU is taken from the model's; to
tell the front's cost from the client's, each round also reads the CPU time of both
processes: ``front_cpu_ms_per_token`` is what the server spent per token beyond what the
embedding API spent for the same work, ``client_cpu_ms_per_token`` what the client spent.
``--client httpx`` (the default) reads the event stream with httpx and msgspec, as
serving benchmarks' clients do; ``--client openai`` uses the official SDK, whose parsing
costs several times more CPU per chunk.

Run: ``python benchmarks/bench_http.py [--model bundled] [--batch 16] [--requests 48]
[--max-tokens 64] [--rounds 3] [--client httpx|openai] [--json out.json]`` (the ``test``
extra has ``openai``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import select
import statistics
import subprocess
import sys
import time
from typing import Any

import trio

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.tools.measurement.bench import bench_prompts


def _runtime_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--max-num-seqs", str(args.batch), "--max-model-len", "512"]


def _summary(ttfts: list[float], tokens: int, seconds: float) -> dict[str, float]:
    ttfts = sorted(ttfts)
    return {
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
    }


def _request(args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    """The streamed greedy completion both HTTP clients send (the SDK's own call names
    the same fields)."""
    return {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip


async def in_process(
    rt: Any, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    limit = trio.Semaphore(args.batch)
    ttfts: list[float] = []
    tokens = 0
    t0 = time.perf_counter()

    async def one(prompt: list[int]) -> None:
        nonlocal tokens
        async with limit:
            start = time.perf_counter()
            first = True
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            async with rt.generate(prompt, params) as stream:
                async for delta in stream:
                    if first and delta.token_ids:
                        ttfts.append(time.perf_counter() - start)
                        first = False
                    tokens += len(delta.token_ids)

    async with trio.open_nursery() as nursery:
        for p in prompts:
            nursery.start_soon(one, p)
    return _summary(ttfts, tokens, time.perf_counter() - t0)


async def over_http(
    url: str, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    if args.client == "openai":
        return await _over_http_openai(url, prompts, args)
    import httpx
    import msgspec

    limit = trio.Semaphore(args.batch)
    ttfts: list[float] = []
    tokens = 0
    decode = msgspec.json.Decoder()
    t0 = time.perf_counter()

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        nonlocal tokens
        async with limit:
            start = time.perf_counter()
            first = True
            body = {**_request(args, prompt), "stream_options": {"include_usage": True}}
            async with client.stream("POST", url + "/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
                pending = b""
                async for data in response.aiter_bytes():
                    events = (pending + data).split(b"\n\n")
                    pending = events.pop()
                    for event in events:
                        payload = event.removeprefix(b"data: ")
                        if payload == b"[DONE]":
                            continue
                        chunk = decode.decode(payload)
                        if first and chunk["choices"] and chunk["choices"][0]["text"]:
                            ttfts.append(time.perf_counter() - start)
                            first = False
                        if chunk.get("usage"):
                            tokens += chunk["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=args.batch, max_keepalive_connections=args.batch)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async with trio.open_nursery() as nursery:
            for p in prompts:
                nursery.start_soon(one, client, p)
    return _summary(ttfts, tokens, time.perf_counter() - t0)


async def raw_ttft(url: str, prompt: list[int], args: argparse.Namespace) -> float:
    """Seconds to the first token of one streamed request over a plain socket: the
    request written by hand, the first event with text found in the bytes as they
    arrive. No HTTP library runs on the client side, so what this adds over in-process
    is the server's share (the front, the kernel's loopback), not the client's."""
    import msgspec

    host, _, rest = url.removeprefix("http://").partition(":")
    port = int(rest.split("/", 1)[0])
    body = msgspec.json.encode(_request(args, prompt))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    decode = msgspec.json.Decoder()
    start = time.perf_counter()
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(head + body)
        seen = b""
        first: float | None = None
        while b"data: [DONE]" not in seen and (data := await stream.receive_some(65536)):
            seen += data
            if first is None:
                # SSE events arrive whole, each within one chunk of the chunked body.
                for event in seen.split(b"data: ")[1:]:
                    payload = event.split(b"\n\n", 1)[0]
                    if payload.startswith(b"{") and decode.decode(payload)["choices"][0]["text"]:
                        first = time.perf_counter()
                        break
        if first is None or not seen.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"no token from {url}: {seen[:200]!r}")
    return first - start


ALONE_SIDES = ("in_process", "http", "raw")


async def alone_triples(
    rt: Any, url: str, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, list[float]]:
    """TTFT (ms) of single requests, one at a time, the three ways in turn for each
    prompt (the order rotating): in-process, through httpx, over a plain socket. The
    machine's speed drifts between rounds by more than the front costs, so each way is
    compared with its neighbours in time. A pause before each request lets the other
    process's math threads, which spin a while after their last op, go idle."""
    one = argparse.Namespace(**{**vars(args), "batch": 1, "max_tokens": 2})
    out: dict[str, list[float]] = {side: [] for side in ALONE_SIDES}
    for i, prompt in enumerate(prompts):
        for j in range(len(ALONE_SIDES)):
            side = ALONE_SIDES[(i + j) % len(ALONE_SIDES)]
            await trio.sleep(args.alone_gap)
            if side == "in_process":
                ms = (await in_process(rt, [prompt], one))["ttft_p50_ms"]
            elif side == "http":
                ms = (await over_http(url, [prompt], one))["ttft_p50_ms"]
            else:
                ms = 1000 * await raw_ttft(url, prompt, one)
            out[side].append(ms)
    return out


def median_interval(xs: list[float]) -> tuple[float, float, float]:
    """The median of ``xs`` and a distribution-free 95% interval for it (order
    statistics n/2 -/+ 0.98 sqrt(n), from the sign test's normal approximation)."""
    xs = sorted(xs)
    n = len(xs)
    half = 0.98 * n**0.5
    lo, hi = max(0, int(n / 2 - half)), min(n - 1, int(n / 2 + half + 0.999))
    return statistics.median(xs), xs[lo], xs[hi]


async def _over_http_openai(
    url: str, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    import anyio
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    limit = anyio.Semaphore(args.batch)
    ttfts: list[float] = []
    tokens = 0
    t0 = time.perf_counter()

    async def one(prompt: list[int]) -> None:
        nonlocal tokens
        async with limit:
            start = time.perf_counter()
            first = True
            stream = await client.completions.create(
                model=args.model,
                prompt=prompt,
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text and first:
                    ttfts.append(time.perf_counter() - start)
                    first = False
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens

    async with anyio.create_task_group() as tg:
        for p in prompts:
            tg.start_soon(one, p)
    await client.close()
    return _summary(ttfts, tokens, time.perf_counter() - t0)


def _cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of this process, or of process ``pid`` (Linux)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "spectrio.tools.cli", "serve", "--http", "127.0.0.1:0",
           "--no-zmq", "--no-spec", *_runtime_flags(args)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    if not ready:
        proc.kill()
        raise SystemExit("the server did not start within 300 s")
    return proc, json.loads(proc.stdout.readline())["http"] + "/v1"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    prompts = bench_prompts(args.requests, 48, args.model)
    config = RuntimeConfig(
        model=args.model,
        max_num_seqs=args.batch,
        max_model_len=512,
        speculative=SpeculativeConfig(method=None),
    )
    proc, url = start_server(args)
    rows: dict[str, list[dict[str, float]]] = {"in_process": [], "http": []}
    alone: dict[str, list[float]] = {side: [] for side in ALONE_SIDES}
    try:
        async with open_runtime(config) as rt:
            await in_process(rt, prompts[: args.batch], args)  # warm both sides once
            await over_http(url, prompts[: args.batch], args)
            for r in range(args.rounds):
                order = ["in_process", "http"] if r % 2 == 0 else ["http", "in_process"]
                for side in order:
                    own, server = _cpu_seconds(), _cpu_seconds(proc.pid)
                    if side == "http":
                        row = await over_http(url, prompts, args)
                    else:
                        row = await in_process(rt, prompts, args)
                    tokens = row["tokens_per_second"] * row["seconds"]
                    own, server = _cpu_seconds() - own, _cpu_seconds(proc.pid) - server
                    if side == "http":  # this process ran the client, the server the rest
                        row["server_cpu_ms_per_token"] = 1000 * server / tokens
                        row["client_cpu_ms_per_token"] = 1000 * own / tokens
                    else:  # this process ran everything; the server sat idle
                        row["server_cpu_ms_per_token"] = 1000 * own / tokens
                    rows[side].append(row)
                    print(
                        side, {k: round(v, 2) for k, v in rows[side][-1].items()}, file=sys.stderr
                    )
                if args.alone:
                    got = await alone_triples(rt, url, prompts[: args.alone], args)
                    for side, ms in got.items():
                        alone[side] += ms
                    print("alone TTFT p50 ms", {k: round(statistics.median(v), 2)
                          for k, v in got.items()}, file=sys.stderr)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)
    med = {
        side: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for side, runs in rows.items()
    }
    front = med["http"]["server_cpu_ms_per_token"] - med["in_process"]["server_cpu_ms_per_token"]
    return {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "args": vars(args),
        "rounds": rows,
        "median": med,
        "http_over_in_process_tokens_per_second": med["http"]["tokens_per_second"]
        / med["in_process"]["tokens_per_second"],
        "http_minus_in_process_ttft_p50_ms": med["http"]["ttft_p50_ms"]
        - med["in_process"]["ttft_p50_ms"],
        "alone_ttft_ms": alone,
        # Each request against the in-process one sent next to it (same prompt).
        "alone_http_minus_in_process_ms": _paired(alone["http"], alone["in_process"]),
        "alone_raw_minus_in_process_ms": _paired(alone["raw"], alone["in_process"]),
        "front_cpu_ms_per_token": front,
        "client_cpu_ms_per_token": med["http"]["client_cpu_ms_per_token"],
    }


def _paired(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """Median of the differences ``x - y`` of pairs, with its 95% interval."""
    if not xs:
        return None
    mid, lo, hi = median_interval([x - y for x, y in zip(xs, ys, strict=True)])
    return {"median": mid, "low": lo, "high": hi, "pairs": len(xs)}


def _fmt(paired: dict[str, float] | None) -> str:
    if paired is None:
        return "not measured"
    return f"{paired['median']:+.2f} ms [{paired['low']:+.2f}, {paired['high']:+.2f}]"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bundled")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--alone",
        type=int,
        default=8,
        help="prompts sent one at a time per round, each in-process, by httpx and by socket",
    )
    p.add_argument(
        "--alone-gap", type=float, default=0.3, help="seconds of pause before each such request"
    )
    p.add_argument("--json", default=None)
    p.add_argument(
        "--client",
        choices=["httpx", "openai"],
        default="httpx",
        help="httpx: a lean SSE reader (as serving benchmarks use); openai: the official SDK",
    )
    args = p.parse_args()
    result = trio.run(main_async, args)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(
        f"tokens/s HTTP / in-process: {result['http_over_in_process_tokens_per_second']:.3f}; "
        f"TTFT p50 HTTP - in-process: {result['http_minus_in_process_ttft_p50_ms']:+.1f} ms "
        f"(one request at a time, paired: {_fmt(result['alone_http_minus_in_process_ms'])}, "
        f"by a plain socket {_fmt(result['alone_raw_minus_in_process_ms'])}); "
        f"CPU per token: the front {result['front_cpu_ms_per_token']:+.3f} ms, "
        f"the client {result['client_cpu_ms_per_token']:.3f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
