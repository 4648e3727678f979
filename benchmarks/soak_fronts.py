"""Soak every front together (issue 62, item 5): does one server keep serving HTTP, the
wire and the embedding API at once, for minutes, while wire consumers die or never read?

This process runs the server as ``spectrio serve --http`` composes it with default flags:
``open_runtime(RuntimeConfig(model=...))``, the runtime observed by the metrics (as
``--http`` does), the ZeroMQ server on ``tcp://127.0.0.1`` ephemeral ports (requests
and the PUSH outputs socket; no tap) and the HTTP front on an ephemeral port. A child
process (this script with ``--load``, so that the clients' Python does not share the
server's GIL) then drives, all at once, for ``--duration`` seconds:

* **HTTP**: ``--clients`` (32) concurrent clients of the official ``openai`` SDK
  (``AsyncOpenAI``, ``max_retries=0``, timeout 30 s), non-streamed and streamed
  completions of 4-24 tokens; 30 % of them leave after 0.01-0.3 s (mid-stream, or before
  the response). Counted: completed, cut by the client, timeouts
  (``openai.APITimeoutError``), 5xx, other errors, latency percentiles, and completions
  and p99 latency per 10 s window (a dip shows when something holds the others).
* **the wire, live consumer**: one stream client (``spectrio.wire.sync_client.Client``
  with the requests endpoint alone) submits requests one after another and reads each to
  its end. Counted: completed, timeouts (``ClientTimeout``), gaps (``SequenceGap``).
* **the wire, dying consumers**: over and over, a stream client submits 3 requests of
  ``--long-max-tokens`` tokens, reads for 0.5-3 s and closes its socket while they run.
  Every other one is a raw DEALER with a routing id libzmq assigned (the server sees its
  connection close), the rest ``Client``s (their own routing id: the server waits
  ``output_stall_s`` for them to come back). Beside them, with no PUSH consumer at all,
  a raw DEALER submits a request without ``stream`` every ``--unread-every`` seconds;
  its steps go to the outputs socket nobody reads. The server must end all of these
  (``output_stalled``): its ``requests_stalled`` and ``clients_gone`` are reported, and,
  from a record observer in this process, how each of these requests ended and how
  long after its consumer closed (for the outputs socket: after it was sent), and the
  tokens generated for them against all tokens generated (what they cost the others
  until the server ended them).

This process meanwhile runs the **embedding API** (``--embed-tasks`` Trio tasks calling
``rt.generate`` in a loop, 30 % of them leaving the stream early), samples its RSS
(``/proc/self/statm``) every second and polls ``GET /health`` every 0.5 s (200s,
non-200s and each 503's reason).

After the load it waits for the runtime to go idle, then reports per front the requests
served and the timeouts (goal: 0), 5xx (goal: 0), RSS at start and end and its slope over
the second half of the run (MB per minute, Theil-Sen: one-off jumps do not move it;
DESIGN.md: RSS settles over the first ~12,000 requests, so read the slope of a long run),
KV blocks free against the total (goal: all), the wire server's counters, and a fresh
8-token HTTP completion timed after the load (goal: at once: well under 1 s beyond the
same request in-process).

Run: ``python benchmarks/soak_fronts.py [--duration 600] [--clients 32] [--model bundled]
[--skip http|live|dying|unread|embed ...] [--json out.json]`` (needs the ``test`` extra
for ``openai``); ``--skip`` leaves a load out, for a baseline. CI runs it for 10 s with 8
clients (``tests/test_soak_fronts.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import gc
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    from spectrio.core.messages import PublishedStep
    from spectrio.runtime.api import Runtime
    from spectrio.wire.server import WireServer

PROMPTS = ("def fib(n):", "import os\nimport sys\n", "class Stack:\n", "for i in range(10):")
HTTP_TIMEOUT_S = 30.0
WIRE_TIMEOUT_S = 30.0
WINDOW_S = 10.0
CUT_SHARE = 0.3  # HTTP requests and embedding streams left early
FRONTS = ("http", "live", "dying", "unread", "embed")  # what --skip may leave out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def theil_sen(t: list[float], y: list[float]) -> float:
    """The median of the slopes between every pair of points (dy per unit of t): a
    one-off jump (an arena doubling, the allocator returning memory) does not move it."""
    ts, ys = np.asarray(t, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if ts.size < 2:
        return 0.0
    i, j = np.triu_indices(ts.size, k=1)
    dt = ts[j] - ts[i]
    keep = dt > 0
    if not keep.any():
        return 0.0
    return float(np.median((ys[j] - ys[i])[keep] / dt[keep]))


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 and max, in ms."""
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None}
    q = np.percentile(np.asarray(values) * 1000.0, [50, 90, 99, 100])
    return {
        f"{k}_ms": round(float(v), 1) for k, v in zip(("p50", "p90", "p99", "max"), q, strict=True)
    }


