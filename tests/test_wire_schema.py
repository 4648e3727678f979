"""Issue 5, wire schema v1: round trips, the schema pin, classification of malformed request
frames, a fuzz test, the worked example in docs/wire.md, and a consumer that reads a live
runtime's step frames with the plain ``msgpack`` package, following docs/wire.md only."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spectrio import Delta, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.acceptance import Acceptance
from spectrio.core.messages import Ended, PublishedStep, SeqResult, StepResult, TokenLogprob
from spectrio.stages.output.records import publish_step
from spectrio.wire.codec import (
    SequenceCounter,
    WireError,
    check_submit,
    decode_envelope,
    decode_reply,
    decode_request,
    decode_step,
    encode,
    encode_step,
)
from spectrio.wire.schema import (
    SCHEMA_MINOR,
    SCHEMA_VERSION,
    WIRE_TYPES,
    Abort,
    Ack,
    Error,
    ErrorCode,
    Info,
    ModelInfo,
    Ping,
    SpeculativeInfo,
    StepEnvelope,
    Submit,
    schema_fingerprint,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "wire.md"

# The pin: one fingerprint per schema version (major, minor). Changing any wire message
# changes the fingerprint; then bump SCHEMA_MINOR (an addition old peers can ignore) or
# SCHEMA_VERSION (anything else) and record the new fingerprint under it.
# v1 was re-pinned, not bumped, for two additions that change no valid request: the
# `duplicate_key` error code (for frames whose meaning was ambiguous), and the ranges of
# SamplingParams as msgspec constraints (values the server refused after decoding, with
# the same code, before).
PINNED_FINGERPRINTS = {
    (1, 0): "b21ade5251671c646859a2a75cc2b7f2206f905fd2d46d056fdfc1a0336db75c",
    (1, 1): "1fa20147d75602ccec0374458b3dcabd31263868cfafea8c2636bf25a7d402dc",  # drafts
    (1, 2): "f973064dbc67e4f731bae19070c995e4cc63260275681a0ac54832588e81a525",  # Info
    (1, 3): "70b235711a675da2ca865ad5693841dc7cd2cf0b7b75475963f8e04e710ac6b5",  # aborted in drafts
    (1, 4): "04e95093295681138d6fe5ae3415760c942e5520e8e2e16247a38f84f3388207",  # ngram info
    (1, 5): "1b1abac351e3c0ccff023aca7ae761ab36f2e0928922f4dcbdac6c8576e911ac",  # messages
    (1, 6): "4ea4fb9c908c7b965e545555ae960b64b3f93d5c08ec6ce06d54ddfd2c686bb3",  # cache_salt
    (1, 7): "becc5e910be5b9c93e5fbe646223fdba17854cbf63d4596678578c42cc969591",  # stream, health
    (1, 8): "dffd50f1750abfd89e2711192401be8ddfd36424e3095e7e101462faa2ff84b4",  # prompt_logprobs
    (1, 9): "2fb6bf980c76e78c9973d283ad37e36e2b6b42de097e1bb5322ed9c46b167ac8",  # draft_model
    (1, 10): "510e918ebf539314feaf502fc0dcf6c08c57ef0e263aa44523ff419cc35fb9ad",  # constraint
}


def mp(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class Encoded(bytes):
    """A value already encoded as msgpack."""


def map_with_pairs(pairs: list[tuple[str, Any]]) -> Encoded:
    """A msgpack map written pair by pair, so a key may repeat (map16 above 15 pairs)."""
    n = len(pairs)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    body = b"".join(mp(k) + (v if isinstance(v, Encoded) else mp(v)) for k, v in pairs)
    return Encoded(head + body)


SUBMIT_PAIRS = [("type", "submit"), ("v", 1), ("request_id", "r1"), ("prompt", [1, 2, 3])]


def submit_map(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "type": "submit",
        "v": SCHEMA_VERSION,
        "request_id": "r1",
        "prompt": [1, 2, 3],
    }
    base.update(over)
    return base


# ---- round trips and the pin --------------------------------------------------------------

ALL_MESSAGES: list[msgspec.Struct] = [
    Submit(v=1, request_id="a", prompt="def f():"),
    Submit(
        v=1,
        request_id="b" * 128,
        prompt=[0, 5, 2**31 - 1],
        params=SamplingParams(max_tokens=3, temperature=0.7, seed=2**62, stop=["\n"], logprobs=5),
    ),
    Abort(v=1, request_id="a"),
    Ping(v=1),
    Info(v=1),
    Info(v=1, tokenizer=True),
    Ack(of="submit", request_id="a"),
    Ack(of="ping"),
    Error(code=ErrorCode.BAD_FRAME, reason="nope"),
    Error(code=ErrorCode.DUPLICATE_REQUEST, reason="running", request_id="a"),
    StepEnvelope(
        step=3,
        request_ids=["a", "b"],
        seqnos=[0, 17],
        finish_reasons=[None, "stop"],
        errors=[Error(code=ErrorCode.UNAVAILABLE, reason="shutdown", request_id="c")],
        drafts={"b": (6, 4)},
    ),
    ModelInfo(
        model="bundled",
        vocab_size=1000,
        max_model_len=1024,
        eos_token_id=0,
        speculative=SpeculativeInfo(
            method="mtp", num_speculative_tokens=2, num_model_steps=None, adaptive=True
        ),
        tokenizer_sha256="ab" * 32,
        tokenizer_bytes=12,
        tokenizer_json='{"x": "é"}',
    ),
]


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_struct_round_trips_through_its_typed_decoder(msg: msgspec.Struct) -> None:
    frame = encode(msg)
    if isinstance(msg, Submit | Abort | Ping | Info):
        assert decode_request(frame) == msg
    elif isinstance(msg, Ack | Error | ModelInfo):
        assert decode_reply(frame) == msg
    else:
        assert decode_envelope(frame) == msg
    # Every message is a self-describing msgpack map with "type" and "v".
    plain = msgpack.unpackb(frame, raw=False)
    assert plain["type"] == type(msg).__struct_config__.tag and plain["v"] == SCHEMA_VERSION


def test_schema_is_pinned_to_its_version() -> None:
    got = schema_fingerprint()
    version = (SCHEMA_VERSION, SCHEMA_MINOR)
    assert PINNED_FINGERPRINTS.get(version) == got, (
        "the wire schema changed: bump SCHEMA_MINOR or SCHEMA_VERSION in wire/schema.py, "
        f"update docs/wire.md, and pin {{{version}: {got!r}}} here"
    )
    assert max(PINNED_FINGERPRINTS) == version


def test_the_pin_notices_a_changed_field_type_name_or_error_code() -> None:
    base = schema_fingerprint()

    class Ping(
        msgspec.Struct,
        frozen=True,
        gc=False,
        kw_only=True,
        tag_field="type",
        tag="ping",
        forbid_unknown_fields=True,
    ):
        v: str  # was int

    class Abort(
        msgspec.Struct,
        frozen=True,
        gc=False,
        kw_only=True,
        tag_field="type",
        tag="abort",
        forbid_unknown_fields=True,
    ):
        v: int
        rid: str  # was request_id

    swap = {"Ping": Ping, "Abort": Abort}
    for name, cls in swap.items():
        types = tuple(cls if t.__name__ == name else t for t in WIRE_TYPES)
        assert schema_fingerprint(types) != base, name
    assert schema_fingerprint(WIRE_TYPES[:-1]) != base  # a message dropped


def test_error_codes_are_documented_strings() -> None:
    doc = DOC.read_text()
    for code in ErrorCode:
        assert isinstance(code.value, str) and code.value == code.value.lower()
        assert f"`{code.value}`" in doc, f"docs/wire.md does not document {code.value}"
    assert (
        msgpack.unpackb(encode(Error(code=ErrorCode.TOO_LARGE, reason="x")))["code"] == "too_large"
    )


# ---- malformed requests: one code per class ----------------------------------------------

VALID = mp(submit_map())

MALFORMED: list[tuple[str, bytes, ErrorCode, str | None]] = [
    ("random bytes", b"\xc1\x07\xff\x00garbage", ErrorCode.BAD_FRAME, None),
    ("empty frame", b"", ErrorCode.BAD_FRAME, None),
    ("truncated msgpack", VALID[:-3], ErrorCode.BAD_FRAME, None),
    ("trailing bytes", VALID + b"\x00", ErrorCode.BAD_FRAME, None),
    (
        "invalid UTF-8 in a string",
        VALID.replace(b"submit", b"\x80ubmit"),
        ErrorCode.BAD_FRAME,
        None,
    ),
    ("top level not a map", mp([1, 2, 3]), ErrorCode.WRONG_TYPE, None),
    ("field of the wrong type", mp(submit_map(prompt=3.5)), ErrorCode.WRONG_TYPE, "r1"),
    (
        "param of the wrong type",
        mp(submit_map(params={"max_tokens": "9"})),
        ErrorCode.WRONG_TYPE,
        "r1",
    ),
    ("version of the wrong type", mp({"type": "ping", "v": "1"}), ErrorCode.WRONG_TYPE, None),
    ("unknown tag", mp({"type": "submitt", "v": 1}), ErrorCode.UNKNOWN_TYPE, None),
    ("no tag", mp({"v": 1, "request_id": "r1"}), ErrorCode.UNKNOWN_TYPE, "r1"),
    ("tag of the wrong type", mp({"type": 7, "v": 1}), ErrorCode.UNKNOWN_TYPE, None),
    ("extra field", mp(submit_map(priority=1)), ErrorCode.UNKNOWN_FIELD, "r1"),
    ("extra param", mp(submit_map(params={"beam_width": 4})), ErrorCode.UNKNOWN_FIELD, "r1"),
    ("missing field", mp({"type": "abort", "v": 1}), ErrorCode.MISSING_FIELD, None),
    ("missing version", mp({"type": "abort", "request_id": "x"}), ErrorCode.MISSING_FIELD, "x"),
    ("newer schema", mp({"type": "ping", "v": 2}), ErrorCode.SCHEMA_VERSION, None),
    (
        "older schema, other fields",
        mp({"type": "abort", "v": 0, "id": "q", "request_id": "q"}),
        ErrorCode.SCHEMA_VERSION,
        "q",
    ),
    ("empty request id", mp(submit_map(request_id="")), ErrorCode.INVALID_FIELD, None),
    ("over-long request id", mp(submit_map(request_id="x" * 129)), ErrorCode.INVALID_FIELD, None),
    ("negative token id", mp(submit_map(prompt=[4, -1])), ErrorCode.INVALID_FIELD, "r1"),
    ("token id beyond int32", mp(submit_map(prompt=[2**31])), ErrorCode.INVALID_FIELD, "r1"),
    ("float token id", mp(submit_map(prompt=[4, 2.0])), ErrorCode.WRONG_TYPE, "r1"),
    ("bool token id", mp(submit_map(prompt=[True])), ErrorCode.WRONG_TYPE, "r1"),
    ("param out of range", mp(submit_map(params={"top_p": 1.5})), ErrorCode.INVALID_PARAMS, "r1"),
    # A repeated key: msgspec would keep the last value, other libraries the first.
    (
        "duplicate type key",
        map_with_pairs([("type", "ping"), *SUBMIT_PAIRS]),
        ErrorCode.DUPLICATE_KEY,
        "r1",
    ),
    (
        "duplicate request id",
        map_with_pairs([*SUBMIT_PAIRS, ("request_id", "r2")]),
        ErrorCode.DUPLICATE_KEY,
        None,
    ),
    (
        "duplicate key, same value",
        map_with_pairs([*SUBMIT_PAIRS, ("prompt", [1, 2, 3])]),
        ErrorCode.DUPLICATE_KEY,
        "r1",
    ),
    (
        "duplicate key in params",
        map_with_pairs(
            [*SUBMIT_PAIRS, ("params", map_with_pairs([("max_tokens", 2), ("max_tokens", 900)]))]
        ),
        ErrorCode.DUPLICATE_KEY,
        "r1",
    ),
    (
        "duplicate key in a map16",
        map_with_pairs([*SUBMIT_PAIRS, *[(f"k{i}", i) for i in range(14)], ("k3", 3)]),
        ErrorCode.DUPLICATE_KEY,
        "r1",
    ),
    (
        "duplicate key, other schema",
        map_with_pairs([("type", "ping"), ("v", 2), ("type", "ping")]),
        ErrorCode.SCHEMA_VERSION,
        None,
    ),
]


@pytest.mark.parametrize(
    ("frame", "key"),
    [
        (map_with_pairs([("type", "ping"), *SUBMIT_PAIRS]), "'type'"),
        (map_with_pairs([*SUBMIT_PAIRS, ("request_id", "r1")]), "'request_id'"),
        (
            map_with_pairs([*SUBMIT_PAIRS, ("params", map_with_pairs([("seed", 1), ("seed", 2)]))]),
            "'params.seed'",
        ),
    ],
)
def test_a_duplicate_key_is_named(frame: bytes, key: str) -> None:
    with pytest.raises(WireError) as info:
        decode_request(frame)
    assert info.value.code is ErrorCode.DUPLICATE_KEY
    assert info.value.reason == f"key {key} appears more than once"


@pytest.mark.parametrize(
    ("frame", "code", "rid"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_each_malformed_class_gets_its_code(frame: bytes, code: ErrorCode, rid: str | None) -> None:
    with pytest.raises(WireError) as info:
        decode_request(frame)
    assert info.value.code is code, info.value.reason
    assert info.value.request_id == rid
    reply = decode_reply(encode(info.value.to_reply()))
    assert isinstance(reply, Error) and reply.code is code and reply.request_id == rid


def test_oversized_frames_are_refused_before_decoding() -> None:
    frame = mp(submit_map(prompt=list(range(1000))))
    assert isinstance(decode_request(frame, max_bytes=len(frame)), Submit)
    with pytest.raises(WireError) as info:
        decode_request(frame, max_bytes=len(frame) - 1)
    assert info.value.code is ErrorCode.TOO_LARGE
    with pytest.raises(WireError) as info:
        decode_request(b"\xc1" * 100, max_bytes=10)  # size is checked first
    assert info.value.code is ErrorCode.TOO_LARGE


def test_requests_decode_from_any_buffer_and_accept_defaults() -> None:
    sub = decode_request(memoryview(bytearray(VALID)))
    assert isinstance(sub, Submit) and sub.prompt == [1, 2, 3] and sub.params == SamplingParams()
    assert decode_request(np.frombuffer(mp({"type": "ping", "v": 1}), dtype=np.uint8)) == Ping(v=1)
    assert decode_request(mp(submit_map(prompt="hi"))).prompt == "hi"  # type: ignore[union-attr]


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text if not c.isspace()]


@pytest.mark.parametrize(
    ("fields", "code", "reason"),
    [
        ({"params": {"stop_token_ids": [50]}}, ErrorCode.INVALID_PARAMS, "stop_token_ids:"),
        ({"params": {"min_tokens": 9, "max_tokens": 4}}, ErrorCode.INVALID_PARAMS, "min_tokens:"),
        ({"params": {"temperature": float("inf")}}, ErrorCode.INVALID_PARAMS, "temperature:"),
        ({"prompt": []}, ErrorCode.EMPTY_PROMPT, "prompt:"),
        ({"prompt": ""}, ErrorCode.EMPTY_PROMPT, "prompt:"),
        ({"prompt": "   "}, ErrorCode.EMPTY_PROMPT, "prompt:"),
        ({"prompt": list(range(10))}, ErrorCode.PROMPT_TOO_LONG, "max_model_len=10"),
        ({"prompt": "abcdefghij"}, ErrorCode.PROMPT_TOO_LONG, "max_model_len=10"),
        ({"prompt": [1, 50]}, ErrorCode.INVALID_FIELD, "below the vocabulary size 50, got 50"),
    ],
)
def test_server_side_submit_checks(fields: dict[str, Any], code: ErrorCode, reason: str) -> None:
    sub = decode_request(mp(submit_map(**fields)))
    assert isinstance(sub, Submit)
    with pytest.raises(WireError) as info:
        check_submit(sub, vocab_size=50, max_model_len=10, tokenize=_Tok().encode)
    assert info.value.code is code and reason in info.value.reason
    assert info.value.request_id == "r1"


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"temperature": -1.0}, "temperature: must be a finite number >= 0, got -1.0"),
        ({"logprobs": 21}, "logprobs: must be None or an int in [0, 20], got 21"),
        ({"stop": ["a", ""]}, "stop: must be a list of non-empty strings, got '' at index 1"),
    ],
)
def test_params_out_of_range_are_refused_while_decoding(
    params: dict[str, Any], reason: str
) -> None:
    with pytest.raises(WireError) as info:
        decode_request(mp(submit_map(params=params)))
    assert (info.value.code, info.value.reason, info.value.request_id) == (
        ErrorCode.INVALID_PARAMS,
        reason,
        "r1",
    )


def test_server_side_submit_checks_pass_good_prompts() -> None:
    for prompt, ids in (([3, 49], [3, 49]), ("a b", [97 % 50, 98 % 50])):
        sub = decode_request(mp(submit_map(prompt=prompt, params={"max_tokens": 4})))
        assert isinstance(sub, Submit)
        assert check_submit(sub, vocab_size=50, max_model_len=10, tokenize=_Tok().encode) == ids


# ---- fuzz ---------------------------------------------------------------------------------

FIELD_NAMES = [
    "type",
    "v",
    "request_id",
    "prompt",
    "params",
    "max_tokens",
    "temperature",
    "seed",
    "stop",
    "logprobs",
    "x",
]
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["submit", "abort", "ping", "ack", 1, 0, 2])
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=4), inner, max_size=5)
    ),
    max_leaves=12,
)
SEEDS = [
    VALID,
    mp({"type": "ping", "v": 1}),
    mp({"type": "abort", "v": 1, "request_id": "z"}),
    mp(submit_map(prompt="text", params={"max_tokens": 2, "stop": ["a"], "seed": 3})),
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    frame = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        at = draw(st.integers(0, max(0, len(frame) - 1)))
        if op == "flip" and frame:
            frame[at] = draw(st.integers(0, 255))
        elif op == "cut":
            del frame[at:]
        elif op == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif frame:
            del frame[at]
    return bytes(frame)


FRAMES = (
    st.binary(max_size=64)
    | mutated()
    | VALUES.map(mp)
    | st.builds(
        lambda extra: mp(submit_map(**extra)),
        st.dictionaries(st.sampled_from(FIELD_NAMES), LEAVES, max_size=3),
    )
)


def test_fuzz_decode_request_raises_only_wire_errors() -> None:
    seen: list[int] = [0, 0]  # frames, frames refused

    @settings(
        max_examples=500,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(FRAMES, min_size=20, max_size=30))
    def run(frames: list[bytes]) -> None:
        for frame in frames:
            seen[0] += 1
            try:
                msg = decode_request(frame, max_bytes=512)
            except WireError as exc:
                seen[1] += 1
                assert isinstance(exc.code, ErrorCode) and exc.reason
                assert exc.request_id is None or isinstance(exc.request_id, str)
            else:
                assert isinstance(msg, Submit | Abort | Ping) and msg.v == SCHEMA_VERSION
                assert decode_request(encode(msg)) == msg

    run()
    assert seen[0] >= 10_000
    assert seen[1] > seen[0] // 2  # the generator really produces malformed frames


def test_fuzz_repeated_keys_are_always_refused_and_named() -> None:
    """Maps written pair by pair, with keys drawn from a small set so they often repeat,
    at the top level and in nested maps (``params``): a frame with a repeated key is
    always refused with ``duplicate_key`` naming a repeated key (or, first, with
    ``schema_version``); one without never is."""
    keys = st.sampled_from(["type", "v", "request_id", "prompt", "params", "x"])
    param_keys = st.sampled_from(["max_tokens", "seed", "stop", "y"])
    leaves = st.sampled_from(["submit", "ping", 1, 2, "r1", [1, 2], ["a"], None])
    params = st.lists(st.tuples(param_keys, leaves), max_size=4)

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(st.lists(st.tuples(keys, leaves | params), min_size=1, max_size=7))
    def run(pairs: list[tuple[str, Any]]) -> None:
        def encode_value(v: Any) -> Any:
            if isinstance(v, list) and v and isinstance(v[0], tuple):
                return map_with_pairs(v)
            return v

        frame = map_with_pairs([(k, encode_value(v)) for k, v in pairs])
        top = [k for k, _ in pairs]
        repeated = {k for k in top if top.count(k) > 1}
        for k, v in pairs:  # a map nested in the request (params, or a wrong spot)
            if isinstance(v, list) and v and isinstance(v[0], tuple):
                inner = [pk for pk, _ in v]
                repeated |= {f"{k}.{pk}" for pk in inner if inner.count(pk) > 1}
        try:
            decode_request(frame)
        except WireError as exc:
            if exc.code is ErrorCode.DUPLICATE_KEY:
                named = exc.reason.split("'")[1]
                assert named in repeated, (named, repeated)
                return
            assert exc.code is ErrorCode.SCHEMA_VERSION or not repeated, (exc.code, repeated)
            return
        assert not repeated

    run()


# ---- output: envelope, sequence numbers, the documented example ---------------------------


def example_step() -> tuple[PublishedStep, list[int]]:
    """The worked example of docs/wire.md: four slots, a logprob block of width 2."""

    def lp(tok: int, val: float, alt: int, alt_val: float, rank: int) -> TokenLogprob:
        return TokenLogprob(token_id=tok, logprob=val, rank=rank, top=[(alt, alt_val)])

    result = StepResult(
        step=7,
        results=[
            SeqResult(
                slot=0,
                seq_id=1,
                request_id="req-a",
                num_drafts=2,
                num_accepted=2,
                token_ids=[17, 42, 5],
                num_logprobs=1,
                num_computed=30,
                context_len=27,
                logprobs=[
                    lp(17, -0.5, 17, -0.5, 1),
                    lp(42, -1.25, 9, -0.75, 2),
                    lp(5, -0.125, 5, -0.125, 1),
                ],
            ),
            SeqResult(
                slot=1,
                seq_id=2,
                request_id="req-b",
                num_drafts=0,
                num_accepted=0,
                token_ids=[],
                num_computed=16,
                context_len=40,
            ),
            SeqResult(
                slot=2,
                seq_id=3,
                request_id="req-c",
                num_drafts=2,
                num_accepted=0,
                token_ids=[7],
                finish_reason="stop",
                num_computed=20,
                context_len=8,
                acceptance=Acceptance(6, 4),
                cached_tokens=4,
            ),
        ],
        ended=[Ended(0, "req-d", "preempted")],
    )
    return publish_step(result), [3, 0, 12, 5]


def hexdump(data: bytes) -> str:
    return "\n".join(f"{i:04x}  {data[i : i + 16].hex(' ')}" for i in range(0, len(data), 16))


def doc_block(name: str) -> str:
    match = re.search(rf"<!-- {name} -->\n```text\n(.*?)\n```", DOC.read_text(), re.S)
    assert match, f"docs/wire.md has no block marked <!-- {name} -->"
    return match.group(1)


def test_docs_worked_example_is_what_the_code_produces() -> None:
    published, seqnos = example_step()
    frame0, frame1 = encode_step(published, seqnos)
    assert doc_block("frame0") == hexdump(frame0)
    assert doc_block("frame1") == hexdump(frame1)
    env, tokens = decode_step([frame0, frame1])
    assert env.request_ids == ["req-a", "req-b", "req-c", "req-d"]
    assert {k: v.tolist() for k, v in tokens.items()} == {"req-a": [17, 42, 5], "req-c": [7]}


def test_encode_step_keeps_the_record_and_checks_lengths() -> None:
    published, seqnos = example_step()
    frames = encode_step(published, seqnos)
    assert frames[1] == published.record
    env = decode_envelope(frames[0])
    assert env.seqnos == seqnos and env.finish_reasons == [None, None, "stop", None]
    with pytest.raises(ValueError, match="seqnos"):
        encode_step(published, seqnos[:-1])
    with pytest.raises(ValueError, match="bad step message"):
        decode_step([frames[0], frames[1][:-4]])


def test_sequence_counter_counts_sent_tokens_and_forgets_finished_requests() -> None:
    def step(n: int, results: list[SeqResult], preempted: list[str] = []) -> PublishedStep:  # noqa: B006
        ended = [Ended(0, rid, "preempted") for rid in preempted]
        return publish_step(StepResult(step=n, results=results, ended=ended))

    def res(slot: int, rid: str, toks: list[int], reason: str | None = None) -> SeqResult:
        return SeqResult(
            slot=slot,
            seq_id=slot,
            request_id=rid,
            num_drafts=0,
            num_accepted=0,
            token_ids=toks,
            finish_reason=reason,
            num_computed=9,
            context_len=9,
        )

    counter = SequenceCounter()
    assert counter.advance(step(1, [res(0, "a", [1, 2]), res(1, "b", [3])])) == [0, 0]
    assert counter.advance(step(2, [res(0, "a", [4])], preempted=["b"])) == [
        2,
        1,
    ]
    assert counter.advance(step(3, [res(0, "b", [5, 6]), res(1, "a", [7], "length")])) == [1, 3]
    assert counter.sent("a") == 0 and counter.sent("b") == 3 and len(counter) == 1


def test_the_client_applies_the_documents_gap_rule_to_every_slot() -> None:
    """docs/wire.md's gap rule checks every slot, those without tokens too; the client's
    ``StreamAssembler`` applies the same rule (it used to skip slots without tokens, so a
    gap showed only at the request's next tokens)."""
    from spectrio.wire.stream_assembler import SequenceGap, StreamAssembler

    published, _ = example_step()  # req-b: a slot in prefill (no tokens, no finish)
    fresh = [0, 0, 0, 0]
    asm = StreamAssembler()
    asm.feed(encode_step(published, fresh))
    assert asm.received("req-a") == 3
    lost = [3, 2, 0, 0]  # req-b says 2 tokens were sent before; the consumer has none
    with pytest.raises(SequenceGap) as gap:
        StreamAssembler(track=["req-b"]).feed(encode_step(published, lost))
    assert (gap.value.request_id, gap.value.expected, gap.value.got) == ("req-b", 0, 2)
    # And the preempted slot (-9, no tokens) of a request whose earlier tokens were lost.
    with pytest.raises(SequenceGap):
        StreamAssembler(track=["req-d"]).feed(encode_step(published, [0, 0, 0, 5]))


# ---- a plain-msgpack consumer of a live runtime, written from docs/wire.md ----------------


def plain_consume(
    frames: list[bytes],
) -> tuple[dict[str, Any], dict[str, list[int]], dict[str, list[list[float]]]]:
    """Decode one step message with ``msgpack``, ``struct`` and NumPy only. Returns the
    envelope map, each slot's tokens and each token's logprob row (when sent)."""
    env = msgpack.unpackb(frames[0], raw=False)
    assert env["type"] == "step" and env["v"] == 1
    rec = frames[1]
    version, packed, bsz, n = struct.unpack_from("<4i", rec, 0)
    kind, width = packed & 0xFF, packed >> 8
    assert version == 1 and kind == 3 and bsz == len(env["request_ids"])
    accept = np.frombuffer(rec, dtype="<i4", count=bsz, offset=16)
    tokens = np.frombuffer(rec, dtype="<i4", count=n, offset=16 + 4 * bsz)
    at = 16 + 4 * (bsz + n)
    lp_vals = None
    if width:
        lp_ids = np.frombuffer(rec, dtype="<i4", count=n * width, offset=at).reshape(n, width)
        lp_vals = np.frombuffer(rec, dtype="<f4", count=n * width, offset=at + 4 * n * width)
        lp_vals = lp_vals.reshape(n, width)
        at += 8 * n * width + 4 * n
        sent = lp_ids[:, 0] >= 0
        assert (lp_ids[sent, 0] == tokens[sent]).all()
    assert at == len(rec)
    ends = np.cumsum(np.maximum(accept, 0))
    starts = ends - np.maximum(accept, 0)
    out: dict[str, list[int]] = {}
    lps: dict[str, list[list[float]]] = {}
    for rid, a, b in zip(env["request_ids"], starts.tolist(), ends.tolist(), strict=True):
        if b > a:
            out[rid] = tokens[a:b].tolist()
            if lp_vals is not None:
                lps[rid] = lp_vals[a:b].tolist()
    return env, out, lps


async def test_plain_msgpack_consumer_reads_a_live_runtime_stream() -> None:
    cfg = RuntimeConfig(
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        speculative=SpeculativeConfig(num_speculative_tokens=2),
    )
    prompts: list[str | list[int]] = ["def fib(n):", "import os\n", "class Stack:\n", [5, 6, 7, 8]]
    params = [
        SamplingParams(max_tokens=12),
        SamplingParams(max_tokens=9, logprobs=2),
        SamplingParams(max_tokens=14, temperature=0.8, seed=1),
        SamplingParams(max_tokens=5),
    ]
    messages: list[list[bytes]] = []
    counter = SequenceCounter()
    deltas: dict[str, list[Delta]] = {f"q{i}": [] for i in range(len(prompts))}
    with trio.fail_after(240):
        async with open_runtime(cfg) as rt:
            rt.add_record_observer(
                lambda pub: messages.append(encode_step(pub, counter.advance(pub)))
            )

            async def one(i: int) -> None:
                async for delta in rt.generate(prompts[i], params[i], request_id=f"q{i}"):
                    deltas[f"q{i}"].append(delta)

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()

    streams, logprobs, finished, steps = reassemble(messages)
    assert steps == list(range(steps[0], steps[0] + len(steps)))
    for rid, ds in deltas.items():
        assert streams[rid] == [t for d in ds for t in d.token_ids] and streams[rid]
        assert finished[rid] == ds[-1].finish_reason
    # ... and the client library, reading the same frames, agrees token for token.
    from spectrio.wire.stream_assembler import StreamAssembler

    library: dict[str, list[int]] = {}
    assembler = StreamAssembler()
    for frames in messages:
        for chunk in assembler.feed(frames):
            library.setdefault(chunk.request_id, []).extend(chunk.token_ids)
    assert library == {rid: toks for rid, toks in streams.items() if toks}
    assert len(logprobs["q1"]) == len(streams["q1"])
    want = [[t.logprob, t.top[0][1]] for d in deltas["q1"] for t in d.logprobs or []]
    np.testing.assert_allclose(np.array([row[:2] for row in logprobs["q1"]]), want, rtol=1e-6)
    # The sequence numbers make a lost message visible.
    lossy = [m for m in messages if m is not next(m for m in messages if plain_consume(m)[1])]
    with pytest.raises(GapError):
        reassemble(lossy)


class GapError(Exception):
    pass


def reassemble(
    messages: list[list[bytes]],
) -> tuple[dict[str, list[int]], dict[str, list[list[float]]], dict[str, str], list[int]]:
    streams: dict[str, list[int]] = {}
    logprobs: dict[str, list[list[float]]] = {}
    finished: dict[str, str] = {}
    steps = []
    for frames in messages:
        env, tokens, lps = plain_consume(frames)
        steps.append(env["step"])
        for slot, rid in enumerate(env["request_ids"]):
            got = streams.setdefault(rid, [])
            if env["seqnos"][slot] != len(got):
                raise GapError(f"{rid}: seqno {env['seqnos'][slot]}, have {len(got)} tokens")
            got.extend(tokens.get(rid, []))
            logprobs.setdefault(rid, []).extend(lps.get(rid, []))
            if env["finish_reasons"][slot] is not None:
                finished[rid] = env["finish_reasons"][slot]
    return streams, logprobs, finished, steps


def test_a_final_step_carries_speculation_totals_and_old_readers_ignore_them() -> None:
    """Schema 1.1: ``drafts`` on the step envelope reaches the request's final chunk; a
    1.0 envelope (no ``drafts`` key) leaves the totals unknown, and a 1.0 reader (a
    struct without the field) decodes a 1.1 envelope unchanged."""
    from spectrio.wire.stream_assembler import StreamAssembler

    published, _ = example_step()
    frames = encode_step(published, [0, 0, 0, 0])  # as if each request started here
    chunks = {c.request_id: c for c in StreamAssembler().feed(frames)}
    assert (chunks["req-c"].total_drafts, chunks["req-c"].total_accepted) == (6, 4)
    assert chunks["req-a"].total_drafts is None  # still running

    plain = msgpack.unpackb(frames[0])
    del plain["drafts"]  # what a 1.0 server sends
    old_frames = [mp(plain), frames[1]]
    chunks = {c.request_id: c for c in StreamAssembler().feed(old_frames)}
    assert chunks["req-c"].finish_reason == "stop" and chunks["req-c"].total_drafts is None

    class StepEnvelopeV10(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="step"):
        v: int
        step: int
        request_ids: list[str]
        seqnos: list[int]
        finish_reasons: list[str | None]
        errors: list[Any] = []

    old = msgspec.msgpack.decode(frames[0], type=StepEnvelopeV10)
    assert old.request_ids == ["req-a", "req-b", "req-c", "req-d"] and old.step == 7
