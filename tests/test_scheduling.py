"""The scheduler's pure logic: budgets, chunked prefill, KV reservation, preemption."""

from __future__ import annotations

from collections.abc import Collection

import pytest
from scheduler_helpers import MTPCatchUp, seq_result

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig
from spectrio.core.acceptance import Acceptance
from spectrio.core.messages import NewRequest, SeqResult, StepPlan, StepResult
from spectrio.core.timing import DeviceTiming
from spectrio.stages.planning.block_manager import BlockManager
from spectrio.stages.planning.scheduler import (
    IDLE_UNTIMED_S,
    UNTIMED_AFTER_IDLE,
    Scheduler,
    Sequence,
)


def make(k: int = 2, blocks: int = 64, **kw: object) -> Scheduler:
    fields: dict[str, object] = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 32,
        "max_model_len": 64,
        "block_size": 4,
        "num_kv_blocks": blocks,
        "speculative": SpeculativeConfig(num_speculative_tokens=k),
    }
    fields.update(kw)
    cfg = RuntimeConfig(**fields)  # type: ignore[arg-type]
    return Scheduler(cfg, BlockManager(blocks, 4))


def seq(i: int, n: int, max_tokens: int = 16) -> Sequence:
    return Sequence(
        NewRequest(
            seq_id=i,
            request_id=f"r{i}",
            prompt_ids=list(range(1, n + 1)),
            params=SamplingParams(max_tokens=max_tokens),
            eos_token_ids=[0],
            speculative=True,
        )
    )


def finish_step(
    s: Scheduler,
    plan: StepPlan,
    emit: int = 1,
    accepted: int | None = 0,
    seconds: float | None = None,
    idle: float = 0.0,
    finish: Collection[int] = (),
    draft_rows: int = 0,
) -> None:
    """Fold ``plan`` in: each sampling sequence emits ``accepted`` drafts (None: all of
    its drafts) plus ``emit`` tokens, and those in ``finish`` (seq ids) end by length;
    ``seconds`` times the step for the policy, which the device waited ``idle`` seconds
    for."""
    results = []
    for w in plan.seqs:
        n = w.num_drafts if accepted is None else accepted
        reason = "length" if w.seq_id in finish else None
        sampled = seq_result(w, n, [7] * (n + emit), reason)
        results.append(sampled if w.sample else seq_result(w, 0, []))
    s.update(
        StepResult(
            step=plan.step,
            results=results,
            device=DeviceTiming(idle_seconds=idle),
            draft_rows=draft_rows,
        ),
        seconds=seconds,
    )


def reported(s: Scheduler, p: StepPlan, why: str) -> list[str]:
    """Request ids the planned step ``p`` reports as ``why`` (preempted, aborted)."""
    return [e.request_id for e in s.reported(p.step) if e.why == why]


def adaptive_scheduler(k: int, speculative: tuple[bool, ...], prompt_len: int = 3) -> Scheduler:
    """An adaptive-k scheduler holding one ``prompt_len``-token request per flag
    (speculative or not)."""
    cfg = RuntimeConfig(
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        speculative=SpeculativeConfig(num_speculative_tokens=k, adaptive=True),
    )
    sched = Scheduler(cfg, BlockManager(64, cfg.block_size))
    # the warm-up rules have their own tests (test_spec_policy)
    sched.policy.warmup_steps = sched.policy.acceptance_warmup = 0
    for i, flag in enumerate(speculative):
        sched.add(
            Sequence(
                NewRequest(
                    seq_id=i,
                    request_id=f"r{i}",
                    prompt_ids=list(range(5, 5 + prompt_len)),
                    params=SamplingParams(max_tokens=200),
                    eos_token_ids=[],
                    speculative=flag,
                )
            )
        )
    return sched


def accept_all(sched: Scheduler, plan: StepPlan, seconds: float) -> None:
    """Fold ``plan`` in with every draft accepted, the step timed at ``seconds``."""
    finish_step(sched, plan, accepted=None, seconds=seconds)


