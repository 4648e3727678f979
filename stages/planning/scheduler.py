"""The scheduler's pure logic: continuous batching, chunked prefill, KV reservation and
preemption. No Trio, no device: ``schedule()`` turns state into a StepPlan and
``update()`` folds a StepResult back in.

Per sequence, ``num_computed`` counts positions whose target KV is valid. In the decode
phase ``num_computed == len(tokens) - 1``: the last token waits to be verified together
with the drafts. The scheduler gives a decoding sequence draft slots and knows nothing of
how drafts are made (``stages/device/draft/``); a draft method's cache shares the target's
block table, so reserving positions for the k+1 verify rows reserves them for it too.

Rules that keep a request's output a function of the request alone:

* **Draft schedule.** A sequence is *decoding* once a step that sampled it has returned,
  until it is preempted. Only a decoding sequence gets drafts (as many as
  ``num_model_steps``, what it may still emit and ``max_model_len`` allow). The step that
  completes a (re)computed context never drafts, however the token budget cut its
  chunks: drafting there needs the target hidden state before the last token, which a
  multi-token last chunk has not computed yet, so a one-token last chunk does not draft
  either. Which decoding steps draft, and how many, is the adaptive policy's choice
  (:mod:`.spec_policy`, one k for the whole step, from measured acceptance and step
  times), so it may depend on the batch; the *output* does not, since acceptance is
  sample-then-match: the token at each position is drawn the same way whether or not,
  and however many, drafts were proposed.
* **One slot per request per step.** Preemption happens while the running sequences are
  planned; a step that preempted admits nobody from the waiting queue (its head is the
  sequence just preempted, which would be recomputed at once and listed twice, and
  admitting anyone behind it would jump the queue). So a step's plan never lists a
  request both as preempted and as running.
* **Overlap.** With ``max_in_flight = 2`` the scheduler plans step N+1 while step N runs.
  A sequence N samples gets a *pending* work item in N+1 (:mod:`.overlap` resolves it on
  the device worker from N's result); its KV reservation covers N's longest outcome
  (``length + k_N + 1 + k_{N+1}`` positions). A sequence N only prefills (not its last
  chunk) is planned as usual: its ``num_computed`` advances when a chunk is planned.
  A result that arrives for a request aborted meanwhile is dropped, never published.

Prefix caching (hits, when prompt blocks are registered, waiting for a prefix a running
request computes, freeing blocks with steps in flight) follows the rules of
:mod:`.prefix_rules`.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from msgspec.structs import replace

from spectrio.core.acceptance import Acceptance
from spectrio.core.config import RuntimeConfig
from spectrio.core.draft_methods import draft_slots
from spectrio.core.messages import Ended, SeqResult, SeqWork, StepPlan, StepResult
from spectrio.stages.planning.block_manager import BlockManager
from spectrio.stages.planning.lifecycle import RequestState
from spectrio.stages.planning.prefix_rules import PrefixRules
from spectrio.stages.planning.sequence import Sequence
from spectrio.stages.planning.spec_policy import Remaining, SpecPolicy

# A step the device worker waited for longer than this (a pause, a gap between requests)
# starts on cold caches and sleeping OpenMP threads, and so does the one after it: both
# run slower whatever k is, so the adaptive policy does not time them.
IDLE_UNTIMED_S = 0.05
UNTIMED_AFTER_IDLE = 2


@dataclasses.dataclass
class _InFlight:
    """A planned step whose result has not been folded in yet."""

    works: dict[int, SeqWork]  # seq id -> its work in the step
    k: int  # drafts per decoding sequence the policy chose for it
    queued: bool  # requests waited for a slot when it was planned
    still_queued: bool  # ... and still did after it admitted (SpecPolicy.observe_occupancy)
    # seq id -> its num_preemptions when planned: a result of a sequence preempted since
    # registers no prefix block (its blocks may belong to others by then)
    epochs: dict[int, int] = dataclasses.field(default_factory=dict)
    # sequences that left the batch since the plan before, reported with this step: its
    # result carries them once folded in (StepResult.ended)
    ended: list[Ended] = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(
        self, config: RuntimeConfig, blocks: BlockManager, *, max_in_flight: int | None = None
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.max_in_flight = max_in_flight or (2 if config.enable_overlap else 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self._by_id: dict[int, Sequence] = {}
        self._inflight: dict[int, _InFlight] = {}  # by step, oldest first
        self._ended: list[Ended] = []  # since the last plan (reported with the next step)
        # aborted seq id -> the last step planned when it was aborted: results of steps up
        # to that one may still carry it, and must not be published (see published()).
        self._aborted_at: dict[int, int] = {}
        # aborted seq id -> (its sequence, the last step in flight that computes for it):
        # its blocks stay held until that step is folded in, so the prompt blocks its
        # steps in flight write are registered (module docstring, *Registration*)
        self._retiring: dict[int, tuple[Sequence, int]] = {}
        self._step = 0
        self.num_preemptions = 0
        self.finished_by_reason: dict[str, int] = {}
        # Every live request's drafts, counted once, as results are folded in.
        self.acceptance = Acceptance()
        # Planned steps with decoding sequences, by the drafts each proposes (0: none), so
        # a user sees which k the adaptive policy ran.
        self.steps_by_k: dict[int, int] = {}
        spec = config.speculative
        self.policy = SpecPolicy(spec.effective_num_model_steps, adaptive=spec.adaptive)
        self._step_k = self.policy.k_max  # drafts per decoding sequence in the planned step
        self._previous_k: int | None = None  # the k of the last decoding step folded in
        self._untimed = 0  # steps still not timed after an idle device (IDLE_UNTIMED_S)
        self.prefix = PrefixRules(blocks, config.speculative)

    # ---- requests ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._by_id:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        self._by_id[seq.seq_id] = seq
        self.waiting.append(seq)

    def state(self, seq_id: int) -> RequestState | None:
        """The lifecycle state of a live sequence; None once it ended (or never existed)."""
        seq = self._by_id.get(seq_id)
        return None if seq is None else seq.state

    def abort(self, seq_id: int) -> Sequence | None:
        """End a live sequence now: its blocks are freed (with prefix caching, once the
        steps in flight that compute for it are folded in and what they wrote of its
        prompt is registered), results still in flight for it are dropped, and the next
        plan reports it (record: -9, finish reason "abort")."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        computing = [n for n, step in self._inflight.items() if seq_id in step.works]
        if seq.state.queued:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        seq.move(RequestState.ABORTED)
        seq.finish_reason = "abort"
        seq.pending = None
        self.finished_by_reason["abort"] = self.finished_by_reason.get("abort", 0) + 1
        self._aborted_at[seq_id] = self._step
        if computing and self.blocks.caching and seq_id in self.blocks:
            self._retiring[seq_id] = (seq, computing[-1])
        else:
            self.blocks.free(seq.seq_id)
        self._ended.append(Ended(seq_id, seq.request_id, "aborted", seq.acceptance.copy()))
        return seq

    def published(self, result: StepResult) -> StepResult:
        """``result`` without requests aborted since it was folded in: the publisher calls
        this right before publishing, so once ``abort`` has returned no token of the
        request is published, even from a step already on its way to the publisher."""
        if not self._aborted_at:
            return result
        keep = [r for r in result.results if r.seq_id not in self._aborted_at]
        for seq_id, step in list(self._aborted_at.items()):
            if step <= result.step:  # no later result can carry it
                del self._aborted_at[seq_id]
        if len(keep) == len(result.results):
            return result
        return replace(result, results=keep)

    def has_work(self) -> bool:
        """Requests to run, or aborts still to be reported in a step."""
        return bool(self.waiting or self.running or self._aborts_to_report())

    def _aborts_to_report(self) -> bool:
        """Aborts the next plan reports: they need a step to reach the record."""
        return any(e.why == "aborted" for e in self._ended)

    @property
    def num_in_flight(self) -> int:
        """Planned steps whose results have not been folded in yet."""
        return len(self._inflight)

    def reported(self, step: int) -> list[Ended]:
        """The endings a planned step in flight reports (its result carries them once
        folded in)."""
        return list(self._inflight[step].ended)

    @property
    def step_in_flight(self) -> bool:
        return bool(self._inflight)

    def can_schedule(self) -> bool:
        return len(self._inflight) < self.max_in_flight and self.has_work()

    # ---- planning ---------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan one step, or None when nothing can run now."""
        if len(self._inflight) >= self.max_in_flight:
            raise RuntimeError(f"schedule() called with {len(self._inflight)} steps in flight")
        drafting = [s for s in self.running if (s.decoding or s.pending) and s.speculative]
        self._step_k = self.policy.choose(
            len(drafting), None if self.waiting else self._closing(drafting)
        )
        budget = self.config.max_chunk_tokens()
        queued = bool(self.waiting)
        planned: list[tuple[Sequence, int, int]] = []  # (seq, rows, drafts)
        preempted: list[str] = []
        for seq in list(self.running):
            if seq not in self.running or budget <= 0:
                continue
            rows, drafts, cost = self._rows_for(seq, budget)
            if rows == 0:
                continue
            need = self._capacity(seq, rows, drafts)
            while not self.blocks.can_allocate(seq.seq_id, need):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self.blocks.allocate(seq.seq_id, need)
            budget -= cost
            planned.append((seq, rows, drafts))
        # A step that preempted admits nobody (module docstring: one slot per request).
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if seq.num_computed or seq.pending is not None:
                raise RuntimeError(f"request {seq.request_id} queued with computed positions")
            hit, awaited = self.prefix.match(seq)
            if awaited:  # a running request is computing more of this prefix: wait for it
                break
            seq.num_computed = len(hit) * self.blocks.block_size
            rows, drafts, cost = self._rows_for(seq, budget)
            if rows == 0 or not self.blocks.can_allocate(
                seq.seq_id, seq.num_computed + rows + drafts, hit
            ):
                seq.num_computed = 0
                break
            self.waiting.popleft()
            self.blocks.allocate(seq.seq_id, seq.num_computed + rows + drafts, hit)
            self.prefix.admitted_with(seq, seq.num_computed)
            seq.move(RequestState.RUNNING)
            self.running.append(seq)
            budget -= cost
            planned.append((seq, rows, drafts))
        if not planned:
            if (self.running or self.waiting) and not self._inflight:
                head = (self.running or list(self.waiting))[0]
                raise RuntimeError(
                    f"no progress possible: request {head.request_id} needs more KV blocks "
                    f"than the pool holds ({self.blocks.num_blocks})"
                )
            if not self._aborts_to_report() and not preempted:
                return None
            # Nothing to run, but aborts must still reach the record: an empty step.
        self._step += 1
        works = [
            self._work(slot, seq, rows, drafts) for slot, (seq, rows, drafts) in enumerate(planned)
        ]
        ended, self._ended = self._ended, []
        self._inflight[self._step] = _InFlight(
            {w.seq_id: w for w in works},
            self._step_k,
            queued,
            bool(self.waiting),
            {seq.seq_id: seq.num_preemptions for seq, _, _ in planned},
            ended,
        )
        if any(w.decodes for w in works):
            # (a constrained sequence's slots beyond k are for forced tokens, not k's)
            k = max((min(w.num_drafts, self._step_k) for w in works), default=0)
            self.steps_by_k[k] = self.steps_by_k.get(k, 0) + 1
        return StepPlan(
            step=self._step,
            seqs=works,
            released=[e.seq_id for e in ended],
            retired=[e.seq_id for e in ended if e.why == "aborted"],
            k=self._step_k,
        )

    def _closing(self, drafting: list[Sequence]) -> list[Remaining]:
        """What the policy weighs when no request waits (:meth:`SpecPolicy.closing_rate`):
        each decoding sequence's remaining tokens and its own first drafts."""
        out = []
        for seq in drafting:
            acc = seq.acceptance
            reached = acc.proposed_at[0] if acc.proposed_at else 0
            accepted = acc.accepted_at[0] if acc.accepted_at else 0
            left = min(seq.remaining_tokens, self.config.max_model_len - seq.length)
            out.append(Remaining(max(1, left), reached, accepted))
        return out

    def _rows_for(self, seq: Sequence, budget: int) -> tuple[int, int, int]:
        """(target rows of real tokens, drafts, budget cost) for this step."""
        if seq.pending is not None:  # decodes after an in-flight step: k + 1 rows reserved
            if budget < self.config.tokens_per_seq or self._last_step_pending(seq):
                return 0, 0, 0
            return 1, self._num_drafts(seq), self.config.tokens_per_seq
        if seq.decoding:  # one pending token: verify it with its drafts, k + 1 rows reserved
            if budget < self.config.tokens_per_seq:
                return 0, 0, 0
            return 1, self._num_drafts(seq), self.config.tokens_per_seq
        if seq.num_computed >= seq.length:  # its last chunk is in flight
            return 0, 0, 0
        # Computing the context (prompt, or prompt + output after preemption): no drafts.
        rows = min(seq.length - seq.num_computed, budget)
        return rows, 0, rows

    def _last_step_pending(self, seq: Sequence) -> bool:
        """The in-flight step will end the sequence whatever it samples (it emits at least
        one token and no more may follow), or a step after it is already planned."""
        assert seq.pending is not None
        room = min(seq.remaining_tokens, self.config.max_model_len - seq.length)
        newest = self._inflight.get(self._step)
        return room <= 1 or newest is None or seq.pending is not newest.works.get(seq.seq_id)

    def _capacity(self, seq: Sequence, rows: int, drafts: int) -> int:
        """KV positions the step needs reserved for ``seq``."""
        if seq.pending is not None:  # the longest outcome of the in-flight step, then ours;
            # resolved drafts never reach past max_model_len (stages/device/overlap.py)
            return min(seq.length + seq.pending.num_drafts + 1 + drafts, self.config.max_model_len)
        return seq.num_computed + rows + drafts

    def _num_drafts(self, seq: Sequence) -> int:
        if not seq.speculative:
            return 0
        k = self._step_k
        if seq.params.constraint is not None:
            # Every slot its grammar's forced tokens may fill: they are near-certain, and a
            # slot left empty costs no row (the proposer still drafts only k: draft stage).
            k = max(k, self.policy.k_max)
        return draft_slots(k, seq.remaining_tokens, self.config.max_model_len - seq.length)

    def _work(self, slot: int, seq: Sequence, rows: int, drafts: int) -> SeqWork:
        common = dict(
            slot=slot,
            seq_id=seq.seq_id,
            request_id=seq.request_id,
            block_table=self.blocks.block_table(seq.seq_id),
            eos_token_ids=seq.eos_token_ids,
            params=seq.params,
            speculative=seq.speculative,
            max_model_len=self.config.max_model_len,
        )
        if seq.pending is not None:  # resolved on the device worker (stages/device/overlap.py)
            work = SeqWork(
                **common,  # type: ignore[arg-type]
                start_pos=seq.num_computed,
                token_ids=[],
                sample=True,
                num_drafts=drafts,
                max_new_tokens=min(seq.remaining_tokens, self.config.max_model_len - seq.length),
                num_output=len(seq.output_ids),
                context_len=seq.length,
                pending=True,
            )
            seq.pending = work
            return work
        tokens = seq.tokens
        start = seq.num_computed
        sample = start + rows == seq.length
        work = SeqWork(
            **common,  # type: ignore[arg-type]
            start_pos=start,
            token_ids=tokens[start : start + rows],
            sample=sample,
            num_drafts=drafts,
            max_new_tokens=min(seq.remaining_tokens, self.config.max_model_len - seq.length),
            num_output=len(seq.output_ids),
            context_len=seq.length,
            prompt_ids=(
                seq.prompt_ids
                if sample and not seq.output_ids and seq.params.repetition_penalty != 1.0
                else []
            ),
            cached_ids=tokens[: seq.prefix_hit],
            **self._score(seq, start, rows),  # type: ignore[arg-type]
        )
        seq.prefix_hit = 0
        if sample:
            seq.pending = work
        else:
            seq.num_computed = start + rows  # a chunk always completes
        return work

    @staticmethod
    def _score(seq: Sequence, start: int, rows: int) -> dict[str, object]:
        """The prompt rows this context chunk (positions ``start .. start + rows - 1``)
        scores for prompt_logprobs: those not planned for scoring before, up to the
        prompt's second-to-last position, whose row predicts its last token. The
        watermark moves when the chunk is planned: a planned step's result is always
        published (a sequence preempted since still gets it; only an abort drops it, and
        then nothing more is owed), so a position is scored once, never twice or not at
        all, through chunking, overlap and recompute (whose prefix hit stops at the
        watermark: :meth:`_match`)."""
        if not seq.scoring_left:
            return {}
        lo = max(start, seq.prompt_scored)
        hi = min(start + rows, len(seq.prompt_ids) - 1)
        if hi <= lo:
            return {}
        seq.prompt_scored = hi
        return {"score_start": lo, "score_ids": seq.prompt_ids[lo + 1 : hi + 1]}

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and requeue it first; it recomputes later."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.prefix_hit = 0
        seq.decoding = False
        seq.move(RequestState.PREEMPTED)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._ended.append(Ended(seq.seq_id, seq.request_id, "preempted"))

    # ---- results ----------------------------------------------------------------------

    def update(self, result: StepResult, seconds: float | None = None) -> StepResult:
        """Fold the oldest in-flight step's results in. Returns what to publish: the
        result without requests aborted since it was planned, with the endings reported
        with the step attached (:attr:`StepResult.ended`, from the step's in-flight
        record: they never went through the device).

        ``seconds``, the step's time, feeds the adaptive speculation policy, with the
        step's extra rows (target prompt rows, and the proposer's ``draft_rows``, such as
        MTP's catch-up over a whole prompt chunk), whose cost does not depend on k and
        which the policy takes off, and the k of the decoding step before it, whose
        accepted rows a proposer's pass may catch up on
        (:meth:`SpecPolicy.observe_step`). The first :data:`UNTIMED_AFTER_IDLE` steps
        after the device waited more than :data:`IDLE_UNTIMED_S` are not timed: they
        run slower whatever k is."""
        if not self._inflight or result.step != next(iter(self._inflight)):
            raise RuntimeError(f"result of step {result.step}; in flight: {list(self._inflight)}")
        step = self._inflight.pop(result.step)
        works, step_k = step.works, step.k
        self._observe_occupancy(works, result, step.queued, step.still_queued)
        if seconds is None:
            seconds = result.device.seconds or None
        if result.device.idle_seconds > IDLE_UNTIMED_S:
            self._untimed = UNTIMED_AFTER_IDLE
        if self._untimed:
            self._untimed -= 1
            seconds = None
        if any(r.num_forced for r in result.results):
            # A grammar's forced drafts fill slots beyond the step's k: its time is not k's.
            seconds = None
        drafted = any(r.num_drafts for r in result.results)
        filed_k = step_k if drafted else 0
        if seconds is not None and works:
            # The same count choose() was given: the step's decoding speculative sequences.
            speculative = sum(1 for w in works.values() if w.speculative and w.decodes)
            prompt_rows = sum(len(w.token_ids) for w in works.values() if not w.decodes)
            self.policy.observe_step(
                speculative, filed_k, seconds, self._previous_k, (prompt_rows, result.draft_rows)
            )
        if any(w.decodes for w in works.values()):
            self._previous_k = filed_k
        for r in result.results:
            # A grammar's forced drafts are near-certain and tell nothing of the
            # proposer's acceptance, which is what the policy weighs k by; a proposer's
            # drafts after them sit deeper than their positions say. Such a step is left
            # out of the acceptance, as it is out of the step times.
            if r.num_drafts and not r.num_forced:
                self.policy.observe_acceptance(r.num_drafts, r.num_accepted)
        published: list[SeqResult] = []
        for r in result.results:
            work = works.pop(r.seq_id, None)
            if work is None:
                raise RuntimeError(f"step {result.step} returned an unplanned sequence {r.seq_id}")
            seq = self._by_id.get(r.seq_id)
            if seq is None:  # aborted since: nothing of it is published any more
                retiring = self._retiring.get(r.seq_id)
                if (
                    retiring is not None
                    and step.epochs.get(r.seq_id) == retiring[0].num_preemptions
                ):
                    self.prefix.register(retiring[0], work)
                continue
            published.append(r)
            if (
                self.blocks.caching
                and seq.state is RequestState.RUNNING
                and step.epochs.get(seq.seq_id) == seq.num_preemptions
            ):
                self.prefix.register(seq, work)
            if work.sample:
                self._apply_sample(seq, work, r)
        for seq_id, work in works.items():
            seq = self._by_id.get(seq_id)
            # The device dropped a pending sequence its previous step finished.
            if seq is not None or not work.pending:
                raise RuntimeError(f"step {result.step} returned no result for sequence {seq_id}")
        for seq_id, (_, last) in list(self._retiring.items()):
            if last <= result.step:  # no step in flight computes for it any more
                del self._retiring[seq_id]
                self.blocks.free(seq_id)
        return replace(result, results=published, ended=step.ended)

    def _observe_occupancy(
        self, works: dict[int, SeqWork], result: StepResult, queued: bool, still_queued: bool
    ) -> None:
        """Tell the policy the step's tokens and, if requests waited for a slot when it
        was planned, the slots that advanced no request's decoding: its prefill works, the
        slots it left unplanned (free, or a running request with nothing to run) if
        requests still waited after it admitted, and half a step for each request it
        finished (:meth:`SpecPolicy.observe_occupancy`). A step with no work (it only
        reports aborts or preemptions) runs nothing on the device and is left out."""
        if not works:
            return
        tokens = sum(len(r.token_ids) for r in result.results)
        overhead = 0.0
        if queued:
            decoding = sum(1 for w in works.values() if w.decodes)
            overhead = len(works) - decoding
            if still_queued:
                overhead += max(0, self.config.max_num_seqs - len(works))
            overhead += 0.5 * sum(1 for r in result.results if r.finish_reason is not None)
        self.policy.observe_occupancy(overhead, tokens)

    def _apply_sample(self, seq: Sequence, work: SeqWork, r: SeqResult) -> None:
        seq.output_ids.extend(r.token_ids)
        seq.acceptance.add(r.num_drafts, r.num_accepted)
        self.acceptance.add(r.num_drafts, r.num_accepted)
        if seq.pending is work:
            seq.pending = None
        if seq.state is RequestState.RUNNING:
            # A pending work's positions were resolved on the device: the result has them.
            verified = r.num_computed if work.pending else work.start_pos + len(work.token_ids)
            seq.num_computed = verified + r.num_accepted
            seq.decoding = True
        if r.finish_reason is not None:
            r.acceptance = seq.acceptance.copy()
            r.cached_tokens = seq.cached_tokens or 0
            self._finish(seq, r.finish_reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.state.queued:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        seq.move(RequestState.FINISHED)
        seq.finish_reason = reason
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        del self._by_id[seq.seq_id]
        seq.pending = None  # a step planned ahead for it is dropped on the device (overlap.py)
        self.blocks.free(seq.seq_id)
        self._ended.append(Ended(seq.seq_id, seq.request_id, "finished"))
