"""Per-request sampling parameters and the one home of every request-validation rule.

:class:`SamplingParams` is a msgspec Struct, so it travels on the wire unchanged. Its
type and range rules are msgspec ``Meta`` constraints on the fields; the rules no
constraint can state (finite floats, ``min_tokens <= max_tokens``, the vocabulary, an
empty or over-long prompt) are in :func:`check_params` and :func:`check_prompt`. The
embedding API (:meth:`spectrio.Runtime.generate`) and the wire codec
(:func:`spectrio.wire.codec.decode_request` and :func:`~spectrio.wire.codec.check_submit`)
both go through this module, so a bad field gets the same :class:`InvalidRequest` text
("``<field>: <rule>, got <value>``") on either path. The rule text is rendered from the
constraints themselves (:func:`field_rule`), so it cannot drift from them.

Semantics follow vLLM where they overlap:

* ``temperature == 0`` is greedy: the token is the argmax of the logits after
  penalties and the ``min_tokens`` mask; ``top_k``/``top_p``/``min_p`` and
  ``seed`` then change nothing.
* ``repetition_penalty`` (HF/vLLM): a logit of a token seen in the prompt or the
  output so far is divided by it when positive, multiplied when not.
  ``frequency_penalty`` subtracts ``penalty * count`` and ``presence_penalty``
  subtracts ``penalty`` once, both over the output tokens only.
* ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` get zero
  probability until that many tokens were emitted; stop strings only count from then.
* ``stop`` strings are matched in the detokenised output; the text ends right
  before the match and the tokens end with the one that completed it.
* ``logprobs``: ``None`` for none, else ``0..20`` top alternatives on top of the
  sampled token's own logprob. ``logprobs_mode="raw"`` reports the log-softmax of
  the unmodified target logits, ``"processed"`` the log of the distribution the
  token was drawn from.

A chat request carries messages instead of a prompt: their rules are
:func:`~spectrio.models.text.chat.check_messages`'s (re-exported here), the wire's type for
them is :class:`ChatMessage`, and :func:`with_chat_stops` adds the template's
end-of-turn tokens to the request's stop tokens, as EOS is added.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Final, Literal, cast

import msgspec
import numpy as np
from msgspec import inspect as mi

from spectrio.core.constraints import Constraint, check_constraint
from spectrio.errors import InvalidRequest, RefusalCode
from spectrio.models.text.chat import MESSAGE_RULES, MESSAGES_RULE, check_messages

__all__ = [
    "MAX_CACHE_SALT_LEN",
    "MAX_LOGPROBS",
    "MAX_REQUEST_ID_LEN",
    "MAX_TOKEN_ID",
    "CacheSalt",
    "ChatMessage",
    "Constraint",
    "InvalidRequest",
    "Messages",
    "Prompt",
    "RequestId",
    "SamplingParams",
    "TokenId",
    "check_cache_salt",
    "check_messages",
    "check_params",
    "check_prompt",
    "check_request_id",
    "check_text_length",
    "field_rule",
    "invalid_from_validation_error",
    "max_prompt_bytes",
    "with_chat_stops",
]

MAX_LOGPROBS: Final = 20
"""Largest ``logprobs`` (top alternatives) a request may ask for."""

MAX_REQUEST_ID_LEN: Final = 128
"""Longest request id, in characters."""

MAX_TOKEN_ID: Final = 2**31 - 1
"""Largest token id any request may carry (the step record stores ids as int32)."""

MAX_CACHE_SALT_LEN: Final = 256
"""Longest ``cache_salt``, in characters."""

_MAX_SEED: Final = 2**63 - 1

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
"""A token id: a non-negative int32 (the vocabulary bound is checked by :func:`check_prompt`)."""
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_LEN)]
CacheSalt = Annotated[str, msgspec.Meta(max_length=MAX_CACHE_SALT_LEN)]
"""A request's prefix-cache salt: requests share cached KV only within one salt ("" is
the default, shared by every unsalted request)."""
Prompt = str | list[TokenId]
"""Text (tokenised by the runtime) or token ids."""

_Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]


class ChatMessage(msgspec.Struct, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True):
    """One chat message as the wire carries it (schema 1.5): the embedding API takes the
    same thing as a dict. Which roles exist is the model's chat template's business."""

    role: str
    content: str


Messages = Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
"""A chat: one message at least, rendered by the model's chat template."""


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Sampling parameters of one request. Construction does not validate: the runtime
    and the wire codec do (:func:`check_params`), with the constraints declared here."""

    # tokens to emit at most
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 64
    # EOS / stop tokens / stop strings cannot end the request before this many
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # 0: greedy
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = 0  # 0 or -1: off
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0  # nucleus mass
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0  # keep p >= min_p * max p
    # per-request generator; None draws from the runtime's shared one
    seed: Annotated[int, msgspec.Meta(ge=0, le=_MAX_SEED)] | None = None
    # stop strings (not included in the output text)
    stop: list[Annotated[str, msgspec.Meta(min_length=1)]] = []
    stop_token_ids: list[TokenId] = []  # stop tokens (included in the output tokens)
    ignore_eos: bool = False
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # 1 is off
    frequency_penalty: _Penalty = 0.0
    presence_penalty: _Penalty = 0.0
    # top alternatives per emitted token
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    logprobs_mode: Literal["raw", "processed"] = "raw"
    speculative: bool | None = None  # None: follow the runtime's configuration
    # top alternatives per prompt token after the first (its own logprob always comes)
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    # structured output: what the output must match (spectrio.core.constraints)
    constraint: Constraint | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`InvalidRequest` for a bad field (see :func:`check_params`)."""
        check_params(self, vocab_size)


