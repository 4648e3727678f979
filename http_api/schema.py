"""The OpenAI-compatible HTTP API as msgspec Structs: request bodies, responses, stream
chunks and error objects (reference: ``docs/http.md``).

Request bodies forbid unknown fields, so a field this server does not know is refused
with a 400 naming it instead of being dropped. Fields the server does not implement are
still declared (typed loosely, ``Any``), so that :mod:`spectrio.http_api.mapping` can
accept their neutral values (``null``, ``[]``, ``"none"``) and refuse the rest by name.
Every field is optional at the JSON level except the ones OpenAI requires
(``prompt``; ``messages``), and ``null`` means "not given", as in OpenAI's API.

Responses keep OpenAI's field names and its ``null`` s (``omit_defaults`` is off): a
client that reads ``choice.logprobs`` finds ``null``, not a missing key. The one
extension in a response is ``usage.spectrio`` (drafts proposed and accepted).

Structured output and tool calling (``response_format``, vLLM's ``guided_*`` and
``structured_outputs``, ``tools``, ``tool_choice``) are typed here and mapped by
:mod:`spectrio.http_api.response_format` and :mod:`spectrio.http_api.tool_calls`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "ChatChoice",
    "ChatChunk",
    "ChatChunkChoice",
    "DeltaFunctionCall",
    "DeltaToolCall",
    "FunctionCall",
    "FunctionDefinition",
    "JsonSchemaFormat",
    "MessageFunctionCall",
    "MessageToolCall",
    "NamedFunction",
    "ResponseFormat",
    "StructuredOutputs",
    "Tool",
    "ToolCall",
    "ToolChoiceObject",
    "ChatCompletion",
    "ChatCompletionRequest",
    "ChatDelta",
    "ChatLogprobs",
    "ChatMessage",
    "ChatTokenLogprob",
    "Completion",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "ContentPart",
    "DraftUsage",
    "PromptTokensDetails",
    "ErrorBody",
    "ErrorObject",
    "ModelCard",
    "ModelList",
    "ResponseMessage",
    "StreamOptions",
    "TopLogprob",
    "Usage",
]


# ---- requests ------------------------------------------------------------------------------


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request object: unknown fields are refused, never ignored."""


class StreamOptions(_Body, kw_only=True):
    include_usage: bool | None = None  # a last chunk with usage and no choices
    include_obfuscation: bool | None = None  # padding against size side channels: refused


class JsonSchemaFormat(_Body, kw_only=True):
    """``response_format.json_schema``."""

    name: str  # required by OpenAI; not used
    schema: dict[str, Any] | None = None  # the schema the output must match (required here)
    strict: bool | None = None  # accepted: the schema is always enforced in full
    description: str | None = None


class ResponseFormat(_Body, kw_only=True):
    """``response_format``: ``{"type": "text" | "json_object" | "json_schema"}``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body, kw_only=True):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    json: str | dict[str, Any] | None = None  # a JSON schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, in llguidance's dialect (docs/http.md)
    json_object: bool | None = None


class _SamplingFields(_Body, kw_only=True):
    """The fields both endpoints share. The sampling ones are plain types here: their
    range rules are :class:`spectrio.SamplingParams`' own (checked by
    :func:`spectrio.core.params.check_params`, so the 400 reads the same as the embedding
    API's :class:`spectrio.InvalidRequest`)."""

    model: str | None = None  # the served model's name; None: the served model
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # refused unless empty
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None  # logged with the request
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's: requests share prefix-cache blocks only with the same salt (docs/http.md)
    cache_salt: str | None = None
    # structured output (response_format.py): OpenAI's, then vLLM's extensions
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``."""

    # text, texts, token ids, or lists of token ids: msgspec allows one array type in a
    # union, so the list's items are checked by mapping.prompts_of
    prompt: str | list[Any]
    best_of: int | None = None  # honoured when it equals n
    echo: bool | None = None
    logprobs: int | None = None  # top alternatives per token, 0..20
    suffix: str | None = None  # refused unless empty


class ContentPart(_Body, kw_only=True):
    """One part of a message's content: ``{"type": "text", "text": ...}`` is read; the
    other kinds (images, audio, files, refusals) are refused by name."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


