"""Tool calling's request side (``spectrio.http_api.tool_calls``, pure): ``tools`` and
``tool_choice`` checked with refusals that name the field; the grammar of required and
named calls accepts exactly well-formed calls whose arguments validate (compiled with
llguidance for SmolLM2's tokenizer) and the parser of the same format reads them back;
the default format renders tools, earlier calls and tool results through a template
that knows nothing of tools (SmolLM2's); a template that reads ``tools`` gets them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer

from spectrio.core.constraints import Constraint
from spectrio.core.params import InvalidRequest
from spectrio.http_api import mapping
from spectrio.http_api.response_format import constraint_sources, one_constraint
from spectrio.http_api.schema import ChatCompletionRequest
from spectrio.http_api.tool_calls import (
    NO_PARAMETERS,
    ToolPlan,
    call_grammar,
    default_format,
    hermes_block,
    template_format,
    tool_plan,
)
from spectrio.http_api.tool_parsers import HermesParser, Llama3Parser, parse_all
from spectrio.models.loading.gguf_file import GGUFFile
from spectrio.models.text.chat import ChatTemplate
from spectrio.models.text.tokenizer import TextTokenizer
from spectrio.stages.device.grammar import GrammarCompiler

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}
TOOLS = [
    {"type": "function", "function": WEATHER_TOOL},
    {"type": "function", "function": {"name": "now"}},
]


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return mapping.decode(msgspec.json.encode(body), ChatCompletionRequest)


def plan_of(source: str | None = None, reads_tools: bool = False, **fields: Any) -> ToolPlan | None:
    return tool_plan(chat(**fields), template_source=source, reads_tools=reads_tools)


# ---- tool_choice and tools ------------------------------------------------------------------


def test_no_tools_no_plan_and_auto_by_default() -> None:
    assert plan_of() is None
    assert plan_of(tools=[]) is None
    none = plan_of(tool_choice="none")
    assert none is not None and not none.parses and none.constraint is None
    auto = plan_of(tools=TOOLS)
    assert auto is not None and auto.choice == "auto" and auto.parses and auto.parallel
    assert auto.constraint is None and auto.schemas == [] and auto.format == "hermes"
    assert auto.tools[1] == {"type": "function",
                             "function": {"name": "now", "parameters": NO_PARAMETERS}}  # fmt: skip
    assert isinstance(auto.parser(), HermesParser) and auto.parser().max_calls is None
    assert plan_of(tools=TOOLS, parallel_tool_calls=False).parser().max_calls == 1  # type: ignore[union-attr]
    kept = plan_of(tools=TOOLS, tool_choice="none")
    assert kept is not None and kept.tools and not kept.parses  # shown, not parsed (vLLM)


def test_required_and_named_are_constrained() -> None:
    required = plan_of(tools=TOOLS, tool_choice="required")
    assert required is not None and required.constraint is not None
    assert required.constraint.param == "tool_choice"
    assert required.constraint.constraint.kind == "grammar"
    assert [s.param for s in required.schemas] == [
        "tools[0].function.parameters",
        "tools[1].function.parameters",
    ]
    named = plan_of(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert named is not None and named.choice == "named" and named.named == "now"
    assert not named.parallel and named.parser().max_calls == 1
    assert [s.param for s in named.schemas] == ["tools[1].function.parameters"]
    assert named.constraint is not None and r"\"now\"" in named.constraint.constraint.spec
    assert "get_weather" not in named.constraint.constraint.spec


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "needs tools",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be none, auto, required"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "must name a function in tools (get_weather, now)",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "custom", "custom": {"name": "x"}}},
            "tool_choice.type",
            "must be 'function'",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", "required"),
        (
            {"tools": [{"type": "custom", "custom": {"name": "x"}}]},
            "tools[0].type",
            "only function tools",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
        (
            {"tools": [*TOOLS, {"type": "function", "function": {"name": "now"}}]},
            "tools[2].function.name",
            "names a function given before it",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "letters, digits",
        ),
    ],  # fmt: skip
)
def test_tool_refusals_name_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        plan_of(**fields)
    err = mapping.invalid(exc.value)
    assert err.param == param and err.message.startswith(f"{param}: ") and words in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
            "tools[0].function.x",
        ),
        ({"tool_choice": 3}, "tool_choice"),
    ],  # fmt: skip
)
def test_malformed_tools_are_refused_at_decoding(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(mapping.HttpError) as exc:
        chat(**fields)
    assert exc.value.status == 400 and exc.value.param == param


def test_a_response_format_conflicts_with_a_required_call() -> None:
    req = chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    plan = tool_plan(req, template_source=None, reads_tools=False)
    assert plan is not None and plan.constraint is not None
    with pytest.raises(InvalidRequest) as exc:
        one_constraint([*constraint_sources(req), plan.constraint])
    assert exc.value.field == "tool_choice" and "conflicts with response_format" in str(exc.value)


def test_the_format_follows_the_template() -> None:
    assert template_format(None) == "hermes"
    assert template_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"
    assert template_format("{{ '<|python_tag|>' + x }}") == "llama3"
    assert template_format("{% if m.role == 'ipython' %}{% endif %}") == "llama3"
    plan = plan_of("{{ '<|python_tag|>' }}", True, tools=TOOLS)
    assert plan is not None and plan.native and isinstance(plan.parser(), Llama3Parser)


# ---- the grammar of required and named calls -------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> tuple[GGUFFile, TextTokenizer, GrammarCompiler]:
    gguf = GGUFFile(smollm2_gguf)
    raw = gguf.tokenizer_json()
    assert raw is not None
    tok = TextTokenizer(Tokenizer.from_str(raw), 2)
    return gguf, tok, GrammarCompiler(tok, 49152, [2])


def accepts(compiler: GrammarCompiler, tok: TextTokenizer, grammar: str, text: str) -> bool:
    matcher = compiler.matcher(Constraint.grammar(grammar))
    ok = bool(matcher.consume_tokens(tok.encode(text)))
    return ok and bool(matcher.is_accepting())


def call(name: str, args: dict[str, Any], key: str = "arguments") -> str:
    return json.dumps({"name": name, key: args}, ensure_ascii=False)


def test_the_hermes_grammar_takes_exactly_valid_calls(
    smollm2: tuple[GGUFFile, TextTokenizer, GrammarCompiler],
) -> None:
    _, tok, compiler = smollm2
    plan = plan_of(tools=TOOLS, tool_choice="required")
    assert plan is not None
    grammar = call_grammar(plan.tools, "hermes", parallel=True)
    good = hermes_block("get_weather", {"city": "Rome", "unit": "c", "days": 3})
    empty = hermes_block("now", {})
    for text in (good, empty, f"{good}\n{empty}"):
        assert accepts(compiler, tok, grammar, text), text
        content, calls = parse_all(HermesParser(), text)
        assert content is None and calls
        assert [hermes_block(c.name, c.arguments) for c in calls] == text.split("\n<tool_call>")[
            :1
        ] + [f"<tool_call>{t}" for t in text.split("\n<tool_call>")[1:]]
    bad = [
        hermes_block("get_weather", {"city": "Rome"}),  # a required property missing
        hermes_block("get_weather", {"city": "Rome", "unit": "k"}),  # not in the enum
        hermes_block("get_weather", {"city": "Rome", "unit": "c", "days": 9}),  # over maximum
        hermes_block("get_weather", {"city": "Rome", "unit": "c", "x": 1}),  # no extra keys
        hermes_block("now", {"a": 1}),  # no parameters given: an empty object
        hermes_block("other", {}),  # not a tool
        'Sure! <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',  # text first
        '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>',  # compact JSON spacing
    ]
    for text in bad:
        assert not accepts(compiler, tok, grammar, text), text
    one = call_grammar(plan.tools, "hermes", parallel=False)
    assert accepts(compiler, tok, one, good)
    assert not accepts(compiler, tok, one, f"{good}\n{empty}")


def test_the_llama3_grammar_takes_exactly_valid_calls(
    smollm2: tuple[GGUFFile, TextTokenizer, GrammarCompiler],
) -> None:
    _, tok, compiler = smollm2
    plan = plan_of(tools=TOOLS, tool_choice="required")
    assert plan is not None
    grammar = call_grammar(plan.tools, "llama3", parallel=True)
    good = call("get_weather", {"city": "Oslo", "unit": "f"}, "parameters")
    both = f"{good}; {call('now', {}, 'parameters')}"
    for text in (good, both):
        assert accepts(compiler, tok, grammar, text), text
        content, calls = parse_all(Llama3Parser(), text)
        assert content is None
        assert [c.name for c in calls] == [json.loads(p)["name"] for p in text.split("; ")]
    assert not accepts(compiler, tok, grammar, call("get_weather", {"city": "Oslo"}, "parameters"))
    assert not accepts(compiler, tok, grammar, call("now", {}))  # "arguments": Hermes' key


def test_refs_inside_parameters_resolve_against_the_parameters(
    smollm2: tuple[GGUFFile, TextTokenizer, GrammarCompiler],
) -> None:
    _, tok, compiler = smollm2
    params = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/place"}},
        "required": ["where"],
        "$defs": {"place": {"type": "object", "properties": {"city": {"enum": ["A", "B"]}},
                            "required": ["city"]}},
    }  # fmt: skip
    tools = [{"type": "function", "function": {"name": "go", "parameters": params}}]
    grammar = call_grammar(tools, "hermes", parallel=False)
    assert accepts(compiler, tok, grammar, hermes_block("go", {"where": {"city": "B"}}))
    assert not accepts(compiler, tok, grammar, hermes_block("go", {"where": {"city": "C"}}))


# ---- rendering --------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]  # fmt: skip


def messages_of(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return mapping.chat_messages(chat(messages=conversation).messages)


def test_the_default_format_through_smollm2s_template(
    smollm2: tuple[GGUFFile, TextTokenizer, GrammarCompiler],
) -> None:
    gguf, tok, _ = smollm2
    assert gguf.chat_template is not None
    template = ChatTemplate(gguf.chat_template, tok, {})
    assert not template.reads_tools
    plan = plan_of(gguf.chat_template, False, tools=TOOLS)
    assert plan is not None and not plan.native
    text = template.render(default_format(messages_of(CONVERSATION), plan))
    expected_call = '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}'
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text  # each tool as JSON, one a line
    assert '<tool_call>\n{"name": <function-name>' in text  # the call format asked for
    assert f"<|im_start|>assistant\n<tool_call>\n{expected_call}\n</tool_call><|im_end|>" in text
    assert '<|im_start|>tool\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
    # a system message of the client's keeps its text, the tools after it
    system = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    text = template.render(default_format(messages_of(system), plan))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # without tools, earlier calls are still written back (nothing else added)
    text = template.render(default_format(messages_of(CONVERSATION), None))
    assert "# Tools" not in text and "You are a helpful AI assistant" in text
    assert f"<tool_call>\n{expected_call}\n</tool_call>" in text


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_reads_tools_renders_them_itself(
    smollm2: tuple[GGUFFile, TextTokenizer, GrammarCompiler],
) -> None:
    _, tok, _ = smollm2
    template = ChatTemplate(QWEN_LIKE, tok, {})
    assert template.reads_tools
    plan = plan_of(QWEN_LIKE, True, tools=TOOLS)
    assert plan is not None and plan.native
    text = template.render(messages_of(CONVERSATION), tools=plan.tools)
    assert text.startswith(f"<|im_start|>system\n<tools>{json.dumps(plan.tools[0])}")
    # the arguments reach the template as an object, as transformers passes them
    call_json = '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}'
    assert f"<tool_call>\n{call_json}\n</tool_call>" in text
    assert "# Tools" not in text


def test_auto_with_a_json_format_is_calls_or_that_json(
    smollm2: tuple[GGUFFile, TextTokenizer, GrammarCompiler],
) -> None:
    _, tok, compiler = smollm2
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}
    req = chat(tools=TOOLS, response_format=rf)
    plan = tool_plan(req, template_source=None, reads_tools=False)
    assert plan is not None
    asked = one_constraint(constraint_sources(req))
    runs = plan.with_answer(asked)
    assert runs is not None and runs.constraint.kind == "grammar"
    assert runs.param == "response_format.json_schema.schema"  # its refusals name the format
    grammar = runs.constraint.spec
    assert accepts(compiler, tok, grammar, '{"ok": true}')
    assert accepts(compiler, tok, grammar, hermes_block("now", {}))
    assert not accepts(compiler, tok, grammar, '{"ok": 1}')
    assert not accepts(compiler, tok, grammar, "plain text")
    # a regex, a choice or a grammar shapes the whole answer; required has its own grammar
    regex = chat(tools=TOOLS, guided_regex="a+")
    sourced = one_constraint(constraint_sources(regex))
    assert plan.with_answer(sourced) is sourced
    required = plan_of(tools=TOOLS, tool_choice="required")
    assert required is not None and required.with_answer(None) is None
