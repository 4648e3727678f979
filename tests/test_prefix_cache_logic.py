"""Prefix caching in pure logic: the block manager's hashes, references and eviction, and
the scheduler driving a simulated device that keeps the *contents* of the KV caches.

The simulated device writes, for every target row it computes, the token of that
position into the slot the block table names, and for every MTP catch-up row the pair
(token at p, token at p + 1) that the MTP layer's KV at p depends on. Before a step runs
it checks that every position the step reads (below its ``start_pos``, and below the
MTP catch-up position) holds what a recompute would write. So a cached block that was
registered too early, shared with the wrong request, or rewritten while another request
still reads it fails the test at the read, whatever the outputs."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace
from scheduler_helpers import seq_result

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig
from spectrio.core.messages import NewRequest, SeqResult, SeqWork, StepPlan, StepResult
from spectrio.stages.device.draft import TokenHistory
from spectrio.stages.device.draft.mtp import CatchUp
from spectrio.stages.device.overlap import resolve_plan
from spectrio.stages.planning.block_manager import BlockManager, BlockManagerError, PrefixKey
from spectrio.stages.planning.scheduler import Scheduler, Sequence

STOP = 3
BS = 4


# ------------------------------------------------------------------ block manager


def test_match_register_share_and_free() -> None:
    bm = BlockManager(8, BS, enable_caching=True)
    key = PrefixKey()
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks
    assert bm.match(prompt, key, 10) == []
    bm.allocate("a", 11)
    assert bm.register("a", prompt, key, 11) == 2
    assert bm.num_cached_blocks == 2
    hit = bm.match(prompt, key, 10)
    assert hit == bm.block_table("a")[:2]
    bm.allocate("b", 11, hit)
    assert bm.block_table("b")[:2] == hit
    assert [bm.ref_count(b) for b in hit] == [2, 2]
    bm.check_invariants()
    bm.free("a")
    assert [bm.ref_count(b) for b in hit] == [1, 1]  # b still holds them
    bm.check_invariants()
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_evictable_blocks == 2
    assert bm.match(prompt, key, 10) == hit  # still cached after the last user let go
    bm.check_invariants()


def test_max_tokens_caps_the_hit_to_whole_blocks() -> None:
    bm = BlockManager(8, BS, enable_caching=True)
    prompt = list(range(12))
    bm.allocate("a", 12)
    bm.register("a", prompt, PrefixKey(), 12)
    assert len(bm.match(prompt, PrefixKey(), 11)) == 2  # the last token is always computed
    assert len(bm.match(prompt, PrefixKey(), 12)) == 3
    assert len(bm.match(prompt[:9] + [99, 98, 97], PrefixKey(), 11)) == 2
    assert len(bm.match([99] + prompt[1:], PrefixKey(), 11)) == 0  # chained: a changed head misses


def test_salts_and_lookahead_never_share() -> None:
    bm = BlockManager(16, BS, enable_caching=True)
    prompt = list(range(13))
    bm.allocate("a", 13)
    bm.register("a", prompt, PrefixKey("tenant-a"), 13)
    assert bm.match(prompt, PrefixKey("tenant-b"), 12) == []
    assert bm.match(prompt, PrefixKey(""), 12) == []
    assert bm.match(prompt, PrefixKey("tenant-a", lookahead=1), 12) == []
    assert len(bm.match(prompt, PrefixKey("tenant-a"), 12)) == 3


def test_lookahead_block_depends_on_the_next_token() -> None:
    """The MTP layer's KV at a block's last position reads the next token: a block is
    registered only when that token is known, and matches only the same one."""
    bm = BlockManager(16, BS, enable_caching=True)
    key = PrefixKey(lookahead=1)
    prompt = list(range(8))  # 2 full blocks, but the second has no next token
    bm.allocate("a", 8)
    assert bm.register("a", prompt, key, 8) == 1
    assert len(bm.match(prompt + [50, 51], key, 9)) == 1
    bm.allocate("b", 9)
    bm.register("b", prompt + [50], key, 9)
    assert len(bm.match(prompt + [50, 51], key, 9)) == 2
    assert len(bm.match(prompt + [60, 51], key, 9)) == 1


def test_eviction_is_lru_and_only_when_needed() -> None:
    bm = BlockManager(4, BS, enable_caching=True)
    key = PrefixKey()
    a, b = list(range(100, 108)), list(range(200, 208))
    bm.allocate("a", 8)
    bm.register("a", a, key, 8)
    bm.free("a")
    bm.allocate("b", 8)
    bm.register("b", b, key, 8)
    bm.free("b")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4
    assert bm.stats.evictions == 0
    bm.allocate("c", 4)  # no free block: the least recently released goes (a's tail)
    assert bm.stats.evictions == 1
    assert len(bm.match(a, key, 8)) == 1 and len(bm.match(b, key, 8)) == 2
    bm.check_invariants()
    hit = bm.match(b, key, 8)
    bm.allocate("d", 9, hit)  # reviving b's blocks takes them off the evictable list
    assert bm.stats.evictions == 2
    assert bm.match(a, key, 8) == []
    bm.check_invariants()


def test_twin_blocks_stay_private() -> None:
    bm = BlockManager(8, BS, enable_caching=True)
    prompt = list(range(9))
    bm.allocate("a", 9)
    bm.allocate("b", 9)
    assert bm.register("a", prompt, PrefixKey(), 9) == 2
    assert bm.register("b", prompt, PrefixKey(), 9) == 0  # computed at the same time
    bm.free("b")
    assert bm.num_evictable_blocks == 0 and bm.num_free_blocks == 5
    bm.check_invariants()


def test_prefix_needs_available_blocks_and_a_new_sequence() -> None:
    bm = BlockManager(3, BS, enable_caching=True)
    prompt = list(range(9))
    bm.allocate("a", 9)
    bm.register("a", prompt, PrefixKey(), 9)
    bm.free("a")
    hit = bm.match(prompt, PrefixKey(), 8)
    assert bm.can_allocate("b", 12, hit)  # 2 shared + 1 more: a's third block, evicted
    assert not bm.can_allocate("b", 13, hit)
    bm.allocate("b", 12, hit)
    with pytest.raises(ValueError):
        bm.allocate("b", 12, hit)
    bm.check_invariants()


def test_caching_off_matches_nothing() -> None:
    bm = BlockManager(4, BS)
    bm.allocate("a", 8)
    assert bm.register("a", list(range(8)), PrefixKey(), 8) == 0
    assert bm.match(list(range(8)), PrefixKey(), 8) == []
    bm.free("a")
    assert bm.num_cached_blocks == 0


def test_invariants_catch_a_freed_shared_block() -> None:
    bm = BlockManager(4, BS, enable_caching=True)
    bm.allocate("a", 4)
    bm.register("a", [1, 2, 3, 4], PrefixKey(), 4)
    bm.allocate("b", 5, bm.match([1, 2, 3, 4, 5], PrefixKey(), 4))
    bm._refs[0] = 1  # as if a free had released a block b still lists
    with pytest.raises(BlockManagerError, match="reference count"):
        bm.check_invariants()


# ------------------------------------------------- scheduler + simulated device


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def token_at(rid: str, n: int) -> int:
    return 4 + _h("tok", rid, n) % 50 if _h("stop", rid, n) % 29 else STOP


def _slots(table: list[int]) -> Callable[[int], int]:
    return lambda p: table[p // BS] * BS + p % BS


class Device:
    """Runs resolved plans in order and keeps the KV caches' contents (see module doc)."""

    def __init__(self, num_blocks: int, mtp: bool) -> None:
        self.target: dict[int, object] = {}
        self.draft: dict[int, object] = {}
        self.mtp = mtp
        self.history = TokenHistory()
        self.catch_up = CatchUp()
        self.reads = 0
        del num_blocks

    def step(self, plan: StepPlan) -> StepResult:
        self.history.release(plan.released)
        self.catch_up.release(plan.released)
        everyone = replace(plan, seqs=[replace(w, speculative=True) for w in plan.seqs])
        self.history.fold(everyone)
        drafted = []
        results: list[SeqResult] = []
        for w in plan.seqs:
            assert not w.pending
            toks = self.history.tokens(w.seq_id)
            slot = _slots(w.block_table)
            for p in range(w.start_pos):  # what the target's attention reads
                assert self.target.get(slot(p)) == toks[p], (w.request_id, p)
                self.reads += 1
            acc = _h("acc", w.request_id, w.num_output) % (w.num_drafts + 1) if w.sample else 0
            true = [token_at(w.request_id, w.num_output + i) for i in range(w.num_drafts)]
            drafts = [t if i < acc else 999 for i, t in enumerate(true)]
            # A decode step catches up before verify; one that drafts nothing defers it
            # as the MTP proposer does (a lag of 4 at most). A prompt chunk is caught up
            # after its verify, to its last row. Registered prompt blocks must carry real
            # MTP KV regardless.
            if self.mtp and w.speculative and w.decodes and not self.catch_up.may_defer(w, 4):
                self._catch_up(w, w.start_pos, toks, slot)
                for i in range(len(drafts)):  # substeps: speculative entries
                    self.draft[slot(w.start_pos + i)] = ("spec", i)
            rows = list(w.token_ids) + (drafts if w.sample else [])
            for i, t in enumerate(rows):
                self.target[slot(w.start_pos + i)] = t
            if self.mtp and w.speculative and not w.decodes:
                self._catch_up(w, w.start_pos + len(w.token_ids) - 1, toks, slot)
            drafted.append(replace(w, drafts=drafts if w.sample else []))
            if not w.sample:
                results.append(seq_result(w, 0, []))
                continue
            run = [token_at(w.request_id, w.num_output + i) for i in range(acc + 1)]
            finish, cut = None, len(run)
            for i, t in enumerate(run):
                if t == STOP:
                    cut, finish = i + 1, "stop"
                    break
            if finish is None and cut >= w.max_new_tokens:
                cut, finish = w.max_new_tokens, "length"
            results.append(seq_result(w, acc, run[:cut], finish))
        self.history.drafted(replace(everyone, seqs=drafted))
        return StepResult(step=plan.step, results=results)

    def _catch_up(self, w: SeqWork, end: int, toks: list[int], slot: Callable[[int], int]) -> None:
        """Real MTP KV for positions up to ``end``, after checking what it reads."""
        first, nxt = self.catch_up.advance(w.seq_id, end, toks, len(w.cached_ids))
        for p in range(first):  # the MTP layer's attention
            assert self.draft.get(slot(p)) == (toks[p], toks[p + 1]), (w.request_id, p)
        for i, p in enumerate(range(first, end)):
            self.draft[slot(p)] = (toks[p], nxt[i])


