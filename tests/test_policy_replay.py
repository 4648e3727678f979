"""The policy replay: exact arithmetic on hand-made records, the real policy on them, and
a recording from the bundled model through the runtime's public deltas."""

from __future__ import annotations

import json

import pytest
import trio
from policy_replay import (
    Tape,
    Trace,
    acceptance_draws,
    fixed_clock,
    main,
    record,
    record_tape,
    replay_batch,
    replay_fixed,
    replay_policy,
)

from spectrio.stages.planning.spec_policy import SpecPolicy
from spectrio.tools.measurement.bench import bench_prompts

TIMES = [0.0041, 0.0056, 0.0069, 0.0075]  # batch 1, 2-core CPU, k = 0..3


def test_fixed_k_counts_the_drafts_a_smaller_k_would_have_kept() -> None:
    trace: Trace = [[(3, 3), (3, 0), (3, 2)], [(2, 1), (0, 0)]]  # trimmed at the end
    # k = 1: 2 + 1 + 2 + 2 + 1 tokens in 4 steps of k = 1 and one of k = 0;
    # k = 3: 4 + 1 + 3 + 2 + 1 in three of k = 3, one of 2 and one of 0.
    assert replay_fixed(trace, TIMES, 1) == pytest.approx(8 / (4 * TIMES[1] + TIMES[0]))
    assert replay_fixed(trace, TIMES, 3) == pytest.approx(11 / (3 * TIMES[3] + TIMES[2] + TIMES[0]))
    assert replay_fixed(trace, TIMES, 0) == pytest.approx(1 / TIMES[0])


def test_the_policy_finds_the_best_k_of_steady_records() -> None:
    """All drafts accepted: k = 3 is best by far at these times, and the policy, which
    explores k = 2 and probes it one step in 16, ends close to it."""
    trace: Trace = [[(3, 3)] * 60 for _ in range(4)]
    best = replay_fixed(trace, TIMES, 3)
    assert best > max(replay_fixed(trace, TIMES, k) for k in range(3))
    assert replay_policy(trace, TIMES, SpecPolicy(3)) >= 0.95 * best


def test_a_stretch_of_single_acceptances_favours_k_1_while_it_lasts() -> None:
    """One request accepts exactly one draft a step: k = 1 is best on it, and the policy
    goes there (it beats fixed k = 3 on that record)."""
    trace: Trace = [[(3, 1)] * 80]
    assert replay_fixed(trace, TIMES, 1) > replay_fixed(trace, TIMES, 3)
    assert replay_policy(trace, TIMES, SpecPolicy(3)) > replay_fixed(trace, TIMES, 3)


