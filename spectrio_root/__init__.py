"""spectrio: an async actor-pipeline runtime for speculative decoding with MTP draft heads.

Public names: ``open_runtime``, ``Runtime``, ``Delta``, ``RuntimeConfig``,
``SpeculativeConfig``, ``SamplingParams``, ``Constraint`` (structured output),
``TokenLogprob``, ``PublishedStep``,
``SpectrioError`` and its ``ConfigError``, ``InvalidRequest``, ``EngineDead``.
Each sub-package (``spectrio.models``, ``spectrio.runtime`` ...) lives in its own folder.
"""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "Delta": "spectrio.runtime.api",
    "PublishedStep": "spectrio.core.messages",
    "Runtime": "spectrio.runtime.api",
    "open_runtime": "spectrio.runtime.api",
    "ConfigError": "spectrio.errors",
    "RuntimeConfig": "spectrio.core.config",
    "SpeculativeConfig": "spectrio.core.config",
    "TokenLogprob": "spectrio.core.messages",
    "EngineDead": "spectrio.errors",
    "SpectrioError": "spectrio.errors",
    "InvalidRequest": "spectrio.errors",
    "SamplingParams": "spectrio.core.params",
    "Constraint": "spectrio.core.constraints",
}

__all__ = [
    "ConfigError",
    "Constraint",
    "Delta",
    "EngineDead",
    "InvalidRequest",
    "PublishedStep",
    "Runtime",
    "RuntimeConfig",
    "SamplingParams",
    "SpectrioError",
    "SpeculativeConfig",
    "TokenLogprob",
    "__version__",
    "open_runtime",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.core.config import RuntimeConfig, SpeculativeConfig
    from spectrio.core.constraints import Constraint
    from spectrio.core.messages import PublishedStep, TokenLogprob
    from spectrio.core.params import SamplingParams
    from spectrio.errors import ConfigError, EngineDead, InvalidRequest, SpectrioError
    from spectrio.runtime.api import Delta, Runtime, open_runtime