PREFIXES = [[10 + (7 * i + j) % 37 for j in range(9 + 5 * i)] for i in range(3)]


def make(k: int, method: str, blocks: int, in_flight: int, caching: bool) -> Scheduler:
    spec = (
        SpeculativeConfig(method=None)
        if k == 0
        else SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=False)
    )
    cfg = RuntimeConfig(
        max_num_seqs=4,
        max_num_batched_tokens=24,
        max_model_len=64,
        block_size=BS,
        num_kv_blocks=blocks,
        speculative=spec,
        enable_prefix_caching=caching,
    )
    sched = Scheduler(
        cfg, BlockManager(blocks, BS, enable_caching=caching), max_in_flight=in_flight
    )
    if k > 0:  # stretches of k = 0, whose steps defer the MTP catch-up (Device.step)
        pattern = itertools.cycle([k, 0, 0, 0, k, 0, k, k, 0, 0])
        sched.policy.choose = lambda num_seqs, closing=None: next(pattern)  # type: ignore[method-assign]
    return sched


Arrival = tuple[int, int, int, int, bool]  # (step, prefix, suffix seed, salt, speculative)


def simulate(
    k: int,
    method: str,
    blocks: int,
    in_flight: int,
    caching: bool,
    arrivals: list[Arrival],
    aborts: dict[int, int],
) -> dict[str, object]:
    """Requests arrive after the step numbers ``arrivals`` give (prompt: one of
    :data:`PREFIXES` + a short suffix), ``aborts`` maps a step to a request index aborted
    after it is planned. Checks invariants after every plan and fold."""
    s = make(k, method, blocks, in_flight, caching)
    dev = Device(blocks, mtp=method == "mtp" and k > 0)
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    queue: list[StepPlan] = []
    prev: tuple[StepPlan, StepResult] | None = None
    out: dict[str, list[int]] = {}
    ends: dict[str, list[str]] = {}
    limits: dict[str, int] = {}
    planned = 0
    for _ in range(3000):
        while pending and pending[0][1][0] <= planned:
            i, (_, prefix, seed, salt, spec) = pending.pop(0)
            rid = f"r{i}"
            suffix = [40 + (seed * 3 + j) % 9 for j in range(1 + seed % 5)]
            limits[rid] = 6 + seed % 17
            out[rid], ends[rid] = [], []
            s.add(
                Sequence(
                    NewRequest(
                        seq_id=i + 1,
                        request_id=rid,
                        prompt_ids=PREFIXES[prefix] + suffix,
                        params=SamplingParams(max_tokens=limits[rid]),
                        eos_token_ids=[STOP],
                        speculative=spec and k > 0,
                        cache_salt=f"t{salt}",
                    )
                )
            )
        while s.can_schedule():
            plan = s.schedule()
            if plan is None:
                break
            planned += 1
            queue.append(plan)
            s.blocks.check_invariants()
            if plan.step in aborts:
                seq = s.abort(aborts[plan.step] + 1)
                if seq is not None:
                    ends[seq.request_id].append("abort")
                s.blocks.check_invariants()
        if not queue:
            if pending:
                planned = pending[0][1][0]
                continue
            break
        template = queue.pop(0)
        plan = resolve_plan(template, *(prev or (None, None)))
        result = dev.step(plan)
        prev = (plan, result)
        for r in s.update(result).results:
            out[r.request_id] += r.token_ids
            if r.finish_reason:
                ends[r.request_id].append(r.finish_reason)
        s.blocks.check_invariants()
    assert not s.has_work() and s.num_in_flight == 0 and not pending
    bm = s.blocks
    assert bm.num_used_blocks == 0
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    for rid, got in ends.items():
        assert len(got) == 1, (rid, got)
    return {
        "out": out,
        "ends": ends,
        "limits": limits,
        "preemptions": s.num_preemptions,
        "hits": bm.stats.hits,
        "reads": dev.reads,
    }


