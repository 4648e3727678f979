"""spectrio.wire: the versioned msgpack wire protocol (reference: ``docs/wire.md``).

* :mod:`spectrio.wire.schema`: the v1 message Structs and error codes;
* :mod:`spectrio.wire.codec`: request decoding that classifies bad frames, step encoding;
* :mod:`spectrio.wire.record`: the per-step record carried raw in frame 1.

Submodules are imported explicitly (``from spectrio.wire.codec import decode_request``):
the runtime imports :mod:`spectrio.wire.record` while it is itself being imported, so this
package must not import the runtime-dependent modules eagerly.
"""

__all__ = ["codec", "record", "schema"]