def test_chunked_prefill_splits_a_long_prompt_over_steps() -> None:
    s = make()
    s.add(seq(1, 50))
    mtp = MTPCatchUp(s.policy.k_max)
    p1 = s.schedule()
    assert p1 is not None and p1.seqs[0].token_ids == list(range(1, 33)) and not p1.seqs[0].sample
    assert mtp.run(p1)[0] == {1: (0, [])}
    finish_step(s, p1)
    p2 = s.schedule()
    assert p2 is not None
    w = p2.seqs[0]
    assert (w.start_pos, len(w.token_ids), w.sample) == (32, 18, True)
    # MTP catches up on the first chunk's 32 positions (token at p+1 for each p).
    assert mtp.run(p2)[0] == {1: (0, list(range(2, 34)))}


def test_decoding_sequence_costs_k_plus_one_and_gets_drafts() -> None:
    s = make(k=3, max_num_seqs=5, max_num_batched_tokens=20)
    s.add(seq(1, 5))
    p = s.schedule()
    assert p is not None
    finish_step(s, p)  # prompt done, first token emitted
    for i in range(2, 6):
        s.add(seq(i, 4))
    p = s.schedule()
    assert p is not None
    decode = p.seqs[0]
    assert (decode.token_ids, decode.num_drafts, decode.sample) == ([7], 3, True)
    # The decode row and its 3 drafts cost 4 of the 20-token budget; prompts of 4 fill the rest.
    assert [len(w.token_ids) for w in p.seqs] == [1, 4, 4, 4, 4]


def test_kv_reserved_for_verify_rows() -> None:
    s = make(k=3)
    s.add(seq(1, 8))
    p = s.schedule()
    assert p is not None
    finish_step(s, p)
    p = s.schedule()
    assert p is not None
    # 9 tokens, the last plus 3 drafts verified at positions 8..11: 12 slots, 3 blocks of 4.
    assert len(p.seqs[0].block_table) == 3


def test_num_drafts_never_exceed_what_the_request_may_emit() -> None:
    s = make(k=3)
    s.add(seq(1, 4, max_tokens=3))
    p = s.schedule()
    assert p is not None
    finish_step(s, p)
    p = s.schedule()
    assert p is not None and p.seqs[0].num_drafts == 1  # 2 tokens left: 1 draft + 1 target token


def test_preemption_frees_the_newest_and_recomputes_everything() -> None:
    s = make(k=2, blocks=6, max_model_len=20)
    s.add(seq(1, 10))
    s.add(seq(2, 10))
    p = s.schedule()
    assert p is not None and len(p.seqs) == 2  # 3 blocks each: the pool is full
    finish_step(s, p, emit=1)  # 11 tokens; verifying 2 drafts needs a 4th block each
    p = s.schedule()
    assert p is not None
    assert reported(s, p, "preempted") == ["r2"] and [w.request_id for w in p.seqs] == ["r1"]
    assert s.num_preemptions == 1 and s.waiting[0].request_id == "r2"
    finish_step(s, p, emit=1, accepted=2)
    victim = s.waiting[0]
    assert victim.num_computed == 0 and victim.output_ids == [7]
    s.abort(1)
    p = s.schedule()
    assert p is not None
    w = p.seqs[0]
    # Recompute from prompt plus generated tokens, then sample the next token.
    assert (w.request_id, w.start_pos, w.token_ids, w.sample) == (
        "r2",
        0,
        list(range(1, 11)) + [7],
        True,
    )
    s.blocks.check_invariants()


def test_abort_during_a_step_frees_blocks_at_once_and_drops_its_result() -> None:
    """Steps run in plan order, so blocks an in-flight step writes can be handed out in the
    next plan: its step runs later and writes each position before reading it."""
    s = make()
    s.add(seq(1, 8, max_tokens=1))
    p = s.schedule()
    assert p is not None
    s.abort(1)
    assert s.blocks.num_used_blocks == 0
    result = StepResult(
        step=p.step,
        results=[
            SeqResult(
                slot=0,
                seq_id=1,
                request_id="r1",
                num_drafts=0,
                num_accepted=0,
                token_ids=[5],
                finish_reason="length",
            )
        ],
    )
    assert s.update(result).results == []  # nothing of an aborted request is published
    assert s.finished_by_reason == {"abort": 1}
    # The abort is still reported, in a step of its own.
    p = s.schedule()
    assert p is not None and p.seqs == [] and reported(s, p, "aborted") == ["r1"]
    s.update(StepResult(step=p.step, results=[]))
    assert not s.has_work()