def expected(rid: str, limit: int) -> list[int]:
    toks: list[int] = []
    while len(toks) < limit:
        toks.append(token_at(rid, len(toks)))
        if toks[-1] == STOP:
            break
    return toks


def check_outputs(got: dict[str, object]) -> None:
    for rid, toks in got["out"].items():  # type: ignore[attr-defined]
        want = expected(rid, got["limits"][rid])  # type: ignore[index]
        if got["ends"][rid] == ["abort"]:  # type: ignore[index]
            assert toks == want[: len(toks)]
        else:
            assert toks == want, rid


STAGGERED: list[Arrival] = [(2 * i, i % 3, i, 0, True) for i in range(12)]


@pytest.mark.parametrize("k,method", [(0, "mtp"), (2, "mtp"), (2, "ngram")])
@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("blocks", [200, 17])
def test_cache_on_equals_cache_off(k: int, method: str, in_flight: int, blocks: int) -> None:
    on = simulate(k, method, blocks, in_flight, True, STAGGERED, {})
    off = simulate(k, method, blocks, in_flight, False, STAGGERED, {})
    assert on["out"] == off["out"]
    check_outputs(on)
    assert on["hits"] > 0 and off["hits"] == 0
    if blocks == 22:
        assert on["preemptions"] and off["preemptions"]


