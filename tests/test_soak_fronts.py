"""Every front at once, for 10 s (issue 62, item 5): ``benchmarks/soak_fronts.py`` small.

The server runs in this process as ``spectrio serve --http`` composes it; a child
process drives 8 ``openai`` SDK clients, a live wire consumer, wire consumers that die
mid-stream and requests to the outputs socket nobody reads, while this process runs the
embedding API. Nothing may time out or answer 5xx, ``/health`` stays 200, the server ends
every request whose consumer died (at once for a closed connection, within the stall
bound otherwise), and afterwards every KV block is free. The benchmark figure is
``python benchmarks/soak_fronts.py --duration 600``.
"""

from __future__ import annotations

from typing import Any

import trio
from soak_fronts import build_parser, dead_consumers, soak_fronts, theil_sen

STALL_S = 3.0  # the wire server's --output-stall-s here (10 by default): a shorter test


def test_theil_sen_ignores_a_jump() -> None:
    t = [float(i) for i in range(10)]
    y = [2.0 * i + (50.0 if i == 4 else 0.0) for i in range(10)]
    assert abs(theil_sen(t, y) - 2.0) < 1e-9
    assert theil_sen([1.0], [5.0]) == 0.0


def test_dead_consumers_counts_how_each_request_ended() -> None:
    dead = [("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 2.0)]
    ends = {"a": ("abort", 1.5), "b": ("length", 3.0)}
    got = dead_consumers(dead, ["d"], ends, load_end=4.0)
    assert got["sent"] == 4 and got["ended_by_server"] == 1 and got["refused"] == 1
    assert got["finished_on_their_own"] == 1 and got["never_ended"] == 1
    assert got["end_after_death_max_s"] == 0.5
    assert got["not_ended_by_server_s_before_load_end"] == [("length", 3.0), ("never_ended", 2.0)]


def _all_ended_by_server(d: dict[str, Any]) -> None:
    assert d["sent"] > 0 and d["never_ended"] == 0, d
    assert d["ended_by_server"] + d["finished_on_their_own"] + d["refused"] == d["sent"], d
    assert d["ended_by_server"] > 0, d


async def test_every_front_together_for_ten_seconds() -> None:
    args = build_parser().parse_args(
        ["--duration", "10", "--clients", "8", "--embed-tasks", "2"]
        + ["--output-stall-s", str(STALL_S), "--unread-every", "1"]
    )
    with trio.fail_after(300):
        res = await soak_fronts(args)
    http, live, embed = res["http"], res["wire_live"], res["embedding"]
    assert http["completed"] > 0 and http["cut"] > 0, http
    assert http["timeouts"] == 0 and http["5xx"] == 0 and http["other_errors"] == 0, http
    assert live["completed"] > 0 and live["timeouts"] == 0 and live["gaps"] == 0, live
    assert live["finish_reasons"] == {"length": live["completed"]}, live
    assert embed["completed"] > 0 and embed["timeouts"] == 0, embed
    assert res["wire_dying"]["timeouts"] == 0, res["wire_dying"]
    assert set(res["health"]["counts"]) == {"200"}, res["health"]
    # The server ended every request whose consumer died or never read: a closed
    # connection at once, a silent one within the stall bound (plus the supervisor's
    # tick and a loaded machine's slack), and no other request (the live consumer's).
    raw, client, unread = res["dying_raw_ended"], res["dying_client_ended"], res["unread_ended"]
    for d in (raw, client, unread):
        _all_ended_by_server(d)
    assert raw["end_after_death_max_s"] < STALL_S, raw
    assert client["end_after_death_max_s"] < 3 * STALL_S, client
    server = res["server"]
    ended = raw["ended_by_server"] + client["ended_by_server"] + unread["ended_by_server"]
    assert server["requests_stalled"] == ended, server
    assert server["clients_gone"] > 0 and server["request_failures"] == 0, server
    # Afterwards: idle, every KV block free, and a fresh request answers at once.
    assert res["idle"] and res["open_requests_after"] == 0, res
    assert res["kv_blocks_free"] == res["kv_blocks_total"], res
    fresh = res["fresh_request"]
    assert fresh["first_http_s"] < fresh["in_process_median_s"] + 1.0, fresh
