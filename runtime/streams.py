"""What a request's caller reads: :class:`Delta`, one step's new output of a request,
and :class:`RequestStream`, the async iterator over them that
:meth:`~spectrio.runtime.engine.Runtime.generate` and ``chat`` return."""

from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING

import msgspec
import trio

from spectrio.core.acceptance import Acceptance
from spectrio.core.messages import (
    SeqResult,
    TokenLogprob,
)
from spectrio.core.params import (
    check_cache_salt,
)
from spectrio.errors import EngineDead
from spectrio.stages.output.output_processor import RequestText

if TYPE_CHECKING:
    from spectrio.runtime.engine import Runtime


class Delta(msgspec.Struct, kw_only=True):
    """New output of one request from one step."""

    request_id: str
    token_ids: list[int]  # tokens emitted this step
    text: str  # their text (complete characters only)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_drafts: int = 0  # drafts proposed for this request this step
    num_accepted: int = 0  # of which accepted
    abort_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for
    # On the final delta: the request's drafts over its whole life, per draft position too
    # (the scheduler's one count; :class:`~spectrio.stages.output.output_processor.RequestStats`
    # reads it). ``total_drafts`` and ``total_accepted`` are its totals.
    acceptance: Acceptance | None = None
    # On the final delta of a finished request: prompt tokens whose KV came from the
    # prefix cache (0 with the cache off).
    cached_tokens: int | None = None
    # On the request's first delta, when params.prompt_logprobs is set: one entry per
    # prompt token after the first (prompt tokens 1 .. P-1, in order; the first has no
    # context, so no logprob), each with that many top alternatives. None on later deltas.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def total_drafts(self) -> int | None:
        """On the final delta: drafts proposed over the request's whole life."""
        return None if self.acceptance is None else self.acceptance.proposed

    @property
    def total_accepted(self) -> int | None:
        """On the final delta: drafts accepted over the request's whole life."""
        return None if self.acceptance is None else self.acceptance.accepted


def abort_delta(request_id: str, reason: str, counted: Acceptance | None = None) -> Delta:
    """The final delta of an aborted request (``counted``: its drafts over its life; a
    shutdown's reason is ``"shutdown"``)."""
    return Delta(
        request_id=request_id,
        token_ids=[],
        text="",
        finished=True,
        finish_reason="abort",
        abort_reason=reason,
        acceptance=counted,
    )


@dataclasses.dataclass(frozen=True)
class OpenRequest:
    """A request the runtime delivers to: the runtime's one map from request id to its
    sequence (``Runtime._requests``). The scheduler actor keys its state by ``seq_id``;
    a request id may be reused once its request ended, and ``seq_id`` tells the two
    apart."""

    seq_id: int
    stream: trio.MemorySendChannel[Delta | SeqResult | EngineDead]