def test_aborts_in_the_middle_of_a_shared_prefix() -> None:
    got = simulate(2, "mtp", 200, 2, True, STAGGERED, {3: 0, 5: 1, 6: 3, 9: 4})
    check_outputs(got)
    assert [got["ends"][f"r{i}"] for i in (0, 1)] == [["abort"]] * 2  # type: ignore[index]
    assert got["hits"] > 0


def test_different_salts_never_hit() -> None:
    arrivals: list[Arrival] = [(3 * i, 0, i, i, True) for i in range(5)]
    got = simulate(2, "mtp", 200, 1, True, arrivals, {})
    assert got["hits"] == 0
    same: list[Arrival] = [(3 * i, 0, i, 7, True) for i in range(5)]
    assert simulate(2, "mtp", 200, 1, True, same, {})["hits"] > 0


_arrival = st.tuples(
    st.integers(0, 30), st.integers(0, 2), st.integers(0, 50), st.integers(0, 1), st.booleans()
)


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(_arrival, min_size=1, max_size=12),
    aborts=st.dictionaries(st.integers(1, 60), st.integers(0, 11), max_size=4),
    k=st.sampled_from([0, 2]),
    method=st.sampled_from(["mtp", "ngram"]),
    in_flight=st.sampled_from([1, 2]),
    blocks=st.sampled_from([17, 24, 200]),
)
def test_random_interleavings(
    arrivals: list[Arrival],
    aborts: dict[int, int],
    k: int,
    method: str,
    in_flight: int,
    blocks: int,
) -> None:
    on = simulate(k, method, blocks, in_flight, True, arrivals, aborts)
    check_outputs(on)
    if not aborts:
        off = simulate(k, method, blocks, in_flight, False, arrivals, aborts)
        assert on["out"] == off["out"]


