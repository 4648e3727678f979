"""RuntimeConfig from a TOML or JSON file (``spectrio serve --config FILE``).

The file holds RuntimeConfig's field names at the top level and SpeculativeConfig's in a
``speculative`` table; an unknown key is a ConfigError, never silently ignored::

    model = "bundled"
    max_num_seqs = 64
    [speculative]
    method = "mtp"
    num_speculative_tokens = 3
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

from spectrio.core.config import ConfigError, RuntimeConfig, SpeculativeConfig


def _check_keys(table: dict[str, Any], cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"{unknown[0]}: unknown {where} field (known: {', '.join(sorted(known))})"
        )


def load_config(path: str | Path) -> RuntimeConfig:
    path = Path(path)
    try:
        text = path.read_text()
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:  # tomllib and json errors are ValueErrors
        raise ConfigError(f"config: cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {path} must hold a table of RuntimeConfig fields")
    _check_keys(raw, RuntimeConfig, "RuntimeConfig")
    fields = dict(raw)
    spec = fields.pop("speculative", None)
    if spec is not None:
        if not isinstance(spec, dict):
            raise ConfigError("speculative: must be a table of SpeculativeConfig fields")
        _check_keys(spec, SpeculativeConfig, "speculative")
        fields["speculative"] = SpeculativeConfig(**spec)
    if isinstance(fields.get("graph_capture_sizes"), list):
        fields["graph_capture_sizes"] = tuple(fields["graph_capture_sizes"])
    return RuntimeConfig(**fields)
