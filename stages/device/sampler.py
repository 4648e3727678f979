"""The sampler: from a step's verify logits to the tokens each request emits
(:class:`Sampler`, pure logic: no I/O, no Trio, no device), and the sampler stage that
runs it on the device worker right after verify (:func:`sample`). The worker then ends
the step (:meth:`.workspace.Workspace.end_step`), dropping the state of the requests it
finished.

For every sampling sequence of a step (rows ``[last token, d1..dm]``, see
:mod:`.logits_processing`):

1. process each row with the request's penalties, min_tokens mask and sampling knobs;
2. accept drafts and add the bonus or recovered token with
   :func:`.rejection.rejection_sample` in one batched call. Greedy requests pass their
   processed logits, so greedy output is exactly the argmax of the penalised logits;
   random requests pass the processed probabilities and one-hot (deterministic,
   ``draft_probs=None``) MTP drafts, which is lossless;
3. end the run at the first stop (:mod:`.stops`);
4. compute logprobs for the emitted positions only.

Random numbers are keyed, never streamed (:mod:`.rejection` has the formula). Each
random request has a 64-bit key: its ``seed``, or, without one, a key drawn once from the
sampler's shared generator at the request's first sampling step. The key lives in the
request's state from then until it finishes or is aborted (``StepPlan.retired``), so it
survives preemption. The token a random request emits at output position ``n`` is the
inverse-CDF sample of its processed target distribution at ``n`` with the uniform keyed by
(key, ``n``, ``SAMPLE``), whether it comes out as an accepted draft, the token after a
rejection, or the bonus. Since that distribution depends only on the tokens before
``n``, a seeded request's output is a function of the model, its prompt, its sampling
parameters and its seed: not of its batch, its chunking, preemption or the drafts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from spectrio.core.messages import SeqResult, SeqWork, StepPlan, StepResult
from spectrio.core.params import SamplingParams
from spectrio.models import TextTokenizer
from spectrio.stages.device.grammar_book import GrammarBook
from spectrio.stages.device.logits_processing import (
    History,
    log_softmax,
    logprob_entries,
    process_rows,
    prompt_logprobs,
    token_logprobs,
)
from spectrio.stages.device.rejection import greedy_run, rejection_sample
from spectrio.stages.device.stops import StopStringMatcher, truncate_run

if TYPE_CHECKING:
    from spectrio.stages.device.verify import Verified
    from spectrio.stages.device.workspace import Workspace

__all__ = ["Sampler", "sample"]


@dataclasses.dataclass
class _SeqState:
    params: SamplingParams
    history: History
    key: int | None  # the random key (module docstring); None for greedy requests
    matcher: StopStringMatcher | None


@dataclasses.dataclass
class _Prepared:
    work: SeqWork
    state: _SeqState
    raw: np.ndarray  # [m + 1, V] target logits as computed
    processed: np.ndarray  # [m + 1, V] penalised and masked
    probs: np.ndarray | None  # [m + 1, V] what a random request draws from; None when greedy


class Sampler:
    """Per-request sampling state plus the step decision. No I/O, no Trio, no device."""

    def __init__(
        self, vocab_size: int, tokenizer: TextTokenizer | None = None, *, seed: int | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self._shared = np.random.default_rng(seed)  # draws the keys of unseeded requests
        self._states: dict[int, _SeqState] = {}

    @property
    def num_states(self) -> int:
        return len(self._states)

    def drop(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)

    def _state(self, w: SeqWork) -> _SeqState:
        state = self._states.get(w.seq_id)
        if state is None:
            if w.num_output:
                raise RuntimeError(
                    f"sequence {w.seq_id} has {w.num_output} outputs but no sampler state"
                )
            p = w.params
            matcher = None
            if p.stop:
                if self.tokenizer is None:
                    raise RuntimeError("stop strings need the sampler to have a tokenizer")
                matcher = StopStringMatcher(self.tokenizer, p.stop)
            state = _SeqState(
                params=p,
                history=History.start(p, self.vocab_size, w.prompt_ids),
                key=None if p.is_greedy else self._new_key(p.seed),
                matcher=matcher,
            )
            self._states[w.seq_id] = state
        elif state.history.num_output != w.num_output:
            raise RuntimeError(
                f"sequence {w.seq_id}: sampler saw {state.history.num_output} outputs, "
                f"scheduler reports {w.num_output}"
            )
        return state

    def _new_key(self, seed: int | None) -> int:
        if seed is not None:
            return seed
        return int(self._shared.integers(0, 2**64, dtype=np.uint64))

    def _prepare(self, w: SeqWork, raw: np.ndarray, allowed: np.ndarray | None) -> _Prepared:
        if raw.shape != (len(w.drafts) + 1, self.vocab_size):
            raise ValueError(f"slot {w.slot}: logits {raw.shape} for {len(w.drafts)} drafts")
        if (allowed is None) != (w.params.constraint is None):
            raise ValueError(f"slot {w.slot}: a constrained request needs its grammar's masks")
        state = self._state(w)
        processed, probs = process_rows(
            raw, state.params, state.history, w.drafts, w.eos_token_ids, allowed
        )
        return _Prepared(w, state, raw, processed, probs)

    def step(
        self,
        plan: StepPlan,
        logits: dict[int, np.ndarray],
        prompt_logits: dict[int, np.ndarray] | None = None,
        draft_probs: dict[int, np.ndarray] | None = None,
        allowed: dict[int, np.ndarray] | None = None,
    ) -> StepResult:
        """Decide every sampling slot of ``plan`` from its logits (rows ``[last token,
        d1..dm]`` per slot, from verify), and reduce ``prompt_logits`` (the raw logits of
        the rows that score prompt tokens, ``SeqWork.score_ids``, per slot) to each
        result's ``prompt_logprobs``. ``draft_probs``: per slot, the distributions its
        drafts were sampled from (the full rejection rule); a slot without them has
        one-hot drafts. ``allowed``: per constrained slot, the tokens its grammar allows
        at each row (:meth:`.grammar_book.GrammarBook.masks`)."""
        self.drop(plan.retired)
        allowed = allowed or {}
        draft_probs = _masked_drafts(plan, draft_probs or {}, allowed)
        prepared = [
            self._prepare(w, logits[w.slot], allowed.get(w.slot)) for w in plan.seqs if w.sample
        ]
        emitted = self._accept(prepared, draft_probs)
        finished = [self._finish(prep, run) for prep, run in zip(prepared, emitted, strict=True)]
        pairs = zip(prepared, finished, strict=True)
        _attach_logprobs([(p, r) for p, r in pairs if r.num_logprobs is not None and r.token_ids])
        by_slot = {r.slot: r for r in finished}
        results = [by_slot.get(w.slot) or _silent(w) for w in plan.seqs]
        for w, r in zip(plan.seqs, results, strict=True):
            if w.score_ids:
                if prompt_logits is None or w.slot not in prompt_logits:
                    raise ValueError(f"slot {w.slot} scores prompt tokens but has no logits")
                top = w.params.prompt_logprobs or 0
                r.prompt_logprobs = prompt_logprobs(prompt_logits[w.slot], w.score_ids, top)
        return StepResult(step=plan.step, results=results)

    def _accept(
        self, prepared: list[_Prepared], draft_probs: dict[int, np.ndarray]
    ) -> list[list[int]]:
        """Accepted drafts plus the recovered or bonus token, per prepared sequence."""
        if not prepared:
            return []
        if all(p.probs is None for p in prepared):  # all greedy: nothing to draw
            return [greedy_run(p.processed, p.work.drafts) for p in prepared]
        num_drafts = np.array([len(p.work.drafts) for p in prepared], dtype=np.int64)
        drafts = np.array([d for p in prepared for d in p.work.drafts], dtype=np.int64)
        keys = np.array([p.state.key or 0 for p in prepared], dtype=np.uint64)  # greedy: unused
        positions = np.array([p.work.num_output for p in prepared], dtype=np.int64)
        # Every request's rows [d1..dm, bonus position]: a random request's processed
        # probabilities, a greedy request's processed logits (only their argmax counts).
        target = np.concatenate([p.processed if p.probs is None else p.probs for p in prepared])
        out = rejection_sample(
            drafts,
            num_drafts,
            target,
            np.array([p.state.params.is_greedy for p in prepared]),
            _draft_rows(prepared, draft_probs, target.shape[1]),
            keys,
            positions,
        )
        return [[int(t) for t in row if t >= 0] for row in out]

    def _finish(self, prep: _Prepared, run: list[int]) -> SeqResult:
        w, state, params = prep.work, prep.state, prep.state.params
        cut = truncate_run(
            run,
            stop_token_ids=w.eos_token_ids,
            max_new_tokens=w.max_new_tokens,
            num_output=w.num_output,
            min_tokens=params.min_tokens,
            matcher=state.matcher,
        )
        tokens = run[: cut.num_tokens]
        state.history.extend(tokens)
        if cut.finish_reason is not None:
            self._states.pop(w.seq_id, None)
        return SeqResult(
            slot=w.slot,
            seq_id=w.seq_id,
            request_id=w.request_id,
            num_drafts=len(w.drafts),
            num_accepted=len(run) - 1,
            num_forced=w.forced,
            token_ids=tokens,
            finish_reason=cut.finish_reason,
            text_len=cut.text_len,
            num_logprobs=params.logprobs,
            num_computed=w.start_pos + len(w.token_ids),
            context_len=w.context_len,
        )


def _attach_logprobs(items: list[tuple[_Prepared, SeqResult]]) -> None:
    """Fill ``logprobs`` of every result that asked for them, in one batched computation
    over the emitted rows only: ``raw`` from the unmodified logits, ``processed`` from the
    distribution drawn from (the penalised logits' log-softmax for greedy requests)."""
    if not items:
        return
    logit_rows: list[np.ndarray] = []  # rows that still need a log-softmax
    parts: list[tuple[int, np.ndarray | None]] = []  # per item: (rows, log-probs if known)
    for prep, result in items:
        n = len(result.token_ids)
        if prep.state.params.logprobs_mode == "raw":
            logit_rows.append(prep.raw[:n])
            parts.append((n, None))
        elif prep.probs is None:
            logit_rows.append(prep.processed[:n])
            parts.append((n, None))
        else:
            with np.errstate(divide="ignore"):
                parts.append((n, np.log(prep.probs[:n])))
    soft = log_softmax(np.concatenate(logit_rows)) if logit_rows else None
    at, blocks = 0, []
    for n, known in parts:
        if known is None:
            assert soft is not None
            known, at = soft[at : at + n], at + n
        blocks.append(known)
    tokens = [t for _, r in items for t in r.token_ids]
    top = max(p.state.params.logprobs or 0 for p, _ in items)
    rows = token_logprobs(np.concatenate(blocks), tokens, top)
    wants = [p.state.params.logprobs or 0 for p, r in items for _ in r.token_ids]
    entries = logprob_entries(rows, tokens, wants)
    at = 0
    for _, result in items:
        n = len(result.token_ids)
        result.logprobs, at = entries[at : at + n], at + n


def _silent(w: SeqWork) -> SeqResult:
    """A slot that emits nothing this step (chunked prefill in progress)."""
    return SeqResult(
        slot=w.slot,
        seq_id=w.seq_id,
        request_id=w.request_id,
        num_drafts=0,
        num_accepted=0,
        token_ids=[],
        num_logprobs=w.params.logprobs,
        num_computed=w.start_pos + len(w.token_ids),
        context_len=w.context_len,
    )


def _masked_drafts(
    plan: StepPlan, draft_probs: dict[int, np.ndarray], allowed: dict[int, np.ndarray]
) -> dict[int, np.ndarray]:
    """A constrained slot's sampled drafts were kept only where its grammar allows them
    and before any stop token (the draft stage cuts at the first other one:
    :meth:`.grammar_book.GrammarBook.keeps`), so each was drawn from its draft
    distribution restricted to those tokens: that is the distribution the rejection rule
    must see, renormalised. (Where the draft was not kept, none is made and the target is
    sampled; both branches give the target's distribution.)"""
    if not draft_probs or not allowed:
        return draft_probs
    works = {w.slot: w for w in plan.seqs}
    out = dict(draft_probs)
    for slot, q in draft_probs.items():
        mask = allowed.get(slot)
        if mask is None:
            continue
        n = min(q.shape[0], mask.shape[0] - 1)
        keep = GrammarBook.keeps(mask[:n], works[slot].eos_token_ids)
        kept = np.where(keep, q[:n], 0.0)
        total = kept.sum(axis=1, keepdims=True)
        out[slot] = np.divide(kept, total, out=np.zeros_like(kept), where=total > 0)
    return out


def _draft_rows(
    prepared: list[_Prepared], draft_probs: dict[int, np.ndarray], vocab: int
) -> np.ndarray | None:
    """Every draft's distribution [drafts, V] in the order of the drafts, where a slot
    of the step sampled its drafts: a slot without them gets one-hot rows (a greedy
    request's, which only its argmax match reads). None when no slot sampled."""
    if not any(p.work.slot in draft_probs and p.work.drafts for p in prepared):
        return None
    rows = []
    for p in prepared:
        n = len(p.work.drafts)
        q = draft_probs.get(p.work.slot)
        if q is None:
            q = np.zeros((n, vocab))
            q[np.arange(n), p.work.drafts] = 1.0
        elif q.shape[0] < n or q.shape[1] != vocab:
            raise ValueError(
                f"slot {p.work.slot}: draft distributions {q.shape} for {n} drafts over {vocab}"
            )
        rows.append(q[:n])
    return np.concatenate(rows)


def sample(sampler: Sampler, ws: Workspace, plan: StepPlan, verified: Verified) -> StepResult:
    """The sampler stage: the step's decision from what verify computed."""
    allowed = ws.grammar.masks(plan) if ws.grammar is not None else None
    return sampler.step(plan, verified.logits, verified.prompt_logits, ws.draft_probs, allowed)
