"""``docs/wire.md`` checked sentence by sentence against a real ``spectrio serve`` process,
with nothing but pyzmq, msgpack and NumPy: no spectrio client code on the consumer side,
as a consumer in another language would have it (issue 15, part A).

Every step message the consumer reads is checked against the document's rules for any
step message (:meth:`Wire.on_step`): one more than the previous step number, the first
one numbered 1, per-slot lists of the record's length, the one gap rule (every slot's
``seqnos`` equals the consumer's count), ``errors`` always empty, a finished request never
named again, and ``N`` the sum of the positive ``accept_num``. The tests below add the
behaviour of each section: abort timing (overlap on and off), size limits, framing,
numbers and ordering.
"""

from __future__ import annotations

import itertools
import json
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

SERVE = [sys.executable, "-m", "spectrio.tools.cli", "serve"]
START_TIMEOUT = 120.0
WAIT = 30.0  # seconds any single expectation may take
MAX_MODEL_LEN = 256
PROMPT_IDS = [1, 400, 25, 7, 99, 1000, 3, 12]  # token ids: no tokenizer pass

Msg = dict[str, Any]


def pack(msg: Msg) -> bytes:
    return msgpack.packb(msg)


def submit(rid: str, prompt: str | list[int], **params: Any) -> Msg:
    return {"type": "submit", "v": 1, "request_id": rid, "prompt": prompt, "params": params}


def abort(rid: str) -> Msg:
    return {"type": "abort", "v": 1, "request_id": rid}


PING: Msg = {"type": "ping", "v": 1}


def ack(of: str, rid: str | None) -> Msg:
    return {"type": "ack", "v": 1, "of": of, "request_id": rid}


