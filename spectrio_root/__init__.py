"""spectrio: an async actor-pipeline runtime for speculative decoding with MTP draft heads.

Public names: ``open_runtime``, ``Runtime``, ``Delta``, ``RuntimeConfig``,
``SpeculativeConfig``, ``SamplingParams``, ``TokenLogprob``, ``PublishedStep``,
``ConfigError``, ``InvalidRequest``.
Each sub-package (``spectrio.models``, ``spectrio.runtime`` ...) lives in its own folder.
"""

from spectrio.runtime.api import Delta, PublishedStep, Runtime, open_runtime
from spectrio.runtime.config import ConfigError, RuntimeConfig, SpeculativeConfig
from spectrio.runtime.messages import TokenLogprob
from spectrio.runtime.params import InvalidRequest, SamplingParams

__version__ = "0.1.0"

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
