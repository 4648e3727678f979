"""spectrio.runtime: configuration and planning, typed channels, the rank's workspace,
pipeline assembly and the public embedding API (Trio and asyncio)."""

from spectrio.runtime.aio import AsyncioRequestStream, AsyncioRuntime, open_runtime_asyncio
from spectrio.runtime.api import Delta, RequestStream, Runtime, open_runtime
from spectrio.runtime.channels import ChannelReceiver, ChannelSender, open_channel
from spectrio.runtime.config import ConfigError, RuntimeConfig, SpeculativeConfig
from spectrio.runtime.messages import PublishedStep, TokenLogprob
from spectrio.runtime.params import InvalidRequest, SamplingParams

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
