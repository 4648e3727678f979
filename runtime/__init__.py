"""spectrio.runtime: configuration, planning, channels, pipeline assembly and the public API.

Configuration and capacity planning live in :mod:`spectrio.runtime.config`.
"""

from spectrio.runtime.config import ConfigError, RuntimeConfig, SpeculativeConfig

__all__ = ["ConfigError", "RuntimeConfig", "SpeculativeConfig"]