class RequestStream:
    """The output of one request, as :meth:`Runtime.generate` returns it: an async
    iterator of :class:`Delta`, and an async context manager whose exit (like
    :meth:`aclose`) aborts the request if it has not finished."""

    def __init__(
        self,
        runtime: Runtime,
        prompt: object,
        params: object,
        request_id: str | None,
        *,
        chat: bool = False,
        cache_salt: str = "",
    ) -> None:
        self._receive: trio.MemoryReceiveChannel[Delta | SeqResult | EngineDead] | None = None
        self._done = False  # finished, or closed by the consumer
        self._rt = runtime
        self._prompt, self._params = prompt, params
        self._chat = chat  # the prompt is a message list (Runtime.chat)
        self._cache_salt = check_cache_salt(cache_salt)
        # Known from the start, so a caller can abort by id; checked when the stream starts.
        self._request_id: str = uuid.uuid4().hex if request_id is None else request_id
        self._token = trio.lowlevel.current_trio_token()
        self._seq_id = -1
        self._text: RequestText | None = None  # the request's text, once started
        # prompt_logprobs gathered chunk by chunk until the first delta carries them; None
        # when not asked for, or once handed out
        self._prompt_lps: list[TokenLogprob] | None = None
        self._start()  # checked and submitted now: errors reach the caller of generate()

    @property
    def request_id(self) -> str:
        """The request's id: the one given to :meth:`Runtime.generate`, or a fresh one."""
        return self._request_id

    @property
    def finished(self) -> bool:
        """Whether the stream has ended (its final delta was returned, or it was closed)."""
        return self._done

    def _start(self) -> None:
        if self._receive is not None or self._done:
            return
        ids, params, rid = self._rt._prepare(
            self._prompt, self._params, self._request_id, chat=self._chat
        )
        self._seq_id, self._receive = self._rt._submit(ids, params, rid, self._cache_salt)
        self._params, self._prompt = params, None
        self._text = RequestText(self._rt.tokenizer, params.stop)
        if params.prompt_logprobs is not None:
            self._prompt_lps = []

    async def __aenter__(self) -> RequestStream:
        try:
            await trio.lowlevel.checkpoint()
        except BaseException:  # a cancelled entry: the request goes at once
            self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        self._start()
        if self._done:
            raise StopAsyncIteration
        while True:
            delta = self._on_item(await self._next_item())
            if delta is not None:
                return delta

    async def wait_finished(self) -> None:
        """Wait for the request to end without taking its output: for a caller that reads
        its tokens elsewhere (the wire server's consumers read them from the step records),
        so nothing is detokenized here. Ends at the request's finish or abort; raises
        :class:`EngineDead` if the engine fails first. Cancelling it aborts the request,
        as leaving an iteration does."""
        self._start()
        while not self._done:
            self._end_if_final(await self._next_item())

    async def _next_item(self) -> Delta | SeqResult | EngineDead:
        """The next item of the request's channel; cancelled while waiting, the consumer
        is gone and the request is aborted."""
        assert self._receive is not None
        try:
            return await self._receive.receive()
        except BaseException:
            self.close()
            raise

    def _end_if_final(self, item: Delta | SeqResult | EngineDead) -> bool:
        """Whether ``item`` ends the stream (a finish, an abort's final delta); the engine's
        failure is raised. The request's id is free again once it ended."""
        if isinstance(item, EngineDead):
            self._done = True
            raise item
        if isinstance(item, Delta) or item.finish_reason is not None:
            self._done = True
            self._rt._release(self._request_id, self._seq_id, None)
            return True
        return False

    def _take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt logprobs gathered so far, once: for the first delta handed out."""
        out, self._prompt_lps = self._prompt_lps, None
        return out

    def _on_item(self, item: Delta | SeqResult | EngineDead) -> Delta | None:
        """The delta for one item of the request's channel; None for a step that only
        scored prompt tokens (a prefill chunk): its logprobs wait for the first delta."""
        done = self._end_if_final(item)
        if isinstance(item, Delta):  # aborted or shut down; the abort is already sent
            lps = self._take_prompt_logprobs()
            return item if lps is None else msgspec.structs.replace(item, prompt_logprobs=lps)
        assert not isinstance(item, EngineDead)  # raised above
        if item.prompt_logprobs and self._prompt_lps is not None:
            self._prompt_lps += item.prompt_logprobs
        if not item.token_ids and not done:
            return None
        rid = self._request_id
        assert self._text is not None
        text = self._text.push(item.token_ids, finished=done, text_len=item.text_len)
        return Delta(
            request_id=rid,
            token_ids=item.token_ids,
            text=text,
            finished=done,
            finish_reason=item.finish_reason,
            num_drafts=item.num_drafts,
            num_accepted=item.num_accepted,
            logprobs=item.logprobs,
            acceptance=item.acceptance,
            cached_tokens=item.cached_tokens,
            prompt_logprobs=self._take_prompt_logprobs(),
        )

    def close(self, reason: str = "consumer went away") -> None:
        """Stop the stream now: if its request has not finished, abort it (its KV blocks
        are freed at the next plan). Later iteration ends at once. Idempotent."""
        if self._done:
            return
        self._done = True
        if self._receive is not None:
            self._rt._release(self._request_id, self._seq_id, reason)

    async def aclose(self) -> None:
        """:meth:`close`, as the async iterator protocol names it."""
        self.close()
        await trio.lowlevel.cancel_shielded_checkpoint()

    def __del__(self) -> None:
        # A stream dropped unfinished (no ``async with``, no aclose) aborts its request.
        # The finaliser may run at any point, so the abort is handed to the Trio loop.
        if self._done or self._receive is None:
            return
        try:
            self._token.run_sync_soon(
                self._rt._release, self._request_id, self._seq_id, "consumer went away"
            )
        except trio.RunFinishedError:
            pass
