"""Consumer library for a ``spectrio serve`` endpoint (wire schema v1, ``docs/wire.md``).

Two halves, usable separately:

* **requests:** ``submit``/``abort``/``ping``/``info`` over a DEALER socket; each call
  waits for its reply and raises :class:`RequestRefused` on an ``Error``.
* **outputs:** since schema 1.7, by default, the step messages of the client's own
  requests on that same connection (``Submit.stream``; any number of clients share a
  server); or, with an ``outputs`` endpoint, the server's PUSH socket (one consumer
  process) or PUB tap (observers; may drop). :class:`StreamAssembler` turns them into
  per-request :class:`Chunk` s, checks every request's sequence numbers (raising
  :class:`SequenceGap` on a missing or repeated token) and detokenises incrementally.

:class:`AsyncClient` is the Trio API (on a stream connection one pump task owns the
socket, :mod:`spectrio.wire.stream_connection`; otherwise each socket is owned by one
task at a time, enforced by a lock); :class:`Client` is the synchronous API over
blocking pyzmq calls. Both bound every wait, for a reply and for the next step message,
by ``timeout_s`` (60 s by default) and raise :class:`ClientTimeout` when it passes: a
server that died (even by SIGKILL) or stopped answering never hangs a client. A late
reply is never taken for the reply of a later call: on a stream connection replies are
matched to their call, and otherwise a call that timed out, or was cancelled, while
waiting for its reply reconnects the request socket.

Text is detokenised with the **server's** tokenizer: a client with a requests endpoint
and no ``tokenizer`` argument asks the server for it (``Info``, schema 1.2) before its
first submit, and fetches the tokenizer's JSON only when its hash is not one the process
already has (the bundled model's, or one fetched before). A server older than 1.2
answers ``unknown_type``; the client then uses the bundled tokenizer, as before. A client
without a requests endpoint (an observer of the outputs or the tap) cannot ask, and uses
the bundled tokenizer unless given one.

Note that a PUSH socket deals messages round-robin over its connected PULL peers, so one
process should read the outputs socket; stream connections have no such limit.

This module is the clients' public path. They live in :mod:`.async_client` and
:mod:`.sync_client`, over what both share: :mod:`.client_requests` (argument types,
errors, the ``Submit`` frame), :mod:`.client_tokenizers` and :mod:`.stream_assembler`.
"""

from __future__ import annotations

from spectrio.wire.async_client import AsyncClient, open_client
from spectrio.wire.client_requests import DEFAULT_TIMEOUT_S, ClientTimeout, RequestRefused

# The argument types stay importable from here too, for hints in callers' code (outside
# __all__, as before); the redundant aliases mark them as re-exported.
from spectrio.wire.client_requests import Context as Context
from spectrio.wire.client_requests import Messages as Messages
from spectrio.wire.client_requests import Prompt as Prompt
from spectrio.wire.client_tokenizers import bundled_tokenizer, tokenizer_for
from spectrio.wire.stream_assembler import Chunk, SequenceGap, StreamAssembler
from spectrio.wire.sync_client import Client

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncClient",
    "Chunk",
    "Client",
    "ClientTimeout",
    "RequestRefused",
    "SequenceGap",
    "StreamAssembler",
    "bundled_tokenizer",
    "open_client",
    "tokenizer_for",
]
