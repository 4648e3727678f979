"""Tool-call parsers (``spectrio.http_api.tool_parsers``): Hermes/Qwen ``<tool_call>``
blocks and Llama 3.x JSON, fed whole or cut anywhere, give the same content and calls; a
call's name comes first and its arguments stream as the model writes them; what is no
call is content."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator, Sequence

import pytest

from spectrio.http_api.tool_parsers import (
    CallDelta,
    HermesParser,
    Llama3Parser,
    Parsed,
    ParsedCall,
    ToolParser,
    join_calls,
    parse_all,
)


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def hermes(**kw: object) -> HermesParser:
    return HermesParser(new_id=ids(), **kw)  # type: ignore[arg-type]


def llama3(**kw: object) -> Llama3Parser:
    return Llama3Parser(new_id=ids(), **kw)  # type: ignore[arg-type]


def fed(parser: ToolParser, pieces: Sequence[str]) -> Parsed:
    out = Parsed()
    for piece in pieces:
        out.extend(parser.feed(piece))
    out.extend(parser.finish())
    return out


def cuts(text: str, n: int) -> list[str]:
    """``text`` cut at ``n`` random places."""
    rng = random.Random(n * 7919 + len(text))
    at = sorted(rng.sample(range(1, len(text)), min(n, len(text) - 1)))
    return [text[i:j] for i, j in zip([0, *at], [*at, len(text)], strict=True)]


def splits(text: str) -> Iterator[list[str]]:
    """Every cut in two, every character alone, and random cuts."""
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    for n in (2, 3, 5, 8, 13):
        yield cuts(text, n)


CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "u": "a}\\"b"}}'
HERMES_CASES = [
    # (text, content, [(name, arguments)])
    (
        f"<tool_call>\n{CALL}\n</tool_call>",
        None,
        [("get_weather", '{"city": "Paris", "days": [1, 2], "u": "a}\\"b"}')],
    ),
    (
        'Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": {"y": null}}}\n</tool_call>',
        "Let me look.",
        [("a", "{}"), ("b", '{"x": {"y": null}}')],
    ),
    (  # keys in the other order, and a string of JSON as arguments: given whole at the end
        '<tool_call>{"arguments": {"q": 1}, "name": "s"}</tool_call>'
        '<tool_call>{"name": "t", "arguments": "{\\"k\\": 2}"}</tool_call>',
        None,
        [("s", '{"q": 1}'), ("t", '{"k": 2}')],
    ),
    ("Just text, no <tool_call here. a < b > c", "Just text, no <tool_call here. a < b > c", []),
    (  # broken JSON: the block is text
        "<tool_call>\nnot json\n</tool_call>",
        "<tool_call>\nnot json\n</tool_call>",
        [],
    ),
    (  # a call without its closing tag (the model stopped after the object)
        'ok <tool_call>\n{"name": "f", "arguments": {"a": "<b>"}}',
        "ok",
        [("f", '{"a": "<b>"}')],
    ),
    (  # the closing tag cut short (max_tokens): no content
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_',
        None,
        [("f", "{}")],
    ),
    (  # text after a call that never closed is content
        '<tool_call>\n{"name": "f", "arguments": {}} and then',
        "and then",
        [("f", "{}")],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_whole(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse_all(hermes(), text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]
    for c in got_calls:
        json.loads(c.arguments)


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_cut_anywhere_gives_the_same(
    text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    whole = fed(hermes(), [text])
    for pieces in splits(text):
        got = fed(hermes(), pieces)
        assert got.content == whole.content, pieces
        assert join_calls(got.calls) == join_calls(whole.calls), pieces


def test_hermes_streams_the_name_first_then_argument_pieces() -> None:
    parser = hermes()
    text = f"<tool_call>\n{CALL}\n</tool_call>"
    deltas: list[CallDelta] = []
    contents = ""
    for ch in text:
        out = parser.feed(ch)
        deltas += out.calls
        contents += out.content
    tail = parser.finish()
    assert contents == tail.content == "" and not tail.calls
    first, *rest = deltas
    assert (first.index, first.id, first.name, first.arguments) == (0, "call_0", "get_weather", "")
    assert len(rest) > 10  # a piece per character
    assert all(d.id is None and d.name is None and d.index == 0 for d in rest)
    assert "".join(d.arguments for d in rest) == '{"city": "Paris", "days": [1, 2], "u": "a}\\"b"}'


def test_hermes_name_comes_before_the_arguments_end() -> None:
    parser = hermes()
    out = parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": ')
    assert [(d.name, d.arguments) for d in out.calls] == [("f", ""), (None, '{"a": ')]
    assert parser.feed('"x"}}').calls == [CallDelta(0, arguments='"x"}')]


def test_hermes_holds_back_a_partial_tag_and_whitespace() -> None:
    parser = hermes()
    assert parser.feed("Sure.\n<tool").content == "Sure."
    out = parser.feed('_call>{"name": "f", "arguments": {}}</tool_call>\n')
    assert out.content == "" and join_calls(out.calls) == [ParsedCall("call_0", "f", "{}")]
    assert parser.finish().content == ""  # the newline after the last call is no content
    parser = hermes()
    assert parser.feed("a <tool").content == "a"
    assert parser.feed("box").content == " <toolbox"
    assert parser.finish().content == ""
    parser = hermes()
    assert parser.feed("x <tool").content == "x"
    assert parser.finish().content == " <tool"


def test_hermes_a_call_cut_short_keeps_what_was_written() -> None:
    content, calls = parse_all(hermes(), '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2')
    assert content is None and calls == [ParsedCall("call_0", "f", '{"a": [1, 2')]
    # cut before its name was complete: the text is content
    content, calls = parse_all(hermes(), '<tool_call>\n{"name": "f')
    assert content == '<tool_call>\n{"name": "f' and calls == []


def test_max_calls_keeps_the_first() -> None:
    text = "".join(
        f'<tool_call>{{"name": "f{i}", "arguments": {{}}}}</tool_call>' for i in range(3)
    )
    content, calls = parse_all(hermes(max_calls=1), text)
    assert content is None and [c.name for c in calls] == ["f0"]
    content, calls = parse_all(hermes(), text)
    assert [c.name for c in calls] == ["f0", "f1", "f2"]


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", '{"city": "Rome"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 1}}',
     None, [("a", "{}"), ("b", '{"n": 1}')]),
    ('  {"name": "a", "arguments": {"x": "y"}}', None, [("a", '{"x": "y"}')]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("<|python_ta", "<|python_ta", []),
    ("<|pythonic", "<|pythonic", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse_all(llama3(), text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    whole = fed(llama3(), [text])
    for pieces in splits(text):
        got = fed(llama3(), pieces)
        assert got.content == whole.content, pieces
        assert join_calls(got.calls) == join_calls(whole.calls), pieces


def test_llama3_streams_the_name_first() -> None:
    parser = llama3()
    out = parser.feed('<|python_tag|>{"name": "f", "parameters": {"q": "a')
    assert [(d.id, d.name, d.arguments) for d in out.calls] == [
        ("call_0", "f", ""),
        (None, None, '{"q": "a'),
    ]
    assert parser.feed('b"}}').calls == [CallDelta(0, arguments='b"}')]
    assert parser.finish() == Parsed()


def test_a_finished_parser_refuses_more_text() -> None:
    parser = hermes()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
    assert parser.finish() == Parsed()


# ---- responses and stream chunks from the parsed calls (http_api.responses) ----------------


def test_a_whole_answer_becomes_tool_calls_and_its_finish_reason() -> None:
    from spectrio.http_api.responses import ChoiceState, chat_message
    from spectrio.runtime.api import Delta

    text = f"Checking.\n<tool_call>\n{CALL}\n</tool_call>"
    state = ChoiceState(0)
    state.add(Delta(request_id="r", token_ids=[1, 2], text=text, finished=True,
                    finish_reason="stop"))  # fmt: skip
    message, reason = chat_message(state, hermes())
    assert reason == "tool_calls" and message.content == "Checking."
    assert message.tool_calls is not None
    [call] = message.tool_calls
    assert (call.id, call.type, call.function.name) == ("call_0", "function", "get_weather")
    assert json.loads(call.function.arguments)["city"] == "Paris"
    # cut by max_tokens: the reason stays "length"; no parser: the text as it is
    state.finish_reason = "length"
    assert chat_message(state, hermes())[1] == "length"
    message, reason = chat_message(state, None)
    assert message.content == text and message.tool_calls is None and reason == "length"
    # no call: content unchanged, and the runtime's reason
    plain = ChoiceState(0)
    plain.add(Delta(request_id="r", token_ids=[1], text=" hi ", finished=True,
                    finish_reason="stop"))  # fmt: skip
    message, reason = chat_message(plain, hermes())
    assert (message.content, message.tool_calls, reason) == (" hi ", None, "stop")


def test_stream_chunks_carry_calls_in_openais_shape() -> None:
    import msgspec

    from spectrio.http_api.responses import delta_tool_calls
    from spectrio.http_api.schema import ChatDelta

    deltas = [
        CallDelta(0, "call_0", "f", ""),
        CallDelta(0, arguments='{"a": '),
        CallDelta(0, arguments="1}"),
        CallDelta(1, "call_1", "g", "{}"),
    ]
    chunk = ChatDelta(tool_calls=delta_tool_calls(deltas))
    assert json.loads(msgspec.json.encode(chunk)) == {
        "tool_calls": [
            {"index": 0, "id": "call_0", "type": "function",
             "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"index": 1, "id": "call_1", "type": "function",
             "function": {"name": "g", "arguments": "{}"}},
        ]
    }  # fmt: skip
    later = ChatDelta(tool_calls=delta_tool_calls([CallDelta(1, arguments="x")]))
    assert json.loads(msgspec.json.encode(later)) == {
        "tool_calls": [{"index": 1, "function": {"arguments": "x"}}]
    }