# ---- rule text, rendered from the constraints ----------------------------------------------


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _bounds(t: mi.IntType | mi.FloatType) -> str:
    lo = f"[{_num(t.ge)}" if t.ge is not None else f"({_num(t.gt)}" if t.gt is not None else ""
    hi = f"{_num(t.le)}]" if t.le is not None else f"{_num(t.lt)})" if t.lt is not None else ""
    if lo and hi:
        return f" in {lo}, {hi}"
    if lo:
        return (" >= " if lo[0] == "[" else " > ") + lo[1:]
    if hi:
        return (" <= " if hi[-1] == "]" else " < ") + hi[:-1]
    return ""


def _describe(t: mi.Type, plural: bool = False) -> str:
    """English for a msgspec type with its constraints: ``an int in [0, 20]``."""
    if isinstance(t, mi.IntType):
        return ("ints" if plural else "an int") + _bounds(t)
    if isinstance(t, mi.FloatType):
        return ("finite numbers" if plural else "a finite number") + _bounds(t)
    if isinstance(t, mi.BoolType):
        return "bools" if plural else "a bool"
    if isinstance(t, mi.NoneType):
        return "None"
    if isinstance(t, mi.StrType):
        noun = "strings" if plural else "a string"
        lo, hi = t.min_length, t.max_length
        if lo is not None and hi is not None:
            return f"{noun} of {lo} to {hi} characters"
        if lo == 1:
            return "non-empty " + noun if plural else "a non-empty string"
        if lo is not None:
            return f"{noun} of at least {lo} characters"
        if hi is not None:
            return f"{noun} of at most {hi} characters"
        return noun
    if isinstance(t, mi.LiteralType):
        return " or ".join(repr(v) for v in t.values)
    if isinstance(t, mi.ListType):
        return ("lists of " if plural else "a list of ") + _describe(t.item_type, plural=True)
    if isinstance(t, mi.UnionType):
        # "None or an int in [0, 20]" reads better than "an int in [0, 20] or None".
        parts = sorted(t.types, key=lambda u: not isinstance(u, mi.NoneType))
        return " or ".join(_describe(u, plural) for u in parts)
    return "of the declared type"