def test_finish_frees_blocks() -> None:
    s = make()
    s.add(seq(1, 8, max_tokens=1))
    p = s.schedule()
    assert p is not None
    s.update(
        StepResult(
            step=p.step,
            results=[
                SeqResult(
                    slot=0,
                    seq_id=1,
                    request_id="r1",
                    num_drafts=0,
                    num_accepted=0,
                    token_ids=[5],
                    finish_reason="length",
                )
            ],
        )
    )
    assert s.blocks.num_used_blocks == 0 and s.schedule() is None


def test_schedule_refuses_to_run_twice_in_flight() -> None:
    s = make()
    s.add(seq(1, 4))
    assert s.schedule() is not None
    with pytest.raises(RuntimeError, match="in flight"):
        s.schedule()


def test_one_token_prompt_gets_no_drafts_until_the_mtp_has_a_hidden_state() -> None:
    s = make(k=2)
    s.add(seq(1, 1))
    mtp = MTPCatchUp(s.policy.k_max)
    p = s.schedule()
    assert p is not None and (p.seqs[0].num_drafts, p.seqs[0].sample) == (0, True)
    mtp.run(p)
    finish_step(s, p)
    p = s.schedule()
    assert p is not None
    assert p.seqs[0].num_drafts == 2
    assert mtp.run(p)[0] == {1: (0, [7])}


def test_plans_carry_what_the_sampler_and_record_need() -> None:
    s = make(k=2, max_num_batched_tokens=12, max_num_seqs=4)
    penalised = Sequence(
        NewRequest(
            seq_id=1,
            request_id="r1",
            prompt_ids=list(range(1, 21)),
            params=SamplingParams(max_tokens=8, repetition_penalty=1.2),
            eos_token_ids=[0],
            speculative=True,
        )
    )
    s.add(penalised)
    p = s.schedule()
    assert p is not None
    w = p.seqs[0]
    # A prefill chunk: the record sees num_computed < context_len; no prompt sent yet.
    assert (w.sample, w.context_len, w.num_output, w.prompt_ids) == (False, 20, 0, [])
    assert w.params.repetition_penalty == 1.2
    finish_step(s, p)
    p = s.schedule()
    assert p is not None
    w = p.seqs[0]
    # The first sampling step sends the prompt once, for the repetition penalty.
    assert (w.sample, w.prompt_ids) == (True, list(range(1, 21)))
    finish_step(s, p)
    p = s.schedule()
    assert p is not None and p.seqs[0].prompt_ids == [] and p.seqs[0].num_output == 1
    finish_step(s, p)


def test_aborts_are_reported_once_in_the_next_plan() -> None:
    s = make()
    s.add(seq(1, 4))
    s.add(seq(2, 4))
    p = s.schedule()
    assert p is not None and reported(s, p, "aborted") == [] and p.retired == []
    finish_step(s, p)
    s.abort(2)
    p = s.schedule()
    assert p is not None and (reported(s, p, "aborted"), p.retired) == (["r2"], [2])
    finish_step(s, p)
    p = s.schedule()
    assert p is not None and (reported(s, p, "aborted"), p.retired) == ([], [])


def test_endings_reach_the_result_at_the_fold_never_through_the_device() -> None:
    """The plan carries only the seq ids whose state goes; the step's endings (with an
    aborted request's drafts over its life) come from the scheduler's own record of the
    step, attached when its result is folded in, whatever the device returned."""
    s = make()
    s.add(seq(1, 4))
    s.add(seq(2, 4))
    p = s.schedule()
    assert p is not None
    finish_step(s, p)  # both decode from here, with drafts
    p = s.schedule()
    assert p is not None
    finish_step(s, p, accepted=1)
    s.abort(2)
    p = s.schedule()
    assert p is not None and (p.released, p.retired) == ([2], [2])
    assert not hasattr(p, "ended")  # nothing about endings crosses to the device
    results = [seq_result(w, 0, [7]) for w in p.seqs]
    folded = s.update(StepResult(step=p.step, results=results))  # the device sent none
    assert [(e.seq_id, e.request_id, e.why) for e in folded.ended] == [(2, "r2", "aborted")]
    counted = folded.ended[0].acceptance
    assert counted is not None and (counted.proposed, counted.accepted) == (2, 1)
    assert folded.aborted == folded.ended and folded.preempted == []


