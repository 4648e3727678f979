"""Tool calling on chat completions, the request side (pure: no I/O, no Trio).

* :func:`tool_plan` checks ``tools``, ``tool_choice`` and ``parallel_tool_calls`` and
  says what the request runs: which tools the prompt shows, whether the answer is parsed
  for calls, in which format, and for ``required`` or a named function the grammar that
  makes the answer nothing but well-formed calls whose arguments validate against their
  function's ``parameters`` (:func:`call_grammar`).
* The format follows the chat template (:func:`template_format`): a template that
  mentions ``<|python_tag|>`` or ``ipython`` is Llama 3.x's (JSON calls,
  ``{"name": ..., "parameters": {...}}``); any other is Hermes / Qwen's
  (``<tool_call>`` blocks).
* A template that reads ``tools`` renders them itself (``tools=`` is passed to it, and
  earlier calls stay in the assistant messages' ``tool_calls``). One that does not (such
  as SmolLM2's) gets spectrio's default format (:func:`default_format`): a system
  message listing the tools as JSON and asking for ``<tool_call>`` blocks, earlier calls
  written back as those blocks, and tool results inside ``<tool_response>`` tags.

``tool_choice``: ``none`` shows the tools but parses nothing (as vLLM does), ``auto``
(the default with tools) lets the model answer or call, unconstrained, and parses what
it wrote (with a JSON ``response_format``: calls or JSON in that format,
:meth:`ToolPlan.with_answer`); ``required`` and a named function constrain the answer
to calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any, Final, Literal

from spectrio.core.constraints import Constraint
from spectrio.core.params import InvalidRequest
from spectrio.http_api.response_format import Sourced
from spectrio.http_api.schema import ChatCompletionRequest, Tool
from spectrio.http_api.tool_parsers import (
    HERMES_CLOSE,
    HERMES_OPEN,
    HermesParser,
    Llama3Parser,
    ToolParser,
)
from spectrio.stages.device.grammar import JSON_DEFAULTS

__all__ = [
    "TOOL_CHOICES",
    "ToolFormat",
    "ToolPlan",
    "call_grammar",
    "default_format",
    "hermes_block",
    "template_format",
    "tool_plan",
    "tools_preamble",
]

ToolFormat = Literal["hermes", "llama3"]
TOOL_CHOICES: Final = ("none", "auto", "required")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
NO_PARAMETERS: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}
"""The arguments of a function that gives no ``parameters``: an empty object."""

TOOL_RESPONSE_OPEN: Final = "<tool_response>"
TOOL_RESPONSE_CLOSE: Final = "</tool_response>"


def template_format(source: str | None) -> ToolFormat:
    """The tool-call format of a chat template (module docstring)."""
    if source is not None and ("<|python_tag|>" in source or "ipython" in source):
        return "llama3"
    return "hermes"


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of it."""

    tools: list[dict[str, Any]]  # OpenAI's shape, for the template or the default preamble
    choice: Literal["none", "auto", "required", "named"]
    named: str | None  # the function of a named tool_choice
    parallel: bool  # more than one call per answer
    format: ToolFormat
    native: bool  # the chat template renders the tools itself
    constraint: Sourced | None  # required / named: the calls' grammar
    schemas: list[Sourced]  # the called functions' parameters, checked one by one

    def with_answer(self, sourced: Sourced | None) -> Sourced | None:
        """The constraint of a request with this plan and ``sourced``, the constraint its
        own fields ask for. With ``tool_choice`` auto and a JSON one (``response_format``
        ``json_object`` or ``json_schema``, or vLLM's JSON fields), the answer is either
        calls or JSON in that format (as OpenAI's is): one grammar of both, refused by
        the JSON field's name. Otherwise ``sourced`` alone: with a regex, choice or
        grammar, that constraint shapes the whole answer."""
        if (
            sourced is None
            or self.choice != "auto"
            or not self.tools
            or sourced.constraint.kind not in ("json_object", "json_schema")
        ):
            return sourced
        answer = sourced.constraint.schema()
        grammar = call_grammar(self.tools, self.format, parallel=self.parallel, answer=answer)
        return Sourced(Constraint.grammar(grammar), sourced.param)

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls."""
        return bool(self.tools) and self.choice != "none"

    def parser(self) -> ToolParser:
        """A fresh parser of one answer."""
        max_calls = None if self.parallel else 1
        if self.format == "llama3":
            return Llama3Parser(max_calls=max_calls)
        return HermesParser(max_calls=max_calls)


def _refuse(param: str, rule: str, got: object = ...) -> InvalidRequest:
    return InvalidRequest(param, rule, got=got, code="invalid_field")


def parameters_of(tool: Tool) -> dict[str, Any]:
    """A function's parameters schema (:data:`NO_PARAMETERS` when it gives none)."""
    assert tool.function is not None
    params = tool.function.parameters
    return NO_PARAMETERS if params is None else params


