"""spectrio.core: the types every stage shares, below ``stages`` and ``runtime``: the
runtime configuration, sampling parameters and their checks, the stage messages, the
typed channels, and the per-step record layout (:mod:`spectrio.core.record`, what the
wire carries in frame 1). Nothing here imports Paddle, Trio actors or sockets."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

_EXPORTS = {
    "ChannelReceiver": "spectrio.core.channels",
    "ChannelSender": "spectrio.core.channels",
    "open_channel": "spectrio.core.channels",
    "RuntimeConfig": "spectrio.core.config",
    "SpeculativeConfig": "spectrio.core.config",
    "PublishedStep": "spectrio.core.messages",
    "StepPlan": "spectrio.core.messages",
    "StepResult": "spectrio.core.messages",
    "TokenLogprob": "spectrio.core.messages",
    "SamplingParams": "spectrio.core.params",
}

__all__ = [
    "ChannelReceiver",
    "ChannelSender",
    "PublishedStep",
    "RuntimeConfig",
    "SamplingParams",
    "SpeculativeConfig",
    "StepPlan",
    "StepResult",
    "TokenLogprob",
    "open_channel",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.core.channels import ChannelReceiver, ChannelSender, open_channel
    from spectrio.core.config import RuntimeConfig, SpeculativeConfig
    from spectrio.core.messages import PublishedStep, StepPlan, StepResult, TokenLogprob
    from spectrio.core.params import SamplingParams
