"""Encoding and decoding of wire messages (schema: :mod:`spectrio.wire.schema`).

Request frames are untrusted. :func:`decode_request` either returns a typed request or
raises :class:`WireError` with a specific :class:`~spectrio.wire.schema.ErrorCode`; it never
raises anything else, whatever the bytes. Server-side checks that need the model
(vocabulary, ``max_model_len``, the tokenizer) are in :func:`check_submit`.

Every rule about a request's fields has one home, :mod:`spectrio.core.params` (msgspec
``Meta`` constraints plus :func:`~spectrio.core.params.check_params` and
:func:`~spectrio.core.params.check_prompt`), which the embedding API uses too: a bad
field gets the same reason here as the API's ``InvalidRequest``.

Output: :func:`encode_step` turns one published step into its multipart frames
(frame 0 the :class:`~spectrio.wire.schema.StepEnvelope`, frame 1 the record bytes
unchanged). :class:`SequenceCounter` keeps the per-request sequence numbers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgspec
import numpy as np

from spectrio.core.messages import PublishedStep, TokenLogprob
from spectrio.core.params import (
    InvalidRequest,
    check_params,
    check_prompt,
    invalid_from_validation_error,
)
from spectrio.core.record import RecordError, StepRecord, select_slots, unpack
from spectrio.stages.output.output_processor import record_logprobs
from spectrio.wire.schema import (
    MAX_REQUEST_ID_LEN,
    SCHEMA_VERSION,
    Ack,
    Error,
    ErrorCode,
    ModelInfo,
    Reply,
    Request,
    StepEnvelope,
    Submit,
)

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "SequenceCounter",
    "WireError",
    "check_submit",
    "decode_envelope",
    "decode_reply",
    "decode_request",
    "decode_step",
    "encode",
    "encode_step",
    "refused",
    "slice_step",
]

DEFAULT_MAX_REQUEST_BYTES: Final = 1 << 20
"""Default cap on one request frame (1 MiB: a long prompt as token ids fits easily)."""

_MAX_REASON_CHARS: Final = 300


class WireError(Exception):
    """A message the wire layer refuses: ``code`` is the machine-readable class, ``reason``
    the human-readable detail, ``request_id`` the request it concerns when known."""

    def __init__(self, code: ErrorCode, reason: str, request_id: str | None = None) -> None:
        super().__init__(f"{code.value}: {reason}")
        self.code = code
        self.reason = reason
        self.request_id = request_id

    def to_reply(self) -> Error:
        """The :class:`Error` reply a server sends for this error."""
        return Error(code=self.code, reason=self.reason, request_id=self.request_id)


class _Probe(msgspec.Struct, gc=False):
    """Reads ``v`` and ``request_id`` from any map, ignoring every other key."""

    v: Any = None
    request_id: Any = None


_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
_reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)
_envelope_decoder = msgspec.msgpack.Decoder(StepEnvelope)
_probe_decoder = msgspec.msgpack.Decoder(_Probe)
_any_decoder = msgspec.msgpack.Decoder()
_entries_decoder = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])

_TAG_PATH = "`$.type`"
_MISSING = re.compile(r"^Object missing required field `([^`]*)`( - at `([^`]*)`)?$")


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of any wire message."""
    return _encoder.encode(msg)


def _probe(frame: bytes | memoryview) -> _Probe | None:
    try:
        return _probe_decoder.decode(frame)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None


def _classify(message: str) -> ErrorCode:
    """Map a msgspec ValidationError message onto an error code."""
    missing = _MISSING.match(message)
    if missing:
        # A missing tag at the top level means the request type is unknown.
        if missing.group(1) == "type" and missing.group(3) is None:
            return ErrorCode.UNKNOWN_TYPE
        return ErrorCode.MISSING_FIELD
    if message.endswith(_TAG_PATH):
        return ErrorCode.UNKNOWN_TYPE
    if message.startswith("Object contains unknown field"):
        return ErrorCode.UNKNOWN_FIELD
    if message.startswith("Expected `") and ", got `" in message:
        return ErrorCode.WRONG_TYPE
    return ErrorCode.INVALID_FIELD


def _short(text: str) -> str:
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


def _map_header(buf: memoryview, at: int = 0) -> tuple[int, int] | None:
    """(entries, header bytes) of a msgpack map starting at ``buf[at]``, or None."""
    if at >= buf.nbytes:
        return None
    first = buf[at]
    if 0x80 <= first <= 0x8F:
        return first & 0x0F, 1
    if first == 0xDE and buf.nbytes >= at + 3:
        return int.from_bytes(buf[at + 1 : at + 3], "big"), 3
    if first == 0xDF and buf.nbytes >= at + 5:
        return int.from_bytes(buf[at + 1 : at + 5], "big"), 5
    return None