def test_record_keeps_every_decode_step_of_the_bundled_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two requests of 12 tokens at k = 2: the prefill emits the first token, every later
    token comes from a recorded decode step, so fixed k = 2 replays exactly 11 a request."""

    async def run() -> Trace:
        with trio.fail_after(120):
            return await record("bundled", bench_prompts(2, 16, "bundled"), 2, 12)

    trace = trio.run(run)
    assert len(trace) == 2
    for steps in trace:
        assert steps and all(0 <= a <= d <= 2 for d, a in steps) and steps[0][0] == 2
        assert sum(min(a, d) + 1 for d, a in steps) == 11
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"k": 2, "requests": trace}))
    main(["--trace", str(path), "--times", "4.1,5.6,6.9"])
    with pytest.raises(SystemExit):
        main(["--trace", str(path), "--times", "4.1,5.6"])  # k = 0..2 needs three


def test_a_tape_gives_each_step_the_nearest_recorded_time_of_its_k() -> None:
    tape = Tape([0, 1, 2, 1, 0, 2], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert tape.k_max == 2 and len(tape) == 6
    assert tape.time(0, 0) == 0.1 and tape.time(3, 0) == 0.5  # 4 is nearer than 0
    assert tape.time(2, 1) == 0.4  # a tie between positions 1 and 3 goes to the later one
    assert tape.time(4, 1) == 0.4 and tape.time(5, 1) == 0.2  # 5: 3 and 1 (wrapped) tie
    assert tape.time(0, 2) == 0.6  # wraps: 5 is next to 0
    assert tape.time(6 + 2, 2) == 0.3 and tape.clock(3)(1, 0) == 0.5
    with pytest.raises(KeyError):
        tape.time(0, 3)
    with pytest.raises(ValueError):
        Tape([0, 1], [0.1])


def test_replay_on_a_tape_meets_the_same_noise_for_every_k() -> None:
    """A slow stretch in the middle of the tape slows fixed k and the policy alike."""
    ks = [k for _ in range(100) for k in range(4)]
    slow = [3.0 if 120 <= i < 240 else 1.0 for i in range(len(ks))]
    tape = Tape(ks, [TIMES[k] * f for k, f in zip(ks, slow, strict=True)])
    trace: Trace = [[(3, 3)] * 60 for _ in range(2)]
    quiet, busy = tape.clock(300), tape.clock(100)
    assert replay_fixed(trace, quiet, 3) == pytest.approx(replay_fixed(trace, TIMES, 3))
    assert replay_fixed(trace, busy, 3) < 0.8 * replay_fixed(trace, quiet, 3)
    assert replay_policy(trace, busy, SpecPolicy(3)) >= 0.9 * replay_fixed(trace, busy, 3)


def test_record_tape_from_the_bundled_model_and_replay_on_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    async def run() -> Tape:
        with trio.fail_after(120):
            return await record_tape("bundled", bench_prompts(2, 16, "bundled"), 2, 24, 12)

    tape = trio.run(run)
    assert len(tape) == 24 and set(tape.ks) == {0, 1, 2}
    assert all(0 < s < 1.0 for s in tape.seconds)
    path, acc = tmp_path / "tape.json", tmp_path / "acc.json"
    path.write_text(json.dumps({"k": tape.ks, "seconds": tape.seconds}))
    acc.write_text(json.dumps({"k": 2, "requests": [[(2, 2), (2, 1), (2, 0)] * 5] * 3}))
    main(["--trace", str(acc), "--tape", str(path), "--offsets", "3", "--run-requests", "1"])
    with pytest.raises(SystemExit):
        main(["--trace", str(acc)])  # neither --times nor --tape


def test_replay_at_a_batch_gives_each_sequence_its_leading_accepted_drafts() -> None:
    clock = fixed_clock(TIMES)
    # Two steps of two sequences; position 2 rejected for the first sequence of step 0.
    accepts = [[[True, False, True], [True, True, True]], [[False, True, True]] * 2]
    # k = 3: step 0 gives 2 + 4 tokens, step 1 gives 1 + 1.
    assert replay_batch(clock, SpecPolicy(3, adaptive=False), accepts) == pytest.approx(
        8 / (2 * TIMES[3])
    )
    assert replay_batch(clock, SpecPolicy(1, adaptive=False), accepts) == pytest.approx(
        6 / (2 * TIMES[1])
    )
    draws = acceptance_draws([0.9, 0.5], batch=3, steps=400, seed=1)
    assert draws == acceptance_draws([0.9, 0.5], batch=3, steps=400, seed=1)
    assert len(draws) == 400 and all(len(step) == 3 for step in draws)
    share = [sum(row[i] for step in draws for row in step) / 1200 for i in range(2)]
    assert share[0] == pytest.approx(0.9, abs=0.03) and share[1] == pytest.approx(0.5, abs=0.05)


def test_acceptance_replay_on_a_batch_tape(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A tape whose machine is 40% slower for a stretch: the policy and every fixed k meet
    the stretch alike, and the report has a line per k and one for the policy."""
    ks = [k for _ in range(120) for k in (2, 0, 3, 1)]
    slow = [1.4 if 100 <= i < 220 else 1.0 for i in range(len(ks))]
    path = tmp_path / "tape.json"
    seconds = [TIMES[k] * f for k, f in zip(ks, slow, strict=True)]
    path.write_text(json.dumps({"k": ks, "seconds": seconds, "batch": 4}))
    args = ["--tape", str(path), "--acceptance", "0.9,0.8,0.7", "--run-steps", "60"]
    main([*args, "--offsets", "3", "--seeds", "2"])
    out = capsys.readouterr().out
    assert "batch 4, 6 runs of 60 steps" in out and out.count(" of the best") == 5
    for bad in (["--acceptance", "0.9"], [*args[:2], "--acceptance", "0.9,0.8,0.7,0.6"]):
        with pytest.raises(SystemExit):
            main(bad)  # no tape; a k the tape never ran
    with pytest.raises(SystemExit):
        main([*args[:2], "--acceptance", "0.9,1.5"])


def test_record_tape_runs_at_a_batch() -> None:
    async def run() -> Tape:
        with trio.fail_after(120):
            return await record_tape("bundled", bench_prompts(3, 16, "bundled"), 2, 16, 10, batch=2)

    tape = trio.run(run)
    assert len(tape) == 16 and set(tape.ks) <= {0, 1, 2}
    assert all(0 < s < 1.0 for s in tape.seconds)
