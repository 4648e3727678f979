"""What a request's output must match, from its HTTP fields (pure: no I/O, no Trio).

A request may name one constraint, from one of these fields (``docs/http.md``):

* OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint),
  ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. ``strict`` is
  accepted whatever its value: the schema is always enforced in full;
* vLLM's ``guided_json`` (a schema, or its JSON text), ``guided_regex``,
  ``guided_choice`` and ``guided_grammar`` (Lark, in llguidance's dialect);
* vLLM's newer ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``,
  ``grammar`` and ``json_object``.

Two of them in one request are refused, naming both. The result is a :class:`Sourced`
constraint: the :class:`~spectrio.core.constraints.Constraint` and the HTTP field it came
from, which every refusal of it names (:func:`renamed`): a schema the grammar library
cannot enforce is refused as ``response_format.json_schema.schema: cannot be enforced:
...``, not as the runtime's ``constraint``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from spectrio.core.constraints import Constraint
from spectrio.core.params import InvalidRequest
from spectrio.http_api.schema import ChatCompletionRequest, CompletionRequest, ResponseFormat

__all__ = [
    "RESPONSE_FORMAT_TYPES",
    "Sourced",
    "check_enforceable",
    "constraint_sources",
    "one_constraint",
    "renamed",
    "requested_constraint",
]

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


@dataclasses.dataclass(frozen=True)
class Sourced:
    """A constraint and the HTTP field it came from (named in its refusals)."""

    constraint: Constraint
    param: str


def _refuse(param: str, rule: str, got: object = ...) -> InvalidRequest:
    return InvalidRequest(param, rule, got=got, code="invalid_constraint")


def _schema_of(value: str | dict[str, Any], param: str) -> Constraint:
    """A JSON schema given as a mapping or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _refuse(param, f"must be a JSON schema, or its JSON text ({exc})") from None
        if not isinstance(value, dict):
            raise _refuse(param, "must be a JSON schema (a JSON object)", value)
    return Constraint.json_schema(value)


def _from_response_format(rf: ResponseFormat) -> Sourced | None:
    if rf.type not in RESPONSE_FORMAT_TYPES:
        raise _refuse(
            "response_format.type",
            f"must be one of {', '.join(RESPONSE_FORMAT_TYPES)} (regex, choice and grammar "
            "constraints are the guided_* fields: docs/http.md)",
            rf.type,
        )
    if rf.type != "json_schema":
        if rf.json_schema is not None:
            raise _refuse(
                "response_format.json_schema", f"is only read with type json_schema, not {rf.type}"
            )
        return None if rf.type == "text" else Sourced(Constraint.json_object(), "response_format")
    if rf.json_schema is None:
        raise _refuse("response_format.json_schema", "required with type json_schema")
    if rf.json_schema.schema is None:
        raise _refuse(
            "response_format.json_schema.schema", "required: the schema the output must match"
        )
    param = "response_format.json_schema.schema"
    return Sourced(Constraint.json_schema(rf.json_schema.schema), param)


def constraint_sources(req: CompletionRequest | ChatCompletionRequest) -> list[Sourced]:
    """Every constraint the request's fields ask for, in the order of the module
    docstring (:func:`one_constraint` refuses two)."""
    found: list[Sourced] = []
    if req.response_format is not None:
        sourced = _from_response_format(req.response_format)
        if sourced is not None:
            found.append(sourced)
    if req.guided_json is not None:
        found.append(Sourced(_schema_of(req.guided_json, "guided_json"), "guided_json"))
    if req.guided_regex is not None:
        found.append(Sourced(Constraint.regex(req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        found.append(Sourced(Constraint.choice(req.guided_choice), "guided_choice"))
    if req.guided_grammar is not None:
        found.append(Sourced(Constraint.grammar(req.guided_grammar), "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        if so.json is not None:
            at = "structured_outputs.json"
            found.append(Sourced(_schema_of(so.json, at), at))
        if so.regex is not None:
            found.append(Sourced(Constraint.regex(so.regex), "structured_outputs.regex"))
        if so.choice is not None:
            found.append(Sourced(Constraint.choice(so.choice), "structured_outputs.choice"))
        if so.grammar is not None:
            found.append(Sourced(Constraint.grammar(so.grammar), "structured_outputs.grammar"))
        if so.json_object:
            found.append(Sourced(Constraint.json_object(), "structured_outputs.json_object"))
    return found


def one_constraint(found: list[Sourced]) -> Sourced | None:
    """The one constraint of ``found``, None for none; two are refused, naming both."""
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        raise InvalidRequest(
            second,
            f"conflicts with {first}: a request takes one constraint (response_format, a "
            "guided_* field, structured_outputs or a required tool_choice)",
            code="invalid_constraint",
        )
    return found[0] if found else None


def requested_constraint(req: CompletionRequest | ChatCompletionRequest) -> Sourced | None:
    """The constraint the request's fields ask for (module docstring), or None. Raises
    :class:`InvalidRequest` naming the field: a malformed one, or two of them."""
    return one_constraint(constraint_sources(req))


def renamed(exc: InvalidRequest, sourced: Sourced | None) -> InvalidRequest:
    """``exc`` naming the HTTP field when it is a refusal of the runtime's ``constraint``
    field; otherwise ``exc`` itself."""
    if sourced is None or exc.field != "constraint":
        return exc
    return InvalidRequest(sourced.param, exc.rule, code=exc.code)


def check_enforceable(check: Callable[[Constraint], None], sourced: Sourced) -> None:
    """Run the grammar library's check (``GrammarCompiler.check``) on the constraint; its
    refusal names the HTTP field the constraint came from."""
    try:
        check(sourced.constraint)
    except InvalidRequest as exc:
        raise renamed(exc, sourced) from None