def _str_at(buf: memoryview, at: int) -> tuple[str, int] | None:
    """The msgpack str at ``buf[at]`` and the offset after it, or None if there is none."""
    first = buf[at] if at < buf.nbytes else None
    if first is not None and 0xA0 <= first <= 0xBF:
        size, at = first & 0x1F, at + 1
    elif first in (0xD9, 0xDA, 0xDB):
        width = {0xD9: 1, 0xDA: 2, 0xDB: 4}[first]
        size, at = int.from_bytes(buf[at + 1 : at + 1 + width], "big"), at + 1 + width
    else:
        return None
    try:
        return bytes(buf[at : at + size]).decode(), at + size
    except UnicodeDecodeError:
        return None


def _repeated_key(buf: memoryview, entries: dict[str, msgspec.Raw]) -> str:
    """The first key of the map in ``buf`` that occurs twice. ``entries`` is the map as
    decoded, holding one value per key; every value's bytes are known from it, so the
    walk reads keys only. A key's value at this position that differs from the one kept
    means the key occurs again."""
    header = _map_header(buf)
    count, at = header if header is not None else (0, 0)
    seen: set[str] = set()
    for _ in range(count):
        read = _str_at(buf, at)
        if read is None or read[0] not in entries:
            break  # cannot happen: the decoder read this map with string keys
        key, at = read
        if key in seen:
            return key
        seen.add(key)
        kept = bytes(memoryview(entries[key]))
        if bytes(buf[at : at + len(kept)]) != kept:
            return key
        at += len(kept)
    return "?"


def _find_repeated_key(
    buf: memoryview, path: str = "", depth: int = 0
) -> tuple[str, dict[str, msgspec.Raw]] | None:
    """``(dotted path of a key that occurs twice, top-level entries)`` for the first map
    with a repeated key (at the top level, or in a map nested in it, like ``params``),
    else None. msgspec keeps the last value of a repeated key without a word, and other
    msgpack libraries keep the first, so a request must never have one."""
    header = _map_header(buf)
    if header is None:
        return None
    try:
        entries = _entries_decoder.decode(buf)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None  # not a map with string keys: the typed decoder classifies it
    if len(entries) < header[0]:
        return path + _repeated_key(buf, entries), entries
    if depth < 2:
        for key, raw in entries.items():
            inner = memoryview(raw)
            if _map_header(inner) is not None:
                found = _find_repeated_key(inner, f"{path}{key}.", depth + 1)
                if found is not None:
                    return found[0], entries
    return None


def _echo_id(raw: msgspec.Raw | None) -> str | None:
    """A well-formed request id from a raw value, else None."""
    if raw is None:
        return None
    try:
        rid = _any_decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    return rid if isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_LEN else None


def _check_no_repeated_key(view: memoryview) -> None:
    found = _find_repeated_key(view)
    if found is None:
        return
    key, entries = found
    rid = None if key == "request_id" else _echo_id(entries.get("request_id"))
    if key != "v" and "v" in entries:
        try:
            version = _any_decoder.decode(entries["v"])
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            version = None
        if isinstance(version, int) and not isinstance(version, bool) and version != SCHEMA_VERSION:
            raise WireError(
                ErrorCode.SCHEMA_VERSION,
                f"schema version {_short(repr(version))} is not supported "
                f"(this server speaks {SCHEMA_VERSION})",
                rid,
            )
    raise WireError(ErrorCode.DUPLICATE_KEY, f"key {key!r} appears more than once", rid)


def _field_refusal(view: memoryview, exc: msgspec.ValidationError) -> InvalidRequest | None:
    """The embedding API's refusal for the field msgspec names, if it names one."""
    try:
        body = _any_decoder.decode(view)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        body = None
    return invalid_from_validation_error(exc, body)


