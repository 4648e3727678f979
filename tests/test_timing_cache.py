"""The adaptive policy's timing cache: kept at shutdown, read at start-up, per identity."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import trio
from pipeline_helpers import collect, prompts

from spectrio import ConfigError, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.models import load
from spectrio.runtime import timing_cache

MAX_TOKENS = 64


def config(cache: str, **kw: object) -> RuntimeConfig:
    fields: dict[str, object] = {
        "dtype": "float32",
        "max_model_len": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "speculative": SpeculativeConfig(num_speculative_tokens=3, timing_cache=cache),
    }
    fields.update(kw)
    return RuntimeConfig(**fields)  # type: ignore[arg-type]


async def run(cfg: RuntimeConfig, batch: list[list[int]]) -> tuple[list[list[int]], dict]:
    """Every prompt's tokens, and the policy's step times before its first step."""
    results: list[list[int]] = [[] for _ in batch]
    with trio.fail_after(300):
        async with open_runtime(cfg) as rt:
            seeded = rt.scheduler.policy.step_times()

            async def one(i: int) -> None:
                params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
                results[i] = await collect(rt, batch[i], params)

            async with trio.open_nursery() as nursery:
                for i in range(len(batch)):
                    nursery.start_soon(one, i)
    return results, seeded


def some(n: int) -> list[list[int]]:
    return prompts(load("bundled").tokenizer)[:n]


def files(folder: Path) -> list[Path]:
    return sorted((folder / "spec_timings").glob("*.json"))


def test_a_run_keeps_its_timings_and_the_next_starts_from_them(tmp_path: Path) -> None:
    batch = some(6)
    first, seeded = trio.run(run, config(str(tmp_path)), batch)
    assert seeded == {}
    [kept] = files(tmp_path)
    data = json.loads(kept.read_text())
    assert data["identity"]["k"] == 3 and data["identity"]["dtype"] == "float32"
    assert data["timings"]["k_max"] == 3 and data["timings"]["buckets"]
    second, seeded = trio.run(run, config(str(tmp_path)), batch)
    assert seeded, "the second runtime starts with the first one's step times"
    assert {bucket for bucket, _ in seeded} <= {int(b) for b in data["timings"]["buckets"]}
    assert second == first  # lossless whatever k the kept timings lead to
    assert files(tmp_path) == [kept]  # same identity, same file, rewritten


def test_another_identity_gets_its_own_file(tmp_path: Path) -> None:
    batch = some(2)
    trio.run(run, config(str(tmp_path)), batch)
    other = dataclasses.replace(config(str(tmp_path)), num_threads=1)
    _, seeded = trio.run(run, other, batch)
    assert seeded == {}  # the 2-thread timings say nothing about 1 thread
    assert len(files(tmp_path)) == 2


@pytest.mark.parametrize("content", ["{not json", '{"identity": 1, "timings": []}', "BAD"])
def test_a_damaged_file_is_ignored_and_replaced(tmp_path: Path, content: str) -> None:
    batch = some(2)
    trio.run(run, config(str(tmp_path)), batch)
    [kept] = files(tmp_path)
    if content == "BAD":  # the right identity with timings of the wrong shape
        data = json.loads(kept.read_text())
        data["timings"] = {"k_max": 3, "buckets": {"3": {"pairs": {}}}}
        content = json.dumps(data)
    kept.write_text(content)
    _, seeded = trio.run(run, config(str(tmp_path)), batch)
    assert seeded == {}
    assert json.loads(kept.read_text())["timings"]["buckets"]  # whole again


def test_off_and_fixed_k_keep_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECTRIO_CACHE_DIR", str(tmp_path))
    batch = some(2)
    trio.run(run, config("off"), batch)
    fixed = dataclasses.replace(
        config("auto"), speculative=SpeculativeConfig(num_speculative_tokens=3, adaptive=False)
    )
    trio.run(run, fixed, batch)
    assert files(tmp_path) == []
    trio.run(run, config("auto"), batch)  # "auto" reads $SPECTRIO_CACHE_DIR
    assert len(files(tmp_path)) == 1


def test_an_unwritable_folder_only_logs(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    results, _ = trio.run(run, config(str(blocker)), some(2))
    assert all(len(r) == MAX_TOKENS for r in results)
    ident = {"schema": timing_cache.SCHEMA}
    assert not timing_cache.save_timings(blocker / "spec_timings" / "x.json", ident, {})


@pytest.mark.parametrize("bad", ["", 5, None])
def test_timing_cache_setting_is_checked(bad: object) -> None:
    with pytest.raises(ConfigError, match="timing_cache"):
        SpeculativeConfig(timing_cache=bad)  # type: ignore[arg-type]


def test_a_file_is_read_only_for_its_own_identity(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    ident = {"schema": timing_cache.SCHEMA, "threads": 2}
    timings = {"k_max": 3, "buckets": {"64": {"pairs": {"2": [0.2]}, "times": {"2": 0.05}}}}
    assert timing_cache.load_timings(path, ident) is None  # nothing kept yet
    assert timing_cache.save_timings(path, ident, timings)
    assert timing_cache.load_timings(path, ident) == timings
    assert timing_cache.load_timings(path, {**ident, "threads": 4}) is None
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left


def test_one_cache_folder_for_every_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$SPECTRIO_CACHE_DIR, else $XDG_CACHE_HOME/spectrio, else ~/.cache/spectrio (an empty
    variable counts as unset); the timing cache's "auto" and the fused-kernel verdict
    (``spectrio.models.fast_ops``) both use it."""
    from spectrio.cache_dir import cache_dir

    monkeypatch.setenv("SPECTRIO_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "own" == timing_cache.cache_root("auto")
    monkeypatch.setenv("SPECTRIO_CACHE_DIR", "")
    assert cache_dir() == tmp_path / "xdg" / "spectrio" == timing_cache.cache_root("auto")
    monkeypatch.delenv("SPECTRIO_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "spectrio"
    assert timing_cache.cache_root("off") is None
    assert timing_cache.cache_root(str(tmp_path / "d")) == tmp_path / "d"
