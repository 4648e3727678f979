"""spectrio.wire: msgspec schema, codec, framing, ZeroMQ endpoints and the client."""