class ServeProcess:
    """``spectrio serve`` on loopback tcp ports; stderr goes to a file."""

    def __init__(self, tmp: Path, config: dict[str, Any], *args: str) -> None:
        cfg = tmp / "config.json"
        cfg.write_text(json.dumps(config))
        self._err_path = tmp / "serve.err"
        self._err = self._err_path.open("w")
        self.proc = subprocess.Popen(
            [
                *SERVE,
                "--config",
                str(cfg),
                "--requests",
                "tcp://127.0.0.1:*",
                "--outputs",
                "tcp://127.0.0.1:*",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT)
        assert ready, f"serve did not start:\n{self.stderr()}"
        line = self.proc.stdout.readline()
        assert line, f"serve exited with {self.proc.poll()}:\n{self.stderr()}"
        self.endpoints: dict[str, str] = json.loads(line)

    def stderr(self) -> str:
        self._err.flush()
        return self._err_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._err.close()


class Step:
    """One step message, decoded with msgpack and NumPy views (``docs/wire.md``)."""

    def __init__(self, frames: list[bytes]) -> None:
        assert len(frames) == 2, f"version 1 sends 2 frames, got {len(frames)}"
        self.env: Msg = msgpack.unpackb(frames[0])
        rec = frames[1]
        header = np.frombuffer(rec, "<i4", count=4)
        version, packed, bsz, n = (int(x) for x in header)
        assert version == 1 and packed & 0xFF == 3
        width = packed >> 8
        self.accept = np.frombuffer(rec, "<i4", count=bsz, offset=16)
        self.token_ids = np.frombuffer(rec, "<i4", count=n, offset=16 + 4 * bsz)
        words = 4 + bsz + n + (2 * n * width + n if width else 0)
        assert len(rec) == 4 * words
        assert n == int(np.maximum(self.accept, 0).sum())
        self.bsz = bsz

    def tokens(self) -> Iterator[tuple[int, str, int, list[int], str | None]]:
        """(slot, request id, accept_num, token ids, finish reason) per slot."""
        off = np.concatenate([[0], np.cumsum(np.maximum(self.accept, 0))])
        for i, rid in enumerate(self.env["request_ids"]):
            ids = [int(t) for t in self.token_ids[off[i] : off[i + 1]]]
            yield i, rid, int(self.accept[i]), ids, self.env["finish_reasons"][i]


class Wire:
    """A raw consumer: a DEALER on the requests, a PULL on the outputs, one thread.

    Replies and step messages are read by one poll loop; when both sockets are ready,
    step messages are read first, so a step that the server handed over before a reply
    is seen before it."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoints: dict[str, str]) -> None:
        self.req = ctx.socket(zmq.DEALER)
        self.req.setsockopt(zmq.LINGER, 0)
        self.req.connect(endpoints["requests"])
        self.out = ctx.socket(zmq.PULL)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.connect(endpoints["outputs"])
        self.replies: list[Msg] = []
        self._replies_taken = 0
        self.steps: list[Step] = []
        self.counts: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.last_slot: dict[str, int] = {}  # request id -> accept_num of its last slot
        self.totals: dict[str, list[int]] = {}  # request id -> the final step's drafts entry

    def close(self) -> None:
        self.req.close(0)
        self.out.close(0)

    def send(self, msg: Msg | bytes) -> None:
        self.req.send(msg if isinstance(msg, bytes) else pack(msg))

    def on_step(self, step: Step) -> None:
        env = step.env
        assert env["type"] == "step" and env["v"] == 1
        # Since 1.7 the outputs socket gets only the steps with one of its requests in
        # them: step numbers increase, and may skip (those of other destinations).
        after = 0 if not self.steps else self.steps[-1].env["step"]
        assert env["step"] > after, f"step {env['step']} after {after}"
        assert len(env["request_ids"]) == len(env["seqnos"]) == len(env["finish_reasons"])
        assert len(env["request_ids"]) == step.bsz
        assert env["errors"] == []
        for _slot, rid, accept, ids, reason in step.tokens():
            assert rid not in self.finished, f"{rid} named after its finish"
            # The gap rule: every slot, with or without tokens.
            assert env["seqnos"][_slot] == self.counts.get(rid, 0), (rid, env)
            self.tokens.setdefault(rid, []).extend(ids)
            self.counts[rid] = self.counts.get(rid, 0) + len(ids)
            self.last_slot[rid] = accept
            if accept == -9:
                assert not ids
            if reason is not None:
                assert reason in ("stop", "length", "abort")
                self.finished[rid] = reason
                # Since 1.3 every request that ends (aborted ones too) has its totals here.
                totals = env.get("drafts", {}).get(rid)
                assert isinstance(totals, list) and len(totals) == 2, (rid, env)
                assert 0 <= totals[1] <= totals[0]
                self.totals[rid] = totals
                del self.counts[rid]
        self.steps.append(step)

    def pump(self, until: Callable[[], bool], timeout: float = WAIT) -> None:
        """Read step messages and replies until ``until()`` holds."""
        poller = zmq.Poller()
        poller.register(self.out, zmq.POLLIN)
        poller.register(self.req, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            assert left > 0, "timed out"
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self.out in ready:
                self.on_step(Step(self.out.recv_multipart()))
                continue  # steps first
            if self.req in ready:
                frames = self.req.recv_multipart()
                assert len(frames) == 1, frames
                self.replies.append(msgpack.unpackb(frames[0]))

    def reply(self, timeout: float = WAIT) -> Msg:
        """The next reply (step messages meanwhile are consumed and checked)."""
        seen = self._replies_taken
        self.pump(lambda: len(self.replies) > seen, timeout)
        self._replies_taken += 1
        return self.replies[seen]

    def run(self, rid: str, prompt: str | list[int], **params: Any) -> list[int]:
        """Submit, expect the Ack, read to the finish; the request's tokens."""
        self.send(submit(rid, prompt, **params))
        assert self.reply() == ack("submit", rid)
        self.pump(lambda: rid in self.finished)
        return self.tokens[rid]


_ids = itertools.count()


def new_id(name: str) -> str:
    return f"{name}-{next(_ids)}"


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _served(
    tmp_path_factory: pytest.TempPathFactory,
    ctx: zmq.Context[zmq.Socket[bytes]],
    overlap: bool,
) -> Iterator[tuple[ServeProcess, Wire]]:
    tmp = tmp_path_factory.mktemp("overlap" if overlap else "plain")
    server = ServeProcess(tmp, {"max_model_len": MAX_MODEL_LEN, "enable_overlap": overlap})
    wire = Wire(ctx, server.endpoints)  # connected before any step is published
    try:
        yield server, wire
    finally:
        wire.close()
        server.stop()


@pytest.fixture(scope="module")
def plain(
    tmp_path_factory: pytest.TempPathFactory, ctx: zmq.Context[zmq.Socket[bytes]]
) -> Iterator[tuple[ServeProcess, Wire]]:
    yield from _served(tmp_path_factory, ctx, overlap=False)


@pytest.fixture(scope="module")
def overlapped(
    tmp_path_factory: pytest.TempPathFactory, ctx: zmq.Context[zmq.Socket[bytes]]
) -> Iterator[tuple[ServeProcess, Wire]]:
    yield from _served(tmp_path_factory, ctx, overlap=True)


@pytest.fixture
def wire(plain: tuple[ServeProcess, Wire]) -> Wire:
    return plain[1]


def other_dealer(ctx: zmq.Context[zmq.Socket[bytes]], server: ServeProcess) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(WAIT * 1000))
    sock.connect(server.endpoints["requests"])
    return sock