@pytest.mark.parametrize("k,method", [(0, "mtp"), (2, "mtp"), (2, "ngram")])
def test_requests_arriving_together_wait_for_the_prefix_instead_of_recomputing_it(
    k: int, method: str
) -> None:
    """Four requests over one 24-token prefix arrive at once: the first computes it, the
    others wait for its blocks (promised at its admission) and then hit all of them."""
    arrivals: list[Arrival] = [(0, 2, i, 0, True) for i in range(4)]
    got = simulate(k, method, 200, 2, True, arrivals, {})
    check_outputs(got)
    prompt_blocks = len(PREFIXES[2]) // BS  # every suffix is at least one token long
    assert got["hits"] >= 3 * prompt_blocks * BS  # (two suffixes share a first token)


def test_a_promise_ends_with_its_sequence() -> None:
    bm = BlockManager(8, BS, enable_caching=True)
    prompt = list(range(13))
    bm.allocate("a", 13)
    assert bm.promise("a", prompt, PrefixKey(), 13) == 3
    assert bm.lookup(prompt, PrefixKey(), 12) == ([], 3)
    assert bm.lookup(prompt, PrefixKey("other"), 12) == ([], 0)
    bm.register("a", prompt, PrefixKey(), 8)
    hit, promised = bm.lookup(prompt, PrefixKey(), 12)
    assert len(hit) == 2 and promised == 1
    bm.check_invariants()
    bm.free("a")  # finished before its last block's KV was final: the promise goes
    assert bm.lookup(prompt, PrefixKey(), 12) == (hit, 0)
    bm.check_invariants()


# ---------------------------- prompts whose requests end at once (issue 59, item 2)


def _seq(i: int, prompt: list[int], max_tokens: int, spec: bool) -> Sequence:
    return Sequence(
        NewRequest(
            seq_id=i + 1,
            request_id=f"r{i}",
            prompt_ids=prompt,
            params=SamplingParams(max_tokens=max_tokens),
            eos_token_ids=[STOP],
            speculative=spec,
        )
    )


def _drain(
    s: Scheduler,
    dev: Device,
    after_plan: Callable[[StepPlan], None] | None = None,
    after_fold: Callable[[int, StepResult], None] | None = None,
) -> int:
    """Plan and fold until the scheduler is idle (``after_plan`` sees each plan as it is
    made, before any later fold; ``after_fold`` each step's number, from 1, and what it
    published); returns the steps run."""
    queue: list[StepPlan] = []
    prev: tuple[StepPlan, StepResult] | None = None
    steps = 0
    while s.has_work() or queue:
        while s.can_schedule():
            plan = s.schedule()
            if plan is None:
                break
            queue.append(plan)
            if after_plan is not None:
                after_plan(plan)
            s.blocks.check_invariants()
        if not queue:
            break
        plan = resolve_plan(queue.pop(0), *(prev or (None, None)))
        result = dev.step(plan)
        prev = (plan, result)
        published = s.update(result)
        steps += 1
        if after_fold is not None:
            after_fold(steps, published)
        s.blocks.check_invariants()
    return steps


def _registered_blocks(prompt: list[int], mtp: bool) -> int:
    """Full prompt blocks a request registers by its first token: with MTP KV, a block
    needs the token after its last position, so the prompt's last position's block
    waits for the sampled token."""
    return (len(prompt) - 1) // BS if mtp else len(prompt) // BS


ENDING_AT_ONCE = [(0, "mtp", 1), (2, "mtp", 1), (2, "mtp", 2), (2, "ngram", 2)]


