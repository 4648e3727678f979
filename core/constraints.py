"""Structured output: what a request's output must match (:class:`Constraint`), and the
rules of its shape that need no grammar library (:func:`check_constraint`).

A constraint is one of

* ``json_object``: any JSON object;
* ``json_schema``: JSON valid under a schema (``spec``: the schema as JSON text);
* ``regex``: text the regular expression ``spec`` matches in full;
* ``grammar``: text the Lark grammar ``spec`` derives (llguidance's dialect, with
  ``%json`` and regex terminals: ``docs/embedding.md``);
* ``choice``: exactly one of ``choices``.

It travels inside :class:`~spectrio.core.params.SamplingParams` (the wire carries it since
schema 1.10). Whether the library can enforce it (a bad regex, a schema keyword it does
not implement) is checked by :class:`spectrio.stages.device.grammar.GrammarCompiler` when
the runtime accepts the request, with the same :class:`InvalidRequest`: nothing is
silently ignored.

A constrained request always ends by its grammar: it may stop only where the grammar is
complete (EOS and its stop tokens are masked until then), so ``min_tokens`` and
``ignore_eos``, which would fight that, are refused with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import msgspec

from spectrio.errors import InvalidRequest

__all__ = ["CONSTRAINT_KINDS", "Constraint", "ConstraintKind", "check_constraint"]

ConstraintKind = Literal["json_object", "json_schema", "regex", "grammar", "choice"]
CONSTRAINT_KINDS: Final[tuple[str, ...]] = ConstraintKind.__args__  # type: ignore[attr-defined]

MAX_SPEC_CHARS: Final = 1 << 18
"""Longest ``spec`` (a schema, a pattern or a grammar), in characters."""


class Constraint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a request's output must match (module docstring). Build one with the class
    methods: ``Constraint.json_schema({...})``, ``Constraint.regex(r"\\d+")``, ..."""

    kind: ConstraintKind
    spec: str = ""  # json_schema: the schema (JSON text); regex: the pattern; grammar: Lark
    choices: list[str] = []  # choice: the output is exactly one of these

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(kind="json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Constraint:
        """A JSON schema, as a mapping or as JSON text."""
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        return cls(kind="json_schema", spec=text)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls(kind="regex", spec=pattern)

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        return cls(kind="grammar", spec=lark)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Constraint:
        return cls(kind="choice", choices=list(choices))

    def schema(self) -> dict[str, Any]:
        """The JSON schema a ``json_object`` / ``json_schema`` constraint stands for."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind == "json_schema":
            return dict(json.loads(self.spec))
        raise ValueError(f"a {self.kind} constraint has no JSON schema")


def _refuse(rule: str, got: object = ...) -> InvalidRequest:
    return InvalidRequest("constraint", rule, got=got, code="invalid_constraint")


def check_constraint(constraint: Constraint) -> Constraint:
    """The rules of a constraint's shape (module docstring); returns it or raises
    :class:`InvalidRequest` on field ``constraint`` (code ``invalid_constraint``)."""
    if not isinstance(constraint, Constraint):
        raise _refuse("must be a Constraint", constraint)
    try:  # the types a caller of the embedding API may have got wrong, and lone surrogates
        msgspec.convert(msgspec.to_builtins(constraint), Constraint)
        constraint.spec.encode("utf-8")
        for choice in constraint.choices:
            choice.encode("utf-8")
    except msgspec.ValidationError as exc:
        raise _refuse(f"malformed: {exc}") from None
    except (UnicodeEncodeError, AttributeError, TypeError):
        raise _refuse("its text must be valid Unicode strings (no lone surrogates)") from None
    kind = constraint.kind
    if kind not in CONSTRAINT_KINDS:
        raise _refuse(f"kind must be one of {', '.join(CONSTRAINT_KINDS)}", kind)
    if len(constraint.spec) > MAX_SPEC_CHARS:
        raise _refuse(f"spec must be at most {MAX_SPEC_CHARS} characters", len(constraint.spec))
    if kind == "choice":
        if constraint.spec:
            raise _refuse("a choice constraint has choices, not a spec", constraint.spec)
        if not constraint.choices or not all(constraint.choices):
            raise _refuse("choices must be a non-empty list of non-empty strings",
                          constraint.choices)  # fmt: skip
        return constraint
    if constraint.choices:
        raise _refuse(f"a {kind} constraint takes no choices", constraint.choices)
    if kind == "json_object":
        if constraint.spec:
            raise _refuse("a json_object constraint takes no spec (use json_schema)",
                          constraint.spec)  # fmt: skip
        return constraint
    if not constraint.spec:
        raise _refuse(f"a {kind} constraint needs a non-empty spec")
    if kind == "json_schema":
        try:
            schema = json.loads(constraint.spec)
        except ValueError as exc:
            raise _refuse(f"spec must be a JSON schema as JSON text ({exc})") from None
        if not isinstance(schema, dict):
            raise _refuse("spec must be a JSON schema (a JSON object)", schema)
    return constraint
