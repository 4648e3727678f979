"""Tool calls read out of a model's text as it streams (pure: no I/O, no Trio).

Two formats (``docs/http.md``, *Tool calling*):

* **Hermes / Qwen** (:class:`HermesParser`): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``;
  the text outside the tags is the message's content.
* **Llama 3.x JSON** (:class:`Llama3Parser`): the whole answer is one or more JSON
  objects ``{"name": ..., "parameters": {...}}`` separated by ``;``, optionally after
  ``<|python_tag|>``; an answer that does not start that way is content.

A parser is fed the text as it arrives, cut anywhere (:meth:`ToolParser.feed`), and
returns what it can tell so far: content, and :class:`CallDelta` s in OpenAI's streaming
shape (a call's id and name first, then the pieces of its arguments' JSON text, streamed
as the model writes them). Text that might still turn out to be part of a call (a
partial ``<tool_call>``, trailing whitespace) is held back until it is known.
:meth:`ToolParser.finish` says the rest. The whole text fed at once gives the same calls
and content as any cut of it (:func:`parse_all` is that), so a streamed response and a
whole one agree.

A call whose JSON is broken before anything of it was streamed is given back as
content; one cut after its name was streamed (``max_tokens``) stays a call with the
arguments written so far, as OpenAI's are then.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from typing import Any, Final

__all__ = [
    "CallDelta",
    "HermesParser",
    "Llama3Parser",
    "Parsed",
    "ParsedCall",
    "ToolParser",
    "join_calls",
    "new_call_id",
    "parse_all",
]

HERMES_OPEN: Final = "<tool_call>"
HERMES_CLOSE: Final = "</tool_call>"
PYTHON_TAG: Final = "<|python_tag|>"

# a call object's head, up to its arguments' value: {"name": "f", "arguments":
_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_HEAD_LIMIT: Final = 4096  # characters of a call object searched for its head
_JSON_BARE: Final = frozenset(" \t\r\n{}[]:,-+.0123456789eEtrufalsn")


def new_call_id() -> str:
    """A tool call id in OpenAI's form: ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass(frozen=True)
class CallDelta:
    """A piece of one tool call: ``id`` and ``name`` on the call's first piece only."""

    index: int  # which call of the answer: 0, 1, ...
    id: str | None = None
    name: str | None = None
    arguments: str = ""  # the next piece of the arguments' JSON text


@dataclasses.dataclass
class Parsed:
    """What a piece of text turned out to be: content, and pieces of calls."""

    content: str = ""
    calls: list[CallDelta] = dataclasses.field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.calls += other.calls


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