# ---- Ordering: the first step number, and nothing published while idle ----------------------


def test_the_first_step_of_a_server_run_is_numbered_1_and_each_next_one_more(wire: Wire) -> None:
    """*Ordering*: "The first step message of a server run has `step` 1"; the
    consumer's checks (``Wire.on_step``) hold each later one to one more."""
    wire.run(new_id("first"), PROMPT_IDS, max_tokens=3)
    assert wire.steps[0].env["step"] == 1


def test_nothing_is_published_while_the_server_is_idle(wire: Wire) -> None:
    """*Ordering*: "While no request is running, nothing is published"."""
    wire.run(new_id("idle"), PROMPT_IDS, max_tokens=3)
    assert wire.out.poll(700) == 0  # no step message within 0.7 s of the last request's end


# ---- Abort timing (overlap off and on) -------------------------------------------------------


def _abort_midway(wire: Wire, n: int, others: int) -> None:
    """Run ``others`` requests next to ``n`` that are aborted midway, one after another;
    every aborted request's tokens end before its Ack."""
    background = [new_id("bg") for _ in range(others)]
    for rid in background:
        wire.send(submit(rid, PROMPT_IDS, max_tokens=200, ignore_eos=True))
        assert wire.reply() == ack("submit", rid)
    for _ in range(n):
        rid = new_id("abort")
        wire.send(submit(rid, PROMPT_IDS, max_tokens=200, ignore_eos=True))
        assert wire.reply() == ack("submit", rid)
        wire.pump(lambda rid=rid: len(wire.tokens.get(rid, [])) >= 4)  # type: ignore[misc]
        assert rid not in wire.finished
        wire.send(abort(rid))
        assert wire.reply() == ack("abort", rid)
        at_ack = len(wire.tokens[rid])
        wire.pump(lambda rid=rid: rid in wire.finished)  # type: ignore[misc]
        # "Once the Ack of an Abort is sent, no further tokens of that request are
        # published; its next slot is -9 with finish reason abort."
        assert len(wire.tokens[rid]) == at_ack, "tokens arrived after the abort's Ack"
        assert wire.finished[rid] == "abort" and wire.last_slot[rid] == -9
    for rid in background:
        wire.send(abort(rid))
        assert wire.reply()["request_id"] == rid
    wire.pump(lambda: all(rid in wire.finished for rid in background))


def test_no_token_is_published_after_the_ack_of_an_abort(wire: Wire) -> None:
    _abort_midway(wire, n=5, others=3)


