"""The scheduler's pure logic: continuous batching, chunked prefill, KV reservation and
preemption. No Trio, no device: ``schedule()`` turns state into a StepPlan and
``update()`` folds a StepResult back in.

Per sequence, ``num_computed`` counts positions whose target KV is valid and
``mtp_computed`` those whose MTP KV holds real (non-speculative) entries. In the decode
phase ``num_computed == len(tokens) - 1``: the last token waits to be verified together
with the drafts. The MTP cache shares the target's block table, so reserving positions
for the k+1 verify rows reserves them for the MTP substeps as well.

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
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque

from spectrio.core.config import RuntimeConfig
from spectrio.core.messages import SeqWork, StepPlan, StepResult
from spectrio.core.params import SamplingParams
from spectrio.stages.block_manager import BlockManager
from spectrio.stages.spec_policy import SpecPolicy


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    speculative: bool
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    mtp_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    decoding: bool = False  # a step sampled it since its context was last (re)computed

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)


class Scheduler:
    def __init__(self, config: RuntimeConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self._by_id: dict[int, Sequence] = {}
        self._inflight: dict[int, SeqWork] = {}
        self._step_in_flight = False
        self._aborted_inflight: set[int] = set()
        self._released: list[int] = []
        self._aborted: list[str] = []  # request ids aborted since the last plan
        self._retired: list[int] = []  # their seq ids (the sampler drops their state)
        self._dropped: list[int] = []  # aborted seq ids no step can touch any more
        self._step = 0
        self.num_preemptions = 0
        spec = config.speculative
        self.policy = SpecPolicy(spec.effective_num_model_steps, adaptive=spec.adaptive)
        self._step_k = self.policy.k_max  # drafts per decoding sequence in the planned step

    # ---- requests ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._by_id:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        self._by_id[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a sequence; its blocks are freed now, or when its in-flight step returns."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "abort"
        self._aborted.append(seq.request_id)
        self._retired.append(seq_id)
        if seq_id in self._inflight:
            self._aborted_inflight.add(seq_id)  # its step may still write state: wait for it
        else:
            self._release(seq)
            self._dropped.append(seq_id)
        return seq

    def take_aborted(self) -> list[int]:
        """Seq ids aborted since the last call whose device state no step can touch any
        more (an abort during a step counts once the step returned): the scheduler actor
        drops their workspace state at once. The next plan's ``released`` lists them too,
        which is harmless (releasing is idempotent)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def has_work(self) -> bool:
        """Requests to run, or aborts still to be reported in a step."""
        return bool(self.waiting or self.running or self._aborted)

    @property
    def step_in_flight(self) -> bool:
        """A planned step has not returned its result yet."""
        return self._step_in_flight

    # ---- planning ---------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan one step, or None when nothing can run."""
        if self._step_in_flight:
            raise RuntimeError("schedule() called while a step is in flight")
        self._step_k = self.policy.choose(
            sum(1 for s in self.running if s.decoding and s.speculative)
        )
        budget = self.config.max_chunk_tokens()
        planned: list[tuple[Sequence, int, int]] = []  # (seq, rows, drafts)
        preempted: list[str] = []
        for seq in list(self.running):
            if seq not in self.running or budget <= 0:
                continue
            rows, drafts, cost = self._rows_for(seq, budget)
            if rows == 0:
                continue
            need = seq.num_computed + rows + drafts
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
            rows, drafts, cost = self._rows_for(seq, budget)
            if rows == 0 or not self.blocks.can_allocate(
                seq.seq_id, seq.num_computed + rows + drafts
            ):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq.seq_id, seq.num_computed + rows + drafts)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            budget -= cost
            planned.append((seq, rows, drafts))
        if not planned:
            if self.running or self.waiting:
                head = (self.running or list(self.waiting))[0]
                raise RuntimeError(
                    f"no progress possible: request {head.request_id} needs more KV blocks "
                    f"than the pool holds ({self.blocks.num_blocks})"
                )
            if not self._aborted:
                return None
            # Nothing to run, but aborts must still reach the record: an empty step.
        self._step += 1
        works = [
            self._work(slot, seq, rows, drafts) for slot, (seq, rows, drafts) in enumerate(planned)
        ]
        released, self._released = self._released, []
        aborted, self._aborted = self._aborted, []
        retired, self._retired = self._retired, []
        for w in works:
            self._inflight[w.seq_id] = w
        self._step_in_flight = True
        return StepPlan(
            step=self._step,
            seqs=works,
            preempted=preempted,
            aborted=aborted,
            released=released,
            retired=retired,
        )

    def _rows_for(self, seq: Sequence, budget: int) -> tuple[int, int, int]:
        """(target rows of real tokens, drafts, budget cost) for this step."""
        if seq.decoding:  # one pending token: verify it with its drafts, k + 1 rows reserved
            if budget < self.config.tokens_per_seq:
                return 0, 0, 0
            return 1, self._num_drafts(seq), self.config.tokens_per_seq
        # Computing the context (prompt, or prompt + output after preemption): no drafts.
        rows = min(seq.length - seq.num_computed, budget)
        return rows, 0, rows

    def _num_drafts(self, seq: Sequence) -> int:
        if not seq.speculative:
            return 0
        return max(
            0, min(self._step_k, seq.remaining_tokens - 1, self.config.max_model_len - seq.length)
        )

    def _work(self, slot: int, seq: Sequence, rows: int, drafts: int) -> SeqWork:
        tokens = seq.tokens
        start = seq.num_computed
        sample = start + rows == seq.length
        if seq.speculative:
            mtp_start, mtp_tokens = seq.mtp_computed, tokens[seq.mtp_computed + 1 : start + 1]
            seq.mtp_computed = start
        else:
            mtp_start, mtp_tokens = start, []
        return SeqWork(
            slot=slot,
            seq_id=seq.seq_id,
            request_id=seq.request_id,
            block_table=self.blocks.block_table(seq.seq_id),
            start_pos=start,
            token_ids=tokens[start : start + rows],
            sample=sample,
            num_drafts=drafts,
            mtp_start=mtp_start,
            mtp_token_ids=mtp_tokens,
            eos_token_ids=seq.eos_token_ids,
            max_new_tokens=min(seq.remaining_tokens, self.config.max_model_len - seq.length),
            params=seq.params,
            num_output=len(seq.output_ids),
            context_len=seq.length,
            prompt_ids=(
                seq.prompt_ids
                if sample and not seq.output_ids and seq.params.repetition_penalty != 1.0
                else []
            ),
        )

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and requeue it first; it recomputes later."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.mtp_computed = 0
        seq.decoding = False
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._released.append(seq.seq_id)

    # ---- results ----------------------------------------------------------------------

    def update(self, result: StepResult, seconds: float | None = None) -> list[Sequence]:
        """Fold a step's results in; returns the sequences that finished in it.

        ``seconds``, the step's wall time from plan to result, feeds the adaptive
        speculation policy when every sequence of the step was decoding (a step with
        prefill rows says nothing about the cost of drafts)."""
        self._step_in_flight = False
        if seconds is not None and self._inflight:
            works = list(self._inflight.values())
            if all(w.sample and len(w.token_ids) == 1 for w in works):
                drafted = any(w.num_drafts for w in works)
                self.policy.observe_step(len(works), self._step_k if drafted else 0, seconds)
        for r in result.results:
            if r.num_drafts:
                self.policy.observe_acceptance(r.num_drafts, r.num_accepted)
        finished: list[Sequence] = []
        for r in result.results:
            work = self._inflight.pop(r.seq_id)
            if r.seq_id in self._aborted_inflight:
                self._aborted_inflight.discard(r.seq_id)
                self.blocks.free(r.seq_id)
                self._released.append(r.seq_id)
                self._dropped.append(r.seq_id)
                continue
            seq = self._by_id[r.seq_id]
            verified = work.start_pos + len(work.token_ids)
            seq.num_computed = verified + r.num_accepted if work.sample else verified
            seq.decoding = seq.decoding or work.sample
            seq.output_ids.extend(r.token_ids)
            if r.finish_reason is not None:
                seq.finish_reason = r.finish_reason
                self.running.remove(seq)
                del self._by_id[seq.seq_id]
                seq.status = SeqStatus.FINISHED
                self._release(seq)
                finished.append(seq)
        for seq_id in list(self._inflight):
            raise RuntimeError(f"step {result.step} returned no result for sequence {seq_id}")
        return finished

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        self._released.append(seq.seq_id)
