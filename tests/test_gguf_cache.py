"""A GGUF file is converted once into the cache folder and read from there afterwards
(models/loading/gguf_cache.py): the same model, config, tokenizer and template as the file
itself, a fresh conversion when the file changes, and the file read directly whenever
the cache cannot serve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_gguf import write_gguf

from spectrio.models import load
from spectrio.models.loading.gguf_cache import cached_folder
from spectrio.models.loading.loader import load_tokenizer, model_config


def _params(path: Path) -> dict[str, np.ndarray]:
    return {n: p.numpy() for n, p in load(path).model.named_parameters()}


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "gguf_cache"
    monkeypatch.setenv("SPECTRIO_GGUF_CACHE", str(root))
    return root


def _refuse_gguf_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make opening the GGUF file itself an error: a load must come from the folder."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr("spectrio.models.loading.loader.GGUFFile", refuse)


def test_second_load_reads_the_folder_and_gives_the_same_model(
    tmp_path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    monkeypatch.setenv("SPECTRIO_GGUF_CACHE", "0")
    direct = load(path)
    direct_params = {n: p.numpy() for n, p in direct.model.named_parameters()}
    monkeypatch.setenv("SPECTRIO_GGUF_CACHE", str(cache_root))
    first = load(path)  # converts
    [folder] = [p for p in cache_root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert (folder / "config.json").is_file() and (folder / "SOURCE").read_text().strip()
    # config and tokenizer alone come from the file's header, which opens fast
    assert model_config(path) == direct.config
    tok = load_tokenizer(path)
    assert tok is not None and tok.encode("hello world") == direct.tokenizer.encode("hello world")
    _refuse_gguf_reads(monkeypatch)
    again = load(path)
    for loaded in (first, again):
        assert loaded.config == direct.config
        assert loaded.chat_template == direct.chat_template
        assert loaded.path == path  # named by the file, not the folder
        assert loaded.tokenizer is not None and direct.tokenizer is not None
        assert loaded.tokenizer.raw.to_str() == direct.tokenizer.raw.to_str()
        for name, p in loaded.model.named_parameters():
            np.testing.assert_array_equal(p.numpy(), direct_params[name], err_msg=name)
    assert not [p for p in cache_root.iterdir() if p.name.startswith(".")]  # no leftovers


def test_a_rewritten_file_is_converted_again(tmp_path: Path, cache_root: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    before = _params(path)
    write_gguf(tmp_path / "q8.gguf", qtype=Q.Q8_0)
    (tmp_path / "q8.gguf").replace(path)  # other bytes under the same name
    after = _params(path)
    assert len([p for p in cache_root.iterdir() if p.is_dir() and not p.name.startswith(".")]) == 2
    name = "model.layers.0.mlp.gate_proj.weight"
    assert not np.array_equal(before[name], after[name])  # the new file's values, not stale


def test_cache_off_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECTRIO_GGUF_CACHE", "off")
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    assert cached_folder(path) is None
    assert load(path).tokenizer is not None


def test_an_unwritable_cache_falls_back_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("SPECTRIO_GGUF_CACHE", str(blocker))
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    assert cached_folder(path) is None
    loaded = load(path)
    assert loaded.config.num_hidden_layers > 0


def test_losing_a_race_keeps_the_winners_folder(
    tmp_path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes (tensor-parallel ranks) convert at once: the one whose rename comes
    second finds the folder in place, keeps it and discards its own copy."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    from spectrio.models.loading import convert  # gguf_cache imports it lazily, from there

    original = convert.convert_gguf
    winner: list[Path] = []

    def convert_while_another_wins(src: Path, out: Path, *args: object, **kw: object) -> Path:
        final = cache_root / out.name.split(".")[1]
        original(src, final, *args, **kw)  # type: ignore[arg-type]
        winner.append(final)
        return original(src, out, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(convert, "convert_gguf", convert_while_another_wins)
    folder = cached_folder(path)
    assert winner and folder == winner[0]
    assert sorted(p.name for p in cache_root.iterdir() if p.is_dir()) == [folder.name]


def test_the_tokenizer_is_built_once_and_again_for_a_rewritten_file(
    tmp_path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A served file's tokenizer is built from the header's tokens and merges once, then
    read from the cache: the same tokenizer, never stale for a rewritten file, and built
    every time with the cache off."""
    from spectrio.models.loading import gguf_vocab

    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    built: list[Path] = []
    original = gguf_vocab.tokenizer_json

    def counting(field: object, where: Path) -> str | None:
        built.append(where)
        return original(field, where)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf_vocab, "tokenizer_json", counting)
    first = load_tokenizer(path)
    again = load_tokenizer(path)
    assert len(built) == 1
    assert first is not None and again is not None
    assert again.raw.to_str() == first.raw.to_str()
    [kept] = cache_root.glob("*.tokenizer.json")
    assert kept.read_text(encoding="utf-8") and not list(cache_root.glob(".*"))
    write_gguf(tmp_path / "q8.gguf", qtype=Q.Q8_0)
    (tmp_path / "q8.gguf").replace(path)  # other bytes under the same name: built anew
    third = load_tokenizer(path)
    assert len(built) == 2 and third is not None
    assert len(list(cache_root.glob("*.tokenizer.json"))) == 2
    monkeypatch.setenv("SPECTRIO_GGUF_CACHE", "0")
    load_tokenizer(path)
    load_tokenizer(path)
    assert len(built) == 4
