"""Admission: what a request must pass before it costs the runtime anything.

Guarantees:

* **Size caps.** The transport's message limit (:func:`message_cap`) is larger than the
  request cap, so every oversized request a real client sends reaches the server and is
  answered ``too_large`` (:func:`~spectrio.wire.codec.decode_request` checks the cap
  first). A prompt that cannot fit under ``max_model_len`` is refused before it is
  tokenized (:func:`check_length`): token ids by count, text by its UTF-8 length and the
  tokenizer's exact bound (:func:`~spectrio.core.params.check_text_length`).
* **Per-client rate limits.** :class:`RateLimiter` is a token bucket per client (its
  CURVE key or ROUTER identity): ``rate`` requests/s in bursts of ``burst``; one over the
  cap is refused, and no client's bucket affects another's.
* **Off-loop tokenizing.** Text prompts are tokenized in a worker thread, one at a time,
  with the GIL released (:class:`PromptTokenizer`), so the event loop keeps serving
  meanwhile. So are chats (``messages``, schema 1.5): the model's chat template, untrusted
  text from a download, renders them in that thread too (:meth:`Runtime.chat_prompt
  <spectrio.runtime.api.Runtime.chat_prompt>`).
  :class:`PromptQueue` bounds the prompts waiting for the tokenizer, overall
  (:data:`MAX_TOKENIZING`) and per client (:data:`MAX_TOKENIZING_PER_CLIENT`); past either
  bound a prompt is refused ``rate_limited``, so no client can queue unbounded work.

Refusals are :class:`~spectrio.wire.codec.WireError` s with their wire error code; the
server turns them into ``Error`` replies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec
import trio
from tokenizers import Tokenizer

from spectrio.core.params import InvalidRequest, SamplingParams, check_text_length
from spectrio.models.text.tokenizer import TextTokenizer
from spectrio.wire.codec import WireError, check_submit, refused
from spectrio.wire.schema import ErrorCode, Submit

if TYPE_CHECKING:
    from spectrio.runtime.api import Runtime

__all__ = [
    "MAX_TOKENIZING",
    "MAX_TOKENIZING_PER_CLIENT",
    "MIN_MESSAGE_BYTES",
    "PendingPrompt",
    "PromptQueue",
    "PromptTokenizer",
    "RateLimiter",
    "check_length",
    "message_cap",
]

MAX_TOKENIZING: Final = 32
"""Text prompts waiting for the tokenizer at once, over all clients."""

MAX_TOKENIZING_PER_CLIENT: Final = 2
"""Text prompts one client may have waiting for the tokenizer."""

MIN_MESSAGE_BYTES: Final = 16 << 20
"""The least transport message limit (``zmq.MAXMSGSIZE``) :func:`message_cap` sets."""


def message_cap(max_request_bytes: int, max_message_bytes: int | None = None) -> int:
    """The transport's message limit (``zmq.MAXMSGSIZE``) for a request cap: by default
    16 times the cap and at least :data:`MIN_MESSAGE_BYTES`, so that any oversized
    request a real client sends reaches the server and gets ``too_large``. Raises
    ``ValueError`` for a limit that does not exceed the cap (a frame between the two
    would vanish without a reply)."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if max_message_bytes is None:
        return max(MIN_MESSAGE_BYTES, 16 * max_request_bytes)
    if max_message_bytes <= max_request_bytes:
        raise ValueError(
            f"max_message_bytes ({max_message_bytes}) must exceed max_request_bytes "
            f"({max_request_bytes}), so that an oversized request gets a too_large reply"
        )
    return max_message_bytes


class RateLimiter:
    """Token bucket per client: ``rate`` requests/s, bursts of ``burst``; ``rate`` None
    admits everything."""

    def __init__(self, rate: float | None, burst: int = 64) -> None:
        self.rate = rate
        self._burst = float(burst)
        self._buckets: dict[bytes, tuple[float, float]] = {}  # owner -> (tokens, time)

    def admit(self, owner: bytes, now: float) -> bool:
        """Whether ``owner`` may send a request at ``now`` (seconds); takes one token."""
        if self.rate is None:
            return True
        tokens, then = self._buckets.get(owner, (self._burst, now))
        tokens = min(self._burst, tokens + (now - then) * self.rate)
        if len(self._buckets) > 10_000:  # forget idle clients (their buckets are full)
            self._buckets = {
                k: v for k, v in self._buckets.items() if (now - v[1]) * self.rate < self._burst
            }
        if tokens < 1.0:
            self._buckets[owner] = (tokens, now)
            return False
        self._buckets[owner] = (tokens - 1.0, now)
        return True


def check_length(msg: Submit, *, max_model_len: int, max_token_bytes: int | None) -> None:
    """Refuse a prompt that cannot fit under ``max_model_len`` before it costs
    anything: token ids by count, text by its UTF-8 length and the tokenizer's exact
    bound (:func:`~spectrio.core.params.check_text_length`). Raises :class:`WireError`."""
    rid = msg.request_id
    if msg.prompt is None:  # a chat: bounded by the frame cap, checked once rendered
        return
    try:
        if isinstance(msg.prompt, str):
            check_text_length(
                msg.prompt, max_model_len=max_model_len, max_token_bytes=max_token_bytes
            )
            return
    except InvalidRequest as exc:
        raise WireError(ErrorCode(exc.code), str(exc), rid) from None
    if len(msg.prompt) >= max_model_len:
        raise WireError(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt: {len(msg.prompt)} tokens leave no room under max_model_len={max_model_len}",
            rid,
        )


