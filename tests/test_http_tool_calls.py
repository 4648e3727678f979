"""Tool calling over HTTP: the official ``openai`` client against ``spectrio serve --http
--model smollm2`` (n-gram speculation). SmolLM2's template has no tools, so the default
format is used (a system preamble, ``<tool_call>`` blocks). ``required`` and a named
function always return calls whose arguments validate against the function's
``parameters`` (``jsonschema``), greedy and sampled, streamed and not, the stream in
OpenAI's delta shape; ``auto`` parses what the model wrote and ``none`` does not; earlier
calls and tool results are accepted in the messages; conflicting options get 400s
naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from http_helpers import HttpServer, http_server

MODEL = "smollm2"
TIMEOUT_S = 120.0

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
EMAIL = {
    "type": "object",
    "properties": {
        "to": {"type": "array", "items": {"type": "string", "maxLength": 40},
               "minItems": 1, "maxItems": 3},
        "subject": {"type": "string", "maxLength": 60},
        "urgent": {"type": "boolean"},
    },
    "required": ["to", "subject", "urgent"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The weather forecast of a city"}},
    {"type": "function", "function": {"name": "send_email", "parameters": EMAIL,
                                      "description": "Send an email"}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
QUESTIONS = [
    "What will the weather be in Lisbon for the next three days?",
    "Email Ann and Bob that the meeting moved to 3pm.",
    "What time is it?",
]
# what a Hermes-format call looks like: guided_grammar makes the model write one
CALL_GRAMMAR = (
    'start: "<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": {}}\\n</tool_call>"\n'
)


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    args = (
        "--no-zmq", "--model", str(smollm2_gguf), "--served-model-name", MODEL,
        "--spec-method", "ngram", "--max-model-len", "2048", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512",
    )  # fmt: skip
    with http_server(tmp_path_factory.mktemp("http_tools"), *args) as srv:
        yield srv


@pytest.fixture
def client(server: HttpServer) -> Iterator[openai.OpenAI]:
    with server.sdk(timeout=TIMEOUT_S) as c:
        yield c


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _validate(name: str, arguments: str) -> None:
    schema = SCHEMAS[name]
    args = json.loads(arguments)
    if schema is None:  # no parameters: an empty object
        assert args == {}
    else:
        jsonschema.validate(args, schema)


def _streamed(
    chunks: Any, n: int
) -> tuple[list[list[dict[str, Any]]], list[str | None], list[str]]:
    """Each choice's calls rebuilt from the deltas (checking OpenAI's shape), finish
    reasons and content."""
    calls: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    contents = [""] * n
    for chunk in chunks:
        for ch in chunk.choices:
            contents[ch.index] += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                mine = calls[ch.index]
                if d.id is not None:  # a call's first delta: id, type and name
                    assert d.index == len(mine) and d.type == "function"
                    assert d.function is not None and d.function.name
                    assert d.id.startswith("call_")
                    mine.append({"id": d.id, "name": d.function.name,
                                 "arguments": d.function.arguments or ""})  # fmt: skip
                else:
                    assert d.index == len(mine) - 1 and d.type is None
                    assert d.function is not None and d.function.name is None
                    mine[-1]["arguments"] += d.function.arguments or ""
            if ch.finish_reason is not None:
                reasons[ch.index] = ch.finish_reason
    return calls, reasons, contents


def _calls_of(out: Any) -> tuple[list[list[dict[str, Any]]], list[str | None], list[Any]]:
    """Each choice's calls, finish reasons and content of a whole response."""
    calls = [[{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
              for c in ch.message.tool_calls or []] for ch in out.choices]  # fmt: skip
    return (
        calls,
        [ch.finish_reason for ch in out.choices],
        [ch.message.content for ch in out.choices],
    )


def _answers(client: openai.OpenAI, n: int, **kw: Any) -> list[tuple[list[dict[str, Any]], Any]]:
    """(calls, finish reason) of each choice: greedy and sampled, whole and streamed."""
    got: list[tuple[list[dict[str, Any]], Any]] = []
    for temperature, choices in ((0.0, 1), (1.0, n)):
        params = {"temperature": temperature, "n": choices, "seed": 7, **kw}
        calls, reasons, contents = _calls_of(client.chat.completions.create(**params))
        assert all(c is None for c, r in zip(contents, reasons, strict=True) if r != "length")
        s_calls, s_reasons, s_contents = _streamed(
            client.chat.completions.create(stream=True, **params), choices
        )
        assert all(c == "" for c, r in zip(s_contents, s_reasons, strict=True) if r != "length")
        if temperature == 0:  # a streamed greedy answer is the whole one
            assert [(c["name"], c["arguments"]) for c in s_calls[0]] == [
                (c["name"], c["arguments"]) for c in calls[0]
            ]
        got += zip(calls, reasons, strict=True)
        got += zip(s_calls, s_reasons, strict=True)
    return got


@pytest.mark.parametrize("question", QUESTIONS)
def test_required_calls_always_validate(client: openai.OpenAI, question: str) -> None:
    """tool_choice required with parallel_tool_calls false, greedy and sampled (n = 4),
    streamed and not: every answer is one call of a function in tools whose arguments
    validate, and ends with finish_reason "tool_calls"."""
    answers = _answers(
        client, 4, model=MODEL, messages=_user(question), tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=300,
    )  # fmt: skip
    for calls, reason in answers:
        assert reason == "tool_calls" and len(calls) == 1, (reason, calls)
        _validate(calls[0]["name"], calls[0]["arguments"])
    print(f"{question!r}: {len(answers)} calls, all valid")


def test_parallel_required_calls_validate_up_to_the_cut(client: openai.OpenAI) -> None:
    """With parallel calls allowed (OpenAI's default), a small model may call again and
    again until max_tokens: every call it completed validates."""
    complete = 0
    for question in QUESTIONS:
        answers = _answers(
            client, 3, model=MODEL, messages=_user(question), tools=TOOLS,
            tool_choice="required", max_tokens=150,
        )  # fmt: skip
        for calls, reason in answers:
            assert calls and reason in ("tool_calls", "length"), (reason, calls)
            done = calls if reason == "tool_calls" else calls[:-1]  # the last may be cut
            for call in done:
                _validate(call["name"], call["arguments"])
                complete += 1
    assert complete >= 10
    print(f"parallel: {complete} complete calls, all valid")


@pytest.mark.parametrize("name", [t["function"]["name"] for t in TOOLS])
def test_a_named_function_is_the_one_called(client: openai.OpenAI, name: str) -> None:
    choice = {"type": "function", "function": {"name": name}}
    for stream in (False, True):
        kw: dict[str, Any] = {"model": MODEL, "messages": _user(QUESTIONS[0]), "tools": TOOLS,
                              "tool_choice": choice, "temperature": 1.0, "n": 3, "seed": 3,
                              "max_tokens": 300}  # fmt: skip
        if stream:
            calls, reasons, _ = _streamed(client.chat.completions.create(stream=True, **kw), 3)
        else:
            calls, reasons, _ = _calls_of(client.chat.completions.create(**kw))
        assert reasons == ["tool_calls"] * 3
        for mine in calls:
            assert [c["name"] for c in mine] == [name]  # one call of that function
            _validate(name, mine[0]["arguments"])


def test_auto_parses_what_the_model_writes_and_none_does_not(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "messages": _user(QUESTIONS[2]), "tools": TOOLS,
                          "temperature": 0,
                          "extra_body": {"guided_grammar": CALL_GRAMMAR}}  # fmt: skip
    auto = client.chat.completions.create(**kw)  # auto: the default with tools
    choice = auto.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_time" and call.function.arguments == "{}"  # type: ignore[union-attr]
    calls, reasons, contents = _streamed(client.chat.completions.create(stream=True, **kw), 1)
    assert reasons == ["tool_calls"] and contents == [""]
    assert [(c["name"], c["arguments"]) for c in calls[0]] == [("get_time", "{}")]
    none = client.chat.completions.create(tool_choice="none", **kw)
    choice = none.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == json.loads(CALL_GRAMMAR.split(": ", 1)[1])
    # unconstrained, an answer without calls is plain content
    free = client.chat.completions.create(
        model=MODEL, messages=_user("Say hello."), tools=TOOLS, temperature=0, max_tokens=40,  # type: ignore[arg-type]
    )  # fmt: skip
    assert free.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for call in free.choices[0].message.tool_calls or []:
        assert call.id.startswith("call_")


def test_auto_with_a_json_format_answers_with_calls_or_that_json(client: openai.OpenAI) -> None:
    """As OpenAI's: with tools and a JSON response_format, the model either calls a
    function or answers in the format; either way the answer validates."""
    answer = {"type": "object", "properties": {"reply": {"type": "string", "maxLength": 40}},
              "required": ["reply"], "additionalProperties": False}  # fmt: skip
    rf = {"type": "json_schema", "json_schema": {"name": "reply", "schema": answer}}
    kinds = set()
    for question in [*QUESTIONS, "Say hello."]:
        out = client.chat.completions.create(
            model=MODEL, messages=_user(question), tools=TOOLS, response_format=rf,  # type: ignore[arg-type]
            temperature=1.0, n=3, seed=2, max_tokens=300,
        )  # fmt: skip
        for choice in out.choices:
            assert choice.finish_reason in ("stop", "tool_calls"), choice
            if choice.finish_reason == "tool_calls":
                kinds.add("calls")
                for call in choice.message.tool_calls or []:
                    _validate(call.function.name, call.function.arguments)  # type: ignore[union-attr]
            else:
                kinds.add("json")
                jsonschema.validate(json.loads(choice.message.content or ""), answer)
    assert kinds
    print(f"auto with a JSON format: {sorted(kinds)}")


def test_earlier_calls_and_tool_results_are_accepted(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=_user(QUESTIONS[0]), tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        temperature=0, max_tokens=300,
    )  # fmt: skip
    message = first.choices[0].message
    assert message.tool_calls
    messages: list[Any] = [
        *_user(QUESTIONS[0]),
        message.model_dump(),  # the assistant's calls, as the SDK gives them (nulls too)
        *[{"role": "tool", "tool_call_id": c.id, "content": '{"forecast": "sunny, 24C"}'}
          for c in message.tool_calls],
    ]  # fmt: skip
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=60
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage is not None and out.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_conflicting_options_are_refused_naming_them(client: openai.OpenAI) -> None:
    bad_params = {"type": "function", "function": {"name": "bad", "parameters": {"type": "strin"}}}
    unimplemented = {
        "type": "function",
        "function": {"name": "u", "parameters": {"type": "object", "not": {}}},
    }
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
         "tool_choice.function.name", "must name a function in tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice",
         "conflicts with response_format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
          "extra_body": {"guided_regex": "a+"}}, "tool_choice", "conflicts with guided_regex"),
        ({"tools": [*TOOLS, bad_params], "tool_choice": "required"},
         "tools[3].function.parameters", "Invalid type: strin"),
        ({"tools": [unimplemented], "tool_choice": "required"},
         "tools[0].function.parameters", "cannot be enforced"),
        ({"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools[0].type",
         "only function tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "given before"),
    ]  # fmt: skip
    for fields, param, words in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=_user("hi"), **fields)
        body = exc.value.body
        assert isinstance(body, dict) and body["param"] == param, (param, body)
        assert body["message"].startswith(f"{param}: ") and words in body["message"], body
    # an invalid schema in auto mode is only shown to the model: not refused
    ok = client.chat.completions.create(
        model=MODEL, messages=_user("hi"), tools=[bad_params], max_tokens=2, temperature=0,  # type: ignore[list-item]
    )  # fmt: skip
    assert ok.choices[0].finish_reason is not None