def windows(done: list[tuple[float, float]], t0: float, seconds: float) -> list[dict[str, Any]]:
    """Completions and their p99 latency per :data:`WINDOW_S` of the run; ``done`` holds
    (end time, latency) pairs on the same clock as ``t0``."""
    count = max(1, int(seconds // WINDOW_S))
    per: list[list[float]] = [[] for _ in range(count)]
    for end, latency in done:
        k = int((end - t0) // WINDOW_S)
        if 0 <= k < count:
            per[k].append(latency)
    return [
        {
            "t_s": round(k * WINDOW_S, 1),
            "completed": len(lat),
            "p99_ms": percentiles(lat)["p99_ms"],
        }
        for k, lat in enumerate(per)
    ]


# ---- the child: HTTP clients (asyncio) and wire clients (threads) ----------------------


async def http_load(url: str, model: str, clients: int, until: float, seed: int) -> dict[str, Any]:
    """``clients`` SDK clients until ``until`` (``time.monotonic``)."""
    import httpx
    import openai

    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    latencies: dict[str, list[float]] = {"stream": [], "whole": []}
    done: list[tuple[float, float]] = []
    t0 = time.monotonic()

    async def one(c: openai.AsyncOpenAI, stream: bool) -> None:
        out = await c.completions.create(
            model=model, prompt=rng.choice(PROMPTS), max_tokens=rng.randint(4, 24),
            temperature=rng.choice([0.0, 0.8]), stream=stream,
        )  # fmt: skip
        if isinstance(out, openai.AsyncStream):
            async for _ in out:
                pass

    async def worker(c: openai.AsyncOpenAI) -> None:
        while time.monotonic() < until:
            kind = rng.random()
            stream = kind < 0.5
            start = time.monotonic()
            try:
                if kind < CUT_SHARE:  # a client that leaves mid-way
                    await asyncio.wait_for(one(c, stream), timeout=rng.uniform(0.01, 0.3))
                else:
                    await one(c, stream)
            except TimeoutError:  # asyncio.wait_for's: this client's own cut
                counts["cut"] += 1
                continue
            except openai.APITimeoutError:
                counts["timeouts"] += 1
                continue
            except openai.APIStatusError as exc:
                key = "5xx" if exc.status_code >= 500 else "other_errors"
                counts[key] += 1
                errors[f"{exc.status_code}: {str(exc)[:160]}"] += 1
                continue
            except (openai.APIError, httpx.HTTPError) as exc:
                counts["other_errors"] += 1
                errors[f"{type(exc).__name__}: {str(exc)[:160]}"] += 1
                continue
            end = time.monotonic()
            counts["completed"] += 1
            latencies["stream" if stream else "whole"].append(end - start)
            done.append((end, end - start))

    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S
    ) as c:
        await asyncio.gather(*(worker(c) for _ in range(clients)))
    every = latencies["stream"] + latencies["whole"]
    return {
        "completed": counts["completed"],
        "cut": counts["cut"],
        "timeouts": counts["timeouts"],
        "5xx": counts["5xx"],
        "other_errors": counts["other_errors"],
        "errors": dict(errors.most_common(10)),
        "latency": percentiles(every),
        "latency_streamed": percentiles(latencies["stream"]),
        "latency_whole": percentiles(latencies["whole"]),
        "windows": windows(done, t0, until - t0),
    }


def _params(max_tokens: int) -> Any:
    from spectrio.core.params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def wire_live(requests: str, until: float, seed: int, out: dict[str, Any]) -> None:
    """One stream client: a request at a time, each read to its end."""
    from spectrio.wire.client_requests import ClientTimeout, RequestRefused
    from spectrio.wire.stream_assembler import SequenceGap
    from spectrio.wire.sync_client import Client

    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    finish: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    client = Client(requests, timeout_s=WIRE_TIMEOUT_S)
    try:
        while time.monotonic() < until:
            start = time.monotonic()
            try:
                rid = client.submit(rng.choice(PROMPTS), _params(rng.randint(4, 24)))
                for chunk in client.stream(rid):
                    if chunk.finished:
                        finish[str(chunk.finish_reason)] += 1
            except (ClientTimeout, SequenceGap) as exc:
                counts["timeouts" if isinstance(exc, ClientTimeout) else "gaps"] += 1
                counts[f"error {type(exc).__name__}: {str(exc)[:120]}"] += 1
                client.close()  # a fresh connection: nothing stale is read as this one's
                client = Client(requests, timeout_s=WIRE_TIMEOUT_S)
                continue
            except RequestRefused as exc:
                counts[f"refused {exc.error.code.value}"] += 1
                continue
            counts["completed"] += 1
            latencies.append(time.monotonic() - start)
    finally:
        client.close()
    out.update(
        completed=counts.pop("completed", 0),
        timeouts=counts.pop("timeouts", 0),
        gaps=counts.pop("gaps", 0),
        finish_reasons=dict(finish),
        other=dict(counts),
        latency=percentiles(latencies),
    )


def _raw_dealer(ctx: Any, requests: str) -> Any:
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(requests)
    return sock


def _submit(stream: bool, max_tokens: int, prompt: str, request_id: str) -> bytes:
    from spectrio.wire.codec import encode
    from spectrio.wire.schema import SCHEMA_VERSION, Submit

    return encode(
        Submit(
            v=SCHEMA_VERSION,
            request_id=request_id,
            prompt=prompt,
            params=_params(max_tokens),
            stream=stream,
        )
    )


def _read_replies(
    sock: Any,
    counts: collections.Counter[str],
    wait_s: float,
    refused: list[str],
    *,
    until_reply: bool = False,
) -> int:
    """Read what ``sock`` has for ``wait_s`` seconds (or, with ``until_reply``, until a
    reply comes): replies counted in ``counts`` by kind (``ack``, or ``error <code>``),
    the ids of refused requests appended to ``refused``, step messages (two frames)
    returned as a count."""
    from spectrio.wire.codec import decode_reply
    from spectrio.wire.schema import Error

    steps = 0
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(max(1, int(left * 1000))):
            if until_reply:
                counts["timeouts"] += 1
            break
        frames = sock.recv_multipart()
        if len(frames) > 1:
            steps += 1
            continue
        reply = decode_reply(frames[-1])
        counts["ack" if not isinstance(reply, Error) else f"error {reply.code.value}"] += 1
        if isinstance(reply, Error) and reply.request_id is not None:
            refused.append(reply.request_id)
        if until_reply:
            break
    return steps


DYING_RAW, DYING_CLIENT, UNREAD = "dying-raw-", "dying-client-", "unread-"
"""Request id prefixes of the requests whose consumer dies or is absent: the parent
follows their ends in the step records (``time.monotonic`` is one clock for both
processes on Linux: ``CLOCK_MONOTONIC``)."""


def wire_dying(
    requests: str, until: float, seed: int, max_tokens: int, out: dict[str, Any]
) -> None:
    """Stream consumers that submit 3 long requests, read 0.5-3 s and close abruptly.
    ``out["dead"]`` gets ``[request id, time of the close]`` for each request sent."""
    import zmq

    from spectrio.wire.client_requests import ClientTimeout, RequestRefused
    from spectrio.wire.sync_client import Client

    rng = random.Random(seed)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    counts: collections.Counter[str] = collections.Counter()
    dead: list[tuple[str, float]] = []
    refused: list[str] = []
    n = 0
    while time.monotonic() < until:
        n += 1
        read_s = rng.uniform(0.5, 3.0)
        sent: list[str] = []
        if n % 2:  # libzmq's routing id: the server sees the connection close
            sock = _raw_dealer(ctx, requests)
            for _ in range(3):  # one at a time: 2 text prompts of a client may wait at once
                sent.append(f"{DYING_RAW}{uuid.uuid4().hex}")
                sock.send(_submit(True, max_tokens, rng.choice(PROMPTS), sent[-1]))
                steps = _read_replies(sock, counts, WIRE_TIMEOUT_S, refused, until_reply=True)
                counts["steps_read"] += steps
            counts["steps_read"] += _read_replies(sock, counts, read_s, refused)
            sock.close(linger=0)
            counts["raw_consumers"] += 1
        else:  # the client library's own routing id: it might come back
            client = Client(requests, timeout_s=WIRE_TIMEOUT_S)
            try:
                for _ in range(3):
                    sent.append(f"{DYING_CLIENT}{uuid.uuid4().hex}")
                    client.submit(rng.choice(PROMPTS), _params(max_tokens), request_id=sent[-1])
                    counts["ack"] += 1
                deadline = time.monotonic() + read_s
                running = set(sent)
                while running and time.monotonic() < deadline:  # a step comes while any runs
                    chunks = client.next_chunks()
                    counts["steps_read"] += len(chunks) > 0
                    running -= {c.request_id for c in chunks if c.finished}
            except ClientTimeout:
                counts["timeouts"] += 1
            except RequestRefused as exc:
                counts[f"error {exc.error.code.value}"] += 1
                refused.append(sent[-1])
            finally:
                client.close()
            counts["client_consumers"] += 1
        closed = time.monotonic()
        dead += [(rid, closed) for rid in sent]
        time.sleep(rng.uniform(0.1, 0.5))
    out.update(
        consumers=n,
        sent=len(dead),
        acked=counts.pop("ack", 0),
        timeouts=counts.pop("timeouts", 0),
        **dict(counts),
        dead=dead,
        refused=refused,
    )


def wire_unread(
    requests: str, until: float, seed: int, every_s: float, max_tokens: int, out: dict[str, Any]
) -> None:
    """Requests without ``stream``, whose steps go to the PUSH socket nobody reads.
    ``out["dead"]`` gets ``[request id, time sent]`` for each."""
    import zmq

    rng = random.Random(seed)
    sock = _raw_dealer(zmq.Context.instance(), requests)
    counts: collections.Counter[str] = collections.Counter()
    dead: list[tuple[str, float]] = []
    refused: list[str] = []
    try:
        while time.monotonic() < until:
            dead.append((f"{UNREAD}{uuid.uuid4().hex}", time.monotonic()))
            sock.send(_submit(False, max_tokens, rng.choice(PROMPTS), dead[-1][0]))
            wait_s = min(every_s, max(0.0, until - time.monotonic()))
            _read_replies(sock, counts, wait_s, refused)
        _read_replies(sock, counts, 1.0, refused)
    finally:
        sock.close(linger=0)
    out.update(
        sent=len(dead), acked=counts.pop("ack", 0), **dict(counts), dead=dead, refused=refused
    )


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """The child: every load generator at once, for ``args.duration`` seconds (one in
    ``args.skip`` ends at once, and reports zeros)."""
    start = time.monotonic()
    end = {f: start if f in args.skip else start + args.duration for f in FRONTS}
    wire: dict[str, dict[str, Any]] = {"live": {}, "dying": {}, "unread": {}}
    threads = [
        threading.Thread(
            target=wire_live, args=(args.requests, end["live"], args.seed + 1, wire["live"])
        ),
        threading.Thread(
            target=wire_dying,
            args=(args.requests, end["dying"], args.seed + 2, args.long_max_tokens, wire["dying"]),
        ),
        threading.Thread(
            target=wire_unread,
            args=(
                args.requests,
                end["unread"],
                args.seed + 3,
                args.unread_every,
                args.long_max_tokens,
                wire["unread"],
            ),
        ),
    ]
    for th in threads:
        th.start()
    http = asyncio.run(http_load(args.url, args.model, args.clients, end["http"], args.seed))
    for th in threads:
        th.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "seconds": round(time.monotonic() - start, 2),
        "http": http,
        "wire_live": wire["live"],
        "wire_dying": wire["dying"],
        "wire_unread": wire["unread"],
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
    }


# ---- the parent: the server, the embedding API, RSS and /health ------------------------


async def embed_load(rt: Runtime, task: int, seed: int, out: dict[str, Any]) -> None:
    """Requests through the embedding API until cancelled; 30 % leave the stream early."""
    import trio

    rng = random.Random(seed + task)
    counts = out.setdefault("counts", collections.Counter())
    latencies = out.setdefault("latencies", [])
    while True:
        leave = rng.random() < CUT_SHARE
        after = rng.randint(1, 3)
        start = time.monotonic()
        with trio.move_on_after(HTTP_TIMEOUT_S) as scope:
            async with rt.generate(rng.choice(PROMPTS), _params(rng.randint(4, 24))) as stream:
                deltas = 0
                async for _ in stream:
                    deltas += 1
                    if leave and deltas >= after:
                        break
        if scope.cancelled_caught:
            counts["timeouts"] += 1
        elif leave and deltas >= after:
            counts["left"] += 1
        else:
            counts["completed"] += 1
            latencies.append(time.monotonic() - start)


async def sample_rss(samples: list[tuple[float, int]]) -> None:
    import trio

    while True:
        samples.append((time.monotonic(), rss_bytes()))
        await trio.sleep(1.0)


async def poll_health(url: str, out: dict[str, Any]) -> None:
    """``GET /health`` every 0.5 s: 200s, others by status, 503s by reason, and polls
    that got no answer within 5 s."""
    import httpx
    import trio

    counts: collections.Counter[str] = out.setdefault("counts", collections.Counter())
    reasons: collections.Counter[str] = out.setdefault("reasons", collections.Counter())
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as c:
        while True:
            try:
                r = await c.get("/health")
            except httpx.HTTPError as exc:
                counts["no_answer"] += 1
                reasons[type(exc).__name__] += 1
            else:
                counts[str(r.status_code)] += 1
                if r.status_code != 200:
                    body = r.json()
                    err = body.get("error") or {}
                    reasons[f"{err.get('code')}: {err.get('message')}"] += 1
            await trio.sleep(0.5)


async def wait_idle(rt: Runtime, limit_s: float) -> tuple[float, bool]:
    """Seconds until nothing is open, running or waiting and every KV block is free
    (polled every 50 ms), and whether that happened within ``limit_s``."""
    import trio

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        s = rt.stats()
        if (
            s.running == 0
            and s.waiting == 0
            and s.free_kv_blocks == s.num_kv_blocks
            and rt.health().open_requests == 0
        ):
            return time.monotonic() - t0, True
        await trio.sleep(0.05)
    return time.monotonic() - t0, False


async def fresh_request(rt: Runtime, url: str, model: str, rounds: int = 5) -> dict[str, Any]:
    """An 8-token completion over HTTP right after the load, then the same in-process,
    ``rounds`` times in turn (0.2 s apart). ``first_http_s`` is the fresh request; the
    in-process median is the request's own time."""
    import httpx
    import trio

    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True}
    http_s: list[float] = []
    in_process_s: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S) as c:
        for _ in range(rounds):
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json=body)
            http_s.append(round(time.monotonic() - t0, 3))
            r.raise_for_status()
            t0 = time.monotonic()
            async with rt.generate(PROMPTS[0], _params(8)) as stream:
                async for _ in stream:
                    pass
            in_process_s.append(round(time.monotonic() - t0, 3))
            await trio.sleep(0.2)
    return {
        "first_http_s": http_s[0],
        "http_median_s": statistics.median(http_s),
        "in_process_median_s": statistics.median(in_process_s),
        "http_s": http_s,
        "in_process_s": in_process_s,
    }


