"""RuntimeConfig from TOML and JSON files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectrio import ConfigError, RuntimeConfig, SpeculativeConfig
from spectrio.runtime.config_file import load_config


def test_toml_and_json_give_the_same_config(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text(
        'model = "bundled"\nmax_num_seqs = 8\nmax_num_batched_tokens = 64\n'
        '[speculative]\nmethod = "mtp"\nnum_speculative_tokens = 3\n'
    )
    (tmp_path / "c.json").write_text(
        json.dumps(
            {
                "model": "bundled",
                "max_num_seqs": 8,
                "max_num_batched_tokens": 64,
                "speculative": {"method": "mtp", "num_speculative_tokens": 3},
            }
        )
    )
    want = RuntimeConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        speculative=SpeculativeConfig(num_speculative_tokens=3),
    )
    assert load_config(tmp_path / "c.toml") == want == load_config(tmp_path / "c.json")


@pytest.mark.parametrize(
    "text,match",
    [
        ("max_num_seq = 8\n", "max_num_seq: unknown RuntimeConfig field"),
        ("[speculative]\nk = 3\n", "k: unknown speculative field"),
        ("max_num_seqs = 0\n", "max_num_seqs"),
        ("max_num_seqs = \n", "cannot read"),
        ("[speculative]\nnum_speculative_tokens = 9\n", "num_speculative_tokens"),
    ],
)
def test_bad_files_name_the_field(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(tmp_path / "c.toml")


def test_prefix_caching_is_on_by_default_and_off_from_the_file(tmp_path: Path) -> None:
    assert RuntimeConfig().enable_prefix_caching
    path = tmp_path / "c.toml"
    path.write_text("enable_prefix_caching = false\n")
    assert not load_config(path).enable_prefix_caching
    path.write_text('enable_prefix_caching = "no"\n')
    with pytest.raises(ConfigError, match="enable_prefix_caching: must be a bool"):
        load_config(path)