class PromptTokenizer:
    """The server's text-prompt tokenizer: the model's ``tokenizer.json`` (an instance
    of its own, used from the tokenizer's worker thread only), with the exact length bound
    of :func:`spectrio.core.params.check_text_length` and an ``encode`` that releases the
    GIL, so a long prompt tokenized in a worker thread does not stall the event loop."""

    def __init__(self, runtime: Runtime) -> None:
        path = Path(runtime.loaded.path) / "tokenizer.json"
        # A GGUF file has no tokenizer.json: its tokenizer was built from the file's
        # metadata, and that tokenizer's own JSON is the one clients fetch.
        self.json = (
            path.read_text(encoding="utf-8") if path.is_file() else runtime.tokenizer.raw.to_str()
        )
        self._tok = TextTokenizer(Tokenizer.from_str(self.json), runtime.tokenizer.eos_token_id)
        self.max_token_bytes = self._tok.max_token_bytes
        sample = "def f(x):\n    return {'é': x}  # ok <|endoftext|>"
        if self.encode_prompt(sample) != runtime.tokenizer.encode_prompt(sample):
            raise RuntimeError("the server's tokenizer disagrees with the runtime's")

    def encode(self, text: str) -> list[int]:
        """A rendered chat's ids (:meth:`TextTokenizer.encode`)."""
        return self._tok.encode_releasing_gil(text)

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's ids (:meth:`TextTokenizer.encode_prompt`)."""
        return self._tok.encode_prompt_releasing_gil(text)


ChatPrompt = Callable[..., tuple[list[int], SamplingParams]]
"""Renders a chat: :meth:`spectrio.runtime.api.Runtime.chat_prompt`, called as
``chat(messages, params, tokenize=...)``."""


@dataclasses.dataclass(eq=False)
class PendingPrompt:
    """A text or chat ``Submit`` whose prompt is being tokenized (not acknowledged yet)."""

    owner: bytes
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    # Envelopes of ``Abort`` s its client sent meanwhile: once the prompt is tokenized,
    # the request starts, is aborted, and then each of them gets its ``Ack``.
    aborts: list[list[bytes]] = dataclasses.field(default_factory=list)


class PromptQueue:
    """The text prompts and chats waiting for the tokenizer, by request id, and the checks
    every prompt passes (:func:`~spectrio.wire.codec.check_submit` with the server's
    tokenizer; a chat, ``chat``, the runtime's rendering with it)."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        chat: ChatPrompt | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        self._chat = chat
        self._limiter = trio.CapacityLimiter(1)  # one prompt at a time
        self._pending: dict[str, PendingPrompt] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def get(self, request_id: str) -> PendingPrompt | None:
        return self._pending.get(request_id)

    def check(self, msg: Submit) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids, checked (tokenizing a text prompt, or rendering and
        tokenizing a chat, here, on this thread), and the parameters to run them with (a
        chat's carry its template's end-of-turn tokens). Raises :class:`WireError`."""
        if msg.messages is None:
            ids = check_submit(
                msg,
                vocab_size=self._vocab_size,
                max_model_len=self._max_model_len,
                tokenize=self.tokenizer.encode_prompt,
            )
            return ids, msg.params
        messages: list[dict[str, Any]] = [msgspec.structs.asdict(m) for m in msg.messages]
        try:
            if self._chat is None:
                raise InvalidRequest(
                    "messages", "this server renders no chats", code="no_chat_template"
                )
            return self._chat(messages, msg.params, tokenize=self.tokenizer.encode)
        except InvalidRequest as exc:
            raise refused(exc, msg.request_id) from None

    def reserve(self, msg: Submit, owner: bytes) -> PendingPrompt:
        """Queue a text prompt or chat of ``owner``'s; ``rate_limited`` past either bound."""
        mine = sum(p.owner == owner for p in self._pending.values())
        if len(self._pending) >= MAX_TOKENIZING or mine >= MAX_TOKENIZING_PER_CLIENT:
            raise WireError(
                ErrorCode.RATE_LIMITED,
                "too many prompts waiting for the tokenizer; retry later",
                msg.request_id,
            )
        pending = self._pending[msg.request_id] = PendingPrompt(owner)
        return pending

    async def tokenize(
        self, msg: Submit, pending: PendingPrompt
    ) -> tuple[list[int], SamplingParams] | None:
        """:meth:`check` in the tokenizer's worker thread. Returns None when ``pending``
        was cancelled (:meth:`cancel_all`; the thread is abandoned), and raises
        :class:`WireError` for a refused prompt. Call :meth:`done` afterwards."""
        with pending.scope:
            return await trio.to_thread.run_sync(
                self.check, msg, limiter=self._limiter, abandon_on_cancel=True
            )
        return None

    def done(self, request_id: str) -> None:
        """Forget a prompt once its tokenizing ended (whatever the outcome)."""
        del self._pending[request_id]

    def cancel_all(self) -> None:
        """Cancel every prompt still waiting (the server is shutting down)."""
        for pending in list(self._pending.values()):
            pending.scope.cancel()