def _tool_dicts(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if tool.type != "function":
            raise _refuse(f"{at}.type", "only function tools are supported", tool.type)
        if tool.custom is not None:
            raise _refuse(f"{at}.custom", "custom tools are not supported", tool.custom)
        if tool.function is None:
            raise _refuse(f"{at}.function", "required for a function tool")
        name = tool.function.name
        if not _NAME.match(name):
            raise _refuse(
                f"{at}.function.name", "must be 1 to 64 letters, digits, underscores or dashes",
                name,
            )  # fmt: skip
        if any(t["function"]["name"] == name for t in out):
            raise _refuse(f"{at}.function.name", "names a function given before it", name)
        function: dict[str, Any] = {"name": name}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        function["parameters"] = parameters_of(tool)
        out.append({"type": "function", "function": function})
    return out


def _choice(req: ChatCompletionRequest, names: list[str]) -> tuple[str, str | None]:
    """``(choice, named function)`` of ``tool_choice``."""
    tc = req.tool_choice
    if tc is None:
        return ("auto" if names else "none"), None
    if isinstance(tc, str):
        if tc not in TOOL_CHOICES:
            raise _refuse(
                "tool_choice",
                f"must be {', '.join(TOOL_CHOICES)} or {{'type': 'function', 'function': "
                "{'name': ...}}",
                tc,
            )
        if tc != "none" and not names:
            raise _refuse("tool_choice", "needs tools: there is no function to call", tc)
        return tc, None
    if tc.type != "function":
        raise _refuse("tool_choice.type", "must be 'function' (a named function)", tc.type)
    if tc.custom is not None or tc.allowed_tools is not None:
        raise _refuse("tool_choice", "only a named function is supported here")
    if tc.function is None:
        raise _refuse("tool_choice.function", "required: {'name': ...}")
    if not names:
        raise _refuse("tool_choice", "needs tools: there is no function to call")
    if tc.function.name not in names:
        raise _refuse(
            "tool_choice.function.name",
            f"must name a function in tools ({', '.join(names)})",
            tc.function.name,
        )
    return "named", tc.function.name


def tool_plan(
    req: ChatCompletionRequest, *, template_source: str | None, reads_tools: bool
) -> ToolPlan | None:
    """What the request's tool fields ask for (module docstring); None when it has no
    tools and no tool_choice. Raises :class:`InvalidRequest` naming the field."""
    tools = _tool_dicts(req.tools or [])
    names = [t["function"]["name"] for t in tools]
    choice, named = _choice(req, names)
    if not tools and req.tool_choice is None:
        return None
    fmt = template_format(template_source)
    parallel = req.parallel_tool_calls is not False and choice != "named"
    called = [named] if named is not None else names
    constraint: Sourced | None = None
    schemas: list[Sourced] = []
    if choice in ("required", "named"):
        assert req.tools is not None
        for i, tool in enumerate(req.tools):
            if tool.function is not None and tool.function.name in called:
                schema = _with_defaults(parameters_of(tool))
                schemas.append(
                    Sourced(Constraint.json_schema(schema), f"tools[{i}].function.parameters")
                )
        chosen = [t for t in tools if t["function"]["name"] in called]
        grammar = call_grammar(chosen, fmt, parallel=parallel)
        constraint = Sourced(Constraint.grammar(grammar), "tool_choice")
    return ToolPlan(
        tools=tools,
        choice=choice,  # type: ignore[arg-type]
        named=named,
        parallel=parallel,
        format=fmt,
        native=reads_tools,
        constraint=constraint,
        schemas=schemas,
    )


# ---- the grammar of required and named calls ------------------------------------------------


def _with_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` generating compact JSON, as a ``json_schema`` constraint does."""
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": JSON_DEFAULTS}


def _lark(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def call_grammar(
    tools: Sequence[dict[str, Any]],
    fmt: ToolFormat,
    *,
    parallel: bool,
    answer: dict[str, Any] | None = None,
) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are calls of ``tools`` in
    ``fmt``, each function's name fixed and its arguments valid under its ``parameters``
    (``%json``): one call, or with ``parallel`` one or more. With ``answer`` (a JSON
    schema), an answer valid under it is a sentence too: calls or that answer."""
    key = "parameters" if fmt == "llama3" else "arguments"
    rules: list[str] = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        head = "{" + f'"name": {json.dumps(fn["name"])}, "{key}": '
        schema = json.dumps(_with_defaults(fn["parameters"]), ensure_ascii=False)
        opening, closing = head, "}"
        if fmt == "hermes":
            opening, closing = f"{HERMES_OPEN}\n{head}", f"}}\n{HERMES_CLOSE}"
        body = f"{_lark(opening)} %json{schema} {_lark(closing)}"
        rules.append(f"call_{i}: {body}")
    sep = _lark("\n" if fmt == "hermes" else "; ")
    calls = f"call ({sep} call)*" if parallel else "call"
    alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
    lines = [f"start: {calls}", f"call: {alternatives}", *rules]
    if answer is not None:
        schema = json.dumps(_with_defaults(answer), ensure_ascii=False)
        lines[0] = f"start: {calls} | answer"
        lines.append(f"answer: %json{schema}")
    return "\n".join(lines) + "\n"


# ---- the default format ----------------------------------------------------------------------

_PREAMBLE: Final = """# Tools

You may call one or more functions to help with the user's request. The functions are \
listed within <tools></tools> XML tags, one JSON object each, with their parameters \
as a JSON schema:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and its arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""


def tools_preamble(tools: Sequence[dict[str, Any]], *, parallel: bool = True) -> str:
    """The system text of spectrio's default format: the tools as JSON and the call
    format."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = _PREAMBLE.format(tools=listed)
    if not parallel:
        text += "\nCall at most one function per answer."
    return text


def hermes_block(name: str, arguments: object) -> str:
    """One call as the default format writes it (``arguments``: a mapping, or JSON
    text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    call = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}'
    return f"{HERMES_OPEN}\n{call}\n{HERMES_CLOSE}"


def default_format(
    messages: Sequence[dict[str, Any]], plan: ToolPlan | None
) -> list[dict[str, Any]]:
    """``messages`` for a template that does not render tools (module docstring): the
    tools' preamble in the system message (a system message of its own when the first
    message is not one), each assistant message's ``tool_calls`` written as
    ``<tool_call>`` blocks after its content, and a ``tool`` message's content inside
    ``<tool_response>`` tags."""
    out: list[dict[str, Any]] = []
    for message in messages:
        m = dict(message)
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = "\n".join(
                hermes_block(c["function"]["name"], c["function"]["arguments"]) for c in calls
            )
            m["content"] = f"{m['content']}\n{blocks}" if m.get("content") else blocks
        if m["role"] == "tool":
            m["content"] = f"{TOOL_RESPONSE_OPEN}\n{m['content']}\n{TOOL_RESPONSE_CLOSE}"
        out.append(m)
    if plan is not None and plan.tools:
        preamble = tools_preamble(plan.tools, parallel=plan.parallel)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out