def test_no_token_is_published_after_the_ack_of_an_abort_with_overlap(
    overlapped: tuple[ServeProcess, Wire],
) -> None:
    """The same with two steps in flight (``enable_overlap``): the step computed before
    the abort arrived has its tokens of that request dropped."""
    _abort_midway(overlapped[1], n=5, others=3)


def test_an_abort_while_the_prompt_is_tokenized_is_answered_after_its_submit(
    wire: Wire,
) -> None:
    """*Who may abort*: the reply to an `Abort` never comes before the reply to the
    `Submit` it names; the request ends with one `-9` slot, `"abort"`."""
    for _ in range(3):
        rid = new_id("tok")
        wire.send(submit(rid, "def fib(n):\n    " * 15, max_tokens=50, ignore_eos=True))
        wire.send(abort(rid))
        assert wire.reply() == ack("submit", rid)
        assert wire.reply() == ack("abort", rid)
        at_ack = len(wire.tokens.get(rid, []))
        wire.pump(lambda rid=rid: rid in wire.finished)  # type: ignore[misc]
        assert wire.finished[rid] == "abort" and wire.last_slot[rid] == -9
        assert len(wire.tokens.get(rid, [])) == at_ack


def test_an_abort_of_a_finished_request_gets_unknown_request(wire: Wire) -> None:
    """*Abort*: an `Abort` that comes after the request finished gets `unknown_request`;
    the request's last slot has its own finish reason."""
    rid = new_id("done")
    wire.run(rid, PROMPT_IDS, max_tokens=3)
    assert wire.finished[rid] == "length"
    wire.send(abort(rid))
    reply = wire.reply()
    assert reply["type"] == "error" and reply["code"] == "unknown_request"
    assert reply["request_id"] == rid


# ---- Size limits -------------------------------------------------------------------------------


@pytest.mark.parametrize("mib", [2, 5])
def test_a_request_over_the_cap_gets_too_large(wire: Wire, mib: int) -> None:
    """*Limits*: a frame over `--max-request-bytes` (1 MiB) and up to the transport
    limit (16 MiB) gets `too_large`, with `request_id` nil (it is not decoded)."""
    rid = new_id("big")
    frame = pack(submit(rid, "x" * (mib << 20)))
    assert len(frame) > mib << 20
    wire.send(frame)
    reply = wire.reply()
    assert reply["type"] == "error" and reply["code"] == "too_large"
    assert reply["request_id"] is None
    wire.send(PING)
    assert wire.reply() == ack("ping", None)


def test_a_message_over_the_transport_limit_closes_the_connection_without_a_reply(
    ctx: zmq.Context[zmq.Socket[bytes]], plain: tuple[ServeProcess, Wire]
) -> None:
    """*Limits*: beyond 16 MiB libzmq closes the connection without a reply; the message
    is lost, a DEALER reconnects by itself, and every other client is served as before."""
    server, wire = plain
    big = other_dealer(ctx, server)
    try:
        big.send(b"\x00" * ((16 << 20) + 1))
        assert big.poll(1500) == 0  # no reply
        big.send(pack(PING))  # the same socket, reconnected
        assert msgpack.unpackb(big.recv()) == ack("ping", None)
    finally:
        big.close(0)
    assert len(wire.run(new_id("after-big"), PROMPT_IDS, max_tokens=4)) == 4


# ---- Framing -----------------------------------------------------------------------------------


def test_a_req_socket_is_answered(
    ctx: zmq.Context[zmq.Socket[bytes]], plain: tuple[ServeProcess, Wire]
) -> None:
    """*Framing*: a REQ socket (it sends an empty delimiter frame first) gets its replies
    with the delimiter, so it reads them as replies."""
    server, wire = plain
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, int(WAIT * 1000))
    req.connect(server.endpoints["requests"])
    try:
        req.send(pack(PING))
        assert msgpack.unpackb(req.recv()) == ack("ping", None)
        rid = new_id("req")
        req.send(pack(submit(rid, PROMPT_IDS, max_tokens=3)))
        assert msgpack.unpackb(req.recv()) == ack("submit", rid)
        req.send(b"\xc1")
        assert msgpack.unpackb(req.recv())["code"] == "bad_frame"
    finally:
        req.close(0)
    wire.pump(lambda: rid in wire.finished)
    assert len(wire.tokens[rid]) == 3