def test_aborting_the_last_request_still_yields_a_step_that_reports_it() -> None:
    s = make()
    s.add(seq(1, 4))
    p = s.schedule()
    assert p is not None
    finish_step(s, p)
    s.abort(1)
    assert s.has_work()
    p = s.schedule()
    assert p is not None and p.seqs == [] and reported(s, p, "aborted") == ["r1"]
    s.update(StepResult(step=p.step, results=[]))
    assert not s.has_work() and s.schedule() is None and s.blocks.num_used_blocks == 0


def test_a_request_preempted_while_planning_is_not_readmitted_in_the_same_step() -> None:
    """Issue 9, item 2: r2 preempts itself to make room, which frees enough blocks to
    recompute its whole context right away; listing it both as preempted and as running
    would give it two slots in the step's record."""
    s = make(k=2, blocks=7, max_model_len=20)
    s.add(seq(1, 10))
    s.add(seq(2, 10))
    p = s.schedule()
    assert p is not None and len(p.seqs) == 2  # 3 blocks each, 1 free
    finish_step(s, p, emit=1)  # 11 tokens each; verifying 2 drafts needs a 4th block each
    p = s.schedule()
    assert p is not None and reported(s, p, "preempted") == ["r2"]
    assert [w.request_id for w in p.seqs] == ["r1"]
    # r2's 11 tokens fit the 3 freed blocks: it is admitted in the next step, not this one.
    assert s.blocks.num_free_blocks == 3 and s.waiting[0].request_id == "r2"
    finish_step(s, p, emit=1)
    p = s.schedule()
    assert p is not None and reported(s, p, "preempted") == []
    assert [w.request_id for w in p.seqs] == ["r1", "r2"]
    assert (p.seqs[1].start_pos, p.seqs[1].sample) == (0, True)


def test_no_plan_lists_a_request_twice_under_kv_pressure() -> None:
    s = make(k=3, blocks=17, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8)
    for i in range(1, 9):
        s.add(seq(i, 3 + 2 * i, max_tokens=30))
    while s.has_work():
        p = s.schedule()
        assert p is not None
        ids = [w.request_id for w in p.seqs] + [e.request_id for e in s.reported(p.step)]
        assert len(ids) == len(set(ids)), (p.step, ids)
        results = []
        for w in p.seqs:  # every sampling slot accepts one of its drafts
            n = min(1 + min(w.num_drafts, 1), w.max_new_tokens) if w.sample else 0
            finish = "length" if w.sample and n == w.max_new_tokens else None
            results.append(seq_result(w, max(n - 1, 0), [7] * n, finish))
        s.update(StepResult(step=p.step, results=results))
        s.blocks.check_invariants()
    assert s.num_preemptions >= 5 and s.blocks.num_used_blocks == 0


def test_drafts_depend_on_the_sequence_not_on_where_the_budget_cut_its_prompt() -> None:
    """The step that completes a context never drafts: a one-token last chunk does not
    either (it used to, unlike a longer last chunk). Once decoding, every step drafts."""
    for first in (2, 9, 10, 11):  # r1's prompt length decides where r2's prompt is cut
        s = make(k=3, max_num_batched_tokens=20, max_num_seqs=5)
        s.add(seq(1, first))
        s.add(seq(2, 30 - first - 9))  # 21 - first: 20 - first in step 1, 1 in step 2
        drafts: list[tuple[int, bool, int]] = []
        for _ in range(4):
            p = s.schedule()
            assert p is not None
            drafts += [(len(w.token_ids), w.sample, w.num_drafts) for w in p.seqs if w.seq_id == 2]
            finish_step(s, p)
        assert drafts[:2] == [(20 - first, False, 0), (1, True, 0)]
        assert drafts[2:] == [(1, True, 3), (1, True, 3)]


