"""spectrio.wire: the versioned msgpack wire protocol (reference: ``docs/wire.md``).

* :mod:`spectrio.wire.schema`: the v1 message Structs and error codes;
* :mod:`spectrio.wire.codec`: request decoding that classifies bad frames, step encoding;
* :mod:`spectrio.wire.server`: the ZeroMQ server in front of a runtime, with
  :mod:`spectrio.wire.outbox` (each destination's bounded queue of step messages);
* :mod:`spectrio.wire.client`: the consumer library's public path: the clients
  (:mod:`~spectrio.wire.async_client`, :mod:`~spectrio.wire.sync_client`) and the
  :mod:`~spectrio.wire.stream_assembler`, with :mod:`spectrio.wire.stream_connection`
  (one connection for requests and their steps).
* :mod:`spectrio.wire.record`: the per-step record carried raw in frame 1 (its layout
  lives in :mod:`spectrio.core.record`).

Submodules are imported explicitly (``from spectrio.wire.codec import decode_request``),
so ``import spectrio.wire.schema`` needs neither Paddle nor the runtime.
"""

__all__ = [
    "client",
    "codec",
    "curve",
    "outbox",
    "record",
    "schema",
    "server",
    "stream_connection",
    "zmq_transport",
]
