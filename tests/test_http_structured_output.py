"""Structured output over HTTP, measured as issue 60 states it: the official ``openai``
client against ``spectrio serve --http --model smollm2`` with speculation on (MTP, the
checkpoint's own head). Every answer that finishes validates against its schema
(``jsonschema``), greedy and sampled, streamed and not, over schemas with nested
objects, enums, arrays with bounds and numbers with ranges; a streamed answer is the
whole one; completions take ``response_format`` and the ``guided_*`` fields too; and
what cannot be enforced gets a 400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from http_helpers import HttpServer, http_server

MODEL = "smollm2"
TIMEOUT_S = 120.0  # per request


def _text(n: int) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": n}


SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "nested": (
        "Describe a person who lives in Paris, as JSON.",
        {
            "type": "object",
            "properties": {
                "name": _text(24),
                "address": {
                    "type": "object",
                    "properties": {
                        "city": _text(20),
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        "geo": {
                            "type": "object",
                            "properties": {
                                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                                "lon": {"type": "number", "minimum": -180, "maximum": 180},
                            },
                            "required": ["lat", "lon"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["city", "zip", "geo"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
    ),
    "enums": (
        "Pick a t-shirt for me, as JSON.",
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                "fit": {"enum": ["slim", "regular", None, 3]},
            },
            "required": ["color", "size", "fit"],
            "additionalProperties": False,
        },
    ),
    "arrays": (
        "List some fruits and their prices, as JSON.",
        {
            "type": "object",
            "properties": {
                "fruits": {"type": "array", "items": _text(12), "minItems": 2, "maxItems": 4},
                "prices": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 1, "maximum": 99},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["fruits", "prices"],
            "additionalProperties": False,
        },
    ),
    "ranges": (
        "Give today's weather in Oslo, as JSON.",
        {
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "minimum": -30, "maximum": 45},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                "wind": {"type": "number", "exclusiveMinimum": 0, "maximum": 60},
                "rain": {"type": "boolean"},
            },
            "required": ["temperature", "humidity", "wind", "rain"],
            "additionalProperties": False,
        },
    ),
    "items_of_objects": (
        "Plan a three-step morning routine, as JSON.",
        {
            "type": "object",
            "properties": {
                "steps": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "what": _text(20),
                            "minutes": {"type": "integer", "minimum": 1, "maximum": 60},
                            "kind": {"enum": ["wash", "eat", "move"]},
                        },
                        "required": ["what", "minutes", "kind"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["steps"],
            "additionalProperties": False,
        },
    ),
}


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    args = (
        "--no-zmq", "--model", str(smollm2_gguf), "--served-model-name", MODEL,
        "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
    )  # fmt: skip
    with http_server(tmp_path_factory.mktemp("http_structured"), *args) as srv:
        yield srv


@pytest.fixture
def client(server: HttpServer) -> Iterator[openai.OpenAI]:
    with server.sdk(timeout=TIMEOUT_S) as c:
        yield c


def _format(name: str, schema: dict[str, Any], strict: bool | None = True) -> dict[str, Any]:
    spec = {"name": name, "schema": schema, "strict": strict}
    return {"type": "json_schema", "json_schema": spec}


def _ask(
    client: openai.OpenAI, name: str, *, stream: bool, **kw: Any
) -> list[tuple[str, str | None]]:
    """(text, finish_reason) of each choice."""
    prompt, schema = SCHEMAS[name]
    messages = [{"role": "user", "content": prompt}]
    rf = _format(name, schema)
    if not stream:
        out = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format=rf,
            max_tokens=300,
            **kw,  # type: ignore[arg-type]
        )
        return [(c.message.content or "", c.finish_reason) for c in out.choices]
    n = kw.get("n") or 1
    texts, reasons = [""] * n, [None] * n
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        response_format=rf,
        max_tokens=300,
        stream=True,
        **kw,  # type: ignore[arg-type]
    )
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason is not None:
                reasons[ch.index] = ch.finish_reason  # type: ignore[call-overload]
    return list(zip(texts, reasons, strict=True))


def _check(name: str, answers: list[tuple[str, str | None]], tally: dict[str, int]) -> None:
    schema = SCHEMAS[name][1]
    for text, reason in answers:
        assert reason in ("stop", "length"), (name, reason)
        if reason != "stop":
            tally["cut"] += 1
            continue
        tally["finished"] += 1
        jsonschema.validate(json.loads(text), schema)  # raises with the path that fails
        tally["valid"] += 1


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_finished_answer_validates(client: openai.OpenAI, name: str) -> None:
    """Greedy and sampled (n = 6, temperature 1), streamed and not: 100% of the answers
    that finish validate, and the greedy ones all finish. A streamed greedy answer is
    the whole one."""
    tally = {"finished": 0, "valid": 0, "cut": 0}
    greedy = _ask(client, name, stream=False, temperature=0)
    streamed = _ask(client, name, stream=True, temperature=0)
    assert streamed == greedy
    assert [r for _, r in greedy] == ["stop"]
    _check(name, greedy + streamed, tally)
    for stream in (False, True):
        answers = _ask(client, name, stream=stream, temperature=1.0, n=6, seed=11 + stream)
        _check(name, answers, tally)
    assert tally["valid"] == tally["finished"] >= 10, tally  # most sampled answers finish too
    print(f"{name}: {tally}")


def test_json_object_and_strict_false(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about cats in JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:
        assert (choice.message.content or "").startswith("{")
    # strict: false (or null) still enforces the schema in full
    prompt, schema = SCHEMAS["enums"]
    for strict in (False, None):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
            response_format=_format("enums", schema, strict),  # type: ignore[arg-type]
        )  # fmt: skip
        jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)


def test_completions_take_the_same_fields(client: openai.OpenAI) -> None:
    schema = SCHEMAS["ranges"][1]
    out = client.completions.create(
        model=MODEL, prompt="Weather report as JSON:", max_tokens=120, temperature=0,
        extra_body={"response_format": _format("ranges", schema)},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    regex = r"[0-9]{3}-[0-9]{4}"
    out = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.8, n=3, seed=5,
        extra_body={"guided_regex": regex},
    )  # fmt: skip
    assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(
        model=MODEL, prompt="Is the sky green? Answer:", max_tokens=5, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )  # fmt: skip
    assert out.choices[0].text in ("yes", "no", "maybe")
    grammar = 'start: "The answer is " NUM "."\nNUM: /[1-9][0-9]?/\n'
    out = client.completions.create(
        model=MODEL, prompt="What is 6 times 7?", max_tokens=12, temperature=0,
        extra_body={"guided_grammar": grammar},
    )  # fmt: skip
    assert re.fullmatch(r"The answer is [1-9][0-9]?\.", out.choices[0].text)


def test_chat_takes_the_guided_fields(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Which colour is the sky?"}],
        temperature=0,
        extra_body={"guided_choice": ["blue", "green"]},
    )
    assert out.choices[0].message.content in ("blue", "green")
    assert out.choices[0].finish_reason == "stop"


def _refused(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    return exc.value


def test_what_cannot_be_enforced_is_refused_naming_the_field(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi"}]

    def chat(**kw: Any) -> Any:
        return lambda: client.chat.completions.create(model=MODEL, messages=messages, **kw)  # type: ignore[arg-type]

    cases = [
        (chat(response_format=_format("x", {"type": "strin"})),
         "response_format.json_schema.schema", "Invalid type: strin"),
        (chat(response_format=_format("x", {"type": "array", "uniqueItems": True})),
         "response_format.json_schema.schema", "uniqueItems"),
        (chat(extra_body={"guided_regex": "[a-"}), "guided_regex", "unclosed character class"),
        (chat(extra_body={"guided_grammar": "start: nothing"}), "guided_grammar", "unknown name"),
        (chat(extra_body={"guided_json": {"not": {}}}), "guided_json", "not"),
        (chat(response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}),
         "guided_choice", "conflicts with response_format"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format.json_schema.schema", "required"),
        (chat(response_format={"type": "json_object"}, extra_body={"min_tokens": 3}),
         "min_tokens", "with a constraint"),
        (lambda: client.completions.create(model=MODEL, prompt="x",
                                           extra_body={"guided_json": "{bad"}),
         "guided_json", "JSON schema"),
    ]  # fmt: skip
    for call, param, words in cases:
        err = _refused(call)
        body = err.body
        assert isinstance(body, dict) and body["param"] == param, (param, body)
        assert body["message"].startswith(f"{param}: ") and words in body["message"], body
        assert err.status_code == 400