def test_adaptive_policy_sets_the_drafts_of_every_decoding_sequence() -> None:
    """The scheduler drafts what the policy chooses for the step: once its measurements
    say one draft is fastest, decoding sequences get one (another k on a probe step)."""
    sched = adaptive_scheduler(3, (True, True))
    seen: list[list[int]] = []
    for _ in range(40):
        plan = sched.schedule()
        assert plan is not None
        seen.append([w.num_drafts for w in plan.seqs])
        # Every draft accepted, so tokens per second are 1.0, 1.82, 1.58, 1.43 for k = 0..3.
        accept_all(sched, plan, [1.0, 1.1, 1.9, 2.8][plan.seqs[0].num_drafts])
    assert seen[0] == [0, 0]  # the prompt step never drafts
    first = [row[0] for row in seen[1:7]]
    assert first == [1, 1, 2, 2, 0, 0]  # the cheap k first, twice each; k = 3 is not tried
    late = seen[8:]
    assert all(row[0] == row[1] for row in late)
    # Probes re-measure a neighbour of the best (two steps in every 8 while its pairs
    # are young); every other step drafts one.
    assert sum(row[0] != 1 for row in late) <= 8 and late.count([1, 1]) >= len(late) - 8


def test_a_result_already_folded_in_is_not_published_after_an_abort() -> None:
    """The publisher asks the scheduler right before publishing: a step folded in before
    the abort, still waiting for the publisher, loses the aborted request's tokens."""
    s = make()
    s.add(seq(1, 8))
    s.add(seq(2, 8))
    p = s.schedule()
    assert p is not None
    results = [
        SeqResult(
            slot=w.slot,
            seq_id=w.seq_id,
            request_id=w.request_id,
            num_drafts=0,
            num_accepted=0,
            token_ids=[7],
        )
        for w in p.seqs
    ]
    folded = s.update(StepResult(step=p.step, results=results))
    assert [r.seq_id for r in folded.results] == [1, 2]
    s.abort(1)
    assert [r.seq_id for r in s.published(folded).results] == [2]
    later = s.schedule()
    assert later is not None and reported(s, later, "aborted") == ["r1"]


def test_step_times_are_filed_under_the_count_choose_was_given() -> None:
    """A batch mixing one speculative and one plain request: choose() is asked for one
    speculative sequence, so the step's time must be filed under that bucket too, or
    the policy never gets a timing for it and stays at k_max."""
    sched = adaptive_scheduler(2, (True, False))
    for _ in range(12):
        plan = sched.schedule()
        assert plan is not None
        accept_all(sched, plan, 1.0)
    assert {bucket for bucket, _ in sched.policy.step_times()} == {1}
    assert {k for _, k in sched.policy.step_times()} >= {2, 1}  # it moved past k_max


def record_observed_steps(
    sched: Scheduler,
) -> list[tuple[int, int, int | None, tuple[int, int]]]:
    """What the scheduler files with its policy from now on, one entry per
    :meth:`SpecPolicy.observe_step` call: (num_seqs, k, previous_k, extra_rows)."""
    seen: list[tuple[int, int, int | None, tuple[int, int]]] = []
    observe = sched.policy.observe_step

    def recording(
        num_seqs: int,
        k: int,
        seconds: float,
        previous_k: int | None = None,
        extra_rows: tuple[int, int] = (0, 0),
    ) -> None:
        seen.append((num_seqs, k, previous_k, extra_rows))
        observe(num_seqs, k, seconds, previous_k, extra_rows)

    sched.policy.observe_step = recording  # type: ignore[method-assign]
    return seen