@pytest.mark.parametrize("k,method,in_flight", ENDING_AT_ONCE)
def test_a_request_ending_at_its_first_token_registers_its_prompt_blocks(
    k: int, method: str, in_flight: int
) -> None:
    """``max_tokens=1``: the request ends in its prefill step. Its prompt blocks, MTP KV
    included, were written in that step, so they are registered, and the next request
    over the same prompt hits them."""
    mtp = method == "mtp" and k > 0
    s = make(k, method, 200, in_flight, True)
    dev = Device(200, mtp=mtp)
    prompt = PREFIXES[2] + [41, 42]  # 21 tokens: 5 full blocks
    s.add(_seq(0, prompt, 1, k > 0))
    _drain(s, dev)
    assert s.blocks.num_cached_blocks == _registered_blocks(prompt, mtp) > 0
    s.add(_seq(1, prompt, 4, k > 0))
    _drain(s, dev)  # the simulated device checks every cached position it reads
    assert s.blocks.stats.hits == _registered_blocks(prompt, mtp) * BS
    assert s.blocks.num_used_blocks == 0


@pytest.mark.parametrize("k,method,in_flight", ENDING_AT_ONCE)
def test_a_request_aborted_with_its_prefill_in_flight_registers_what_the_step_wrote(
    k: int, method: str, in_flight: int
) -> None:
    """Aborted right after its (one-chunk) prefill is planned: its blocks stay held until
    that step is folded in, then what the step wrote is registered and the blocks are
    released to the cache."""
    mtp = method == "mtp" and k > 0
    s = make(k, method, 200, in_flight, True)
    dev = Device(200, mtp=mtp)
    prompt = PREFIXES[2] + [41, 42]
    s.add(_seq(0, prompt, 8, k > 0))
    held: list[int] = []

    def abort_it(plan: StepPlan) -> None:
        if plan.step == 1:
            assert s.abort(1) is not None
            held.append(s.blocks.num_used_blocks)

    _drain(s, dev, abort_it)
    assert held and held[0] >= -(-len(prompt) // BS)  # held until the step returns
    assert s.blocks.num_used_blocks == 0
    assert s.blocks.num_cached_blocks == _registered_blocks(prompt, mtp) > 0
    assert s.state(1) is None and s.finished_by_reason == {"abort": 1}


@pytest.mark.parametrize("k,method,in_flight", ENDING_AT_ONCE)
def test_requests_closed_after_their_first_token_share_a_prefix_warmed_by_max_tokens_1(
    k: int, method: str, in_flight: int
) -> None:
    """The issue's case in logic: a shared prefix is warmed by a request with
    ``max_tokens=1``, then 8 requests over it arrive at once, and each is aborted as soon
    as its first token is folded in (a client that closes its stream). Every one hits the
    whole warmed prefix, and none waits on another's promise."""
    mtp = method == "mtp" and k > 0
    s = make(k, method, 200, in_flight, True)
    dev = Device(200, mtp=mtp)
    prefix = PREFIXES[2] + [41]  # 20 tokens: 5 full blocks
    s.add(_seq(0, prefix + [44], 1, k > 0))
    _drain(s, dev)
    warmed = s.blocks.num_cached_blocks
    assert warmed == len(prefix) // BS
    for i in range(1, 9):
        s.add(_seq(i, prefix + [45 + i, 46], 8, k > 0))
    first_token_at: dict[int, int] = {}

    def close_at_first_token(step: int, published: StepResult) -> None:
        for r in published.results:
            if r.token_ids and r.seq_id not in first_token_at:
                first_token_at[r.seq_id] = step
                if r.finish_reason is None:
                    s.abort(r.seq_id)  # the client closes after its first token

    _drain(s, dev, after_fold=close_at_first_token)
    assert sorted(first_token_at) == list(range(2, 10))
    # every request hit the whole shared prefix (with MTP KV, a block whose last
    # position's next token is a request's own suffix is not shared)
    assert s.blocks.stats.hits == 8 * _registered_blocks(prefix, mtp) * BS
    # max_num_seqs (4) at a time, each a 2-3 token prefill: two rounds of admission,
    # not one request at a time behind another's promise
    assert max(first_token_at.values()) <= 4 * in_flight
    assert s.blocks.num_used_blocks == 0
