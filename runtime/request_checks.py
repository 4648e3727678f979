"""How a :class:`~spectrio.runtime.engine.Runtime` takes a request: the checks of
:mod:`spectrio.core.params` on a prompt or a chat (the wire codec runs the same ones),
the chat template's rendering, and the hand-over to the scheduler actor with the
request's stream. A mixin of the runtime."""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import Callable, Sequence

import trio

from spectrio.core.channels import ChannelSender
from spectrio.core.config import RuntimeConfig
from spectrio.core.messages import (
    Control,
    NewRequest,
    SeqResult,
)
from spectrio.core.params import (
    InvalidRequest,
    SamplingParams,
    check_messages,
    check_params,
    check_prompt,
    check_request_id,
    with_chat_stops,
)
from spectrio.errors import EngineDead
from spectrio.models import LoadedModel
from spectrio.models.text.chat import ChatTemplate, is_messages
from spectrio.models.text.tokenizer import TextTokenizer
from spectrio.runtime.streams import Delta, OpenRequest
from spectrio.stages.device.grammar import GrammarCompiler


class RuntimeRequests:
    """The runtime's request checks and submission (module docstring). The attributes
    are the runtime's (:class:`~spectrio.runtime.engine.Runtime` sets them)."""

    config: RuntimeConfig
    loaded: LoadedModel
    tokenizer: TextTokenizer
    chat_template: ChatTemplate | None
    chat_stop_ids: list[int]
    grammar: GrammarCompiler
    _no_chat: str
    _requests: dict[str, OpenRequest]
    _ids: itertools.count[int]
    _closed: bool
    _dead: EngineDead | None
    _control: ChannelSender[Control] | None
    _open_seqs: set[int]
    _active_since: float | None

    # ---- requests ---------------------------------------------------------------------

    def _prepare(
        self, prompt: object, params: object, request_id: object, *, chat: bool = False
    ) -> tuple[list[int], SamplingParams, str]:
        """Check a request with the rules of :mod:`spectrio.core.params` (the wire
        codec runs the same ones). Returns the prompt's token ids, the parameters and the
        request id (a fresh one for ``None``). A message list (``chat``, or a prompt that
        :func:`~spectrio.models.text.chat.is_messages`) is rendered by :meth:`chat_prompt`.
        A constraint is compiled here (:meth:`GrammarCompiler.check`), so one the library
        cannot enforce is refused before the request runs.
        Raises :class:`InvalidRequest`."""
        params = check_params(
            SamplingParams() if params is None else params, self.loaded.config.vocab_size
        )
        if params.constraint is not None:
            self.grammar.check(params.constraint)
        rid = uuid.uuid4().hex if request_id is None else check_request_id(request_id)
        if chat or is_messages(prompt):
            ids, params = self.chat_prompt(prompt, params)
            return ids, params, rid
        ids = check_prompt(
            prompt,
            vocab_size=self.loaded.config.vocab_size,
            max_model_len=self.config.max_model_len,
            tokenize=self.tokenizer.encode_prompt,
            max_token_bytes=self.tokenizer.max_token_bytes,
        )
        return ids, params, rid

    def chat_prompt(
        self,
        messages: object,
        params: SamplingParams | None = None,
        *,
        tokenize: Callable[[str], Sequence[int]] | None = None,
        tools: Sequence[dict[str, object]] | None = None,
    ) -> tuple[list[int], SamplingParams]:
        """What a chat request runs: ``messages`` rendered by the model's chat template
        (ending where the assistant's answer begins) and tokenized (``tokenize``, by
        default the model's tokenizer), and ``params`` with the template's end-of-turn
        tokens added to ``stop_token_ids`` (:func:`~spectrio.core.params.with_chat_stops`:
        as EOS, so not with ``ignore_eos``). :meth:`chat` runs exactly these token ids.
        ``tools`` (OpenAI-shaped function tools) are passed to a template that reads them
        (:attr:`~spectrio.models.text.chat.ChatTemplate.reads_tools`).

        Raises :class:`InvalidRequest` on field ``messages``: a malformed list
        (:func:`~spectrio.core.params.check_messages`), a model without a chat template
        (code ``no_chat_template``; a template is never guessed), a template that refuses
        the messages, or a rendered prompt that is empty or too long. Safe to call from
        another thread (the wire server renders in its tokenizer thread)."""
        params = check_params(
            SamplingParams() if params is None else params, self.loaded.config.vocab_size
        )
        checked = check_messages(messages)
        if self.chat_template is None:
            raise InvalidRequest("messages", self._no_chat, code="no_chat_template")
        if tools is None:
            text = self.chat_template.render(checked)
        else:
            text = self.chat_template.render(checked, tools=list(tools))
        try:
            ids = check_prompt(
                text,
                vocab_size=self.loaded.config.vocab_size,
                max_model_len=self.config.max_model_len,
                tokenize=self.tokenizer.encode if tokenize is None else tokenize,
                max_token_bytes=self.tokenizer.max_token_bytes,
            )
        except InvalidRequest as exc:  # the prompt is the rendered messages: say so
            raise InvalidRequest(
                "messages", f"rendered by the chat template, {exc.rule}", code=exc.code
            ) from None
        return ids, with_chat_stops(params, self.chat_stop_ids)

    def _submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str = "",
    ) -> tuple[int, trio.MemoryReceiveChannel[Delta | SeqResult | EngineDead]]:
        """Hand a checked request to the scheduler; returns its sequence id and stream."""
        if self._dead is not None:
            raise self._dead
        if self._closed or self._control is None:
            raise RuntimeError("the runtime is not running")
        self._check_not_running(request_id)
        spec = (
            self.config.speculative.enabled
            if params.speculative is None
            else (params.speculative and self.config.speculative.enabled)
        )
        stops = list(params.stop_token_ids)
        if not params.ignore_eos:  # every EOS of a config that lists several
            stops += [t for t in self.loaded.config.eos_token_ids if t not in stops]
        seq_id = next(self._ids)
        send, receive = trio.open_memory_channel[Delta | SeqResult | EngineDead](math.inf)
        self._requests[request_id] = OpenRequest(seq_id, send)
        if not self._open_seqs:  # work arrives after idleness: the stall clock starts now
            self._active_since = time.monotonic()
        self._open_seqs.add(seq_id)
        self._control.send_nowait(
            NewRequest(
                seq_id=seq_id,
                request_id=request_id,
                prompt_ids=prompt_ids,
                params=params,
                eos_token_ids=stops,
                speculative=spec,
                cache_salt=cache_salt,
            )
        )
        return seq_id, receive

    def _check_not_running(self, request_id: str) -> None:
        if request_id in self._requests:
            raise InvalidRequest(
                "request_id", "must not be the id of a running request", got=request_id
            )
