"""The sampling flags of ``spectrio generate`` and ``spectrio client``: one flag per
:class:`~spectrio.core.params.SamplingParams` field, generated from the struct, so the
two commands take the same flags and a new field cannot be forgotten by one of them.

A flag not given leaves the field at the struct's default. Values are checked where
requests are checked (the runtime, or the server): a bad one gets the embedding API's
reason for that field, and exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Final

import msgspec

from spectrio.core.constraints import Constraint
from spectrio.core.params import SamplingParams
from spectrio.errors import InvalidRequest

__all__ = ["SAMPLING_HELP", "add_sampling_flags", "sampling_params"]

_DEST: Final = "sampling."

SAMPLING_HELP: Final[dict[str, str]] = {
    "max_tokens": "most tokens to generate",
    "min_tokens": "EOS and stops cannot end the request before this many tokens",
    "temperature": "sampling temperature; 0 is greedy",
    "top_k": "keep the k most likely tokens (0 or -1: off)",
    "top_p": "nucleus sampling: keep the smallest set with this much probability",
    "min_p": "keep tokens with p >= min_p * the top token's p",
    "seed": "this request's own random generator (reproducible sampling)",
    "stop": "a stop string, not included in the output (repeat for more)",
    "stop_token_ids": "token ids that end the request (included in the output)",
    "ignore_eos": "do not stop at the end-of-sequence token",
    "repetition_penalty": "> 1 discourages tokens already in the prompt or output; 1 is off",
    "frequency_penalty": "subtract this times a token's count in the output (-2..2)",
    "presence_penalty": "subtract this from every token already in the output (-2..2)",
    "logprobs": "report each token's logprob and this many top alternatives (0..20)",
    "logprobs_mode": "logprobs of the raw model output or after the sampling transforms",
    "constraint": "structured output: the output matches a JSON schema, a regex, a grammar "
    "or a choice (--json-schema, --json-object, --regex, --grammar, --choice)",
}
"""Help per SamplingParams field; the only place it lives."""

NOT_FLAGS: Final = {
    # Per-request speculation is an API and wire knob; on the command line the whole
    # runtime's speculation is set with --spec/--no-spec.
    "speculative": "set for the runtime with --spec/--no-spec",
    # Prompt scoring is for evaluation clients (the HTTP API's echo + logprobs, the wire,
    # the embedding API); the CLI's commands print generated tokens only.
    "prompt_logprobs": "an API, wire and HTTP (echo + logprobs) knob",
}


_CONSTRAINT_DEST: Final = "constraint."

_CONSTRAINT_FLAGS: Final = {
    "json_schema": ("SCHEMA", "the output is JSON valid under this schema (JSON text, or @FILE)"),
    "json_object": (None, "the output is a JSON object"),
    "regex": ("PATTERN", "the output matches this regular expression in full"),
    "grammar": ("LARK", "the output derives from this Lark grammar (text, or @FILE)"),
    "choice": ("TEXT", "the output is one of these strings (repeat for more)"),
}


def _fields() -> list[msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(SamplingParams)
    assert isinstance(info, msgspec.inspect.StructType)
    return [f for f in info.fields if f.name not in NOT_FLAGS]


def _add_constraint_flags(group: argparse._ArgumentGroup) -> None:
    """``constraint`` is a struct: one flag per kind, at most one given."""
    for kind, (metavar, text) in _CONSTRAINT_FLAGS.items():
        flag = "--" + kind.replace("_", "-")
        kw: dict[str, Any] = {"dest": _CONSTRAINT_DEST + kind, "default": argparse.SUPPRESS}
        if metavar is None:
            kw["action"] = "store_true"
        elif kind == "choice":
            kw.update(action="append", metavar=metavar)
        else:
            kw["metavar"] = metavar
        group.add_argument(flag, help=text, **kw)


def _constraint(args: argparse.Namespace) -> Constraint | None:
    given = {
        key[len(_CONSTRAINT_DEST) :]: value
        for key, value in vars(args).items()
        if key.startswith(_CONSTRAINT_DEST)
    }
    if not given:
        return None
    if len(given) > 1:
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(given))
        raise InvalidRequest("constraint", f"give one of {flags}, not several")
    ((kind, value),) = given.items()
    if isinstance(value, str) and value.startswith("@"):
        value = Path(value[1:]).read_text()
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "choice":
        return Constraint.choice(value)
    return msgspec.convert({"kind": kind, "spec": value}, Constraint)


def _kind(t: msgspec.inspect.Type) -> msgspec.inspect.Type:
    """The value type of an optional field."""
    if isinstance(t, msgspec.inspect.UnionType):
        rest = [x for x in t.types if not isinstance(x, msgspec.inspect.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return t


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field (``--max-tokens``, ``--temperature``, ...)."""
    fields = _fields()
    names = {f.name for f in fields}
    if names != set(SAMPLING_HELP):
        raise RuntimeError(
            f"tools/cli/sampling_flags.py is out of step with SamplingParams: without help "
            f"{sorted(names - set(SAMPLING_HELP))}, help for no field "
            f"{sorted(set(SAMPLING_HELP) - names)}"
        )
    group = p.add_argument_group("sampling", "SamplingParams fields (core/params.py)")
    for f in fields:
        if f.name == "constraint":
            _add_constraint_flags(group)
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _kind(f.type)
        default = f.default
        kw: dict[str, Any] = {"dest": _DEST + f.name, "default": argparse.SUPPRESS}
        shown = "none" if default is None else default
        if isinstance(kind, msgspec.inspect.BoolType):
            kw["action"] = "store_true"
            shown = None
        elif isinstance(kind, msgspec.inspect.ListType):
            item = kind.item_type
            if isinstance(item, msgspec.inspect.StrType):
                kw.update(action="append", metavar="TEXT")
            else:
                kw.update(type=int, nargs="+", metavar="ID")
            shown = None
        elif isinstance(kind, msgspec.inspect.LiteralType):
            kw["choices"] = [str(v) for v in kind.values]
        elif isinstance(kind, msgspec.inspect.IntType):
            kw.update(type=int, metavar="N")
        elif isinstance(kind, msgspec.inspect.FloatType):
            kw.update(type=float, metavar="X")
        else:
            raise RuntimeError(f"{f.name}: no flag type for {kind!r}")
        suffix = f" (default: {shown})" if shown is not None else ""
        group.add_argument(flag, help=SAMPLING_HELP[f.name] + suffix, **kw)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams the flags give (fields not given keep their defaults)."""
    given = {key[len(_DEST) :]: value for key, value in vars(args).items() if key.startswith(_DEST)}
    return SamplingParams(**given, constraint=_constraint(args))