@pytest.mark.parametrize(
    ("frames", "want_frames", "code"),
    [
        ([b"", pack(PING)], [b""], None),  # REQ framing from a DEALER: delimiter kept
        ([pack(PING), pack(PING)], [], "bad_frame"),  # two frames
        ([b"", pack(PING), pack(PING)], [b""], "bad_frame"),  # two frames after a delimiter
        ([b""], [], "bad_frame"),  # one empty frame: not msgpack
    ],
)
def test_framings_and_their_replies(
    ctx: zmq.Context[zmq.Socket[bytes]],
    plain: tuple[ServeProcess, Wire],
    frames: list[bytes],
    want_frames: list[bytes],
    code: str | None,
) -> None:
    """*Framing*: the table of accepted framings and how each is answered."""
    sock = other_dealer(ctx, plain[0])
    try:
        sock.send_multipart(frames)
        got = sock.recv_multipart()
    finally:
        sock.close(0)
    assert got[:-1] == want_frames
    reply = msgpack.unpackb(got[-1])
    if code is None:
        assert reply == ack("ping", None)
    else:
        assert reply["type"] == "error" and reply["code"] == code


# ---- Numbers -----------------------------------------------------------------------------------


def test_an_int_is_accepted_where_a_float_is_specified(wire: Wire) -> None:
    """*Numbers*: `"temperature": 1` (an int) is the float 1.0."""
    rid = new_id("int-temp")
    ids = wire.run(rid, PROMPT_IDS, max_tokens=5, temperature=1, top_p=1, seed=7)
    again = wire.run(new_id("float-temp"), PROMPT_IDS, max_tokens=5, temperature=1.0, seed=7)
    assert ids == again and len(ids) == 5


@pytest.mark.parametrize(
    ("params", "code"),
    [
        ({"max_tokens": 2.0}, "wrong_type"),
        ({"max_tokens": 3.5}, "wrong_type"),
        ({"top_k": True}, "wrong_type"),
        ({"seed": 1.0}, "wrong_type"),
        ({"seed": 2**63}, "invalid_params"),
        ({"seed": -1}, "invalid_params"),
    ],
)
def test_a_float_is_never_accepted_where_an_int_is(
    wire: Wire, params: dict[str, Any], code: str
) -> None:
    """*Numbers*: no float (not even 2.0) and no bool where an int is specified; the
    seed is in [0, 2^63)."""
    rid = new_id("num")
    wire.send(submit(rid, PROMPT_IDS, **params))
    reply = wire.reply()
    assert reply["type"] == "error" and reply["code"] == code, reply
    assert reply["request_id"] == rid


def test_the_largest_seed_needs_64_bits(wire: Wire) -> None:
    """*Numbers*: the seed's range is [0, 2^63 - 1]; the largest one is accepted."""
    ids = wire.run(new_id("seed"), PROMPT_IDS, max_tokens=3, temperature=0.7, seed=2**63 - 1)
    assert len(ids) == 3


def test_the_transport_limit_is_16_times_the_cap_and_at_least_16_mib(tmp_path: Path) -> None:
    """*Limits*: the default transport limit, and a limit not above the cap is refused
    (status 2, before the model is loaded)."""
    from spectrio.wire.server import message_cap

    assert message_cap(1 << 20) == 16 << 20
    assert message_cap(4096) == 16 << 20
    assert message_cap(2 << 20) == 32 << 20
    assert message_cap(1 << 20, 2 << 20) == 2 << 20
    with pytest.raises(ValueError, match="must exceed"):
        message_cap(1 << 20, 1 << 20)
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            *SERVE,
            "--run-dir",
            str(run),
            "--max-request-bytes",
            "2048",
            "--max-message-bytes",
            "2048",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "must exceed" in proc.stderr
    assert "model loaded" not in proc.stderr
