"""spectrio.runtime: configuration and planning, typed channels, the rank's workspace,
pipeline assembly and the public embedding API (Trio and asyncio)."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

_EXPORTS = {
    "AsyncioRequestStream": "spectrio.runtime.aio",
    "AsyncioRuntime": "spectrio.runtime.aio",
    "open_runtime_asyncio": "spectrio.runtime.aio",
    "Delta": "spectrio.runtime.api",
    "RequestStream": "spectrio.runtime.api",
    "Runtime": "spectrio.runtime.api",
    "open_runtime": "spectrio.runtime.api",
    "ChannelReceiver": "spectrio.runtime.channels",
    "ChannelSender": "spectrio.runtime.channels",
    "open_channel": "spectrio.runtime.channels",
    "ConfigError": "spectrio.runtime.config",
    "RuntimeConfig": "spectrio.runtime.config",
    "SpeculativeConfig": "spectrio.runtime.config",
    "PublishedStep": "spectrio.runtime.messages",
    "TokenLogprob": "spectrio.runtime.messages",
    "InvalidRequest": "spectrio.runtime.params",
    "SamplingParams": "spectrio.runtime.params",
}

__all__ = [
    "AsyncioRequestStream",
    "AsyncioRuntime",
    "ChannelReceiver",
    "ChannelSender",
    "ConfigError",
    "Delta",
    "InvalidRequest",
    "PublishedStep",
    "RequestStream",
    "Runtime",
    "RuntimeConfig",
    "SamplingParams",
    "SpeculativeConfig",
    "TokenLogprob",
    "open_channel",
    "open_runtime",
    "open_runtime_asyncio",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.runtime.aio import AsyncioRequestStream
    from spectrio.runtime.aio import AsyncioRuntime
    from spectrio.runtime.aio import open_runtime_asyncio
    from spectrio.runtime.api import Delta
    from spectrio.runtime.api import RequestStream
    from spectrio.runtime.api import Runtime
    from spectrio.runtime.api import open_runtime
    from spectrio.runtime.channels import ChannelReceiver
    from spectrio.runtime.channels import ChannelSender
    from spectrio.runtime.channels import open_channel
    from spectrio.runtime.config import ConfigError
    from spectrio.runtime.config import RuntimeConfig
    from spectrio.runtime.config import SpeculativeConfig
    from spectrio.runtime.messages import PublishedStep
    from spectrio.runtime.messages import TokenLogprob
    from spectrio.runtime.params import InvalidRequest
    from spectrio.runtime.params import SamplingParams
