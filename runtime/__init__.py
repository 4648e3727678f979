"""spectrio.runtime: configuration and planning, typed channels, the rank's workspace,
pipeline assembly, the adaptive policy's timing cache (``timing_cache``), the runtime's
health verdict (``health``) and the public embedding API (Trio and asyncio)."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

_EXPORTS = {
    "AsyncioRequestStream": "spectrio.runtime.aio",
    "AsyncioRuntime": "spectrio.runtime.aio",
    "open_runtime_asyncio": "spectrio.runtime.aio",
    "Delta": "spectrio.runtime.api",
    "Health": "spectrio.runtime.health",
    "RequestStream": "spectrio.runtime.api",
    "Runtime": "spectrio.runtime.api",
    "open_runtime": "spectrio.runtime.api",
    "ChannelReceiver": "spectrio.core.channels",
    "ChannelSender": "spectrio.core.channels",
    "open_channel": "spectrio.core.channels",
    "ConfigError": "spectrio.errors",
    "RuntimeConfig": "spectrio.core.config",
    "SpeculativeConfig": "spectrio.core.config",
    "PublishedStep": "spectrio.core.messages",
    "TokenLogprob": "spectrio.core.messages",
    "InvalidRequest": "spectrio.errors",
    "SamplingParams": "spectrio.core.params",
}

__all__ = [
    "AsyncioRequestStream",
    "AsyncioRuntime",
    "ChannelReceiver",
    "ChannelSender",
    "ConfigError",
    "Delta",
    "Health",
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
    from spectrio.core.channels import ChannelReceiver, ChannelSender, open_channel
    from spectrio.core.config import RuntimeConfig, SpeculativeConfig
    from spectrio.core.messages import PublishedStep, TokenLogprob
    from spectrio.core.params import SamplingParams
    from spectrio.errors import ConfigError, InvalidRequest
    from spectrio.runtime.aio import AsyncioRequestStream, AsyncioRuntime, open_runtime_asyncio
    from spectrio.runtime.api import Delta, RequestStream, Runtime, open_runtime
    from spectrio.runtime.health import Health
