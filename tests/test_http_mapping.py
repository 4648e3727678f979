"""The HTTP front's pure logic (``spectrio.http_api.mapping``, ``logprobs``,
``responses``): decoding with errors that name the field, every OpenAI field declared and
either honoured or refused, the field-by-field mapping onto SamplingParams, per-choice
seeds, prompt shapes, chat messages, logprobs in both formats and usage."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from tokenizers.pre_tokenizers import ByteLevel

from spectrio.core.acceptance import Acceptance
from spectrio.core.messages import TokenLogprob
from spectrio.core.params import InvalidRequest, SamplingParams, check_params
from spectrio.http_api import mapping
from spectrio.http_api.logprobs import (
    _BYTE_LEVEL,
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
)
from spectrio.http_api.mapping import HttpError
from spectrio.http_api.responses import ChoiceState, usage
from spectrio.http_api.schema import ChatCompletionRequest, CompletionRequest
from spectrio.models import LoadedModel
from spectrio.runtime.api import Delta

VOCAB = 1000


def completion(**fields: Any) -> CompletionRequest:
    return mapping.decode(msgspec.json.encode({"prompt": "x", **fields}), CompletionRequest)


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return mapping.decode(msgspec.json.encode(body), ChatCompletionRequest)


def refusal(exc: pytest.ExceptionInfo[BaseException]) -> tuple[str | None, str]:
    err = exc.value
    if isinstance(err, InvalidRequest):
        err = mapping.invalid(err)
    assert isinstance(err, HttpError) and err.status == 400
    return err.param, err.message


# ---- every field of the official client is declared -------------------------------------


def _sdk_fields(module: Any) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def test_every_field_the_openai_sdk_sends_is_declared() -> None:
    """A field the API defines is never an 'unknown field': it is honoured, or refused
    by name with its own rule (the tests below)."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    declared = {f.name for f in msgspec.structs.fields(CompletionRequest)}
    assert _sdk_fields(completion_create_params) <= declared
    declared = {f.name for f in msgspec.structs.fields(ChatCompletionRequest)}
    assert _sdk_fields(chat_create_params) <= declared


# tools, tool_choice, parallel_tool_calls and response_format are honoured:
# tests/test_tool_calls.py and tests/test_http_response_format.py
REFUSED_CHAT: list[tuple[str, Any]] = [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("store", True),
    ("metadata", {"a": "b"}),
    ("moderation", {"model": "omni-moderation-latest"}),
    ("web_search_options", {}),
    ("reasoning_effort", "high"),
    ("verbosity", "low"),
    ("service_tier", "flex"),
    ("prompt_cache_retention", "24h"),
    ("prompt_cache_options", {"mode": "explicit"}),
    ("logit_bias", {"5": 1.0}),
]
NEUTRAL_CHAT: list[tuple[str, Any]] = [
    ("tools", []),
    ("tool_choice", "none"),
    ("function_call", "none"),
    ("response_format", {"type": "text"}),
    ("modalities", ["text"]),
    ("store", False),
    ("metadata", {}),
    ("reasoning_effort", "none"),
    ("service_tier", "auto"),
    ("prompt_cache_retention", "in_memory"),
    ("prompt_cache_options", {"mode": "implicit"}),
    ("prompt_cache_key", "k"),
    ("safety_identifier", "u1"),
    ("user", "u1"),
    ("logit_bias", {}),
]


@pytest.mark.parametrize(("field", "value"), REFUSED_CHAT, ids=[f for f, _ in REFUSED_CHAT])
def test_a_chat_field_not_honoured_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as exc:
        mapping.check_chat(chat(**{field: value}))
    param, message = refusal(exc)
    assert param == field and message.startswith(f"{field}: ")


@pytest.mark.parametrize(("field", "value"), NEUTRAL_CHAT, ids=[f for f, _ in NEUTRAL_CHAT])
def test_a_neutral_value_is_accepted(field: str, value: Any) -> None:
    mapping.check_chat(chat(**{field: value}))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
        ({"logit_bias": {"1": -100}}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        (
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
    ],  # fmt: skip
)
def test_completion_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        mapping.check_completion(completion(**fields))
    assert refusal(exc)[0] == param


def test_completion_neutral_values() -> None:
    mapping.check_completion(completion(best_of=2, n=2, suffix="", echo=True, logit_bias={}))


def test_chat_top_logprobs_needs_logprobs_and_a_range() -> None:
    with pytest.raises(InvalidRequest, match="top_logprobs: needs logprobs"):
        mapping.check_chat(chat(top_logprobs=2))
    with pytest.raises(InvalidRequest, match=r"top_logprobs: must be an int in \[0, 20\]"):
        mapping.check_chat(chat(logprobs=True, top_logprobs=21))
    with pytest.raises(InvalidRequest, match="max_tokens: must equal max_completion_tokens"):
        mapping.check_chat(chat(max_tokens=3, max_completion_tokens=4))