class MessageFunctionCall(_Body, kw_only=True):
    name: str
    arguments: str  # JSON text, as the response gave it


class MessageToolCall(_Body, kw_only=True):
    """A tool call of an earlier assistant message, in the shape the response gave it."""

    id: str | None = None
    type: str = "function"
    function: MessageFunctionCall


class ChatMessage(_Body, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # passed to the template
    tool_call_id: str | None = None  # passed to the template (a "tool" message)
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    function_call: Any = None  # refused
    refusal: str | None = None  # refused
    audio: Any = None  # refused
    annotations: Any = None  # a response's citations, sent back with it: null or [] only


class FunctionDefinition(_Body, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # accepted: a constrained call enforces the schema in full


class Tool(_Body, kw_only=True):
    """One of ``tools``: ``{"type": "function", "function": {...}}`` (other types are
    refused by name)."""

    type: str
    function: FunctionDefinition | None = None
    custom: Any = None  # a custom tool: refused


class NamedFunction(_Body, kw_only=True):
    name: str


class ToolChoiceObject(_Body, kw_only=True):
    """``tool_choice`` as an object: ``{"type": "function", "function": {"name": ...}}``."""

    type: str
    function: NamedFunction | None = None
    custom: Any = None  # refused
    allowed_tools: Any = None  # refused


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # max_tokens' newer name
    logprobs: bool | None = None
    top_logprobs: int | None = None  # 0..20, with logprobs
    # OpenAI features this server does not implement: neutral values only (mapping.py)
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    metadata: Any = None
    modalities: Any = None
    moderation: Any = None
    parallel_tool_calls: bool | None = None
    prediction: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning_effort: Any = None
    safety_identifier: str | None = None  # logged with the request, like user
    service_tier: Any = None
    store: Any = None
    tool_choice: str | ToolChoiceObject | None = None
    tools: list[Tool] | None = None
    verbosity: Any = None
    web_search_options: Any = None


# ---- responses -----------------------------------------------------------------------------


class DraftUsage(msgspec.Struct, kw_only=True):
    """The extension in ``usage``: speculative decoding's drafts for this response (all
    its choices), as the scheduler counted them."""

    drafts_proposed: int
    drafts_accepted: int


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    """OpenAI's breakdown of ``prompt_tokens``."""

    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int  # once per prompt, whatever n is
    completion_tokens: int  # over every choice
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    spectrio: DraftUsage  # extension (docs/http.md); namespaced so it never meets a new OpenAI key


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str]
    # null for the first prompt token with echo (it has no context, so no logprob)
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # the top alternatives and the token itself
    text_offset: list[int]  # character offset of each token in the choice's text


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct, kw_only=True):
    """A completions response, or one chunk of its stream (``usage`` then only on the
    last chunk, with ``stream_options.include_usage``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str  # call_<hex>
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is tool calls alone
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: str | None = None


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None  # on a call's first delta
    arguments: str | None = None  # the next piece of the arguments' JSON text


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed tool call: ``id``, ``type`` and ``function.name`` on its
    first delta, then ``function.arguments`` pieces; ``index`` tells the calls apart."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A stream chunk's delta: ``role`` on a choice's first chunk only, ``content`` when
    there is text, ``tool_calls`` when there are calls (OpenAI omits what a chunk does
    not carry)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | None = None
    service_tier: str | None = None
    usage: Usage | None = None


class ErrorObject(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct, kw_only=True):
    """Every error response (and a stream's error event): ``{"error": {...}}``."""

    error: ErrorObject


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "spectrio"
    max_model_len: int  # extension, as vLLM has it


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]
