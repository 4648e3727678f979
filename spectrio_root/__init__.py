"""spectrio: an async actor-pipeline runtime for speculative decoding with MTP draft heads.

Public names: ``open_runtime``, ``Runtime``, ``Delta``, ``RuntimeConfig``,
``SpeculativeConfig``, ``SamplingParams``, ``TokenLogprob``, ``PublishedStep``,
``ConfigError``, ``InvalidRequest``.
Each sub-package (``spectrio.models``, ``spectrio.runtime`` ...) lives in its own folder.
"""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "Delta": "spectrio.runtime.api",
    "PublishedStep": "spectrio.runtime.api",
    "Runtime": "spectrio.runtime.api",
    "open_runtime": "spectrio.runtime.api",
    "ConfigError": "spectrio.runtime.config",
    "RuntimeConfig": "spectrio.runtime.config",
    "SpeculativeConfig": "spectrio.runtime.config",
    "TokenLogprob": "spectrio.runtime.messages",
    "InvalidRequest": "spectrio.runtime.params",
    "SamplingParams": "spectrio.runtime.params",
}

__all__ = [
    "ConfigError",
    "Delta",
    "InvalidRequest",
    "PublishedStep",
    "Runtime",
    "RuntimeConfig",
    "SamplingParams",
    "SpeculativeConfig",
    "TokenLogprob",
    "__version__",
    "open_runtime",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.runtime.api import Delta, PublishedStep, Runtime, open_runtime
    from spectrio.runtime.config import ConfigError, RuntimeConfig, SpeculativeConfig
    from spectrio.runtime.messages import TokenLogprob
    from spectrio.runtime.params import InvalidRequest, SamplingParams