_PARAM_TYPES: Final[dict[str, mi.Type]] = {
    f.name: f.type
    for f in mi.type_info(SamplingParams).fields  # type: ignore[attr-defined]
}
_REQUEST_TYPES: Final[dict[str, mi.Type]] = {
    "prompt": mi.type_info(Prompt),
    "request_id": mi.type_info(RequestId),
    "cache_salt": mi.type_info(CacheSalt),
}
_FLOAT_PARAMS: Final = tuple(n for n, t in _PARAM_TYPES.items() if isinstance(t, mi.FloatType))


def field_rule(field: str) -> str:
    """The rule of ``field`` (a request field or a :class:`SamplingParams` field) as it
    appears in an :class:`InvalidRequest`: ``field_rule("top_p")`` is
    ``"must be a finite number in (0, 1]"``."""
    t = _PARAM_TYPES.get(field) or _REQUEST_TYPES[field]
    return "must be " + _describe(t)


# ---- msgspec errors -> InvalidRequest -----------------------------------------------------

_ERROR = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_TYPE_ERROR = re.compile(r"^Expected `[^`]*`, got `[^`]*`$")


def _split(exc: msgspec.ValidationError) -> tuple[str, list[str | int]] | None:
    """msgspec's message as (what went wrong, path steps), or None without a path."""
    match = _ERROR.match(str(exc))
    if match is None or match.group("path") is None:
        return None
    steps = [name if name else int(index) for name, index in _STEP.findall(match.group("path"))]
    return match.group("what"), steps


def _refusal(
    what: str, field: str, rest: list[str | int], value: Any, kind: RefusalCode
) -> InvalidRequest:
    """The refusal of ``field`` whose value is ``value`` (``...`` if unknown); ``rest``
    is the path below the field (an index when a list item is bad)."""
    at = rest[0] if rest and isinstance(rest[0], int) else None
    if at is not None:
        if isinstance(value, list) and at < len(value):
            value = value[at]
        else:
            value, at = ..., None
    code: RefusalCode = "wrong_type" if _TYPE_ERROR.match(what) else kind
    return InvalidRequest(field, field_rule(field), got=value, at=at, code=code)


def _messages_refusal(what: str, rest: list[str | int], value: Any) -> InvalidRequest | None:
    """The embedding API's refusal (:func:`check_messages`) for a wrongly typed message
    list or message; None for a missing or unknown key in a message (the wire's
    ``missing_field`` and ``unknown_field`` say that better)."""
    if not rest:  # the list itself: not a list, or empty
        code: RefusalCode = "wrong_type" if _TYPE_ERROR.match(what) else "empty_prompt"
        return InvalidRequest("messages", MESSAGES_RULE, got=value, code=code)
    if not _TYPE_ERROR.match(what) or not isinstance(rest[0], int):
        return None
    at = rest[0]
    key = rest[1] if len(rest) > 1 and rest[1] in ("role", "content") else None
    item = value[at] if isinstance(value, list) and at < len(value) else ...
    return InvalidRequest("messages", MESSAGE_RULES[key], got=item, at=at, code="wrong_type")


def with_chat_stops(params: SamplingParams, stop_token_ids: Sequence[int]) -> SamplingParams:
    """``params`` with a chat template's end-of-turn tokens (``<|im_end|>``,
    ``<|eot_id|>``, ...) added to ``stop_token_ids``. They are treated as EOS is: they
    end the request and are its last output token (their text is not in the output text
    when they are special tokens, which end-of-turn tokens are), ``min_tokens`` holds
    them back, and with ``ignore_eos`` they are not added (the answer runs on past the
    end of its turn, as it runs past EOS)."""
    if params.ignore_eos:
        return params
    extra = [t for t in dict.fromkeys(stop_token_ids) if t not in params.stop_token_ids]
    if not extra:
        return params
    return msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])


