"""Replay the adaptive speculation policy on recorded acceptance, free of timing noise.

On the shared 2-core machine one bench case moves by 5-8% between rounds, more than the
differences between variants of the policy. This tool takes the machine out:

* ``--record FILE`` runs a model at batch 1 with a fixed k (every step proposes k drafts,
  greedy) on the bench's held-out prompts, one request after another, and keeps each
  request's drafts and accepted drafts per decode step (fewer than k, down to 0, on the
  last steps, where fewer tokens remain), as the runtime's public
  :class:`~spectrio.runtime.api.Delta` reports them;
* ``--trace FILE --times T0,T1,...`` replays :class:`SpecPolicy` on those records with a
  fixed step time per k (milliseconds, e.g. ``spectrio bench``'s draft + verify + sample
  columns) and reports its tokens per second next to every fixed k's on the same records;
* ``--record-tape FILE`` runs the model at batch 1 with every step's k drawn in turn from
  a shuffled cycle of 0..k, and keeps each step's time as the scheduler files it for the
  policy: the machine's own noise (drift over seconds, spikes of 1.5-3x about one step in
  ten, k-dependent shape costs), with every k measured within a few steps of every
  other;
* ``--trace FILE --tape TAPE`` replays on that noise instead of fixed times: a step that
  runs k at replay step n takes the time of the tape's step with that k nearest to
  position ``offset + n``. Each of ``--offsets`` evenly spaced starts is one run, as a
  bench round is, and fixed k and the policy meet the same noise in each;
* ``--record-tape FILE --batch B`` records the same at B running sequences, and
  ``--acceptance a1,a2,... --tape FILE`` replays at the tape's batch size, every sequence
  accepting draft i with probability ``a_i`` given the drafts before it (no request's
  record applies to a batch), from ``--offsets`` starts with ``--seeds`` draws each;
  fixed k and the policy meet the same draws and the same stretches of the tape.

The replay is a model, not a re-run: a step that drafts ``k' < k`` is taken to accept
``min(recorded, k')`` drafts, and the next step starts where the recorded one did.
Greedy drafts depend on the context only, but a smaller k moves where later steps start.
Compare policies on the same records; do not read the figures as the runtime's.

Run: ``python benchmarks/policy_replay.py --record acc.json [--requests 24]``, then
``python benchmarks/policy_replay.py --trace acc.json --times 4.1,5.6,6.9,7.5``; or
``--record-tape tape.json [--steps 3000]`` and ``--trace acc.json --tape tape.json``; at
batch 16: ``--record-tape t16.json --batch 16 --k 4 --steps 300``, then
``--tape t16.json --acceptance 0.90,0.86,0.90,0.94``.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import random
import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

import trio

from spectrio.stages.planning.spec_policy import (
    Remaining,
    SpecPolicy,
    batch_bucket,
    scale_to_bucket,
)

__all__ = [
    "Accepts",
    "Tape",
    "Trace",
    "acceptance_draws",
    "record",
    "record_tape",
    "replay_batch",
    "replay_fixed",
    "replay_policy",
]

R = TypeVar("R")

#: Per request, per recorded step: ``(drafts proposed, drafts accepted)``.
Trace = list[list[tuple[int, int]]]

#: Seconds of the replay's step ``n`` (counted over the whole trace) when it runs ``k``.
Clock = Callable[[int, int], float]


def fixed_clock(times: list[float]) -> Clock:
    """``times[k]`` seconds for every step that runs k."""
    return lambda n, k: times[k]


class Tape:
    """Step times recorded on the machine, in order: ``ks[i]`` drafts took ``seconds[i]``."""

    def __init__(self, ks: list[int], seconds: list[float]) -> None:
        if len(ks) != len(seconds) or not ks:
            raise ValueError("a tape needs as many k as times, and at least one")
        self.ks, self.seconds = ks, seconds
        self._at: dict[int, list[int]] = {}
        for i, k in enumerate(ks):
            self._at.setdefault(k, []).append(i)

    def __len__(self) -> int:
        return len(self.ks)

    @property
    def k_max(self) -> int:
        return max(self._at)

    def time(self, position: int, k: int) -> float:
        """The time of the step with ``k`` drafts nearest to ``position`` (wrapping at
        the tape's end, so any start and length can be replayed; a tie goes to the later
        step)."""
        where = self._at.get(k)
        if where is None:
            raise KeyError(f"the tape has no step with k = {k}")
        size = len(self.ks)
        pos = position % size
        j = bisect.bisect_left(where, pos)
        after = where[j] if j < len(where) else where[0] + size
        before = where[j - 1] if j > 0 else where[-1] - size
        return self.seconds[(after if after - pos <= pos - before else before) % size]

    def clock(self, offset: int) -> Clock:
        return lambda n, k: self.time(offset + n, k)


def replay_fixed(trace: Trace, times: list[float] | Clock, k: int) -> float:
    """Tokens per second of a fixed ``k`` over ``trace`` (``times[k]`` seconds a step, or
    a clock): the runtime's own fixed-k policy, replayed."""
    return replay_policy(trace, times, SpecPolicy(k, adaptive=False))