class EndWatch:
    """A record observer: when, and with what finish reason, each request whose id has
    one of ``prefixes`` ended (``time.monotonic``); and the tokens generated for them
    against all tokens generated (the work spent on outputs nobody reads)."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes
        self.ends: dict[str, tuple[str, float]] = {}
        self.tokens = 0
        self.tokens_theirs = 0

    def __call__(self, pub: PublishedStep) -> None:
        from spectrio.core.record import unpack

        now = time.monotonic()
        accepted = np.maximum(unpack(pub.record).accept_num, 0)
        self.tokens += int(accepted.sum())
        for slot, (rid, reason) in enumerate(zip(pub.request_ids, pub.finish_reasons, strict=True)):
            if rid.startswith(self.prefixes):
                self.tokens_theirs += int(accepted[slot])
                if reason is not None:
                    self.ends[rid] = (reason, now)


def dead_consumers(
    dead: list[tuple[str, float]],
    refused: list[str],
    ends: dict[str, tuple[str, float]],
    load_end: float,
) -> dict[str, Any]:
    """What became of requests whose consumer died (or never was): how many the server
    ended (``abort``), how many finished on their own, how many it never reported ended
    (still open), how many were refused, and the seconds from the consumer's death (or, for the
    outputs socket, the submission) to the request's end. Requests that finished on their
    own, or were never reported ended, are listed by how long before the end of the load
    their consumer died (a request left near the end runs alone and may finish within
    the bound)."""
    reasons: collections.Counter[str] = collections.Counter()
    after: list[float] = []
    not_ended: list[tuple[str, float]] = []
    no = set(refused)
    for rid, t_dead in dead:
        if rid in no:
            reasons["refused"] += 1
            continue
        end = ends.get(rid)
        if end is None:
            reasons["never_ended"] += 1
            not_ended.append(("never_ended", round(load_end - t_dead, 2)))
            continue
        reasons[end[0]] += 1
        if end[0] == "abort":
            after.append(end[1] - t_dead)
        else:
            not_ended.append((end[0], round(load_end - t_dead, 2)))
    lat = percentiles(after)
    return {
        "sent": len(dead),
        "ended_by_server": reasons.pop("abort", 0),
        "finished_on_their_own": reasons.pop("length", 0) + reasons.pop("stop", 0),
        "never_ended": reasons.pop("never_ended", 0),
        "refused": reasons.pop("refused", 0),
        **({"other": dict(reasons)} if reasons else {}),
        "end_after_death_p50_s": None if lat["p50_ms"] is None else round(lat["p50_ms"] / 1e3, 2),
        "end_after_death_max_s": None if lat["max_ms"] is None else round(lat["max_ms"] / 1e3, 2),
        "not_ended_by_server_s_before_load_end": not_ended[:20],
    }


def _load_command(args: argparse.Namespace, url: str, requests: str) -> list[str]:
    return [
        sys.executable, os.path.abspath(__file__), "--load",
        "--url", url, "--requests", requests, "--model", args.model,
        "--duration", str(args.duration), "--clients", str(args.clients),
        "--seed", str(args.seed), "--long-max-tokens", str(args.long_max_tokens),
        "--unread-every", str(args.unread_every),
        *(f"--skip={f}" for f in args.skip),
    ]  # fmt: skip


async def _observe_ends(rt: Runtime, watch: EndWatch) -> None:
    import trio

    remove = rt.add_record_observer(watch)
    try:
        await trio.sleep_forever()
    finally:
        remove()


async def soak_fronts(args: argparse.Namespace) -> dict[str, Any]:
    """Serve, load every front for ``args.duration`` seconds, and report."""
    import msgspec
    import trio
    import zmq

    from spectrio.core.config import RuntimeConfig
    from spectrio.http_api.front import HttpFront
    from spectrio.http_api.server import serve_http
    from spectrio.runtime.api import open_runtime
    from spectrio.runtime.metrics import ObservedRuntime, ServeMetrics
    from spectrio.wire.server import serve

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rss: list[tuple[float, int]] = []
    child: subprocess.CompletedProcess[bytes] | None = None
    health: dict[str, Any] = {}
    embed: dict[str, Any] = {}
    try:
        config = RuntimeConfig(model=args.model)
        async with open_runtime(config) as rt, trio.open_nursery() as nursery:
            metrics = ServeMetrics()  # as `serve --http`: the runtime observed by the metrics
            remove = metrics.attach(rt)

            async def run_metrics() -> None:
                try:
                    await metrics.run(rt)
                finally:
                    remove()

            nursery.start_soon(run_metrics)
            watch = EndWatch((DYING_RAW, DYING_CLIENT, UNREAD))
            nursery.start_soon(_observe_ends, rt, watch)
            served = cast("Runtime", ObservedRuntime(rt, [metrics]))
            front = HttpFront(served, model_name=args.model, registry=metrics.registry)
            server: WireServer = await nursery.start(
                functools.partial(
                    serve,
                    served,
                    "tcp://127.0.0.1:*",
                    "tcp://127.0.0.1:*",
                    None,
                    context=ctx,
                    output_stall_s=args.output_stall_s,
                )
            )
            assert server.endpoints is not None
            url: str = await nursery.start(serve_http, front, "127.0.0.1", 0)
            gc.freeze()  # as the CLI does once it serves
            print(f"serving: {url}, wire {server.endpoints.requests}", file=sys.stderr)

            rss0 = rss_bytes()
            t0 = time.monotonic()
            async with trio.open_nursery() as load:
                load.start_soon(sample_rss, rss)
                load.start_soon(poll_health, url, health)
                for task in range(0 if "embed" in args.skip else args.embed_tasks):
                    load.start_soon(embed_load, rt, task, args.seed, embed)
                with trio.move_on_after(args.duration + 120):  # the child is bounded too
                    child = await trio.run_process(
                        _load_command(args, url, server.endpoints.requests),
                        capture_stdout=True,
                        check=False,
                    )
                load.cancel_scope.cancel()
            load_end = time.monotonic()
            load_s = load_end - t0
            rss_end = rss_bytes()
            idle_s, idle = await wait_idle(rt, 3 * args.output_stall_s + 30.0)
            stats = rt.stats()
            after_health = rt.health()
            fresh = await fresh_request(rt, url, args.model)
            nursery.cancel_scope.cancel()
    finally:
        gc.unfreeze()
        ctx.destroy(linger=0)

    if child is None:
        raise RuntimeError(f"the load process did not end within {args.duration + 120:g} s")
    if child.returncode != 0:
        raise RuntimeError(f"the load process exited with status {child.returncode}")
    lines = child.stdout.decode().strip().splitlines()
    clients = json.loads(lines[-1])
    dying, unread = clients["wire_dying"], clients["wire_unread"]
    half = rss[len(rss) // 2 :]
    slope = theil_sen([t for t, _ in half], [b / 2**20 for _, b in half]) * 60.0
    counts = embed.get("counts", collections.Counter())
    return {
        "machine": f"{cpu_model()}, {os.cpu_count()} cpus",
        "args": {k: v for k, v in vars(args).items() if k not in ("load", "url", "requests")},
        "load_s": round(load_s, 1),
        "http": clients["http"],
        "wire_live": clients["wire_live"],
        "wire_dying": {k: v for k, v in dying.items() if k not in ("dead", "refused")},
        "wire_unread": {k: v for k, v in unread.items() if k not in ("dead", "refused")},
        "dying_raw_ended": dead_consumers(
            [d for d in dying["dead"] if d[0].startswith(DYING_RAW)],
            dying["refused"],
            watch.ends,
            load_end,
        ),
        "dying_client_ended": dead_consumers(
            [d for d in dying["dead"] if d[0].startswith(DYING_CLIENT)],
            dying["refused"],
            watch.ends,
            load_end,
        ),
        "unread_ended": dead_consumers(unread["dead"], unread["refused"], watch.ends, load_end),
        "tokens_generated": watch.tokens,
        "tokens_for_dead_consumers": watch.tokens_theirs,
        "embedding": {
            "completed": counts["completed"],
            "left": counts["left"],
            "timeouts": counts["timeouts"],
            "latency": percentiles(embed.get("latencies", [])),
        },
        "load_process_cpu_s": clients["cpu_s"],
        "health": {
            "counts": dict(health.get("counts", {})),
            "reasons": dict(health.get("reasons", {})),
        },
        "rss_start_mb": round(rss0 / 2**20, 1),
        "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_max_mb": round(max((b for _, b in rss), default=rss_end) / 2**20, 1),
        "rss_slope_mb_per_min": round(slope, 3),
        "rss_mb": [[round(t - t0, 1), round(b / 2**20, 1)] for t, b in rss],  # every second
        "idle_after_s": round(idle_s, 2),
        "idle": idle,
        "open_requests_after": after_health.open_requests,
        "kv_blocks_free": stats.free_kv_blocks,
        "kv_blocks_total": stats.num_kv_blocks,
        "finished": dict(stats.finished),
        "server": msgspec.structs.asdict(server.stats),
        "fresh_request": fresh,
    }


def _ended(what: str, d: dict[str, Any]) -> str:
    return (
        f"{what}: {d['sent']} sent, {d['ended_by_server']} ended by the server "
        f"({d['end_after_death_p50_s']} s after, max {d['end_after_death_max_s']} s), "
        f"{d['finished_on_their_own']} finished, {d['refused']} refused, "
        f"{d['never_ended']} never ended"
    )


def summary(res: dict[str, Any]) -> str:
    http, live, dying, unread = res["http"], res["wire_live"], res["wire_dying"], res["wire_unread"]
    embed, srv, hc = res["embedding"], res["server"], res["health"]["counts"]
    fresh = res["fresh_request"]
    wins = [w["completed"] for w in http["windows"]]
    worst = max((w["p99_ms"] or 0.0 for w in http["windows"]), default=0.0)
    non200 = sum(v for k, v in hc.items() if k != "200")
    lines = [
        f"load: {res['load_s']} s, {res['machine']}",
        f"HTTP ({res['args']['clients']} SDK clients): {http['completed']} completed, "
        f"{http['cut']} cut by the client, {http['timeouts']} timeouts, {http['5xx']} 5xx, "
        f"{http['other_errors']} other errors; latency p50 {http['latency']['p50_ms']} ms, "
        f"p99 {http['latency']['p99_ms']} ms, max {http['latency']['max_ms']} ms",
        f"  per {WINDOW_S:g} s: {min(wins, default=0)}-{max(wins, default=0)} completed, "
        f"worst p99 {worst} ms",
        f"wire, live consumer: {live.get('completed')} completed, {live.get('timeouts')} "
        f"timeouts, {live.get('gaps')} gaps; latency p50 {live['latency']['p50_ms']} ms, "
        f"p99 {live['latency']['p99_ms']} ms",
        f"wire, dying consumers: {dying.get('consumers')} consumers, {dying.get('sent')} "
        f"requests sent, {dying.get('timeouts')} timeouts",
        _ended("  closed connection (libzmq id)", res["dying_raw_ended"]),
        _ended("  closed Client (own id)", res["dying_client_ended"]),
        f"wire, unread outputs socket: {unread.get('sent')} sent, {unread.get('acked')} acked, "
        f"{unread.get('error rate_limited', 0)} rate_limited",
        _ended("  unread", res["unread_ended"]),
        f"  tokens generated for them: {res['tokens_for_dead_consumers']} of "
        f"{res['tokens_generated']} generated in all",
        f"  ended by the server: requests_stalled {srv['requests_stalled']}, clients_gone "
        f"{srv['clients_gone']}, steps_dropped {srv['steps_dropped']}, max_backlog "
        f"{srv['max_backlog']}",
        f"embedding API: {embed['completed']} completed, {embed['left']} left early, "
        f"{embed['timeouts']} timeouts; latency p50 {embed['latency']['p50_ms']} ms",
        f"/health: {hc.get('200', 0)} x 200, {non200} other {res['health']['reasons'] or ''}",
        f"RSS: {res['rss_start_mb']} MB at start, {res['rss_end_mb']} MB at end (max "
        f"{res['rss_max_mb']}), slope over the second half {res['rss_slope_mb_per_min']} MB/min",
        f"after: idle in {res['idle_after_s']} s (idle: {res['idle']}), KV blocks free "
        f"{res['kv_blocks_free']}/{res['kv_blocks_total']}",
        f"fresh 8-token request over HTTP: {fresh['first_http_s']} s (then median "
        f"{fresh['http_median_s']} s; in-process median {fresh['in_process_median_s']} s)",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bundled")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=32, help="concurrent openai SDK clients")
    p.add_argument("--embed-tasks", type=int, default=3, help="embedding API tasks")
    p.add_argument(
        "--long-max-tokens",
        type=int,
        default=960,
        help="max_tokens of the requests whose consumer dies or is absent (never reached "
        "before the server ends them)",
    )
    p.add_argument(
        "--unread-every", type=float, default=3.0, help="seconds between unread requests"
    )
    p.add_argument(
        "--output-stall-s",
        type=float,
        default=10.0,
        help="the wire server's bound (spectrio serve --output-stall-s; default as there)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=FRONTS,
        help="leave this load out (repeatable), for a baseline: http, live (the wire's live "
        "consumer), dying (its dying consumers), unread (the unread outputs socket), embed",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    # The child process's mode (the load generators); set by the parent.
    p.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--requests", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.load:
        res = run_load(args)
        print(json.dumps(res), flush=True)
        return res
    import trio

    from spectrio.tools.cli.logging_setup import configure_logging

    configure_logging("warning")
    res = trio.run(soak_fronts, args)
    print(summary(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
