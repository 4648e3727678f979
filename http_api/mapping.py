"""Request bodies to what the runtime runs, field by field (pure: no I/O, no Trio).

* :func:`decode` turns a body into its Struct, or an :class:`HttpError` whose message
  names the field (a malformed body, a wrong type, an unknown or missing field).
* :func:`check_completion` and :func:`check_chat` refuse every field this server does not
  honour unless it holds that field's neutral value (``null``, ``[]``, ``"none"`` ...),
  as an :class:`~spectrio.InvalidRequest` naming it: nothing is silently ignored.
* :func:`sampling_params` maps the fields onto :class:`~spectrio.SamplingParams` and
  checks them with :func:`~spectrio.core.params.check_params`, so a bad value gets the
  same ``"<field>: <rule>, got <value>"`` text as the embedding API and the wire.
  :func:`per_choice` gives each of the ``n`` choices its own seed.
* :func:`prompts_of` and :func:`chat_messages` check the prompt shapes and turn chat
  messages into the dicts a chat template renders (an assistant's earlier
  ``tool_calls`` with their arguments as objects, as templates read them).

Structured output and tools are :mod:`.response_format` and :mod:`.tool_calls`; their
constraint reaches :func:`sampling_params` as a
:class:`~spectrio.http_api.response_format.Sourced`, whose refusals name its field.

OpenAI's defaults apply where they differ from the runtime's: ``temperature`` 1,
completions ``max_tokens`` 16, and a chat's ``max_completion_tokens`` as many as fit
under ``max_model_len``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeVar

import msgspec

from spectrio.core.params import (
    MAX_LOGPROBS,
    InvalidRequest,
    SamplingParams,
    check_params,
    field_rule,
)
from spectrio.errors import show_value
from spectrio.http_api.response_format import Sourced, renamed
from spectrio.http_api.schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorBody,
    ErrorObject,
)

__all__ = [
    "COMPLETION_MAX_TOKENS",
    "DEFAULT_TEMPERATURE",
    "MAX_CHOICES",
    "HttpError",
    "check_chat",
    "check_completion",
    "chat_messages",
    "decode",
    "echo_only",
    "error_body",
    "invalid",
    "per_choice",
    "prompts_of",
    "sampling_params",
]

MAX_CHOICES: Final = 128
"""Most choices one request may ask for: prompts times ``n``."""

COMPLETION_MAX_TOKENS: Final = 16
"""``max_tokens`` of a completion that gives none (OpenAI's default)."""

DEFAULT_TEMPERATURE: Final = 1.0
"""``temperature`` of a request that gives none (OpenAI's default; the runtime's is 0)."""

_MAX_SEED: Final = 2**63

Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


class HttpError(Exception):
    """An error response: the HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> ErrorBody:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None, code: str | None) -> ErrorBody:
    return ErrorBody(error=ErrorObject(message=message, type=type, param=param, code=code))


def invalid(exc: InvalidRequest) -> HttpError:
    """The 400 of a refusal: its text unchanged, ``param`` the field it names."""
    return HttpError(400, str(exc), param=exc.field, code=exc.code)


# ---- decoding -------------------------------------------------------------------------------

_PATH_ERROR = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]*)`, got `[^`]*`$")
_PARAM_FIELDS: Final = frozenset(f.name for f in msgspec.structs.fields(SamplingParams))


def _param_name(steps: Sequence[str | int]) -> str:
    """``["messages", 0, "content"]`` -> ``"messages[0].content"``."""
    out = ""
    for step in steps:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out


def _value_at(doc: Any, steps: Sequence[str | int]) -> Any:
    for step in steps:
        if isinstance(step, int) and isinstance(doc, list) and step < len(doc):
            doc = doc[step]
        elif isinstance(step, str) and isinstance(doc, dict) and step in doc:
            doc = doc[step]
        else:
            return ...
    return doc


def decode(body: bytes, kind: type[Body]) -> Body:
    """The request Struct of ``body``, or an :class:`HttpError` (400) naming the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: first
        raise _validation_error(exc, body) from None
    except msgspec.DecodeError as exc:
        raise HttpError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None


def _validation_error(exc: msgspec.ValidationError, body: bytes) -> HttpError:
    match = _PATH_ERROR.match(str(exc))
    assert match is not None  # the pattern matches any text
    what = match.group("what")
    where: list[str | int] = [
        name if name else int(index) for name, index in _STEP.findall(match.group("path") or "")
    ]
    if not where and _EXPECTED.match(what):  # the body itself is not an object
        return HttpError(400, "the body must be a JSON object", code="wrong_type")
    unknown, missing = _UNKNOWN.match(what), _MISSING.match(what)
    if unknown is not None:
        param = _param_name([*where, unknown.group("name")])
        return HttpError(
            400,
            f"{param}: unknown field (not in the OpenAI API, nor an extension this server "
            "honours; docs/http.md)",
            param=param,
            code="unknown_field",
        )
    if missing is not None:
        param = _param_name([*where, missing.group("name")])
        return HttpError(400, f"{param}: required", param=param, code="missing_field")
    param = _param_name(where)
    try:
        got = _value_at(msgspec.json.decode(body), where)
    except msgspec.DecodeError:
        got = ...
    leaf = where[-1] if where else None
    if len(where) == 1 and isinstance(leaf, str) and leaf in _PARAM_FIELDS:
        rule = field_rule(leaf)  # the runtime's own rule text for its parameters
    else:
        expected = _EXPECTED.match(what)
        rule = f"must be {expected.group('want')}" if expected else what
    return invalid(InvalidRequest(param, rule, got=got, code="wrong_type"))


# ---- refusals -------------------------------------------------------------------------------


def _refuse(field: str, rule: str, got: object) -> InvalidRequest:
    return InvalidRequest(field, rule, got=got, code="invalid_field")


def _neutral(field: str, value: object, allowed: Sequence[object], why: str) -> None:
    """Refuse ``value`` unless it is None or one of ``allowed`` (the values that ask for
    nothing this server lacks)."""
    if value is None or value in allowed:
        return
    shown = " or ".join(["null", *(show_value(a) for a in allowed)])
    raise _refuse(field, f"{why}; must be {shown}", value)


def _check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise _refuse("n", f"must be an int in [1, {MAX_CHOICES}]", req.n)
    _neutral("logit_bias", req.logit_bias, [{}], "logit_bias is not supported")
    if req.stream_options is not None:
        if not req.stream:
            raise _refuse("stream_options", "is only allowed when stream is true", "given")
        _neutral(
            "stream_options.include_obfuscation",
            req.stream_options.include_obfuscation,
            [False],
            "stream obfuscation is not implemented",
        )


def check_completion(req: CompletionRequest) -> None:
    """Refuse the completion fields this server does not honour (InvalidRequest)."""
    _check_common(req)
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise _refuse(
            "best_of", f"must equal n ({n}) or be null: choices are never ranked", req.best_of
        )
    _neutral("suffix", req.suffix, [""], "insertion (suffix) is not supported")
    if req.max_tokens == 0:
        if not req.echo:
            raise InvalidRequest(
                "max_tokens",
                "must be an int >= 1 (0 only with echo: the prompt scored, nothing generated)",
                got=0,
                code="invalid_params",
            )
        if req.min_tokens:
            raise InvalidRequest(
                "min_tokens", "must be 0 when max_tokens is 0", got=req.min_tokens,
                code="invalid_params",
            )  # fmt: skip


def echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens`` 0: the answer is the prompt alone, scored when
    ``logprobs`` is given (how evaluation tools score a text). The runtime always emits
    at least one token, so it runs with ``max_tokens`` 1 and the response drops that
    token (vLLM does the same)."""
    return bool(req.echo) and req.max_tokens == 0


def check_chat(req: ChatCompletionRequest) -> None:
    """Refuse the chat fields this server does not honour (InvalidRequest)."""
    _check_common(req)
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise _refuse(
                "top_logprobs", f"must be an int in [0, {MAX_LOGPROBS}]", req.top_logprobs
            )
        if not req.logprobs:
            raise _refuse("top_logprobs", "needs logprobs to be true", req.top_logprobs)
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise _refuse(
            "max_tokens",
            f"must equal max_completion_tokens ({req.max_completion_tokens}) when both are given",
            req.max_tokens,
        )
    # tools, tool_choice: tool_calls.tool_plan; response_format: response_format.py
    _neutral(
        "functions", req.functions, [[]], "the legacy functions API is not supported; use tools"
    )
    _neutral("function_call", req.function_call, ["none"],
             "the legacy functions API is not supported; use tool_choice")  # fmt: skip
    _neutral("modalities", req.modalities, [["text"]], "only text is produced")
    _neutral("audio", req.audio, [], "only text is produced")
    _neutral("prediction", req.prediction, [], "predicted outputs are not supported")
    _neutral("store", req.store, [False], "completions are not stored")
    _neutral("metadata", req.metadata, [{}], "completions are not stored, so they carry none")
    _neutral("moderation", req.moderation, [], "no moderation model runs here")
    _neutral("web_search_options", req.web_search_options, [], "there is no web search")
    _neutral("reasoning_effort", req.reasoning_effort, ["none"], "the model does not reason")
    _neutral("verbosity", req.verbosity, [], "verbosity cannot be constrained")
    _neutral("service_tier", req.service_tier, ["auto", "default"], "there is one tier")
    # Every prompt's full KV blocks are cached automatically and evicted only when needed
    # (least recently used); a key or a longer retention cannot be promised.
    _neutral("prompt_cache_retention", req.prompt_cache_retention, ["in_memory"], "no 24h cache")
    _neutral(
        "prompt_cache_options",
        req.prompt_cache_options,
        [{}, {"mode": "implicit"}],
        "the prefix cache is implicit and has no TTL",
    )


# ---- prompts and messages -------------------------------------------------------------------

_PROMPT_RULE: Final = (
    "must be a string, a list of strings, a list of token ids or a list of lists of token ids"
)


def _is_ids(items: object) -> bool:
    return isinstance(items, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in items
    )


def prompts_of(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts of a completions request, each text or token ids (their range and
    length are checked by :func:`spectrio.core.params.check_prompt`)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt", "must not be empty", code="empty_prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if _is_ids(prompt):
        return [list(prompt)]
    if all(_is_ids(p) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequest("prompt", _PROMPT_RULE, got=prompt, code="wrong_type")


CHAT_ROLES: Final = ("system", "developer", "user", "assistant", "tool", "function")


def _tool_calls(message: ChatMessage, at: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls as templates read them: OpenAI's shape, the
    arguments an object (parsed from their JSON text)."""
    calls: list[dict[str, Any]] = []
    if message.tool_calls and message.role != "assistant":
        raise _refuse(f"{at}.tool_calls", "only an assistant message has tool calls", "given")
    for j, call in enumerate(message.tool_calls or []):
        where = f"{at}.tool_calls[{j}]"
        if call.type != "function":
            raise _refuse(f"{where}.type", "must be 'function'", call.type)
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            raise _refuse(
                f"{where}.function.arguments", "must be JSON text (an object)",
                call.function.arguments,
            ) from None  # fmt: skip
        function = {"name": call.function.name, "arguments": arguments}
        entry: dict[str, Any] = {"type": "function", "function": function}
        if call.id is not None:
            entry["id"] = call.id
        calls.append(entry)
    return calls


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: ``role`` and ``content`` strings
    (text parts joined by newlines), with ``name`` and ``tool_call_id`` when given, and
    an assistant's ``tool_calls`` (:func:`_tool_calls`; its ``content`` may then be
    null, read as ``""``). ``developer`` (OpenAI's newer name for ``system``) is
    rendered as ``system``: the templates of open models know only that one."""
    if not messages:
        raise InvalidRequest("messages", "must be a non-empty list of messages", got=[])
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if m.role not in CHAT_ROLES:
            raise _refuse(f"{at}.role", f"must be one of {', '.join(CHAT_ROLES)}", m.role)
        calls = _tool_calls(m, at)
        _neutral(f"{at}.function_call", m.function_call, [], "use tool_calls")
        _neutral(f"{at}.audio", m.audio, [], "audio is not supported")
        _neutral(f"{at}.refusal", m.refusal, [], "refusal messages are not supported")
        _neutral(f"{at}.annotations", m.annotations, [[]], "annotations are not supported")
        if isinstance(m.content, str):
            content = m.content
        elif isinstance(m.content, list):
            texts: list[str] = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise _refuse(
                        f"{at}.content[{j}].type",
                        "only text parts ({'type': 'text', 'text': ...}) are supported",
                        part.type,
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        elif calls:
            content = ""
        else:
            raise _refuse(f"{at}.content", "must be a string or a list of text parts", None)
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content,
        }
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


# ---- sampling parameters --------------------------------------------------------------------


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    vocab_size: int,
    default_max_tokens: int,
    logprobs: int | None,
    constraint: Sourced | None = None,
) -> SamplingParams:
    """The request's sampling parameters, checked (:class:`InvalidRequest` with the
    runtime's rule text). ``default_max_tokens`` applies when the request gives none;
    ``logprobs`` is the top width each endpoint reads from its own fields;
    ``constraint`` is what the output must match, a refusal of it naming its field."""
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    prompt_logprobs = None
    if isinstance(req, CompletionRequest):
        if echo_only(req):
            max_tokens = 1  # one token the response drops (echo_only)
        if req.echo:  # the echoed prompt's tokens come with logprobs too
            prompt_logprobs = logprobs
    given: dict[str, Any] = {
        "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "min_tokens": req.min_tokens,
        "temperature": DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        "top_k": req.top_k,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "seed": req.seed,
        "stop": [req.stop] if isinstance(req.stop, str) else req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "constraint": None if constraint is None else constraint.constraint,
    }
    # None means "not given": the runtime's default, except where OpenAI's differs (above)
    params = SamplingParams(
        **{
            k: v
            for k, v in given.items()
            if v is not None or k in ("seed", "logprobs", "prompt_logprobs")
        }
    )
    try:
        return check_params(params, vocab_size)
    except InvalidRequest as exc:
        if (
            exc.field == "max_tokens"
            and isinstance(req, ChatCompletionRequest)
            and req.max_completion_tokens is not None
        ):  # name the field the client sent
            raise InvalidRequest(
                "max_completion_tokens", exc.rule, got=max_tokens, code=exc.code
            ) from None
        raise renamed(exc, constraint) from None


def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Parameters of each of ``n`` choices. With a ``seed``, choice ``i`` samples with
    ``seed + i`` (mod 2**63): the choices differ from one another, and the same request
    gives the same choices again."""
    if params.seed is None:
        return [params] * n
    return [msgspec.structs.replace(params, seed=(params.seed + i) % _MAX_SEED) for i in range(n)]