def decode_request(
    frame: bytes | bytearray | memoryview, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> Request:
    """Decode one request frame. Raises :class:`WireError` (and nothing else) when the
    frame is oversized (``too_large``), not msgpack (``bad_frame``), has a map with a
    repeated key (``duplicate_key``), is from another schema version (``schema_version``),
    of an unknown type (``unknown_type``), or has missing, unknown, wrongly typed or
    out-of-range fields (``missing_field``, ``unknown_field``, ``wrong_type``,
    ``invalid_field``, ``invalid_params``). A field's reason is the embedding API's
    :class:`InvalidRequest` text for it. ``WireError.request_id`` is set when the frame
    had a readable one."""
    try:
        view = memoryview(frame)
    except TypeError as exc:
        raise WireError(
            ErrorCode.BAD_FRAME, f"not a bytes-like frame: {type(frame).__name__}"
        ) from exc
    if view.nbytes > max_bytes:
        raise WireError(
            ErrorCode.TOO_LARGE, f"frame of {view.nbytes} bytes exceeds the cap of {max_bytes}"
        )
    if view.ndim != 1 or view.itemsize != 1 or not view.c_contiguous:
        view = memoryview(view.tobytes())
    _check_no_repeated_key(view)
    try:
        msg = _request_decoder.decode(view)
    except msgspec.ValidationError as exc:  # before DecodeError: it is a subclass
        probe = _probe(view)
        rid = probe.request_id if probe is not None else None
        if not (isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_LEN):
            rid = None  # only a well-formed id is echoed back
        version = probe.v if probe is not None else None
        if isinstance(version, int) and not isinstance(version, bool) and version != SCHEMA_VERSION:
            raise WireError(
                ErrorCode.SCHEMA_VERSION,
                f"schema version {_short(repr(version))} is not supported "
                f"(this server speaks {SCHEMA_VERSION})",
                rid,
            ) from None
        refusal = _field_refusal(view, exc)
        if refusal is not None:
            raise WireError(ErrorCode(refusal.code), _short(str(refusal)), rid) from None
        raise WireError(_classify(str(exc)), _short(str(exc)), rid) from None
    except msgspec.DecodeError as exc:
        raise WireError(ErrorCode.BAD_FRAME, _short(str(exc))) from None
    except UnicodeDecodeError as exc:  # msgspec raises it as is for a bad UTF-8 string
        raise WireError(ErrorCode.BAD_FRAME, f"invalid UTF-8 in a string: {exc.reason}") from None
    except RecursionError:
        raise WireError(ErrorCode.BAD_FRAME, "msgpack nesting too deep") from None
    if msg.v != SCHEMA_VERSION:
        rid = getattr(msg, "request_id", None)
        raise WireError(
            ErrorCode.SCHEMA_VERSION,
            f"schema version {msg.v} is not supported (this server speaks {SCHEMA_VERSION})",
            rid,
        )
    if isinstance(msg, Submit):
        _check_one_prompt(msg)
    return msg


def _check_one_prompt(msg: Submit) -> None:
    """A ``Submit`` carries a prompt or messages (since 1.5), never both: with both, which
    one the server ran would be a guess."""
    if msg.prompt is None and msg.messages is None:
        raise WireError(
            ErrorCode.MISSING_FIELD,
            "prompt: a submit needs a prompt (or, since schema 1.5, messages)",
            msg.request_id,
        )
    if msg.prompt is not None and msg.messages is not None:
        raise WireError(
            ErrorCode.INVALID_FIELD,
            "prompt: a submit carries a prompt or messages, not both",
            msg.request_id,
        )


def check_submit(
    submit: Submit,
    *,
    vocab_size: int,
    max_model_len: int,
    tokenize: Callable[[str], list[int]],
) -> list[int]:
    """The server-side checks of a decoded :class:`Submit` that need the model: the same
    :func:`~spectrio.core.params.check_params` and
    :func:`~spectrio.core.params.check_prompt` the embedding API runs. Returns the
    prompt's token ids; raises :class:`WireError` whose code is the refusal's
    (``invalid_params``, ``invalid_field`` for a token id outside the vocabulary,
    ``empty_prompt`` or ``prompt_too_long``) and whose reason is its text. A chat
    (``messages``) is the runtime's to render: :meth:`spectrio.Runtime.chat_prompt`."""
    try:
        check_params(submit.params, vocab_size)
        return check_prompt(
            submit.prompt, vocab_size=vocab_size, max_model_len=max_model_len, tokenize=tokenize
        )
    except InvalidRequest as exc:
        raise refused(exc, submit.request_id) from None


def refused(exc: InvalidRequest, request_id: str | None) -> WireError:
    """The wire's refusal of an :class:`InvalidRequest`: its code, and its text as the
    reason."""
    return WireError(ErrorCode(exc.code), _short(str(exc)), request_id)


def decode_reply(frame: bytes | memoryview) -> Ack | Error | ModelInfo:
    """Decode a reply (client side). Raises ``msgspec.DecodeError`` on a malformed one."""
    return _reply_decoder.decode(frame)


# ---- output -------------------------------------------------------------------------------


class SequenceCounter:
    """Per-request count of tokens already sent, the ``seqnos`` of each envelope.

    Call :meth:`advance` once per published step, in step order: it returns the
    sequence numbers for the step's slots, then adds the step's tokens and forgets
    requests that finished (a finish reason) in it.
    """

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def sent(self, request_id: str) -> int:
        """Tokens sent so far to a request that has not finished (0 if unknown)."""
        return self._sent.get(request_id, 0)

    def advance(self, published: PublishedStep, record: StepRecord | None = None) -> list[int]:
        """``record``: ``published.record`` already unpacked, if the caller has it."""
        accept = (unpack(published.record) if record is None else record).accept_num
        if accept.shape[0] != len(published.request_ids):
            raise ValueError(
                f"record has {accept.shape[0]} slots for {len(published.request_ids)} request ids"
            )
        seqnos = [self._sent.get(rid, 0) for rid in published.request_ids]
        for rid, n, reason in zip(
            published.request_ids, accept.tolist(), published.finish_reasons, strict=True
        ):
            if n > 0:
                self._sent[rid] = self._sent.get(rid, 0) + n
            if reason is not None:
                self._sent.pop(rid, None)
        return seqnos


def slice_step(
    published: PublishedStep, slots: Sequence[int], record: StepRecord | None = None
) -> PublishedStep:
    """The step restricted to ``slots`` (ascending indices): the same step number, those
    slots' request ids and finish reasons, their totals, and the record sliced in the
    same layout (:func:`spectrio.core.record.select_slots`; ``record``: the step's record
    unpacked once for all its slices). All slots: the step itself."""
    if len(slots) == len(published.request_ids):
        return published
    ids = [published.request_ids[i] for i in slots]
    keep = set(ids)
    return PublishedStep(
        step=published.step,
        request_ids=ids,
        finish_reasons=[published.finish_reasons[i] for i in slots],
        record=select_slots(published.record if record is None else record, list(slots)),
        acceptance={r: a for r, a in published.acceptance.items() if r in keep},
        cached_tokens={r: n for r, n in published.cached_tokens.items() if r in keep},
        prompt_logprobs={r: v for r, v in published.prompt_logprobs.items() if r in keep},
    )


def encode_step(
    published: PublishedStep,
    seqnos: Sequence[int],
    errors: Sequence[Error] = (),
) -> list[bytes]:
    """The multipart frames of one step: ``[envelope, record]``. Frame 1 is
    ``published.record`` unchanged. ``seqnos[i]`` is the number of tokens already sent to
    slot ``i``'s request before this step (see :class:`SequenceCounter`). The envelope's
    ``drafts`` are ``published.drafts``: each normally finished request's speculation
    totals."""
    bsz = len(published.request_ids)
    if len(seqnos) != bsz or len(published.finish_reasons) != bsz:
        raise ValueError(
            f"{bsz} slots but {len(seqnos)} seqnos "
            f"and {len(published.finish_reasons)} finish reasons"
        )
    envelope = StepEnvelope(
        step=published.step,
        request_ids=list(published.request_ids),
        seqnos=[int(s) for s in seqnos],
        finish_reasons=list(published.finish_reasons),  # type: ignore[arg-type]
        errors=list(errors),
        drafts={rid: (a.proposed, a.accepted) for rid, a in published.acceptance.items()},
        cached_tokens={rid: int(n) for rid, n in published.cached_tokens.items()},
        prompt_logprobs=dict(published.prompt_logprobs),
    )
    return [_encoder.encode(envelope), bytes(published.record)]


def decode_envelope(frame: bytes | memoryview) -> StepEnvelope:
    """Decode frame 0 of a step message (raises ``msgspec.DecodeError`` on a bad one)."""
    return _envelope_decoder.decode(frame)


def decode_step(frames: Sequence[bytes | memoryview]) -> tuple[StepEnvelope, dict[str, np.ndarray]]:
    """Decode a whole step message: the envelope, and each slot's emitted token ids keyed
    by request id (slots that emitted nothing are left out). Raises ``ValueError`` when
    the frames do not form a consistent step message."""
    if len(frames) < 2:
        raise ValueError(f"a step message has at least 2 frames, got {len(frames)}")
    try:
        env = decode_envelope(frames[0])
        rec = unpack(frames[1])
    except (msgspec.DecodeError, RecordError) as exc:
        raise ValueError(f"bad step message: {exc}") from exc
    if env.v != SCHEMA_VERSION:
        raise ValueError(f"envelope schema version {env.v}, expected {SCHEMA_VERSION}")
    if not len(env.request_ids) == len(env.seqnos) == len(env.finish_reasons) == rec.bsz:
        raise ValueError("envelope lists and record bsz disagree")
    off = rec.offsets
    tokens = {
        rid: rec.token_ids[off[i] : off[i + 1]]
        for i, rid in enumerate(env.request_ids)
        if off[i + 1] > off[i]
    }
    return env, tokens


def step_logprobs(
    frames: Sequence[bytes | memoryview], request_ids: Sequence[str]
) -> dict[str, list[TokenLogprob]]:
    """Each slot's logprobs from a step message's record (frame 1), keyed by request id
    (:func:`spectrio.stages.output.output_processor.record_logprobs`)."""
    return record_logprobs(unpack(frames[1]), request_ids)
