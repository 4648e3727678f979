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
    from spectrio.runtime.aio import AsyncioRequestStream, AsyncioRuntime, open_runtime_asyncio
    from spectrio.runtime.api import Delta, RequestStream, Runtime, open_runtime
    from spectrio.runtime.channels import ChannelReceiver, ChannelSender, open_channel
    from spectrio.runtime.config import ConfigError, RuntimeConfig, SpeculativeConfig
    from spectrio.runtime.messages import PublishedStep, TokenLogprob
    from spectrio.runtime.params import InvalidRequest, SamplingParams