def join_calls(deltas: list[CallDelta]) -> list[ParsedCall]:
    """Whole calls from their pieces, in index order."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        entry = calls.setdefault(d.index, ["", "", ""])
        if d.id is not None:
            entry[0] = d.id
        if d.name is not None:
            entry[1] = d.name
        entry[2] += d.arguments
    return [ParsedCall(*calls[i]) for i in sorted(calls)]


# ---- one call object ------------------------------------------------------------------------


class _Scan:
    """Where a JSON value that starts with ``{`` or ``[`` ends, read a character at a
    time: brackets counted outside strings. Characters that no JSON has outside a string
    (``<`` of a closing tag, words) make it fail."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False
        self.failed = False

    def step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth <= 0:
                self.done = True
        elif ch not in _JSON_BARE:
            self.failed = True


def _whole_call(text: str) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of a complete call object, or None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = obj.get("arguments", obj.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


class _Call:
    """One call object, from its ``{``: its name as soon as the head is complete and its
    arguments' text as it comes (when they are an object), else the whole call once the
    object ends.

    ``feed`` returns the text past the object's end (None while it goes on); ``failed``
    says the text was not a call, ``streamed`` whether any of it was already given."""

    def __init__(self, index: int, new_id: Callable[[], str]) -> None:
        self.index = index
        self._new_id = new_id
        self.text = ""
        self._outer = _Scan()
        self._args: _Scan | None = None  # the arguments' scan once the head is read
        self._args_at = 0  # how much of text the arguments' pieces have given
        self._head_done = False
        self.streamed = False
        self.failed = False

    def feed(self, text: str, out: Parsed) -> str | None:
        rest: str | None = None
        for i, ch in enumerate(text):
            self._outer.step(ch)
            if self._outer.failed:
                self.text += text[:i]
                rest = text[i:]
                break
            if self._outer.done:
                self.text += text[: i + 1]
                rest = text[i + 1 :]
                break
        else:
            self.text += text
        self._read_head(out)
        self._stream_args(out)
        if self._outer.failed:
            self.failed = not self.streamed
            return rest
        if self._outer.done:
            if not self.streamed:
                whole = _whole_call(self.text)
                if whole is None:
                    self.failed = True
                else:
                    name, args = whole
                    out.calls.append(CallDelta(self.index, self._new_id(), name, args))
                    self.streamed = True
            return rest
        return None

    def _read_head(self, out: Parsed) -> None:
        if self._head_done or len(self.text) > _HEAD_LIMIT:
            return
        head = _HEAD.match(self.text)
        if head is None or head.end() >= len(self.text):
            return  # not a head yet, or the value's first character not here yet
        self._head_done = True
        if self.text[head.end()] not in "{[":
            return  # a string (or odd) value: the call is given whole at its end
        name = json.loads(f'"{head.group("name")}"')
        out.calls.append(CallDelta(self.index, self._new_id(), name, ""))
        self.streamed = True
        self._args = _Scan()
        self._args_at = head.end()

    def _stream_args(self, out: Parsed) -> None:
        scan = self._args
        if scan is None or scan.done:
            return
        start = self._args_at
        end = start
        while end < len(self.text) and not scan.done and not scan.failed:
            scan.step(self.text[end])
            end += 1
        if scan.failed:
            end -= 1
            scan.done = True
        self._args_at = end
        if end > start:
            out.calls.append(CallDelta(self.index, arguments=self.text[start:end]))

    def finish(self, out: Parsed) -> None:
        """The text ended inside the object."""
        if not self.streamed:
            self.failed = True


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (a tag cut by a chunk)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---- the parsers -----------------------------------------------------------------------------


class ToolParser(abc.ABC):
    """Reads one answer's text as it streams (module docstring). ``max_calls`` keeps only
    the first calls (``parallel_tool_calls: false``: one); later ones are dropped."""

    def __init__(
        self, *, max_calls: int | None = None, new_id: Callable[[], str] = new_call_id
    ) -> None:
        self.max_calls = max_calls
        self.new_id = new_id
        self.num_calls = 0  # calls begun
        self._finished = False
        self._call: _Call | None = None  # the call being read

    def feed(self, text: str) -> Parsed:
        """What ``text``, after all the text before it, tells."""
        if self._finished:
            raise RuntimeError("the parser has finished")
        out = Parsed()
        if text:
            self._feed(text, out)
        return self._kept(out)

    def finish(self) -> Parsed:
        """The rest, at the end of the answer."""
        if self._finished:
            return Parsed()
        self._finished = True
        out = Parsed()
        self._finish(out)
        return self._kept(out)

    def _kept(self, out: Parsed) -> Parsed:
        if self.max_calls is not None:
            out.calls = [c for c in out.calls if c.index < self.max_calls]
        return out

    def _new_call(self) -> _Call:
        call = _Call(self.num_calls, self.new_id)
        self.num_calls += 1
        return call

    def _advance_call(self, text: str, out: Parsed) -> tuple[str, _Call | None]:
        """Feed ``text`` to the call being read: the text after the call, and the call
        once it has ended (None while it goes on). A call that turned out not to be one
        (``failed``) is not counted."""
        call = self._call
        assert call is not None
        rest = call.feed(text, out)
        if rest is None:
            return "", None
        self._call = None
        if call.failed:
            self.num_calls -= 1
        return rest, call

    @abc.abstractmethod
    def _feed(self, text: str, out: Parsed) -> None: ...

    @abc.abstractmethod
    def _finish(self, out: Parsed) -> None: ...


class HermesParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks in text
    (Hermes 2 Pro, Qwen 2.5 and later, and spectrio's default format). Whitespace just
    before a block, and between blocks, is not content."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._state = "text"  # text | open | call | close
        self._held = ""  # text: a partial tag or trailing whitespace; open/close: the block
        self._block = ""  # the raw text of the open block (given back if it is no call)
        self._had_call = False

    def _feed(self, text: str, out: Parsed) -> None:
        while text:
            if self._state == "text":
                text = self._text(text, out)
            elif self._state == "open":
                text = self._open(text, out)
            elif self._state == "call":
                text = self._in_call(text, out)
            else:
                text = self._close(text)

    def _text(self, text: str, out: Parsed) -> str:
        buf = self._held + text
        at = buf.find(HERMES_OPEN)
        if at >= 0:
            out.content += buf[:at].rstrip()  # whitespace right before a block is no content
            self._held = ""
            self._block = HERMES_OPEN
            self._state = "open"
            return buf[at + len(HERMES_OPEN) :]
        cut = _partial_suffix(buf, HERMES_OPEN)
        body, tail = buf[: len(buf) - cut], buf[len(buf) - cut :]
        stripped = body.rstrip()
        out.content += stripped
        self._held = body[len(stripped) :] + tail
        return ""

    def _open(self, text: str, out: Parsed) -> str:
        stripped = text.lstrip()
        self._block += text[: len(text) - len(stripped)]
        if not stripped:
            return ""
        if stripped[0] != "{":  # not a call: the tag was text
            self._state = "text"
            self._held = ""
            given, self._block = self._block, ""
            out.content += given
            return stripped
        self._call = self._new_call()
        self._state = "call"
        return stripped

    def _in_call(self, text: str, out: Parsed) -> str:
        rest, call = self._advance_call(text, out)
        if call is None:
            return rest
        if call.failed:  # no call: the block so far is text
            out.content += self._block + call.text
            self._block = ""
            self._state = "text"
            return rest
        self._had_call = True
        self._state = "close"
        self._held = ""
        return rest

    def _close(self, text: str) -> str:
        buf = self._held + text
        at = buf.find(HERMES_CLOSE)
        if at < 0:
            self._held = buf
            return ""
        self._held = ""
        self._block = ""
        self._state = "text"
        return buf[at + len(HERMES_CLOSE) :]

    def _finish(self, out: Parsed) -> None:
        if self._state == "text":
            if not self._had_call or self._held.strip():
                out.content += self._held
        elif self._state == "open":
            out.content += self._block
        elif self._state == "call":
            assert self._call is not None
            self._call.finish(out)
            if self._call.failed:
                out.content += self._block + self._call.text
        else:  # after a call whose closing tag never came (or came cut short)
            rest = self._held.strip()
            if rest and not HERMES_CLOSE.startswith(rest):
                out.content += rest
        self._held = ""


class Llama3Parser(ToolParser):
    """Llama 3.x's JSON calls: the answer is ``{"name": ..., "parameters": {...}}``
    objects separated by ``;`` (optionally after ``<|python_tag|>``), or it is all
    content."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._state = "begin"  # begin | between | call | content
        self._held = ""

    def _feed(self, text: str, out: Parsed) -> None:
        while text:
            if self._state == "content":
                out.content += text
                return
            if self._state == "begin":
                text = self._begin(text, out)
            elif self._state == "between":
                text = self._between(text, out)
            else:
                text = self._in_call(text, out)

    def _begin(self, text: str, out: Parsed) -> str:
        buf = self._held + text
        stripped = buf.lstrip()
        if not stripped or (PYTHON_TAG.startswith(stripped) and stripped != PYTHON_TAG):
            self._held = buf
            return ""
        self._held = ""
        if stripped.startswith(PYTHON_TAG):
            self._state = "between"
            return stripped[len(PYTHON_TAG) :]
        if stripped.startswith("{"):
            self._state = "between"
            return stripped
        self._state = "content"
        return buf

    def _between(self, text: str, out: Parsed) -> str:
        stripped = text.lstrip(" \t\r\n;")
        if not stripped:
            return ""
        if stripped[0] != "{":  # text after the calls
            self._state = "content"
            return stripped
        self._call = self._new_call()
        self._state = "call"
        return stripped

    def _in_call(self, text: str, out: Parsed) -> str:
        rest, call = self._advance_call(text, out)
        if call is None:
            return rest
        if call.failed:
            out.content += call.text
            self._state = "content"
            return rest
        self._state = "between"
        return rest

    def _finish(self, out: Parsed) -> None:
        if self._state == "begin":
            out.content += self._held
        elif self._state == "call":
            assert self._call is not None
            self._call.finish(out)
            if self._call.failed:
                out.content += self._call.text
        self._held = ""


def parse_all(parser: ToolParser, text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole answer's content and calls. With calls, the content is stripped, and None
    when nothing is left; without, it is the text unchanged."""
    out = parser.feed(text)
    out.extend(parser.finish())
    calls = join_calls(out.calls)
    if not calls:
        return out.content, []
    return (out.content.strip() or None), calls
