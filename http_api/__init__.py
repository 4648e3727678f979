"""spectrio.http_api: the OpenAI-compatible HTTP front (reference: ``docs/http.md``).

* :mod:`spectrio.http_api.schema`: request bodies, responses, chunks and errors as
  msgspec Structs;
* :mod:`spectrio.http_api.mapping`: body decoding, refusals and the field-by-field
  mapping onto :class:`~spectrio.SamplingParams` (pure);
* :mod:`spectrio.http_api.response_format`: ``response_format`` and vLLM's ``guided_*``
  fields to one :class:`~spectrio.Constraint` (pure);
* :mod:`spectrio.http_api.tool_calls` and :mod:`spectrio.http_api.tool_parsers`: tools
  and ``tool_choice`` to what the request runs, and tool calls read out of the answer
  as it streams (pure);
* :mod:`spectrio.http_api.logprobs` and :mod:`spectrio.http_api.responses`: logprobs in
  each endpoint's format, responses and stream chunks from deltas (pure);
* :mod:`spectrio.http_api.front`: the front's state (admission, prompts, drain);
* :mod:`spectrio.http_api.chat`: chat messages to running requests;
* :mod:`spectrio.http_api.app`: the Starlette app, routing to the handlers of
  :mod:`spectrio.http_api.endpoints`, which answer through
  :mod:`spectrio.http_api.exchange` (following the choices' streams, SSE);
* :mod:`spectrio.http_api.server`: :func:`~spectrio.http_api.server.serve_http`,
  Hypercorn's Trio worker in the runtime's own Trio run.

Submodules are imported explicitly (``from spectrio.http_api.server import serve_http``).
"""

__all__ = [
    "app",
    "chat",
    "endpoints",
    "exchange",
    "front",
    "logprobs",
    "mapping",
    "response_format",
    "responses",
    "schema",
    "server",
    "tool_calls",
    "tool_parsers",
]
