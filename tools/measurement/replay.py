"""``spectrio replay``: replay a trace's arrivals in-process or against a running server,
and report what ``bench`` reports (TTFT, ITL and TPOT percentiles, tokens per second,
acceptance per draft position).

Arrivals are replayed at the recorded speed (``--speed 1``), at a multiple of it
(``--speed 4`` arrives four times as fast), or all at once (``--speed inf``). Request
``i`` is submitted at ``arrival_s / speed`` after the start, whatever happened before it:
a slow run does not delay later arrivals (an open-loop replay, like real clients).

The run's output (``--out``) is a trace itself: the same requests plus one result per
request and a summary line, so it can be replayed again or compared with ``spectrio
diff``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from spectrio.core.notifier import Notifier
from spectrio.core.timing import device_summary
from spectrio.stages.output.output_processor import final_totals
from spectrio.tools.measurement.trace_format import (
    Trace,
    TraceError,
    TraceRequest,
    TraceResult,
    TraceWriter,
    read_trace,
    runtime_fields,
)
from spectrio.tools.measurement.trace_record import ResultBuilder
from spectrio.tools.measurement.trace_summary import format_summary, summarize

if TYPE_CHECKING:
    from spectrio.core.config import RuntimeConfig
    from spectrio.models import TextTokenizer
    from spectrio.runtime.api import Runtime
    from spectrio.wire.curve import CurveClientKeys

__all__ = [
    "ReplayRun",
    "add_replay_parser",
    "draft_totals",
    "replay_runtime",
    "replay_wire",
    "submit_times",
]


@dataclasses.dataclass
class ReplayRun:
    """One replay: results in request order, the wall time from the first submission to
    the last finish, the device summary of its steps (in-process, when known), and each
    normally finished request's speculation totals, ``request id -> (drafts proposed,
    accepted)``, from its final delta (in-process) or final step message (a server of
    wire schema 1.1 or later)."""

    results: list[TraceResult]
    wall_s: float
    device: dict[str, float] | None = None
    drafts: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        s = summarize(self.results, self.wall_s)
        s.update(draft_totals(self.drafts.values()))
        if s.get("mean_accept_len") is None:
            # Against a server, chunks carry no per-step draft counts; a chunk is still
            # one step's tokens, so tokens per step is known all the same.
            steps = sum(len(r.step_tokens) for r in self.results)
            tokens = sum(sum(r.step_tokens) for r in self.results)
            s["mean_accept_len"] = round(tokens / steps, 4) if steps else None
        if self.device:
            s["device"] = {k: round(v, 4) for k, v in self.device.items()}
        return s


def draft_totals(totals: Iterable[tuple[int, int]]) -> dict[str, Any]:
    """Summary keys from per-request speculation totals (pure): ``drafts_proposed``,
    ``drafts_accepted`` and ``draft_acceptance`` (accepted / proposed, None when nothing
    was proposed); no keys when no request reported totals."""
    pairs = list(totals)
    if not pairs:
        return {}
    proposed = sum(p for p, _ in pairs)
    accepted = sum(a for _, a in pairs)
    return {
        "drafts_proposed": proposed,
        "drafts_accepted": accepted,
        "draft_acceptance": round(accepted / proposed, 4) if proposed else None,
    }


def submit_times(requests: Sequence[TraceRequest], speed: float) -> list[float]:
    """Seconds after the start at which each request is submitted (pure)."""
    if not speed > 0:
        raise ValueError(f"speed: must be > 0 (inf: as fast as possible), got {speed!r}")
    if math.isinf(speed):
        return [0.0] * len(requests)
    return [r.arrival_s / speed for r in requests]


async def _paced(
    requests: Sequence[TraceRequest],
    speed: float,
    start_one: Any,
) -> None:
    """Call ``start_one(i, request)`` for each request at its submit time."""
    times = submit_times(requests, speed)
    t0 = trio.current_time()
    # A recorded trace lists requests as they finished; submit them as they arrived.
    for i in sorted(range(len(requests)), key=lambda j: times[j]):
        await trio.sleep_until(t0 + times[i])
        start_one(i, requests[i])


async def replay_runtime(
    rt: Runtime, requests: Sequence[TraceRequest], *, speed: float = 1.0
) -> ReplayRun:
    """Replay ``requests`` against a running runtime (each through ``rt.generate`` with its
    recorded prompt ids, params and request id). A request the runtime refuses gets
    ``finish_reason="error"``. Cancellation aborts the requests still running."""
    builders: list[ResultBuilder | None] = [None] * len(requests)
    drafts: dict[str, tuple[int, int]] = {}
    timings0 = rt.step_timings()
    last0 = timings0[-1].step if timings0 else 0  # by step number: timings are a ring
    from spectrio.errors import InvalidRequest

    async def one(i: int, req: TraceRequest) -> None:
        b = builders[i] = ResultBuilder(req.request_id, trio.current_time())
        try:
            async with rt.generate(req.prompt_ids, req.params, request_id=req.request_id) as s:
                async for delta in s:
                    b.add(delta, trio.current_time())
                    done = delta.finish_reason not in (None, "abort")
                    totals = final_totals(delta) if done else None
                    if totals is not None:
                        drafts[req.request_id] = totals
        except InvalidRequest as exc:
            b.fail(str(exc), trio.current_time())

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        await _paced(requests, speed, lambda i, r: nursery.start_soon(one, i, r))
    wall = trio.current_time() - t0
    device = device_summary([t for t in rt.step_timings() if t.step > last0], wall) or None
    return ReplayRun([b.result() for b in builders if b is not None], wall, device, drafts)


async def replay_wire(
    requests: Sequence[TraceRequest],
    requests_endpoint: str,
    outputs_endpoint: str | None = None,
    *,
    speed: float = 1.0,
    timeout_s: float = 60.0,
    curve: CurveClientKeys | None = None,
    tokenizer: TextTokenizer | None = None,
) -> ReplayRun:
    """Replay ``requests`` against a running ``spectrio serve``. Their step messages come
    back on this client's own connection (wire schema 1.7), so other clients may use the
    server meanwhile; with ``outputs_endpoint`` they are read from the server's outputs
    socket instead, of which this client must then be the only reader. A refused request
    gets ``finish_reason="error"``; a server that stops answering raises
    :class:`spectrio.wire.client_requests.ClientTimeout`."""
    from spectrio.wire.async_client import open_client
    from spectrio.wire.client_requests import RequestRefused

    builders: dict[str, ResultBuilder] = {}
    drafts: dict[str, tuple[int, int]] = {}
    pending: set[str] = set()
    submitted = 0
    changed = Notifier()
    wake = changed.notify

    async with open_client(
        requests_endpoint, outputs_endpoint, timeout_s=timeout_s, curve=curve, tokenizer=tokenizer
    ) as client:

        async def reader() -> None:
            while True:
                if not pending:
                    await changed.wait()
                    continue
                chunks = await client.next_chunks()
                now = trio.current_time()
                for chunk in chunks:
                    b = builders.get(chunk.request_id)
                    if b is None:
                        continue
                    b.add(chunk, now)
                    totals = final_totals(chunk)
                    if totals is not None:
                        drafts[chunk.request_id] = totals
                    if b.finished:
                        pending.discard(chunk.request_id)
                        wake()

        async def one(req: TraceRequest) -> None:
            nonlocal submitted
            rid = req.request_id
            b = builders[rid] = ResultBuilder(rid, trio.current_time())
            pending.add(rid)
            wake()
            try:
                await client.submit(req.prompt_ids, req.params, request_id=rid)
            except RequestRefused as exc:
                b.fail(str(exc), trio.current_time())
                pending.discard(rid)
            finally:
                submitted += 1
                wake()

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            async with trio.open_nursery() as submits:
                await _paced(requests, speed, lambda i, r: submits.start_soon(one, r))
            while pending or submitted < len(requests):
                await changed.wait()
            nursery.cancel_scope.cancel()
        wall = trio.current_time() - t0
    return ReplayRun([builders[r.request_id].result() for r in requests], wall, drafts=drafts)


# ---- the command ------------------------------------------------------------------------


def add_replay_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from spectrio.tools.cli.runtime_flags import add_runtime_flags

    p = sub.add_parser(
        "replay",
        help="replay a trace in-process or against a server (docs/trace.md)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="a trace file (docs/trace.md)")
    p.add_argument("--out", "-o", help="write the run (requests, results, summary) as a trace")
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="arrival speed: 1 as recorded, N times as fast, inf all at once (default: 1)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument(
        "--same-config",
        action="store_true",
        help="run with the runtime configuration recorded in the trace's header (the run "
        "that produced its results) instead of the runtime flags",
    )
    add_runtime_flags(p)
    remote = p.add_argument_group(
        "against a running server (the runtime flags above are then ignored)"
    )
    remote.add_argument("--requests", help="the server's requests endpoint")
    remote.add_argument(
        "--outputs",
        help="read the outputs socket instead of the requests connection (a server older "
        "than wire schema 1.7; this client must be its only reader)",
    )
    remote.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a reply")
    remote.add_argument("--curve-server-key", help="CURVE: the server's public NAME.key")
    p.set_defaults(func=replay_main)


async def _replay_in_process(config: RuntimeConfig, trace: Trace, speed: float) -> ReplayRun:
    from spectrio.runtime.api import open_runtime

    async with open_runtime(config) as rt:
        return await replay_runtime(rt, trace.requests, speed=speed)


def replay_main(args: argparse.Namespace) -> int:
    """Exit status: 0 after the replay (requests the runtime refused are counted under
    ``finish_reasons.error``); 2 for a bad trace, flag or configuration; 3 when the
    server stopped answering."""
    from spectrio.errors import SpectrioError

    if not args.speed > 0:
        print(f"error: --speed must be > 0 (inf: all at once), got {args.speed}", file=sys.stderr)
        return 2
    if args.outputs and not args.requests:
        print("error: --outputs needs --requests", file=sys.stderr)
        return 2
    try:
        trace = read_trace(args.trace)
        if args.requests:
            import zmq

            curve = None
            if args.curve_server_key:
                from spectrio.wire.curve import client_keys

                curve = client_keys(args.curve_server_key)
            try:
                run = trio.run(
                    lambda: replay_wire(
                        trace.requests,
                        args.requests,
                        args.outputs,
                        speed=args.speed,
                        timeout_s=args.timeout,
                        curve=curve,
                    )
                )
            except zmq.Again as exc:  # ClientTimeout
                print(f"error: {exc}", file=sys.stderr)
                return 3
            model, runtime = None, None
        else:
            from spectrio.tools.cli.runtime_flags import runtime_config
            from spectrio.tools.measurement.trace_format import config_from_fields

            if args.same_config:
                if trace.header.runtime is None:
                    raise TraceError(f"{args.trace}: the header records no runtime configuration")
                config = config_from_fields(trace.header.runtime)
            else:
                config = runtime_config(args)
            run = trio.run(_replay_in_process, config, trace, args.speed)
            model, runtime = config.model, runtime_fields(config)
    except (SpectrioError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = run.summary()
    if args.out:
        try:
            with TraceWriter(args.out, source="replay", model=model, runtime=runtime) as w:
                for req in trace.requests:
                    w.add_request(
                        req.request_id,
                        req.prompt_ids,
                        req.params,
                        arrival_s=req.arrival_s,
                        prompt_text=req.prompt_text,
                    )
                for res in run.results:
                    w.add_result(res)
                w.add_summary(run.wall_s, summary)
        except (TraceError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
        if "drafts_proposed" in summary:
            print(
                f"drafts: {summary['drafts_accepted']} accepted of "
                f"{summary['drafts_proposed']} proposed "
                f"(acceptance {summary['draft_acceptance']})"
            )
    return 0
