"""Structured output's HTTP fields (``spectrio.http_api.response_format``, pure):
``response_format``, vLLM's ``guided_*`` and ``structured_outputs`` map onto one
:class:`~spectrio.core.constraints.Constraint`; two are refused naming both; every
refusal of a constraint, the grammar library's included, names the HTTP field it came
from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from spectrio.core.constraints import Constraint
from spectrio.core.params import InvalidRequest
from spectrio.http_api import mapping
from spectrio.http_api.response_format import (
    Sourced,
    check_enforceable,
    requested_constraint,
)
from spectrio.http_api.schema import ChatCompletionRequest, CompletionRequest
from spectrio.models.text.tokenizer import TextTokenizer
from spectrio.stages.device.grammar import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def completion(**fields: Any) -> CompletionRequest:
    return mapping.decode(msgspec.json.encode({"prompt": "x", **fields}), CompletionRequest)


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return mapping.decode(msgspec.json.encode(body), ChatCompletionRequest)


def params(req: CompletionRequest | ChatCompletionRequest) -> Any:
    return mapping.sampling_params(
        req, vocab_size=1000, default_max_tokens=16, logprobs=None,
        constraint=requested_constraint(req),
    )  # fmt: skip


MAPPED: list[tuple[dict[str, Any], Constraint | None, str | None]] = [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, Constraint.json_object(), "response_format"),
    (
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
        Constraint.json_schema(SCHEMA),
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "n", "schema": SCHEMA, "strict": None,
                                             "description": "d"}}},
        Constraint.json_schema(SCHEMA),
        "response_format.json_schema.schema",
    ),
    ({"guided_json": SCHEMA}, Constraint.json_schema(SCHEMA), "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, Constraint.json_schema(SCHEMA), "guided_json"),
    ({"guided_regex": r"\d+"}, Constraint.regex(r"\d+"), "guided_regex"),
    ({"guided_choice": ["a", "b"]}, Constraint.choice(["a", "b"]), "guided_choice"),
    ({"guided_grammar": 'start: "x"'}, Constraint.grammar('start: "x"'), "guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA}}, Constraint.json_schema(SCHEMA),
     "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+"}}, Constraint.regex("a+"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["x"]}}, Constraint.choice(["x"]),
     "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'start: "y"'}}, Constraint.grammar('start: "y"'),
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, Constraint.json_object(),
     "structured_outputs.json_object"),
    ({"structured_outputs": {"json_object": False}}, None, None),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "constraint", "param"), MAPPED)
@pytest.mark.parametrize("endpoint", [completion, chat])
def test_the_fields_map_onto_one_constraint(
    endpoint: Any, fields: dict[str, Any], constraint: Constraint | None, param: str | None
) -> None:
    req = endpoint(**fields)
    sourced = requested_constraint(req)
    if constraint is None:
        assert sourced is None and params(req).constraint is None
    else:
        assert sourced == Sourced(constraint, param or "")
        assert params(req).constraint == constraint


REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"response_format": {"type": "regex"}}, "response_format.type", "must be one of text"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "text", "json_schema": {"name": "n", "schema": {}}}},
     "response_format.json_schema", "only read with type json_schema"),
    ({"guided_json": "{not json"}, "guided_json", "must be a JSON schema"),
    ({"guided_json": "[1]"}, "guided_json", "a JSON object"),
    ({"structured_outputs": {"json": "3"}}, "structured_outputs.json", "a JSON object"),
    # the runtime's rules on a constraint's shape, named by the HTTP field
    ({"guided_choice": []}, "guided_choice", "choices must be a non-empty list"),
    ({"guided_regex": ""}, "guided_regex", "needs a non-empty spec"),
    ({"guided_grammar": ""}, "guided_grammar", "needs a non-empty spec"),
    # two sources: refused naming both
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "conflicts with response_format"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice",
     "conflicts with guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice",
     "conflicts with structured_outputs.regex"),
    ({"guided_regex": "a", "structured_outputs": {"json_object": True}},
     "structured_outputs.json_object", "conflicts with guided_regex"),
    # what fights a grammar's own end
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "with a constraint"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", "with a constraint"),
    # unknown fields inside the objects
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "unknown field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {},
                                                                 "x": 1}}},
     "response_format.json_schema.x", "unknown field"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), REFUSED)
@pytest.mark.parametrize("endpoint", [completion, chat])
def test_refusals_name_the_http_field(
    endpoint: Any, fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises((InvalidRequest, mapping.HttpError)) as exc:
        params(endpoint(**fields))
    err = exc.value
    if isinstance(err, InvalidRequest):
        err = mapping.invalid(err)
    assert isinstance(err, mapping.HttpError) and err.status == 400
    assert err.param == param and err.message.startswith(f"{param}: ")
    assert words in err.message


@pytest.fixture(scope="module")
def compiler(smollm2_gguf: Path) -> GrammarCompiler:
    from tokenizers import Tokenizer

    from spectrio.models.loading.gguf_file import GGUFFile

    raw = GGUFFile(smollm2_gguf).tokenizer_json()
    assert raw is not None
    return GrammarCompiler(TextTokenizer(Tokenizer.from_str(raw), 2), 49152, [2])


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (Constraint.json_schema({"type": "strin"}), "Invalid type: strin"),
        (Constraint.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (Constraint.json_schema({"not": {"type": "string"}}), "not"),
        (Constraint.json_schema({"$ref": "#/nowhere"}), "nowhere"),
        (Constraint.regex("[a-"), "unclosed character class"),
        (Constraint.grammar("start: foo"), "unknown name"),
    ],
)
def test_what_the_library_cannot_enforce_is_refused_by_the_http_field(
    compiler: GrammarCompiler, constraint: Constraint, words: str
) -> None:
    param = "response_format.json_schema.schema"
    with pytest.raises(InvalidRequest) as exc:
        check_enforceable(compiler.check, Sourced(constraint, param))
    assert exc.value.field == param and exc.value.code == "invalid_constraint"
    assert str(exc.value).startswith(f"{param}: cannot be enforced: ") and words in str(exc.value)
    check_enforceable(compiler.check, Sourced(Constraint.json_schema(SCHEMA), param))