# ---- decoding ---------------------------------------------------------------------------


def test_malformed_json_and_a_non_object() -> None:
    with pytest.raises(HttpError) as exc:
        mapping.decode(b'{"prompt": ', CompletionRequest)
    assert exc.value.status == 400 and exc.value.code == "invalid_json"
    with pytest.raises(HttpError, match="must be a JSON object"):
        mapping.decode(b"[1, 2]", CompletionRequest)


def test_a_wrong_type_reads_as_the_runtime_rule() -> None:
    """A sampling field's 400 is the embedding API's InvalidRequest text."""
    with pytest.raises(HttpError) as exc:
        mapping.decode(b'{"prompt": "x", "top_p": "high"}', CompletionRequest)
    assert exc.value.param == "top_p" and exc.value.code == "wrong_type"
    with pytest.raises(InvalidRequest) as same:
        check_params(SamplingParams(top_p="high"), VOCAB)  # type: ignore[arg-type]
    assert exc.value.message == str(same.value)


def test_unknown_missing_and_nested_fields_are_named() -> None:
    with pytest.raises(HttpError) as exc:
        mapping.decode(b'{"prompt": "x", "best_of_all": 1}', CompletionRequest)
    assert exc.value.param == "best_of_all" and exc.value.code == "unknown_field"
    with pytest.raises(HttpError) as exc:
        mapping.decode(b'{"max_tokens": 3}', CompletionRequest)
    assert exc.value.param == "prompt" and exc.value.message == "prompt: required"
    body = b'{"messages": [{"role": "user", "content": "x", "mood": "happy"}]}'
    with pytest.raises(HttpError) as exc:
        mapping.decode(body, ChatCompletionRequest)
    assert exc.value.param == "messages[0].mood"
    body = b'{"messages": [{"role": "user", "content": 5}]}'
    with pytest.raises(HttpError) as exc:
        mapping.decode(body, ChatCompletionRequest)
    assert exc.value.param == "messages[0].content" and "got 5" in exc.value.message


# ---- sampling parameters ----------------------------------------------------------------


def test_every_sampling_field_maps_onto_its_parameter() -> None:
    req = completion(
        max_tokens=7, min_tokens=2, temperature=0.5, top_k=40, top_p=0.9, min_p=0.05, seed=11,
        stop="END", stop_token_ids=[3, 4], ignore_eos=True, repetition_penalty=1.1,
        frequency_penalty=0.2, presence_penalty=-0.3,
    )  # fmt: skip
    got = mapping.sampling_params(req, vocab_size=VOCAB, default_max_tokens=16, logprobs=3)
    assert got == SamplingParams(
        max_tokens=7, min_tokens=2, temperature=0.5, top_k=40, top_p=0.9, min_p=0.05, seed=11,
        stop=["END"], stop_token_ids=[3, 4], ignore_eos=True, repetition_penalty=1.1,
        frequency_penalty=0.2, presence_penalty=-0.3, logprobs=3,
    )  # fmt: skip


