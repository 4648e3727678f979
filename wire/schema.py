"""The versioned wire schema (v1): every message a client or consumer exchanges with
``spectrio serve``, as msgspec Structs.

Field-by-field documentation, with sentinels and a worked hex example, is in
``docs/wire.md``; this module is the single source of truth it describes.

Design choices:

* Every message is a msgpack **map** (not ``array_like``). Map keys make the
  protocol readable from any msgpack library without a positional table, and
  ``forbid_unknown_fields`` can then reject extra fields on the request side.
  (msgspec ignores ``omit_defaults`` on ``array_like`` structs, so an array
  layout would not have saved the bytes of default fields anyway.) The fixed
  per-message cost of the keys is a few dozen bytes; the bulk of every step is
  the raw record in frame 1.
* Requests (client to runtime) are one tagged union on the ``"type"`` key and
  forbid unknown fields: a client typo is an error, never silently ignored.
  Every request carries ``"v"`` (the schema version) so a server can reject a
  client built against another version with a specific error code.
* Replies and step envelopes (runtime to client) are tagged the same way.
* Structs are ``frozen`` and ``gc=False``: they are plain data without cycles.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any, Final, Literal

import msgspec

from spectrio.core.messages import TokenLogprob
from spectrio.core.params import (
    MAX_REQUEST_ID_LEN,
    CacheSalt,
    ChatMessage,
    Messages,
    Prompt,
    RequestId,
    SamplingParams,
    TokenId,
)

__all__ = [
    "MAX_REQUEST_ID_LEN",
    "SCHEMA_MINOR",
    "SCHEMA_VERSION",
    "Abort",
    "Ack",
    "ChatMessage",
    "Error",
    "ErrorCode",
    "FinishReason",
    "Info",
    "ModelInfo",
    "Ping",
    "Reply",
    "Request",
    "SpeculativeInfo",
    "StepEnvelope",
    "Submit",
    "TokenId",
    "WIRE_TYPES",
    "schema_fingerprint",
]

SCHEMA_VERSION: Final = 1
"""Major version of this schema: the ``"v"`` of every message. A server refuses a request
of another major version (``schema_version``). Bump it for a change an old peer would
misread: a removed or renamed key, a changed type or meaning."""

SCHEMA_MINOR: Final = 10
"""Minor version within :data:`SCHEMA_VERSION`: bumped for additions an old peer can
ignore (an optional key a reader skips, a new request type an old client never sends).
It is not on every message (an old peer's ``"v"`` stays valid); a client learns the
server's from the ``Info`` reply. History (``docs/wire.md``, *Versioning*): 1.0 the first
release; 1.1 ``StepEnvelope.drafts``; 1.2 the ``Info`` request and its ``ModelInfo``
reply; 1.3 aborted requests in ``drafts``; 1.4 ``SpeculativeInfo``'s method ``"ngram"``
and its ``prompt_lookup_min`` / ``prompt_lookup_max``; 1.5 ``Submit.messages`` (a chat
the server renders with the model's template, instead of a prompt), the error code
``no_chat_template`` and ``ModelInfo.chat_template``. A 1.5 client sends ``messages``
only when it is asked to chat, so an older server meets it only then (and refuses it
with ``unknown_field``); 1.6 ``Submit.cache_salt`` (prefix-cache isolation; sent only
when not empty) and ``StepEnvelope.cached_tokens``; 1.7 ``Submit.stream`` (the
request's step messages come back on the connection that submitted it, so any number
of clients each read their own), the error code ``output_stalled``, and
``ModelInfo.healthy`` / ``health`` / ``output_stall_s``; 1.8 ``SamplingParams.prompt_logprobs``
(sent only when set) and ``StepEnvelope.prompt_logprobs``; 1.9 ``ModelInfo.speculative``'s
method ``"draft_model"``; 1.10 ``SamplingParams.constraint`` (structured output; sent only
when set) and the error code ``invalid_constraint``.

Every change to a message below changes the pin in ``tests/test_wire_schema.py``, which
fails until one of the two versions is bumped."""

# The field types of a request body (``TokenId``, ``RequestId``, ``Prompt``) and the
# constraints of ``SamplingParams`` live in ``spectrio.core.params``: the embedding API
# checks requests with the same rules, and gives the same reasons.

FinishReason = Literal["stop", "length", "abort"]


class ErrorCode(enum.StrEnum):
    """Why a request was refused: the ``code`` of an :class:`Error`, sent as its string
    value. Decoding the frame (:func:`spectrio.wire.codec.decode_request`) raises the
    codes up to ``too_large``, ``duplicate_key``, and ``invalid_params`` for a parameter
    out of its declared range. The server-side checks
    (:func:`spectrio.wire.codec.check_submit` and the request endpoint) raise
    ``invalid_field`` for a token id outside the vocabulary, and the codes after
    ``too_large``. Where a field is named, the reason is the text the embedding API's
    :class:`~spectrio.core.params.InvalidRequest` has for the same field."""

    BAD_FRAME = "bad_frame"
    """Not one complete msgpack value: random bytes, truncated data, trailing bytes, bad UTF-8."""
    WRONG_TYPE = "wrong_type"
    """Valid msgpack, but the message or one of its fields has the wrong type
    (e.g. the top level is not a map, ``max_tokens`` is a string)."""
    MISSING_FIELD = "missing_field"
    """A required field is absent."""
    UNKNOWN_FIELD = "unknown_field"
    """A field that this schema version does not define (also inside ``params``)."""
    UNKNOWN_TYPE = "unknown_type"
    """``"type"`` is missing or names no request type."""
    SCHEMA_VERSION = "schema_version"
    """``"v"`` is not this server's :data:`SCHEMA_VERSION`."""
    INVALID_FIELD = "invalid_field"
    """A field has the right type but breaks its constraint (an empty or over-long
    request id, a negative token id)."""
    TOO_LARGE = "too_large"
    """The frame is longer than the server's request size cap."""
    DUPLICATE_KEY = "duplicate_key"
    """A map in the frame has the same key twice (the reason names it). msgpack
    libraries disagree on which value wins, so such a frame is never guessed at."""
    INVALID_PARAMS = "invalid_params"
    """A ``params`` value breaks its rule (:func:`~spectrio.core.params.check_params`;
    the reason names the field)."""
    EMPTY_PROMPT = "empty_prompt"
    """The prompt is empty (``""``, ``[]``, or text that tokenises to nothing)."""
    PROMPT_TOO_LONG = "prompt_too_long"
    """The prompt leaves no room under the server's ``max_model_len``."""
    NO_CHAT_TEMPLATE = "no_chat_template"
    """A ``Submit`` carried ``messages`` but the served model has no chat template (or
    one that does not compile); since 1.5. The server never guesses a template."""
    INVALID_CONSTRAINT = "invalid_constraint"
    """``params.constraint`` cannot be enforced: a malformed schema, pattern or grammar,
    or a schema keyword the grammar library does not implement (the reason names it);
    since 1.10."""
    DUPLICATE_REQUEST = "duplicate_request"
    """A ``Submit`` reused the id of a request that is still running."""
    UNKNOWN_REQUEST = "unknown_request"
    """An ``Abort`` named a request that is not running (unknown or already finished)."""
    RATE_LIMITED = "rate_limited"
    """The client exceeded its request-rate cap; retry later."""
    UNAVAILABLE = "unavailable"
    """The server is shutting down and takes no new requests."""
    OUTPUT_STALLED = "output_stalled"
    """Since 1.7: the server ended the request because its step messages were not read
    (``ModelInfo.output_stall_s``); in a step envelope's ``errors``, and the reply to an
    ``Abort`` of such a request from its owner."""


class _Message(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag_field="type"):
    pass


# ---- requests (client -> runtime) ---------------------------------------------------------


class Submit(
    _Message,
    tag="submit",
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    omit_defaults=True,
):
    """Start a request. Its output arrives in the step stream under ``request_id``.

    It carries exactly one of ``prompt`` and ``messages`` (since 1.5; the decoder refuses
    both or neither). Defaults are omitted when encoding, so a prompt request from a 1.5
    client has no ``messages`` key and an older server reads it as before."""

    v: int
    request_id: RequestId
    prompt: Prompt | None = None  # text (tokenised by the server) or token ids
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # Since 1.5: a chat, rendered by the model's chat template (its end-of-turn tokens
    # are added to the stop tokens), instead of a prompt.
    messages: Messages | None = None
    # Since 1.6: the request shares prefix-cache blocks only with requests of the same
    # salt (docs/wire.md, *Prefix caching*); "" shares with every unsalted request.
    cache_salt: CacheSalt = ""
    # Since 1.7: the request's step messages come back on the connection that sent this
    # Submit (after its Ack), not on the outputs socket. Needs a DEALER (a REQ socket
    # takes one reply per request).
    stream: bool = False


class Abort(_Message, tag="abort", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Abort a running request; its slot is stamped -9 with finish reason ``"abort"``."""

    v: int
    request_id: RequestId


class Ping(_Message, tag="ping", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Liveness check; answered with an ``Ack`` whose ``request_id`` is nil."""

    v: int


class Info(_Message, tag="info", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Describe the served model (since 1.2); answered with a :class:`ModelInfo`. With
    ``tokenizer=True`` the reply also holds the tokenizer's JSON (hundreds of KiB to a
    few MiB): a client asks for it only when the hash in a plain ``Info`` reply names a
    tokenizer it does not have."""

    v: int
    tokenizer: bool = False


Request = Submit | Abort | Ping | Info
"""The request union: one typed decoder decodes them all."""


# ---- replies (runtime -> that client) -----------------------------------------------------


class Ack(_Message, tag="ack", frozen=True, kw_only=True):
    """The request was accepted. ``of`` names its type."""

    v: int = SCHEMA_VERSION
    of: Literal["submit", "abort", "ping"]
    request_id: str | None = None  # nil for a ping


class Error(_Message, tag="error", frozen=True, kw_only=True):
    """The request was refused (or, inside a :class:`StepEnvelope`, a running request
    failed). ``request_id`` is nil when it could not be read from the frame."""

    v: int = SCHEMA_VERSION
    code: ErrorCode
    reason: str  # human-readable; not part of the contract
    request_id: str | None = None


class SpeculativeInfo(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The server's speculative configuration (``SpeculativeConfig``'s fields)."""

    method: str | None  # "mtp", "ngram" (since 1.4), "draft_model" (since 1.9), or nil
    num_speculative_tokens: int  # k: the most drafts per sequence per step
    num_model_steps: int | None  # MTP substeps per step; nil: k
    adaptive: bool  # each step drafts 0..k, as the measured acceptance says
    # n-gram drafting's longest and shortest suffix looked up (since 1.4; nil from an
    # older server)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # the draft model's name (nil: the target itself) and the layers it drafts with (nil:
    # all), for "draft_model" (since 1.9; nil otherwise and from an older server)
    draft_model: str | None = None
    draft_layers: int | None = None


class ModelInfo(_Message, tag="info", frozen=True, kw_only=True):
    """The reply to :class:`Info` (since 1.2): what a client needs to build requests and
    read outputs without assuming the bundled model."""

    v: int = SCHEMA_VERSION
    minor: int = SCHEMA_MINOR  # the server's schema minor version
    model: str  # the model the server was started with ("bundled", a path, ...)
    vocab_size: int  # token ids are in [0, vocab_size)
    max_model_len: int  # most tokens per request, prompt and output together
    eos_token_id: int | None
    speculative: SpeculativeInfo
    tokenizer_sha256: str  # hex SHA-256 of the tokenizer's JSON (``tokenizer.json``)
    tokenizer_bytes: int  # its length in bytes
    tokenizer_json: str | None = None  # the JSON itself, only when the Info asked for it
    # Since 1.5: the model has a chat template, so a Submit may carry messages (false
    # from an older server, which takes none).
    chat_template: bool = False
    # Since 1.7: whether the pipeline is making progress (false: requests are waiting
    # with no step completed, a sink holds the publisher, or the engine is dead), and why.
    healthy: bool = True
    health: str | None = None
    # Since 1.7: seconds a request's oldest undelivered step message may wait before the
    # server ends the request with ``output_stalled`` (nil from an older server).
    output_stall_s: float | None = None


Reply = Ack | Error | ModelInfo


# ---- output (runtime -> consumer), frame 0 of every step message --------------------------


class StepEnvelope(_Message, tag="step", frozen=True, kw_only=True):
    """Frame 0 of a step message; frame 1 is the step record (``core/record.py``).

    The four per-slot lists have one entry per record slot (``bsz`` in the record
    header), in slot order.
    """

    v: int = SCHEMA_VERSION
    step: int  # pipeline step number, increasing by one per published step
    request_ids: list[str]  # slot i -> request id
    seqnos: list[int]  # slot i -> tokens already sent to that request before this step
    finish_reasons: list[FinishReason | None]  # slot i -> why the request ended this step
    errors: list[Error] = []  # requests that ended with an error this step
    # Since 1.1: request id -> [drafts proposed, drafts accepted] over the request's whole
    # life, for each request that ended in this step ([0, 0] when it never speculated):
    # finished normally ("stop" or "length"), and since 1.3 aborted (its -9 slot).
    drafts: dict[str, tuple[int, int]] = {}
    # Since 1.6: request id -> prompt tokens whose KV came from the prefix cache, for each
    # request that finished normally in this step (0 when none did, or the cache is off).
    cached_tokens: dict[str, int] = {}
    # Since 1.8: request id -> the logprobs of the prompt tokens this step scored, for
    # each request that asked for params.prompt_logprobs and had some scored here (a
    # prefill chunk, so possibly over several steps, in order): each entry is the array
    # [token id, logprob, rank, [[alternative id, logprob], ...]] (TokenLogprob).
    prompt_logprobs: dict[str, list[TokenLogprob]] = {}


# ---- schema pin ---------------------------------------------------------------------------

WIRE_TYPES: Final[tuple[Any, ...]] = (
    Submit,
    Abort,
    Ping,
    Info,
    Ack,
    Error,
    ModelInfo,
    StepEnvelope,
)


def _strip_docs(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_docs(v) for k, v in node.items() if k not in ("title", "description")}
    if isinstance(node, list):
        return [_strip_docs(v) for v in node]
    return node


def schema_fingerprint(types: tuple[Any, ...] = WIRE_TYPES) -> str:
    """SHA-256 of the JSON schema of ``types`` (field names, types, defaults, constraints,
    tags and enum values; docstrings excluded). Any change to a wire message changes it."""
    _, components = msgspec.json.schema_components(types)
    canonical = msgspec.json.encode(_strip_docs(components), order="sorted")
    return hashlib.sha256(canonical).hexdigest()