def test_the_steps_after_an_idle_device_are_not_timed() -> None:
    """After a pause or a gap between requests the device starts on cold caches: the
    first two steps run slower whatever k is, so their times never reach the policy. A
    wait as short as the pipeline's own between steps changes nothing, and the k of an
    untimed step still counts as the one the next step's MTP pass caught up on."""
    sched = adaptive_scheduler(2, (True,))
    seen = record_observed_steps(sched)
    waits = [0.0, 0.0, 0.004, IDLE_UNTIMED_S + 0.01, 0.0, 0.0, 0.0, 2.0, 0.003, 0.0]
    timed, drafts = [], []
    for i, idle in enumerate(waits):
        plan = sched.schedule()
        assert plan is not None
        drafts.append(plan.seqs[0].num_drafts)
        before = len(seen)
        finish_step(sched, plan, accepted=None, seconds=0.01, idle=idle)
        if len(seen) > before:
            timed.append(i)
    # Steps 3-4 and 7-8 follow an idle device (step 0 is the prefill, filed under no
    # decoding sequence).
    assert timed == [0, 1, 2, 5, 6, 9]
    assert UNTIMED_AFTER_IDLE == 2
    assert seen[3][2] == drafts[4] and seen[5][2] == drafts[8]


def test_a_steps_extra_rows_go_to_the_policy_beside_its_time() -> None:
    """The first decode step after a prefill runs the MTP layer over the whole prompt, and
    a new request's prefill rides in a decoding step: their rows reach the policy with
    the step's time (it takes their learnt cost off), counted beyond the k + 1 rows a
    decoding sequence brings, and the step is filed under its decoding sequences."""
    sched = adaptive_scheduler(2, (True,), prompt_len=12)
    observed = record_observed_steps(sched)
    mtp = MTPCatchUp(sched.policy.k_max)
    catch_up: list[int] = []
    for _ in range(4):
        plan = sched.schedule()
        assert plan is not None
        counts, rows = mtp.run(plan)
        catch_up.append(len(counts[0][1]))
        finish_step(sched, plan, accepted=None, seconds=1.0, draft_rows=rows)
    assert catch_up == [
        0,
        12,
        2,
        2,
    ]  # prefill, the prompt's catch-up, then k + 1 rows (k = 1 first)
    # The prefill has no decoding sequence; the catch-up step has 12 - 3 extra rows.
    seen = [(num_seqs, extra) for num_seqs, _, _, extra in observed]
    assert seen == [(0, (12, 0)), (1, (0, 9)), (1, (0, 0)), (1, (0, 0))]
    assert sched.policy._bucket_steps == {1: 3}  # the prefill is nobody's step
    sched.add(
        Sequence(
            NewRequest(
                seq_id=9,
                request_id="r9",
                prompt_ids=list(range(5, 15)),
                params=SamplingParams(max_tokens=200),
                eos_token_ids=[],
                speculative=True,
            )
        )
    )
    plan = sched.schedule()
    assert plan is not None
    finish_step(sched, plan, accepted=None, seconds=1.0, draft_rows=mtp.run(plan)[1])
    num_seqs, _, _, extra = observed[-1]
    assert (num_seqs, extra) == (1, (10, 0))  # one decoding sequence, and the new prompt's rows


def record_occupancy(sched: Scheduler) -> list[tuple[float, int]]:
    """What the scheduler files with its policy from now on, one entry per
    :meth:`SpecPolicy.observe_occupancy` call: (overhead slots, tokens)."""
    seen: list[tuple[float, int]] = []
    observe = sched.policy.observe_occupancy

    def recording(overhead_slots: float, tokens: int) -> None:
        seen.append((overhead_slots, tokens))
        observe(overhead_slots, tokens)

    sched.policy.observe_occupancy = recording  # type: ignore[method-assign]
    return seen


def test_slots_lost_under_a_queue_go_to_the_policy_with_every_steps_tokens() -> None:
    """While requests wait for a slot, a step's prefill works, its free slots (if
    requests still wait after it admitted) and half a step per request it finished are
    slot-steps no request decoded in; the policy gets them with the step's tokens. Once
    nobody waits they are 0, and the tokens still come."""
    sched = make(k=2, max_num_seqs=2)
    seen = record_occupancy(sched)
    for i in range(3):
        sched.add(seq(i, 4))
    plan = sched.schedule()
    assert plan is not None and len(plan.seqs) == 2 and len(sched.waiting) == 1
    finish_step(sched, plan)  # two prefills, a request still waiting
    plan = sched.schedule()
    assert plan is not None
    finish_step(sched, plan, finish={0})  # both decode; r0 finishes
    plan = sched.schedule()
    assert plan is not None and len(sched.waiting) == 0
    finish_step(sched, plan)  # r2's prefill, admitted from the queue; nobody waits after
    plan = sched.schedule()
    assert plan is not None
    finish_step(sched, plan, finish={1, 2})  # nobody waited: nothing lost
    assert seen == [(2.0, 2), (0.5, 2), (1.0, 2), (0.0, 2)]
    assert sched.policy.overhead_per_token() == pytest.approx(3.5 / 8, rel=0.05)


