"""RuntimeConfig from a TOML or JSON file (``spectrio serve --config FILE``), merged with
command-line flags.

The file holds RuntimeConfig's field names at the top level and SpeculativeConfig's in a
``speculative`` table; an unknown key is a ConfigError, never silently ignored::

    model = "bundled"
    max_num_seqs = 64
    [speculative]
    method = "mtp"
    num_speculative_tokens = 3

Flags given on the command line win over the file, field by field
(:func:`merge_tables`): ``--config c.toml --k 3`` keeps everything ``c.toml`` says except
``num_speculative_tokens``. The merged table is validated once, as a whole, so a rule
that ties two fields (``max_num_batched_tokens >= max_num_seqs * (k + 1)``) sees the
values the runtime will run with.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spectrio.core.config import ConfigError, RuntimeConfig, SpeculativeConfig

__all__ = ["config_from_table", "load_config", "merge_tables", "read_table"]


def _check_keys(table: Mapping[str, Any], cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"{unknown[0]}: unknown {where} field (known: {', '.join(sorted(known))})"
        )


def read_table(path: str | Path) -> dict[str, Any]:
    """The file's table, as written (TOML for ``.toml``, else JSON); not validated beyond
    being a table. Raises ConfigError when it cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text()
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:  # tomllib and json errors are ValueErrors
        raise ConfigError(f"config: cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {path} must hold a table of RuntimeConfig fields")
    return raw


def merge_tables(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with every key of ``override`` replacing it; the ``speculative`` tables
    merge key by key too, so a flag for one SpeculativeConfig field keeps the file's
    others (pure)."""
    merged = dict(base)
    for key, value in override.items():
        if (
            key == "speculative"
            and isinstance(value, Mapping)
            and isinstance(merged.get(key), Mapping)
        ):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def config_from_table(table: Mapping[str, Any]) -> RuntimeConfig:
    """A validated RuntimeConfig from a table of its fields (a nested ``speculative``
    table for SpeculativeConfig's); unspecified fields keep their defaults. Raises
    ConfigError naming the first unknown or invalid field."""
    _check_keys(table, RuntimeConfig, "RuntimeConfig")
    fields = dict(table)
    spec = fields.pop("speculative", None)
    if spec is not None:
        if isinstance(spec, SpeculativeConfig):
            spec = dataclasses.asdict(spec)
        if not isinstance(spec, Mapping):
            raise ConfigError("speculative: must be a table of SpeculativeConfig fields")
        _check_keys(spec, SpeculativeConfig, "speculative")
        try:
            fields["speculative"] = SpeculativeConfig(**spec)
        except TypeError as exc:  # cannot happen after _check_keys; kept typed anyway
            raise ConfigError(f"speculative: {exc}") from exc
    if isinstance(fields.get("graph_capture_sizes"), list):
        fields["graph_capture_sizes"] = tuple(fields["graph_capture_sizes"])
    return RuntimeConfig(**fields)


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> RuntimeConfig:
    """The RuntimeConfig in the file at ``path``, with ``overrides`` (a table of the same
    shape, from command-line flags) winning field by field (:func:`merge_tables`)."""
    return config_from_table(merge_tables(read_table(path), overrides or {}))
