"""Per-request streams from step messages (:class:`StreamAssembler`): it checks every
request's sequence numbers (:class:`SequenceGap` on a missing or repeated token) and
detokenises incrementally into :class:`Chunk` s. It reads frames only, so it serves the
clients of :mod:`spectrio.wire.client` and any consumer that reads the sockets itself."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from spectrio.core.messages import TokenLogprob
from spectrio.models import TextTokenizer
from spectrio.stages.output.output_processor import RequestText
from spectrio.wire.client_tokenizers import bundled_tokenizer
from spectrio.wire.codec import decode_step, step_logprobs

__all__ = ["Chunk", "SequenceGap", "StreamAssembler"]


class SequenceGap(Exception):
    """A step's sequence number for a request is not the count of tokens received so far:
    tokens were lost (a dropping tap, a reconnect) or delivered twice."""

    def __init__(self, request_id: str, expected: int, got: int, step: int) -> None:
        super().__init__(
            f"request {request_id!r}: step {step} starts at token {got}, expected {expected}"
        )
        self.request_id = request_id
        self.expected = expected
        self.got = got
        self.step = step


class Chunk(msgspec.Struct, frozen=True, kw_only=True):
    """One request's output from one step."""

    request_id: str
    step: int
    seqno: int  # tokens of this request before this chunk
    token_ids: list[int]
    text: str  # complete characters only
    finish_reason: str | None = None  # "stop" | "length" | "abort" when the request ended
    # On a request's final chunk (server schema 1.1 and later; aborted requests since
    # 1.3; None from an older server): drafts proposed and accepted over the request's
    # whole life, like the embedding API's final ``Delta``.
    total_drafts: int | None = None
    total_accepted: int | None = None
    # On a request's final chunk (server schema 1.6 and later; None before, and for an
    # aborted request): prompt tokens whose KV came from the server's prefix cache.
    cached_tokens: int | None = None
    # One entry per token when the request asked for logprobs (``params.logprobs``).
    logprobs: list[TokenLogprob] | None = None
    # On a request's first chunk, when it asked for ``params.prompt_logprobs`` (server
    # schema 1.8): prompt tokens 1 .. P-1's logprobs, gathered from the steps that
    # scored them (the embedding API's ``Delta.prompt_logprobs``).
    prompt_logprobs: list[TokenLogprob] | None = None
    # The step envelope's error for this request, as ``"code: reason"`` (a request that
    # failed: ``"unavailable: engine_dead: ..."`` when the engine died).
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StreamAssembler:
    """Reassembles per-request streams from step messages.

    ``track`` limits the requests followed to a set given up front (further ids can be
    added with :meth:`follow`); with ``track=None`` every request is followed and must be
    seen from its first token. A request is forgotten after its finishing chunk.
    """

    def __init__(
        self, tokenizer: TextTokenizer | None = None, *, track: Sequence[str] | None = None
    ) -> None:
        self._tok = tokenizer  # None: the bundled one, once first needed
        self._follow_all = track is None
        self._followed: set[str] = set(track or ())
        self._received: dict[str, int] = {}
        self._texts: dict[str, RequestText] = {}
        # prompt logprobs of followed requests, gathered until their first chunk
        self._prompt_lps: dict[str, list[TokenLogprob]] = {}

    @property
    def tokenizer(self) -> TextTokenizer:
        """The tokenizer that detokenises new streams (the bundled one unless set)."""
        if self._tok is None:
            self._tok = bundled_tokenizer()
        return self._tok

    def set_tokenizer(self, tokenizer: TextTokenizer) -> None:
        """Detokenise streams that start from now on with ``tokenizer`` (the clients set
        the server's before their first submit)."""
        self._tok = tokenizer

    def follow(self, request_id: str) -> None:
        self._followed.add(request_id)

    def received(self, request_id: str) -> int:
        """Tokens received so far for a request still running."""
        return self._received.get(request_id, 0)

    def feed(self, frames: Sequence[bytes | memoryview]) -> list[Chunk]:
        """Decode one step message. Raises ``ValueError`` for a malformed message and
        :class:`SequenceGap` when a slot of a followed request has a sequence number other
        than the count of its tokens received so far: the one gap rule of
        ``docs/wire.md`` (*Reassembling a request's stream*), applied to every slot, those
        without tokens included. A chunk is returned for slots with tokens or a finish."""
        env, tokens = decode_step(frames)
        logprobs = step_logprobs(frames, env.request_ids)
        errors = {e.request_id: f"{e.code.value}: {e.reason}" for e in env.errors}
        chunks: list[Chunk] = []
        for rid, seqno, reason in zip(env.request_ids, env.seqnos, env.finish_reasons, strict=True):
            if not (self._follow_all or rid in self._followed):
                continue
            # The gap rule of docs/wire.md, for every slot (with or without tokens).
            expected = self._received.get(rid, 0)
            if seqno != expected:
                raise SequenceGap(rid, expected, seqno, env.step)
            ids = tokens.get(rid)
            token_ids = [] if ids is None else [int(t) for t in ids]
            scored = env.prompt_logprobs.get(rid)
            if scored:
                self._prompt_lps.setdefault(rid, []).extend(scored)
            if not token_ids and reason is None:
                continue  # a slot still in prefill, or preempted: no chunk
            prompt_lps = self._prompt_lps.pop(rid, None)
            # The output processor's text; the wire does not carry the request's stop
            # strings or its stop cut, so nothing is held back here.
            texts = self._texts.get(rid)
            if texts is None:
                texts = self._texts[rid] = RequestText(self.tokenizer)
            text = texts.push(token_ids, finished=reason is not None)
            if reason is not None:
                self._received.pop(rid, None)
                self._texts.pop(rid, None)
                self._followed.discard(rid)
            else:
                self._received[rid] = expected + len(token_ids)
            totals = env.drafts.get(rid) if reason is not None else None
            chunks.append(
                Chunk(
                    request_id=rid,
                    step=env.step,
                    seqno=seqno,
                    token_ids=token_ids,
                    text=text,
                    finish_reason=reason,
                    total_drafts=None if totals is None else totals[0],
                    total_accepted=None if totals is None else totals[1],
                    cached_tokens=env.cached_tokens.get(rid) if reason is not None else None,
                    logprobs=logprobs.get(rid) if token_ids else None,
                    prompt_logprobs=prompt_lps,
                    error=errors.get(rid),
                )
            )
        return chunks
