"""Overlap scheduling in pure logic: the scheduler plans step N+1 while N is in flight,
the device worker resolves N+1's pending work from N's result (stages/device/overlap.py).

A deterministic simulated device stands in for the model: the token at output position
``n`` of request ``r`` is a function of ``(r, n)`` (as sample-then-match makes it for the
real sampler), and how many drafts a step accepts is a keyed hash. Whatever the batching,
each request's output must be the same with one step in flight and with two, every
request must end exactly once, and every block must come back."""

from __future__ import annotations

import hashlib

import pytest
from msgspec.structs import replace
from scheduler_helpers import seq_result

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig
from spectrio.core.messages import NewRequest, SeqResult, StepPlan, StepResult
from spectrio.stages.device.overlap import resolve_plan
from spectrio.stages.planning.block_manager import BlockManager
from spectrio.stages.planning.scheduler import Scheduler, Sequence

STOP = 3


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def token_at(rid: str, n: int) -> int:
    return 4 + _h("tok", rid, n) % 50 if _h("stop", rid, n) % 23 else STOP


def device_step(plan: StepPlan) -> StepResult:
    """What the real device program returns for a resolved plan."""
    results = []
    for w in plan.seqs:
        assert not w.pending
        if not w.sample:
            results.append(
                SeqResult(
                    slot=w.slot,
                    seq_id=w.seq_id,
                    request_id=w.request_id,
                    num_drafts=0,
                    num_accepted=0,
                    token_ids=[],
                    num_computed=w.start_pos + len(w.token_ids),
                    context_len=w.context_len,
                )
            )
            continue
        accepted = _h("acc", w.request_id, w.num_output) % (w.num_drafts + 1)
        run = [token_at(w.request_id, w.num_output + i) for i in range(accepted + 1)]
        finish = None
        cut = len(run)
        for i, t in enumerate(run):
            if t == STOP:
                cut, finish = i + 1, "stop"
                break
        if finish is None and cut >= w.max_new_tokens:
            cut, finish = w.max_new_tokens, "length"
        results.append(seq_result(w, accepted, run[:cut], finish))
    return StepResult(step=plan.step, results=results)


def make(k: int, blocks: int, in_flight: int) -> Scheduler:
    cfg = RuntimeConfig(
        max_num_seqs=6,
        max_num_batched_tokens=40,
        max_model_len=96,
        block_size=4,
        num_kv_blocks=blocks,
        speculative=SpeculativeConfig(num_speculative_tokens=k, adaptive=False)
        if k
        else SpeculativeConfig(method=None),
    )
    return Scheduler(cfg, BlockManager(blocks, 4), max_in_flight=in_flight)


def run(k: int, blocks: int, in_flight: int, abort_at: dict[int, int]) -> dict[str, object]:
    """Drive the scheduler like the actor does: plan while fewer than ``in_flight`` steps
    are out, the device resolves and runs them in order. ``abort_at`` maps a step number
    to a request index aborted right after that step is planned."""
    s = make(k, blocks, in_flight)
    for i in range(10):
        s.add(
            Sequence(
                NewRequest(
                    seq_id=i + 1,
                    request_id=f"r{i}",
                    prompt_ids=[1 + (i * 7 + j) % 40 for j in range(5 + 3 * i)],
                    params=SamplingParams(max_tokens=8 + 3 * i),
                    eos_token_ids=[STOP],
                    speculative=k > 0,
                )
            )
        )
    queue: list[StepPlan] = []
    prev: tuple[StepPlan, StepResult] | None = None
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(10)}
    ends: dict[str, list[str]] = {f"r{i}": [] for i in range(10)}
    for _ in range(2000):
        while s.can_schedule():
            plan = s.schedule()
            if plan is None:
                break
            queue.append(plan)
            if plan.step in abort_at:
                seq = s.abort(abort_at[plan.step] + 1)
                if seq is not None:
                    ends[seq.request_id].append("abort")
        if not queue:
            break
        template = queue.pop(0)
        plan = resolve_plan(template, *(prev or (None, None)))
        result = device_step(plan)
        prev = (plan, result)
        published = s.update(result)
        for r in published.results:
            out[r.request_id] += r.token_ids
            if r.finish_reason:
                ends[r.request_id].append(r.finish_reason)
    assert not s.has_work() and s.num_in_flight == 0
    assert s.blocks.num_used_blocks == 0
    return {"out": out, "ends": ends, "preemptions": s.num_preemptions}


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("blocks", [200, 30])
def test_two_steps_in_flight_give_the_same_output(k: int, blocks: int) -> None:
    one = run(k, blocks, 1, {})
    two = run(k, blocks, 2, {})
    assert one["out"] == two["out"]
    for name, got in two["ends"].items():  # type: ignore[union-attr]
        assert len(got) == 1, (name, got)
    expected = {}
    for i in range(10):
        rid, toks = f"r{i}", []
        while len(toks) < 8 + 3 * i:
            toks.append(token_at(rid, len(toks)))
            if toks[-1] == STOP:
                break
        expected[rid] = toks
    assert two["out"] == expected
    if blocks == 30:
        assert one["preemptions"] and two["preemptions"]


@pytest.mark.parametrize("k", [0, 2])
def test_aborts_mid_flight_end_once_and_free_their_blocks(k: int) -> None:
    got = run(k, 60, 2, {3: 0, 4: 1, 6: 2, 9: 5})
    for name, ends in got["ends"].items():  # type: ignore[union-attr]
        assert len(ends) == 1, (name, ends)
    for i in (0, 1, 2, 5):
        assert got["ends"][f"r{i}"] == ["abort"]  # type: ignore[index]


def test_pending_work_resolves_to_the_plan_made_after_the_result() -> None:
    """Step N+1 planned ahead and resolved equals step N+1 planned after N returned."""
    ahead, after = make(2, 200, 2), make(2, 200, 1)
    rid = next(
        r for r in (f"a{i}" for i in range(100)) if STOP not in [token_at(r, n) for n in range(12)]
    )
    for s in (ahead, after):
        s.add(
            Sequence(
                NewRequest(
                    seq_id=1,
                    request_id=rid,
                    prompt_ids=[5, 6, 7],
                    params=SamplingParams(max_tokens=20),
                    eos_token_ids=[STOP],
                    speculative=True,
                )
            )
        )
    for s in (ahead, after):  # prefill, then one decode step
        p = s.schedule()
        assert p is not None
        s.update(device_step(p))
    n = ahead.schedule()
    assert n is not None
    template = ahead.schedule()  # planned while n is in flight
    assert template is not None and template.seqs[0].pending
    result = device_step(n)
    ahead.update(result)
    resolved = resolve_plan(template, n, result)
    n2 = after.schedule()
    assert n2 is not None
    after.update(device_step(n2))
    expected = after.schedule()
    assert expected is not None
    strip = {"block_table": [], "pending": False}
    assert replace(resolved.seqs[0], **strip) == replace(expected.seqs[0], **strip)
