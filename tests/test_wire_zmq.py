"""The Trio adapter for pyzmq over real sockets (ipc:// and tcp://127.0.0.1): PUSH/PULL
with backpressure, ROUTER/DEALER request-reply, MAXMSGSIZE, single ownership, close and
cancellation. Every test runs under ``trio.fail_after``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from spectrio.wire.codec import WireError, decode_reply, decode_request, encode
from spectrio.wire.schema import Ack, Error, ErrorCode, Ping
from spectrio.wire.zmq_transport import TrioSocket, open_socket

TIMEOUT = 20


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


@pytest.fixture(params=["ipc", "tcp"])
def endpoint(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "ipc":
        return f"ipc://{tmp_path}/sock"
    return "tcp://127.0.0.1:*"


def bound(
    ctx: zmq.Context[zmq.Socket[bytes]], kind: int, endpoint: str, **kw: Any
) -> tuple[TrioSocket, str]:
    sock = open_socket(ctx, kind, bind=endpoint, **kw)
    return sock, sock.socket.getsockopt_string(zmq.LAST_ENDPOINT)


async def test_push_pull_is_lossless_and_ordered_under_backpressure(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str
) -> None:
    count = 2000

    def small_kernel_buffers(sock: zmq.Socket[bytes]) -> None:
        # Without this, loopback TCP autotunes its buffers to megabytes and can absorb the
        # whole stream, so the high-water mark would never be reached on some machines.
        sock.setsockopt(zmq.SNDBUF, 4096)
        sock.setsockopt(zmq.RCVBUF, 4096)

    with trio.fail_after(TIMEOUT):
        pull, addr = bound(ctx, zmq.PULL, endpoint, rcvhwm=4, configure=small_kernel_buffers)
        push = open_socket(ctx, zmq.PUSH, connect=addr, sndhwm=4, configure=small_kernel_buffers)
        blocked = [0]
        first_block = trio.Event()
        got: list[tuple[int, bytes]] = []

        async def producer() -> None:
            for i in range(count):
                if push.socket.getsockopt(zmq.EVENTS) & zmq.POLLOUT == 0:
                    blocked[0] += 1
                    first_block.set()
                await push.send_multipart([i.to_bytes(4, "little"), b"x" * (i % 300)])

        async def consumer() -> None:
            # The consumer reads nothing until the producer has had to wait (or a few
            # seconds passed), so the push-back is observed on any machine's timing.
            with trio.move_on_after(5):
                await first_block.wait()
            for n in range(count):
                if n % 100 == 0:
                    await trio.sleep(0.005)  # a slow consumer: the producer must wait
                head, body = await pull.recv_multipart()
                got.append((int.from_bytes(head, "little"), body))

        async with push, pull, trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            nursery.start_soon(consumer)
    assert [i for i, _ in got] == list(range(count))
    assert all(body == b"x" * (i % 300) for i, body in got)
    assert blocked[0] > 0, "the high-water mark never pushed back"


async def test_router_dealer_request_reply_with_several_clients(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str
) -> None:
    clients, rounds = 4, 25
    with trio.fail_after(TIMEOUT):
        router, addr = bound(ctx, zmq.ROUTER, endpoint)
        dealers = [open_socket(ctx, zmq.DEALER, connect=addr) for _ in range(clients)]
        replies: list[list[Ack | Error]] = [[] for _ in range(clients)]

        async def server() -> None:
            for _ in range(clients * rounds * 2):
                ident, frame = await router.recv_multipart()
                try:
                    msg = decode_request(frame)
                except WireError as exc:
                    reply = encode(exc.to_reply())
                else:
                    assert isinstance(msg, Ping)
                    reply = encode(Ack(of="ping"))
                await router.send_multipart([ident, reply])

        async def client(i: int) -> None:
            for r in range(rounds):
                await dealers[i].send(encode(Ping(v=1)))
                replies[i].append(decode_reply(await dealers[i].recv()))
                await dealers[i].send(b"\xc1garbage" + bytes([i, r]))
                replies[i].append(decode_reply(await dealers[i].recv()))

        async with router, trio.open_nursery() as nursery:
            nursery.start_soon(server)
            for i in range(clients):
                nursery.start_soon(client, i)
        for d in dealers:
            d.close()
    for per_client in replies:
        assert per_client[0::2] == [Ack(of="ping")] * rounds
        assert all(isinstance(e, Error) and e.code is ErrorCode.BAD_FRAME for e in per_client[1::2])


async def test_max_msg_size_drops_an_oversized_peer_and_keeps_serving(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str
) -> None:
    with trio.fail_after(TIMEOUT):
        router, addr = bound(ctx, zmq.ROUTER, endpoint, max_msg_size=1000)
        assert router.socket.getsockopt(zmq.MAXMSGSIZE) == 1000
        big = open_socket(ctx, zmq.DEALER, connect=addr, max_msg_size=None)
        small = open_socket(ctx, zmq.DEALER, connect=addr)
        async with router, big, small:
            await big.send(b"x" * 5000)
            await small.send(b"hello")
            ident, frame = await router.recv_multipart()
            assert frame == b"hello"
            with trio.move_on_after(0.3):
                await router.recv_multipart()
                pytest.fail("the oversized message was delivered")
            await router.send_multipart([ident, b"still here"])
            assert await small.recv() == b"still here"


async def test_one_owner_close_and_cancellation(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    with trio.fail_after(TIMEOUT):
        pull = open_socket(ctx, zmq.PULL, bind=f"ipc://{tmp_path}/one")
        push = open_socket(ctx, zmq.PUSH, connect=f"ipc://{tmp_path}/one")
        # A second task on the same socket is refused.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pull.recv_multipart)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await pull.recv_multipart()
            nursery.cancel_scope.cancel()
        # A cancelled receive consumed nothing; the socket still works.
        with trio.move_on_after(0.05):
            await pull.recv_multipart()
        await push.send(b"after cancel")
        assert await pull.recv() == b"after cancel"
        # Close wakes the waiting owner.
        async with trio.open_nursery() as nursery:

            async def waiter() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await pull.recv_multipart()

            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            pull.close()
        assert pull.closed
        with pytest.raises(trio.ClosedResourceError):
            await pull.recv()
        pull.close()  # idempotent
        push.close()


async def test_open_socket_checks_its_arguments(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        open_socket(ctx, zmq.PULL)
    with pytest.raises(ValueError, match="wildcard"):
        open_socket(ctx, zmq.PULL, bind="tcp://*:5555")
    with pytest.raises(ValueError, match="wildcard"):
        open_socket(ctx, zmq.PULL, bind="tcp://0.0.0.0:5555")
    with trio.fail_after(TIMEOUT):
        async with open_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*") as router:
            # ROUTER_MANDATORY: a reply to an unknown peer raises instead of vanishing.
            with pytest.raises(zmq.ZMQError) as info:
                await router.send_multipart([b"nobody", b"x"])
            assert info.value.errno == zmq.EHOSTUNREACH


async def test_tracked_zero_copy_send_holds_a_record_buffer_until_sent(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    """The GPU record path's reuse rule over a real socket: a record frame sent without a
    copy keeps its ring buffer held until pyzmq's tracker says the send is done."""
    import numpy as np

    from spectrio.cuda_kernels import RecordRing, RingExhausted

    ring = RecordRing(1)
    memory = np.arange(200_000, dtype="<i4")  # above pyzmq's 64 KiB copy threshold
    push, where = bound(ctx, zmq.PUSH, f"ipc://{tmp_path}/rec")
    pull = open_socket(ctx, zmq.PULL, connect=where)
    try:
        with trio.fail_after(TIMEOUT):
            slot = ring.acquire()
            frames_out = [b"envelope", memoryview(memory)]
            tracker = await push.send_multipart(frames_out, copy=False, track=True)
            assert tracker is not None
            ring.release_when(slot, lambda: tracker.done)
            frames = await pull.recv_multipart()
            assert frames[1] == memory.tobytes()
            await trio.to_thread.run_sync(tracker.wait, TIMEOUT)
            assert ring.acquire() == slot  # the send is done: the buffer may be reused
            with pytest.raises(RingExhausted):
                ring.acquire()
            assert await push.send_multipart([b"x"], copy=False, track=False) is None
    finally:
        push.close()
        pull.close()