def invalid_from_validation_error(
    exc: msgspec.ValidationError, body: Any = ...
) -> InvalidRequest | None:
    """Translate msgspec's error for a request body (``$.prompt``, ``$.request_id``,
    ``$.params.<field>``) into the :class:`InvalidRequest` of the field it names.
    ``body`` is the body as msgpack decodes it without a type (a dict), used to show the
    offending value. Returns None when the error names no such field (a missing or
    unknown field, the type tag, the schema version)."""
    split = _split(exc)
    if split is None:
        return None
    what, path = split
    body = body if isinstance(body, dict) else {}
    if path and path[0] == "messages":
        return _messages_refusal(what, path[1:], body.get("messages", ...))
    if len(path) >= 2 and path[0] == "params" and path[1] in _PARAM_TYPES:
        params = body.get("params")
        value = params.get(path[1], ...) if isinstance(params, dict) else ...
        return _refusal(what, str(path[1]), path[2:], value, "invalid_params")
    if path and path[0] in _REQUEST_TYPES:
        return _refusal(what, str(path[0]), path[1:], body.get(path[0], ...), "invalid_field")
    return None


# ---- the checks both paths call -----------------------------------------------------------


def check_params(params: object, vocab_size: int) -> SamplingParams:
    """Check sampling parameters; return them or raise :class:`InvalidRequest`.

    Runs the msgspec conversion the wire decoder runs (the types and ``Meta``
    constraints above), then the rules no constraint can state: finite floats,
    ``min_tokens <= max_tokens`` and stop token ids inside the vocabulary."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequest("params", "must be a SamplingParams", got=params, code="wrong_type")
    fields = msgspec.structs.asdict(params)
    try:
        msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as exc:
        split = _split(exc)
        if split is None or not split[1] or split[1][0] not in _PARAM_TYPES:
            raise InvalidRequest("params", str(exc), code="invalid_params") from None
        what, path = split
        field = str(path[0])
        raise _refusal(what, field, path[1:], fields[field], "invalid_params") from None
    for name in _FLOAT_PARAMS:
        value = fields[name]
        if not math.isfinite(value):
            raise InvalidRequest(name, field_rule(name), got=value, code="invalid_params")
    if params.min_tokens > params.max_tokens:
        raise InvalidRequest(
            "min_tokens",
            f"must be at most max_tokens ({params.max_tokens})",
            got=params.min_tokens,
            code="invalid_params",
        )
    if params.constraint is not None:
        check_constraint(params.constraint)
        for name, neutral in (("min_tokens", 0), ("ignore_eos", False)):
            if getattr(params, name) != neutral:
                raise InvalidRequest(
                    name,
                    f"must be {neutral} with a constraint (the output ends where its "
                    "grammar is complete)",
                    got=getattr(params, name),
                    code="invalid_params",
                )
    for i, tok in enumerate(params.stop_token_ids):
        if tok >= vocab_size:
            raise InvalidRequest(
                "stop_token_ids",
                f"must be token ids below the vocabulary size {vocab_size}",
                got=tok,
                at=i,
                code="invalid_params",
            )
    return params


def _check_string_field(value: object, kind: Any, field: str) -> str:
    """``value`` converted to the constrained string type ``kind``, or
    :class:`InvalidRequest` naming ``field``."""
    try:
        return cast(str, msgspec.convert(value, kind))
    except msgspec.ValidationError as exc:
        split = _split(exc)
        what = split[0] if split else str(exc)
        raise _refusal(what, field, [], value, "invalid_field") from None


def check_request_id(request_id: object) -> str:
    """Check a request id (1 to 128 characters); return it or raise :class:`InvalidRequest`."""
    return _check_string_field(request_id, RequestId, "request_id")


def check_cache_salt(cache_salt: object) -> str:
    """Check a cache salt (a string of at most 256 characters); return it or raise
    :class:`InvalidRequest`."""
    return _check_string_field(cache_salt, CacheSalt, "cache_salt")


def _as_id_list(prompt: object) -> list[Any]:
    """Token ids given as a list, tuple or NumPy array, as a plain list whose items are
    still unchecked. NumPy integers become ints; floats and bools stay what they are, so
    the check refuses them."""
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
        return list(prompt.tolist())
    if isinstance(prompt, list | tuple):
        return [t.item() if isinstance(t, np.integer) else t for t in prompt]
    raise InvalidRequest("prompt", field_rule("prompt"), got=prompt, code="wrong_type")


def max_prompt_bytes(max_model_len: int, max_token_bytes: int) -> int:
    """The longest text, in UTF-8 bytes, that could still be a prompt under
    ``max_model_len``: a prompt needs at most ``max_model_len - 1`` tokens, and a token
    stands for at most ``max_token_bytes`` bytes (the tokenizer's longest vocabulary
    entry, :attr:`spectrio.models.text.tokenizer.TextTokenizer.max_token_bytes`). Exact: that
    many repetitions of the longest entry fit. Longer text cannot fit, whatever it says."""
    return (max_model_len - 1) * max_token_bytes


def check_text_length(text: str, *, max_model_len: int, max_token_bytes: int | None) -> None:
    """Refuse text that is too long for any prompt under ``max_model_len`` by its length
    alone (:func:`max_prompt_bytes`), before it costs a tokenizer pass: ``prompt_too_long``.
    O(1) for ASCII text; other text is measured by encoding it once, unless its
    character count already proves it. Does nothing when ``max_token_bytes`` is None (a
    tokenizer that gives no bound)."""
    if max_token_bytes is None:
        return
    limit = max_prompt_bytes(max_model_len, max_token_bytes)
    size = len(text)  # every character is at least one byte
    if size <= limit and not text.isascii():
        size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise InvalidRequest(
            "prompt",
            f"text of {size} bytes is at least {-(-size // max_token_bytes)} tokens "
            f"(a token is at most {max_token_bytes} bytes), which leaves no room under "
            f"max_model_len={max_model_len}",
            code="prompt_too_long",
        )


def check_prompt(
    prompt: object,
    *,
    vocab_size: int,
    max_model_len: int,
    tokenize: Callable[[str], Sequence[int]],
    max_token_bytes: int | None = None,
) -> list[int]:
    """Check a prompt (text, or token ids) and return its token ids, or raise
    :class:`InvalidRequest`: ``wrong_type`` (not text or ints; floats and bools are not
    token ids), ``invalid_field`` (an id outside ``[0, 2^31 - 1]`` or the vocabulary),
    ``empty_prompt``, or ``prompt_too_long`` (no room left under ``max_model_len``).

    With ``max_token_bytes`` (the tokenizer's bound), text too long for any prompt is
    refused by :func:`check_text_length` before ``tokenize`` runs."""
    if isinstance(prompt, str):
        check_text_length(prompt, max_model_len=max_model_len, max_token_bytes=max_token_bytes)
        ids = list(tokenize(prompt)) if prompt else []
    else:
        items = _as_id_list(prompt)
        try:
            ids = msgspec.convert(items, list[TokenId])
        except msgspec.ValidationError as exc:
            what, path = _split(exc) or (str(exc), [])
            raise _refusal(what, "prompt", path, items, "invalid_field") from None
        bad = next((i for i, t in enumerate(ids) if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                "prompt",
                f"must be token ids below the vocabulary size {vocab_size}",
                got=ids[bad],
                at=bad,
            )
    if not ids:
        raise InvalidRequest("prompt", "must not be empty", code="empty_prompt")
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            "prompt",
            f"{len(ids)} tokens leave no room under max_model_len={max_model_len}",
            code="prompt_too_long",
        )
    return ids