def replay_policy(trace: Trace, times: list[float] | Clock, policy: SpecPolicy) -> float:
    """Tokens per second of ``policy`` choosing each step's k over ``trace``, fed back as
    the scheduler feeds it: the step's time (except a request's first decode step, whose
    MTP pass catches up on the prompt) and the acceptance."""
    clock = fixed_clock(times) if isinstance(times, list) else times
    tokens = seconds = 0.0
    n = 0
    previous: int | None = None
    for steps in trace:
        for i, (drafts, accepted) in enumerate(steps):
            k = policy.choose(1)
            k_eff = min(k, drafts)
            got = min(accepted, k_eff)
            took = clock(n, k_eff)
            n += 1
            filed = k if k_eff else 0  # as the scheduler files it: the step's k if it drafted
            if i > 0:
                policy.observe_step(1, filed, took, previous)
            previous = filed
            if k_eff:
                policy.observe_acceptance(k_eff, got)
            tokens += got + 1
            seconds += took
    return tokens / seconds


async def record(model: str, prompts: list[list[int]], k: int, max_tokens: int) -> Trace:
    """Each prompt's ``(drafts, accepted)`` per decode step, at batch 1 with fixed ``k``.
    A prompt longer than one prefill chunk emits nothing until its last chunk, so its
    first delta is always that chunk's token."""
    from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime

    cfg = RuntimeConfig(
        model=model,
        max_num_seqs=1,
        speculative=SpeculativeConfig(num_speculative_tokens=k, adaptive=False),
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    trace: Trace = []
    async with open_runtime(cfg) as rt:
        for prompt in prompts:
            steps: list[tuple[int, int]] = []
            async for delta in rt.generate(prompt, params):
                steps.append((delta.num_drafts, delta.num_accepted))
            trace.append(steps[1:])  # the first: the prompt's last chunk, no drafts
    return trace


class _CyclePolicy(SpecPolicy):
    """Every k from 0 to ``k_max`` in turn, each cycle shuffled (so no k always follows
    the same one); keeps the step times the scheduler files, as :meth:`observe_step`
    receives them."""

    def __init__(self, k_max: int, seed: int = 0) -> None:
        super().__init__(k_max, adaptive=False)
        self._rng = random.Random(seed)
        self._cycle: list[int] = []
        self.timed: list[tuple[int, int, float]] = []  # (sequences, k, seconds)

    def choose(self, num_seqs: int, closing: Sequence[Remaining] | None = None) -> int:
        if not self._cycle:
            self._cycle = list(range(self.k_max + 1))
            self._rng.shuffle(self._cycle)
        return self._cycle.pop()

    def observe_step(
        self,
        num_seqs: int,
        k: int,
        seconds: float,
        previous_k: int | None = None,
        extra_rows: tuple[int, int] = (0, 0),
    ) -> None:
        if num_seqs > 0 and not any(extra_rows):  # a tape holds decode steps only
            self.timed.append((num_seqs, k, seconds))


async def record_tape(
    model: str,
    prompts: list[list[int]],
    k: int,
    steps: int,
    max_tokens: int,
    batch: int = 1,
) -> Tape:
    """At ``batch`` running sequences, the times of ``steps`` decode steps whose k cycles
    through 0..``k`` (each of ``batch`` lanes runs requests one after another, ``prompts``
    reused in turn), as the policy would see them: only the steps it times (no prefill
    chunk, no catch-up on a prompt) with a batch in the same power-of-two bucket, each
    scaled to ``batch`` sequences as the policy scales it. At batch 64 a new request
    starts on most steps, so far fewer steps are timed than run."""
    from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime

    cfg = RuntimeConfig(
        model=model,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * (k + 1)),
        speculative=SpeculativeConfig(num_speculative_tokens=k, adaptive=False),
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    cycle = _CyclePolicy(k)

    def full() -> list[tuple[int, float]]:
        return [
            (drafts, scale_to_bucket(s, n, batch))
            for n, drafts, s in cycle.timed
            if batch_bucket(n) == batch_bucket(batch)
        ]

    async with open_runtime(cfg) as rt:
        rt.scheduler.policy = cycle
        taken = itertools.count()

        async def lane() -> None:
            while len(full()) < steps:
                async for _ in rt.generate(prompts[next(taken) % len(prompts)], params):
                    pass

        async with trio.open_nursery() as nursery:
            for _ in range(batch):
                nursery.start_soon(lane)
    timed = full()[:steps]
    return Tape([k for k, _ in timed], [s for _, s in timed])


#: Per step, per sequence, per draft position: accepted if the drafts before it were.
Accepts = list[list[list[bool]]]


def replay_batch(clock: Clock, policy: SpecPolicy, accepts: Accepts) -> float:
    """Tokens per second of ``policy`` over ``len(accepts)`` steps of ``len(accepts[0])``
    sequences on ``clock``: a step with k drafts gives each sequence the drafts up to its
    first rejection among the first k. The draws are the caller's, so every policy meets
    the same ones. A model for batches larger than one, where no single request's record
    applies: positions accept independently of each other and of the step before."""
    tokens = seconds = 0.0
    previous: int | None = None
    for n, step in enumerate(accepts):
        k = policy.choose(len(step))
        took = clock(n, k)
        policy.observe_step(len(step), k, took, previous)
        previous = k
        for row in step:
            got = next((i for i in range(k) if not row[i]), k)
            if k:
                policy.observe_acceptance(k, got)
            tokens += got + 1
        seconds += took
    return tokens / seconds


def acceptance_draws(acceptance: list[float], batch: int, steps: int, seed: int) -> Accepts:
    """Seeded :data:`Accepts`: position i accepted with probability ``acceptance[i]``."""
    rng = random.Random(seed)
    return [[[rng.random() < a for a in acceptance] for _ in range(batch)] for _ in range(steps)]


def _parse_times(text: str) -> list[float]:
    try:
        ms = [float(x) for x in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--times: comma-separated numbers, got {text!r}") from exc
    if len(ms) < 2 or any(t <= 0 for t in ms):
        raise argparse.ArgumentTypeError("--times: at least k = 0 and 1, each positive")
    return [t / 1000.0 for t in ms]


def _report(
    runs: Sequence[R],
    k_max: int,
    make_policy: Callable[[], SpecPolicy],
    replay: Callable[[R, SpecPolicy], float],
) -> None:
    """Every fixed k's and a fresh policy's tokens/s per run, as means over the runs;
    with several runs, the policy's ratio to the best fixed k run by run."""
    fixed = {k: [replay(r, SpecPolicy(k, adaptive=False)) for r in runs] for k in range(k_max + 1)}
    best = max(fixed, key=lambda k: statistics.mean(fixed[k]))
    adaptive = [replay(r, make_policy()) for r in runs]
    top = statistics.mean(fixed[best])
    for k, rates in fixed.items():
        rate = statistics.mean(rates)
        print(f"k = {k}: {rate:8.1f} tokens/s  {rate / top:.3f} of the best")
    rate = statistics.mean(adaptive)
    line = f"adaptive: {rate:8.1f} tokens/s  {rate / top:.3f} of the best"
    if len(runs) > 1:
        ratios = sorted(a / b for a, b in zip(adaptive, fixed[best], strict=True))
        line += (
            f" (run by run: min {ratios[0]:.3f}, median {statistics.median(ratios):.3f},"
            f" max {ratios[-1]:.3f} over {len(ratios)} runs)"
        )
    print(line)


def _parse_acceptance(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--acceptance: comma-separated numbers, got {text!r}"
        ) from exc
    if not all(0.0 <= a <= 1.0 for a in rates):
        raise argparse.ArgumentTypeError("--acceptance: each between 0 and 1")
    return rates


def _load_tape(path: str) -> tuple[Tape, int]:
    with open(path) as fh:
        taped = json.load(fh)
    tape = Tape([int(k) for k in taped["k"]], [float(s) for s in taped["seconds"]])
    return tape, int(taped.get("batch", 1))


def _replay_acceptance(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--acceptance`` on ``--tape``: ``--offsets`` evenly spaced starts, ``--seeds``
    acceptance draws each, ``--run-steps`` steps a run, every run with a fresh policy."""
    if args.tape is None:
        p.error("--acceptance replays on a --tape")
    tape, batch = _load_tape(args.tape)
    k_max = len(args.acceptance)
    if tape.k_max < k_max or min(args.offsets, args.seeds, args.run_steps) < 1:
        p.error(f"--tape needs every k up to {k_max}; --offsets, --seeds, --run-steps positive")
    runs = [
        (
            tape.clock(i * len(tape) // args.offsets),
            acceptance_draws(args.acceptance, batch, args.run_steps, seed),
        )
        for i in range(args.offsets)
        for seed in range(args.seeds)
    ]
    print(f"batch {batch}, {len(runs)} runs of {args.run_steps} steps")
    _report(runs, k_max, lambda: SpecPolicy(k_max), lambda r, pol: replay_batch(r[0], pol, r[1]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/policy_replay.py")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="FILE", help="record acceptance into FILE")
    mode.add_argument("--record-tape", metavar="FILE", help="record step times into FILE")
    mode.add_argument("--trace", metavar="FILE", help="replay the policy on FILE")
    mode.add_argument(
        "--acceptance",
        type=_parse_acceptance,
        help="replay on --tape at the tape's batch size, each sequence accepting draft i "
        "with these probabilities (given the drafts before it): a1,a2,...",
    )
    p.add_argument("--model", default="bundled")
    p.add_argument("--k", type=int, default=3, help="drafts per step (most, for a tape)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--steps", type=int, default=3000, help="steps a tape records")
    p.add_argument("--batch", type=int, default=1, help="running sequences a tape records")
    p.add_argument("--run-steps", type=int, default=160, help="steps per --acceptance run")
    p.add_argument("--seeds", type=int, default=4, help="acceptance draws per --acceptance start")
    timing = p.add_mutually_exclusive_group()
    timing.add_argument("--times", type=_parse_times, help="ms per step for k = 0, 1, ...")
    timing.add_argument("--tape", metavar="FILE", help="step times recorded by --record-tape")
    p.add_argument("--offsets", type=int, default=16, help="starts on a tape, evenly spaced")
    p.add_argument(
        "--run-requests",
        type=int,
        help="replay the records in runs of this many requests, each with a fresh policy "
        "(a bench run at batch 1 with --waves 4 is 4 requests); default: one run of all",
    )
    args = p.parse_args(argv)
    if args.record or args.record_tape:
        from spectrio.tools.measurement.bench import bench_prompts

        if min(args.k, args.requests, args.steps, args.batch) < 1 or args.max_tokens < 2:
            p.error(
                "--k, --requests, --steps and --batch must be positive, --max-tokens at least 2"
            )
        prompts = bench_prompts(max(args.requests, args.batch), args.prompt_tokens, args.model)
    if args.record:
        trace = trio.run(record, args.model, prompts, args.k, args.max_tokens)
        with open(args.record, "w") as fh:
            json.dump({"k": args.k, "requests": trace}, fh)
        steps = sum(len(s) for s in trace)
        print(f"recorded {len(trace)} requests, {steps} decode steps at k = {args.k}")
        return
    if args.record_tape:
        tape = trio.run(
            record_tape, args.model, prompts, args.k, args.steps, args.max_tokens, args.batch
        )
        with open(args.record_tape, "w") as fh:
            json.dump({"k": tape.ks, "seconds": tape.seconds, "batch": args.batch}, fh)
        for k in range(tape.k_max + 1):
            ms = [s * 1e3 for kk, s in zip(tape.ks, tape.seconds, strict=True) if kk == k]
            print(f"k = {k}: {len(ms)} steps, median {statistics.median(ms):.2f} ms")
        return
    if args.acceptance is not None:
        _replay_acceptance(p, args)
        return
    with open(args.trace) as fh:
        data = json.load(fh)
    k_max = int(data["k"])
    trace = [[(int(d), int(a)) for d, a in steps] for steps in data["requests"]]
    if args.tape:
        tape, _ = _load_tape(args.tape)
        if tape.k_max < k_max or args.offsets < 1:
            p.error(f"--tape: needs every k up to {k_max}; --offsets must be positive")
        clocks = [tape.clock(i * len(tape) // args.offsets) for i in range(args.offsets)]
    elif args.times is not None:
        if len(args.times) != k_max + 1:
            p.error(f"--times: {k_max + 1} values (k = 0..{k_max}), got {len(args.times)}")
        clocks = [fixed_clock(args.times)]
    else:
        p.error("--trace needs --times or --tape")
    size = args.run_requests or len(trace)
    if size < 1:
        p.error("--run-requests must be positive")
    parts = [trace[i : i + size] for i in range(0, len(trace), size)]
    _report(
        [(t, c) for c in clocks for t in parts],
        k_max,
        lambda: SpecPolicy(k_max),
        lambda run, policy: replay_policy(run[0], run[1], policy),
    )


if __name__ == "__main__":
    main()
