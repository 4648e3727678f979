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
  columns) and reports its tokens per second next to every fixed k's on the same records.

The replay is a model, not a re-run: a step that drafts ``k' < k`` is taken to accept
``min(recorded, k')`` drafts, and the next step starts where the recorded one did.
Greedy drafts depend on the context only, but a smaller k moves where later steps start.
Compare policies on the same records; do not read the figures as the runtime's.

Run: ``python -m spectrio.tools.policy_replay --record acc.json [--requests 24]``, then
``python -m spectrio.tools.policy_replay --trace acc.json --times 4.1,5.6,6.9,7.5``.
"""

from __future__ import annotations

import argparse
import json

import trio

from spectrio.stages.spec_policy import SpecPolicy

__all__ = ["Trace", "record", "replay_fixed", "replay_policy"]

#: Per request, per recorded step: ``(drafts proposed, drafts accepted)``.
Trace = list[list[tuple[int, int]]]


def replay_fixed(trace: Trace, times: list[float], k: int) -> float:
    """Tokens per second of a fixed ``k`` over ``trace`` (``times[k]`` seconds a step):
    the runtime's own fixed-k policy, replayed."""
    return replay_policy(trace, times, SpecPolicy(k, adaptive=False))


def replay_policy(trace: Trace, times: list[float], policy: SpecPolicy) -> float:
    """Tokens per second of ``policy`` choosing each step's k over ``trace``, fed back as
    the scheduler feeds it: the step's time (except a request's first decode step, whose
    MTP pass catches up on the prompt) and the acceptance."""
    tokens = seconds = 0.0
    for steps in trace:
        for i, (drafts, accepted) in enumerate(steps):
            k = policy.choose(1)
            k_eff = min(k, drafts)
            got = min(accepted, k_eff)
            if i > 0:  # as the scheduler files it: under the step's k if it drafted
                policy.observe_step(1, k if k_eff else 0, times[k_eff])
            if k_eff:
                policy.observe_acceptance(k_eff, got)
            tokens += got + 1
            seconds += times[k_eff]
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


def _parse_times(text: str) -> list[float]:
    try:
        ms = [float(x) for x in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--times: comma-separated numbers, got {text!r}") from exc
    if len(ms) < 2 or any(t <= 0 for t in ms):
        raise argparse.ArgumentTypeError("--times: at least k = 0 and 1, each positive")
    return [t / 1000.0 for t in ms]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m spectrio.tools.policy_replay")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="FILE", help="record acceptance into FILE")
    mode.add_argument("--trace", metavar="FILE", help="replay the policy on FILE")
    p.add_argument("--model", default="bundled")
    p.add_argument("--k", type=int, default=3, help="drafts per step when recording")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--times", type=_parse_times, help="ms per step for k = 0, 1, ...")
    args = p.parse_args(argv)
    if args.record:
        from spectrio.tools.bench import bench_prompts

        if args.k < 1 or args.requests < 1 or args.max_tokens < 2:
            p.error("--k and --requests must be positive, --max-tokens at least 2")
        prompts = bench_prompts(args.requests, args.prompt_tokens, args.model)
        trace = trio.run(record, args.model, prompts, args.k, args.max_tokens)
        with open(args.record, "w") as fh:
            json.dump({"k": args.k, "requests": trace}, fh)
        steps = sum(len(s) for s in trace)
        print(f"recorded {len(trace)} requests, {steps} decode steps at k = {args.k}")
        return
    if args.times is None:
        p.error("--trace needs --times")
    with open(args.trace) as fh:
        data = json.load(fh)
    k_max = int(data["k"])
    trace = [[(int(d), int(a)) for d, a in steps] for steps in data["requests"]]
    if len(args.times) != k_max + 1:
        p.error(f"--times: {k_max + 1} values (k = 0..{k_max}), got {len(args.times)}")
    fixed = {k: replay_fixed(trace, args.times, k) for k in range(k_max + 1)}
    best = max(fixed, key=lambda k: fixed[k])
    adaptive = replay_policy(trace, args.times, SpecPolicy(k_max))
    for k, rate in fixed.items():
        print(f"k = {k}: {rate:8.1f} tokens/s  {rate / fixed[best]:.3f} of the best")
    print(f"adaptive: {adaptive:8.1f} tokens/s  {adaptive / fixed[best]:.3f} of the best")


if __name__ == "__main__":
    main()
