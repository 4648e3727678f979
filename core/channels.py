"""Typed channels between stages.

A channel carries one msgspec Struct type. In ``encoded`` mode every message is
round-tripped through msgpack (encoded on send, decoded with a typed decoder on
receive), which proves the stage messages wire-safe; a ZeroMQ transport can implement
the same two small interfaces.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar, get_args, overload

import msgspec
import trio

T = TypeVar("T")


class ChannelSender(Generic[T]):
    def __init__(self, inner: trio.MemorySendChannel[object], msg_type: Any, encoded: bool) -> None:
        self._inner = inner
        self._types: tuple[type, ...] = get_args(msg_type) or (msg_type,)
        self._encoder = msgspec.msgpack.Encoder() if encoded else None

    def _prepare(self, msg: T) -> object:
        if not isinstance(msg, self._types):
            names = " | ".join(t.__name__ for t in self._types)
            raise TypeError(f"channel carries {names}, got {type(msg).__name__}")
        return self._encoder.encode(msg) if self._encoder else msg

    async def send(self, msg: T) -> None:
        """Send one message; waits while the channel is full. A send cancelled while
        waiting delivers nothing."""
        await self._inner.send(self._prepare(msg))

    def send_nowait(self, msg: T) -> None:
        self._inner.send_nowait(self._prepare(msg))

    def statistics(self) -> trio.MemoryChannelStatistics:
        return self._inner.statistics()

    async def aclose(self) -> None:
        await self._inner.aclose()

    def close(self) -> None:
        self._inner.close()


class ChannelReceiver(Generic[T]):
    def __init__(
        self, inner: trio.MemoryReceiveChannel[object], msg_type: Any, encoded: bool
    ) -> None:
        self._inner = inner
        self._decoder = msgspec.msgpack.Decoder(msg_type) if encoded else None

    async def receive(self) -> T:
        """Next message; raises ``trio.EndOfChannel`` once the sender closed."""
        return self._decode(await self._inner.receive())

    def receive_nowait(self) -> T:
        return self._decode(self._inner.receive_nowait())

    def _decode(self, raw: object) -> T:
        if self._decoder is not None:
            assert isinstance(raw, bytes)
            return self._decoder.decode(raw)
        return raw  # type: ignore[return-value]

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        async for raw in self._inner:
            yield self._decode(raw)

    def close(self) -> None:
        self._inner.close()


@overload
def open_channel(
    msg_type: type[T], capacity: float = 1, encoded: bool = False
) -> tuple[ChannelSender[T], ChannelReceiver[T]]: ...


@overload
def open_channel(
    msg_type: Any, capacity: float = 1, encoded: bool = False
) -> tuple[ChannelSender[Any], ChannelReceiver[Any]]: ...


def open_channel(
    msg_type: Any, capacity: float = 1, encoded: bool = False
) -> tuple[ChannelSender[Any], ChannelReceiver[Any]]:
    """A typed channel for ``msg_type`` (a Struct type or a Union of them); bounded by
    ``capacity`` (``math.inf`` for unbounded)."""
    if capacity != math.inf and (capacity < 0 or int(capacity) != capacity):
        raise ValueError("capacity must be a non-negative integer or math.inf")
    send, receive = trio.open_memory_channel[object](capacity)
    return ChannelSender(send, msg_type, encoded), ChannelReceiver(receive, msg_type, encoded)