def test_openai_defaults() -> None:
    got = mapping.sampling_params(
        completion(), vocab_size=VOCAB, default_max_tokens=16, logprobs=None
    )
    assert got == SamplingParams(max_tokens=16, temperature=1.0)
    got = mapping.sampling_params(
        chat(max_completion_tokens=9), vocab_size=VOCAB, default_max_tokens=512, logprobs=None
    )
    assert got.max_tokens == 9


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -1}, "temperature: must be a finite number >= 0, got -1.0"),
        ({"top_p": 0}, "top_p: must be a finite number in (0, 1], got 0.0"),
        ({"max_tokens": 0}, "max_tokens: must be an int >= 1, got 0"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens: must be at most max_tokens (2), got 5"),
        ({"stop_token_ids": [5000]}, "stop_token_ids: must be token ids below the vocabulary"),
        ({"seed": 2**63}, "seed: must be None or an int in [0, 9223372036854775807]"),
        ({"stop": [""]}, "stop: must be a list of non-empty strings"),
    ],
)
def test_bad_values_get_the_runtime_rule_text(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        mapping.sampling_params(
            completion(**fields), vocab_size=VOCAB, default_max_tokens=16, logprobs=None
        )
    assert str(exc.value).startswith(message)


def test_max_completion_tokens_is_named_as_sent() -> None:
    with pytest.raises(InvalidRequest) as exc:
        mapping.sampling_params(
            chat(max_completion_tokens=0), vocab_size=VOCAB, default_max_tokens=5, logprobs=None
        )
    assert exc.value.field == "max_completion_tokens"


def test_choices_get_seed_plus_index() -> None:
    params = SamplingParams(seed=2**63 - 1, temperature=1.0)
    seeds = [p.seed for p in mapping.per_choice(params, 3)]
    assert seeds == [2**63 - 1, 0, 1]
    assert mapping.per_choice(SamplingParams(), 2) == [SamplingParams()] * 2


# ---- prompts and messages ---------------------------------------------------------------


def test_prompt_shapes() -> None:
    assert mapping.prompts_of("a") == ["a"]
    assert mapping.prompts_of(["a", "b"]) == ["a", "b"]
    assert mapping.prompts_of([1, 2]) == [[1, 2]]
    assert mapping.prompts_of([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([1, "a"], [[1], "a"], [True, 2], [[1.0]]):
        with pytest.raises(InvalidRequest, match="prompt: must be a string, a list of strings"):
            mapping.prompts_of(bad)
    with pytest.raises(InvalidRequest, match="prompt: must not be empty"):
        mapping.prompts_of([])


def test_chat_messages_for_the_template() -> None:
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "name": "ann",
             "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok", "tool_calls": []},
        ]
    )  # fmt: skip
    assert mapping.chat_messages(req.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": "ok"},
    ]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "wizard", "content": "x"}, "messages[0].role"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            "messages[0].content[0].type",
        ),
        (
            {
                "role": "user",
                "content": "x",
                "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}],
            },
            "messages[0].tool_calls",
        ),
        (
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{oops"}}],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"role": "assistant", "content": None}, "messages[0].content"),
    ],  # fmt: skip
)
def test_chat_message_refusals(message: dict[str, Any], param: str) -> None:
    req = chat(messages=[message])
    with pytest.raises(InvalidRequest) as exc:
        mapping.chat_messages(req.messages)
    assert refusal(exc)[0] == param


# ---- logprobs and usage -----------------------------------------------------------------


def test_the_byte_table_is_gpt2s() -> None:
    assert set(_BYTE_LEVEL) == set(ByteLevel.alphabet()) and len(_BYTE_LEVEL) == 256
    assert _BYTE_LEVEL["Ġ"] == 32 and _BYTE_LEVEL["Ċ"] == 10 and _BYTE_LEVEL["A"] == 65


def test_token_strings_decode_to_the_text(bundled: LoadedModel) -> None:
    tok = bundled.tokenizer
    assert tok is not None
    strings = TokenStrings(tok)
    text = "def f(x):\n    return 'é' + x  # ok"
    ids = tok.encode(text)
    assert b"".join(strings.get(i)[1] for i in ids).decode("utf-8") == text
    eos = tok.eos_token_id
    assert eos is not None and strings.text(eos) == "<|endoftext|>"


def test_logprob_formats(bundled: LoadedModel) -> None:
    assert bundled.tokenizer is not None
    strings = TokenStrings(bundled.tokenizer)
    a, b = bundled.tokenizer.encode("def")[0], bundled.tokenizer.encode(" x")[0]
    entries = [
        TokenLogprob(token_id=a, logprob=-0.5, rank=1, top=[(a, -0.5), (b, -1.5)]),
        TokenLogprob(token_id=b, logprob=float("-inf"), rank=7, top=[(a, -0.1)]),
    ]
    legacy, end = completion_logprobs(entries, strings, 4)
    assert legacy.tokens == ["def", " x"] and legacy.token_logprobs == [-0.5, -9999.0]
    assert legacy.top_logprobs == [{"def": -0.5, " x": -1.5}, {"def": -0.1, " x": -9999.0}]
    assert legacy.text_offset == [4, 7] and end == 9
    content = chat_logprobs(entries, strings).content
    assert content is not None and [c.token for c in content] == ["def", " x"]
    assert content[1].bytes == [32, 120] and [t.token for t in content[1].top_logprobs] == ["def"]


def test_usage_adds_choices_and_prefers_the_final_count() -> None:
    a, b = ChoiceState(0), ChoiceState(1)
    a.add(Delta(request_id="a", token_ids=[1, 2], text="xy", num_drafts=3, num_accepted=1))
    a.add(Delta(request_id="a", token_ids=[3], text="z", finished=True, finish_reason="length",
                num_drafts=2, num_accepted=0, acceptance=Acceptance(6, 2)))  # fmt: skip
    b.add(Delta(request_id="b", token_ids=[4], text="w", finished=True, finish_reason="stop"))
    got = usage(5, [a, b])
    assert (got.prompt_tokens, got.completion_tokens, got.total_tokens) == (5, 4, 9)
    assert (got.spectrio.drafts_proposed, got.spectrio.drafts_accepted) == (6, 2)
    assert a.text == "xyz" and a.finish_reason == "length"
