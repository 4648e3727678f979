"""The adaptive policy's timing cache: kept at shutdown, read at start-up, per identity."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import trio
from pipeline_helpers import collect, prompts
from test_gguf import write_gguf

from spectrio import ConfigError, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.models import load
from spectrio.models.architecture.model import build_model
from spectrio.models.loading.loader import open_checkpoint
from spectrio.models.loading.mtp_head import HEAD_FILE, head_path_for, save_head, target_fingerprint
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
    (``spectrio.models.ops.fast_ops``) both use it."""
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


def _later(path: Path) -> None:
    """Move the file's modification time a second on (as a later write would)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _write_head(path: Path, seed: int) -> Path:
    """A ``spectrio train-mtp`` head beside the tiny GGUF file ``path`` (``X.mtp.safetensors``):
    an MTP layer drawn from ``seed`` (another seed: a retrained head of the same size)."""
    cfg, source, _, _ = open_checkpoint(path, mtp_head=False)
    drafter = build_model(dataclasses.replace(cfg, num_nextn_predict_layers=1), seed=seed)
    head = head_path_for(path)
    save_head(drafter, head, target_fingerprint(cfg, source), dtype="float32")
    return head


def test_the_identity_covers_the_gguf_file_and_the_attached_head(tmp_path: Path) -> None:
    """A retrained head drafts at another cost, and a rewritten file is another model:
    neither reuses the step times kept for the old one."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    head = _write_head(path, seed=0)
    loaded = load(path)
    assert loaded.config.has_mtp and loaded.head_path == head
    cfg = config(str(tmp_path))
    before = timing_cache.identity(cfg, loaded.path, loaded.head_path)
    for key, file in (("checkpoint", path), ("head", head)):
        assert before[key] == [str(file.resolve()), file.stat().st_size, file.stat().st_mtime_ns]
    assert timing_cache.identity(cfg, path, head) == before  # the same files: the same identity

    _later(path)  # the GGUF file touched
    touched = timing_cache.identity(cfg, path, head)
    assert touched["checkpoint"] != before["checkpoint"] and touched["head"] == before["head"]

    mtime = head.stat().st_mtime_ns
    _write_head(path, seed=1)  # retrained: another file of the same size under that name
    os.utime(head, ns=(mtime + 1_000_000_000, mtime + 1_000_000_000))
    retrained = timing_cache.identity(cfg, path, head)
    assert retrained["head"] != touched["head"] and retrained["checkpoint"] == touched["checkpoint"]
    assert timing_cache.cache_file(cfg, retrained) != timing_cache.cache_file(cfg, touched)
    assert "head" not in timing_cache.identity(cfg, path, None)


def test_a_folders_identity_is_unchanged_by_its_own_head(tmp_path: Path) -> None:
    """A head inside the folder is among the folder's files already: no new key, so the
    timings kept before the key existed still apply."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / HEAD_FILE).write_bytes(b"head")
    cfg = config(str(tmp_path))
    ident = timing_cache.identity(cfg, folder, folder / HEAD_FILE)
    assert ident == timing_cache.identity(cfg, folder) and "head" not in ident
    assert [HEAD_FILE, 4] == ident["checkpoint"][2][:2]
    _later(folder / HEAD_FILE)
    assert timing_cache.identity(cfg, folder, folder / HEAD_FILE) != ident


def test_the_runtime_keys_its_timings_by_the_attached_head(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    head = _write_head(path, seed=0)
    loaded = load(path)
    cfg = config(str(tmp_path), model=str(path), max_model_len=32, max_num_batched_tokens=64)

    async def kept() -> dict:
        with trio.fail_after(120):
            async with open_runtime(cfg, loaded=loaded, warmup=False) as rt:
                return rt._kept_timings.identity

    assert trio.run(kept) == timing_cache.identity(cfg, path, head)
