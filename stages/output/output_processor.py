"""Output processing (pure): what a request's tokens become for the one who reads them.

One module for every consumer of a request's output: the embedding stream
(:class:`spectrio.runtime.api.RequestStream`, which the wire server follows for each
request it runs, and whose text a server's trace recorder keeps), the wire client's stream
assembler (:class:`spectrio.wire.stream_assembler.StreamAssembler`, which turns the
server's step messages back into per-request chunks: the wire carries token ids and the
packed record, never text), and the CLI, bench and replay (:class:`RequestStats`).

Guarantees:

* **Text** (:class:`RequestText`) is decoded incrementally with the project's one
  detokenizer (:class:`~spectrio.models.text.tokenizer.IncrementalDetokenizer`, ``tokenizers``'
  ``DecodeStream``), so every consumer sees the same text token for token. Each piece holds
  complete characters only, until the output ends and the held-back bytes are flushed.
* **Stop strings.** With ``stop`` strings, the last ``max(len(stop)) - 1`` characters are
  held back until the next step or the finish (:func:`hold_back`), so text a stop string
  later cuts is never handed out; a finishing step that ended on a stop string keeps
  ``text_len`` characters in all. Without stop strings nothing is held back.
* **Logprobs** decoded from a packed step record (:func:`record_logprobs`) are exactly the
  :class:`~spectrio.core.messages.TokenLogprob` s the sampler produced; one JSON form
  (:func:`logprob_json`) is what the CLI prints.
* **Statistics** (:class:`RequestStats`) count steps and tokens from the outputs seen;
  acceptance is never counted here. The scheduler counts it once, where it folds the
  sampler's result in, and the request's final output carries that count
  (:class:`~spectrio.core.acceptance.Acceptance`), which this adds up.

No Trio, no I/O, no Paddle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from spectrio.core.acceptance import Acceptance
from spectrio.core.messages import TokenLogprob
from spectrio.core.record import StepRecord
from spectrio.models.text.tokenizer import TextTokenizer

__all__ = [
    "RequestStats",
    "RequestText",
    "final_totals",
    "hold_back",
    "logprob_json",
    "record_logprobs",
]


def hold_back(stop: Sequence[str]) -> int:
    """Characters to hold back for ``stop`` strings: the longest minus one (0 for none),
    the most a stop string completed by a later token could still cut."""
    return max((len(s) for s in stop), default=1) - 1


class RequestText:
    """One request's text, step by step."""

    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = ()) -> None:
        self._detok = tokenizer.stream()
        self._hold = hold_back(stop)
        self._pending = ""  # text decoded but not handed out yet
        self._sent = 0  # characters handed out

    def push(self, token_ids: Sequence[int], *, finished: bool, text_len: int | None = None) -> str:
        """The text to hand out for a step that emitted ``token_ids``. ``finished``: the
        request ended with this step (everything held back is handed out); ``text_len``:
        it ended on a stop string and its text is that many characters in all."""
        detok = self._detok
        self._pending += detok.push(token_ids)
        if finished:
            self._pending += detok.flush()
        if text_len is not None:
            self._pending = self._pending[: max(0, text_len - self._sent)]
        keep = 0 if finished else min(self._hold, len(self._pending))
        cut = len(self._pending) - keep
        text, self._pending = self._pending[:cut], self._pending[cut:]
        self._sent += len(text)
        return text


class Output(Protocol):
    """What :class:`RequestStats` reads of one step's output of a request (a
    :class:`~spectrio.runtime.api.Delta`, or a wire client's chunk)."""

    @property
    def token_ids(self) -> list[int]: ...


@dataclasses.dataclass
class RequestStats:
    """Speculation statistics of one request (or, merged, of many), from its outputs."""

    num_steps: int = 0  # verify steps that emitted tokens for this request
    num_tokens: int = 0
    # The scheduler's count, from the final output (merged over requests).
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)

    def add(self, output: Output) -> None:
        """One step's output; the final one brings the request's acceptance."""
        if output.token_ids:
            self.num_steps += 1
            self.num_tokens += len(output.token_ids)
        counted = getattr(output, "acceptance", None)
        if isinstance(counted, Acceptance):
            self.acceptance.merge(counted)

    def merge(self, other: RequestStats) -> None:
        """Add another request's counts (per-position lists are summed)."""
        self.num_steps += other.num_steps
        self.num_tokens += other.num_tokens
        self.acceptance.merge(other.acceptance)

    @property
    def proposed(self) -> list[int]:
        """Per draft position: steps that proposed it."""
        return self.acceptance.proposed_at

    @property
    def accepted(self) -> list[int]:
        """Per draft position: steps that accepted it."""
        return self.acceptance.accepted_at

    @property
    def reached(self) -> list[int]:
        """Per draft position i: steps that proposed it with drafts 1..i-1 all accepted."""
        return self.acceptance.reached_at

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per verify step (1.0 without speculation)."""
        return self.num_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def accepted_per_position(self) -> list[float]:
        """Share of steps in which draft position i was accepted, of those that proposed it."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed, strict=False)]

    @property
    def conditional_acceptance(self) -> list[float]:
        """Share of drafts at position i that were accepted, among steps that proposed it
        with every earlier draft accepted: the rate a draft model has at that position."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached, strict=True)]

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per step (``mean_accept_len - 1`` without truncation)."""
        return sum(self.accepted) / self.num_steps if self.num_steps else 0.0


def final_totals(output: object) -> tuple[int, int] | None:
    """A request's ``(drafts proposed, accepted)`` over its life, from its final output
    (a delta, or a wire chunk of schema 1.1 or later); None when the output has none."""
    drafts = getattr(output, "total_drafts", None)
    if drafts is None:
        return None
    return int(drafts), int(getattr(output, "total_accepted", None) or 0)


def record_logprobs(rec: StepRecord, request_ids: Sequence[str]) -> dict[str, list[TokenLogprob]]:
    """Each slot's logprobs from a packed step record, keyed by request id: one
    :class:`TokenLogprob` per emitted token, for requests that asked for logprobs (slots
    whose tokens carry rank -1 are left out). Alternatives holding id -1 (beyond what the
    request asked for) are dropped. Vectorised per step; one small loop per emitted token
    to build the objects."""
    if rec.width == 0 or rec.lp_ids is None or rec.lp_vals is None or rec.ranks is None:
        return {}
    off = rec.offsets
    ids, vals, ranks = rec.lp_ids.tolist(), rec.lp_vals.tolist(), rec.ranks.tolist()
    out: dict[str, list[TokenLogprob]] = {}
    for i, rid in enumerate(request_ids):
        lo, hi = int(off[i]), int(off[i + 1])
        if hi == lo or ranks[lo] < 0:
            continue
        out[rid] = [
            TokenLogprob(
                token_id=ids[r][0],
                logprob=vals[r][0],
                rank=ranks[r],
                top=[(t, v) for t, v in zip(ids[r][1:], vals[r][1:], strict=True) if t >= 0],
            )
            for r in range(lo, hi)
        ]
    return out


def logprob_json(lp: TokenLogprob) -> dict[str, object]:
    """A token's logprob as the CLI prints it (``docs/cli.md``)."""
    return {
        "token_id": lp.token_id,
        "logprob": lp.logprob,
        "rank": lp.rank,
        "top": [list(t) for t in lp.top],
    }