def test_slots_a_step_leaves_unplanned_under_a_queue_are_lost_too() -> None:
    """A token budget that admits one prompt and a chunk of the next leaves the third
    slot unplanned while two requests still wait: three slot-steps lost, one token."""
    sched = make(k=2, max_num_seqs=3, max_num_batched_tokens=9)
    seen = record_occupancy(sched)
    for i in range(4):
        sched.add(seq(i, 8))
    plan = sched.schedule()
    assert plan is not None
    assert [len(w.token_ids) for w in plan.seqs] == [8, 1] and len(sched.waiting) == 2
    finish_step(sched, plan)
    assert seen == [(3.0, 1)]


def test_the_actor_applies_each_abort_once_in_channel_order() -> None:
    """Requests and aborts reach the scheduler actor over one control channel, so an
    abort follows its request; the actor applies it once, and an abort of a request
    that already ended changes nothing."""
    from spectrio.core.messages import AbortRequest, NewRequest
    from spectrio.stages.planning.scheduler_actor import SchedulerActor

    s = make()
    actor = SchedulerActor(s)

    def new(seq_id: int) -> NewRequest:
        return NewRequest(
            seq_id=seq_id,
            request_id=f"r{seq_id}",
            prompt_ids=[1, 2, 3],
            params=SamplingParams(max_tokens=4),
            eos_token_ids=[],
            speculative=True,
        )

    actor.handle(new(1))
    actor.handle(new(2))
    assert actor.handle(AbortRequest(seq_id=2)) == Acceptance()
    assert actor.view().waiting == 1 and s.state(2) is None
    assert actor.handle(AbortRequest(seq_id=1)) == Acceptance()
    assert actor.handle(AbortRequest(seq_id=1)) is None  # once
    assert actor.handle(AbortRequest(seq_id=7)) is None  # never here: nothing happens
    p = s.schedule()
    assert p is not None and p.seqs == [] and reported(s, p, "aborted") == ["r2", "r1"]
    assert actor.view().finished == {"abort": 2} and not actor.view().has_work


def test_a_constrained_sequence_gets_every_slot_and_forced_drafts_teach_the_policy_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 60: a constrained request's grammar may force tokens, drafted at no risk, so
    it gets ``k_max`` slots whatever k the policy chose (the proposer still drafts k for
    it: the draft stage's view), and its forced drafts stay out of the acceptance and the
    step times the policy weighs k by."""
    from spectrio.core.constraints import Constraint

    s = make(k=3)
    constrained = seq(1, 5)
    constrained.params.constraint = Constraint.json_object()
    s.add(constrained)
    s.add(seq(2, 5))
    p = s.schedule()
    assert p is not None
    finish_step(s, p)
    monkeypatch.setattr(s.policy, "choose", lambda *a, **kw: 1)
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(s.policy, "observe_acceptance", lambda n, a: seen.append((n, a)))
    p = s.schedule()
    assert p is not None and p.k == 1
    assert {w.seq_id: w.num_drafts for w in p.seqs} == {1: 3, 2: 1}
    results = []
    for w in p.seqs:
        r = seq_result(w, w.num_drafts, [7] * (w.num_drafts + 1))
        if w.seq_id == 1:  # three forced drafts, all accepted
            r.num_forced = 3
        else:  # its one draft rejected
            r = seq_result(w, 0, [7])
        results.append(r)
    timed: list[object] = []
    monkeypatch.setattr(s.policy, "observe_step", lambda *a, **kw: timed.append(a))
    s.update(StepResult(step=p.step, results=results), seconds=0.01)
    assert seen == [(1, 0)]
    assert timed == []  # its rows beyond k are not k's step time
