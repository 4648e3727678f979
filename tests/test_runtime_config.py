"""Planning rules of RuntimeConfig / SpeculativeConfig (docs/architecture.md, *Capacity
planning*)."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

from spectrio.core.config import BASE_CAPTURE_SIZES, kv_bytes_per_block
from spectrio.runtime import ConfigError, RuntimeConfig, SpeculativeConfig


def spec(k: int, **kwargs: Any) -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=k, **kwargs)


NO_SPEC = SpeculativeConfig(method=None)


def cfg(k: int | None = 2, **kwargs: Any) -> RuntimeConfig:
    speculative = NO_SPEC if k is None else spec(k)
    return RuntimeConfig(speculative=speculative, **kwargs)


def raises_naming(field_name: str) -> Any:
    return pytest.raises(ConfigError, match=field_name)


# --------------------------------------------------------------------- defaults


def test_defaults_are_valid() -> None:
    c = RuntimeConfig()
    assert c.speculative == SpeculativeConfig(method="mtp", num_speculative_tokens=4)
    assert c.tokens_per_seq == 5
    assert c.dtype_bytes == 4
    assert c.graph_capture_sizes == None  # noqa: E711  (the user-given field value)
    assert not c.graph_capture_sizes


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_config_is_frozen_and_hashable() -> None:
    c = RuntimeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_num_seqs = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.graph_capture_sizes = (3,)  # type: ignore[misc]
    assert hash(c) == hash(RuntimeConfig())
    assert c == RuntimeConfig()


# ----------------------------------------------------------- speculative config


def test_tokens_per_seq() -> None:
    for k in range(1, 6):
        assert spec(k).tokens_per_seq == k + 1
        assert spec(k).num_draft_tokens == k
        assert spec(k).enabled
    assert NO_SPEC.tokens_per_seq == 1
    assert NO_SPEC.num_draft_tokens == 0
    assert not NO_SPEC.enabled
    # k is ignored with no speculation
    assert SpeculativeConfig(method=None, num_speculative_tokens=4).tokens_per_seq == 1


def test_num_model_steps_defaults_to_k() -> None:
    assert spec(3).num_model_steps is None
    assert spec(3).effective_num_model_steps == 3
    assert spec(3, num_model_steps=1).effective_num_model_steps == 1
    assert spec(3, num_model_steps=3).effective_num_model_steps == 3
    assert NO_SPEC.effective_num_model_steps == 0


@pytest.mark.parametrize("k", [0, 6, -1, 100])
def test_k_outside_1_to_5_rejected(k: int) -> None:
    with raises_naming("num_speculative_tokens"):
        spec(k)


def test_k_must_be_int() -> None:
    with raises_naming("num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=2.0)  # type: ignore[arg-type]
    with raises_naming("num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=True)


@pytest.mark.parametrize(("k", "steps"), [(2, 3), (1, 2), (3, 0), (5, 6), (3, -1)])
def test_num_model_steps_outside_1_to_k_rejected(k: int, steps: int) -> None:
    with raises_naming("num_model_steps"):
        spec(k, num_model_steps=steps)


def test_unknown_method_rejected() -> None:
    with raises_naming("method"):
        SpeculativeConfig(method="eagle")


# ------------------------------------------------------------ field validation


@pytest.mark.parametrize(
    "name",
    [
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "block_size",
        "num_kv_blocks",
        "kv_cache_memory_bytes",
    ],
)
@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "8"])
def test_positive_ints(name: str, bad: object) -> None:
    with raises_naming(name):
        RuntimeConfig(**{name: bad})


def test_max_model_len_one_is_accepted() -> None:
    assert RuntimeConfig(max_model_len=1).max_model_len == 1


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("model", ""),
        ("model", 3),
        ("dtype", "float16"),
        ("dtype", "bfloat16"),
        ("role", "verify"),
        ("speculative", 3),
        ("enable_overlap", 1),
        ("seed", -1),
        ("seed", 1.0),
    ],
)
def test_other_fields(name: str, bad: object) -> None:
    with raises_naming(name):
        RuntimeConfig(**{name: bad})


def test_dtypes() -> None:
    assert RuntimeConfig(dtype="float32").dtype_bytes == 4
    assert RuntimeConfig(dtype="float64").dtype_bytes == 8


def test_roles_accepted() -> None:
    for role in ("mixed", "prefill", "decode"):
        assert RuntimeConfig(role=role).role == role


@pytest.mark.parametrize("tp", [0, -2])
def test_tensor_parallel_size_positive(tp: int) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size") as info:
        RuntimeConfig(tensor_parallel_size=tp)
    assert ">= 1" in str(info.value)


def test_tensor_parallel_size_accepted() -> None:
    assert RuntimeConfig(tensor_parallel_size=2).tensor_parallel_size == 2


def test_batched_tokens_must_cover_k_plus_one_per_seq() -> None:
    # 100 seqs * (3 + 1) = 400
    RuntimeConfig(max_num_seqs=100, max_num_batched_tokens=400, speculative=spec(3))
    with pytest.raises(ConfigError, match="max_num_batched_tokens") as info:
        RuntimeConfig(max_num_seqs=100, max_num_batched_tokens=399, speculative=spec(3))
    assert "400" in str(info.value)
    # k + 1 counts, not max_num_seqs alone: 100 would pass a naive check
    with raises_naming("max_num_batched_tokens"):
        RuntimeConfig(max_num_seqs=100, max_num_batched_tokens=100, speculative=spec(1))
    # the rule applies to every role
    with raises_naming("max_num_batched_tokens"):
        RuntimeConfig(max_num_seqs=10, max_num_batched_tokens=29, speculative=spec(2), role="mixed")


def test_no_spec_multiplier_is_one() -> None:
    c = RuntimeConfig(max_num_seqs=100, max_num_batched_tokens=100, speculative=NO_SPEC)
    assert c.tokens_per_seq == 1
    with raises_naming("max_num_batched_tokens"):
        RuntimeConfig(max_num_seqs=100, max_num_batched_tokens=99, speculative=NO_SPEC)
    assert dataclasses.replace(c, role="decode").max_chunk_tokens() == 100


# -------------------------------------------------------------- chunk planning


def test_decode_role_chunk_is_seqs_times_k_plus_one() -> None:
    c = RuntimeConfig(role="decode", max_num_seqs=100, speculative=spec(3))
    assert c.max_chunk_tokens() == 400
    assert c.warmup_num_tokens() == 400


@pytest.mark.parametrize("role", ["mixed", "prefill"])
def test_other_roles_chunk_is_batched_tokens(role: str) -> None:
    c = RuntimeConfig(role=role, max_num_seqs=100, speculative=spec(3))
    assert c.max_chunk_tokens() == 2048
    assert c.warmup_num_tokens() == 400  # one full decode step, not a whole chunk


def test_decode_chunk_for_each_k() -> None:
    for k in range(1, 6):
        c = cfg(k, role="decode", max_num_seqs=32)
        assert c.max_chunk_tokens() == 32 * (k + 1)
    assert cfg(None, role="decode", max_num_seqs=32).max_chunk_tokens() == 32


# --------------------------------------------------------- graph capture sizes


def test_base_list() -> None:
    assert BASE_CAPTURE_SIZES[:5] == (1, 2, 4, 8, 16)
    assert BASE_CAPTURE_SIZES[-1] == 1024
    assert 128 in BASE_CAPTURE_SIZES and 136 not in BASE_CAPTURE_SIZES
    assert 144 in BASE_CAPTURE_SIZES and 272 not in BASE_CAPTURE_SIZES
    assert 288 in BASE_CAPTURE_SIZES and 1016 not in BASE_CAPTURE_SIZES
    assert len(BASE_CAPTURE_SIZES) == 3 + 16 + 8 + 24
    assert list(BASE_CAPTURE_SIZES) == sorted(set(BASE_CAPTURE_SIZES))


@pytest.mark.parametrize(
    ("k", "max_num_seqs", "expected"),
    [
        (2, 10, [3, 6, 12, 24, 30]),
        (1, 1, [2]),
        (1, 2, [2, 4]),
        (1, 3, [2, 4, 6]),
        (1, 4, [2, 4, 8]),
        (1, 8, [2, 4, 8, 16]),
        (1, 20, [2, 4, 8, 16, 32, 40]),
        (2, 1, [3]),
        (2, 8, [3, 6, 12, 24]),
        (3, 1, [4]),
        (3, 5, [4, 8, 16, 20]),
        (3, 16, [4, 8, 16, 32, 64]),
        (3, 17, [4, 8, 16, 32, 64, 68]),
        (None, 10, [1, 2, 4, 8, 10]),
        (None, 16, [1, 2, 4, 8, 16]),
    ],
)
def test_capture_sizes_small(k: int | None, max_num_seqs: int, expected: list[int]) -> None:
    assert cfg(k, max_num_seqs=max_num_seqs).graph_capture_sizes() == expected


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("max_num_seqs", [1, 7, 64, 100, 130, 256, 300, 1024, 1500])
def test_capture_sizes_rule(k: int, max_num_seqs: int) -> None:
    t = k + 1
    c = cfg(k, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs * t)
    sizes = c.graph_capture_sizes()
    cap = max_num_seqs * t
    assert sizes == sorted(set(sizes))
    assert sizes[-1] == cap
    assert all(s % t == 0 for s in sizes)
    assert all(s <= cap for s in sizes)
    expected = {b * t for b in BASE_CAPTURE_SIZES if b * t <= cap} | {cap}
    assert set(sizes) == expected
    for s in sizes:
        assert c.capture_batch_size(s) == s // t


def test_capture_sizes_k3_100_seqs() -> None:
    sizes = cfg(3, max_num_seqs=100).graph_capture_sizes()
    assert sizes == [4, 8, 16] + list(range(32, 400 + 1, 32)) + [400]


def test_capture_sizes_full_list_k1() -> None:
    c = cfg(1, max_num_seqs=1024)
    assert c.graph_capture_sizes() == [2 * b for b in BASE_CAPTURE_SIZES]
    assert c.graph_capture_sizes()[-1] == 2048


def test_user_capture_sizes_sorted() -> None:
    c = cfg(2, max_num_seqs=10, graph_capture_sizes=(30, 3, 12))
    assert c.graph_capture_sizes() == [3, 12, 30]
    assert c.graph_capture_sizes == (30, 3, 12)
    assert c.graph_capture_sizes.given == (30, 3, 12)
    # lists are stored as tuples, so the config stays hashable
    d = cfg(2, max_num_seqs=10, graph_capture_sizes=[6, 3])
    assert d.graph_capture_sizes.given == (6, 3)
    hash(d)


def test_user_capture_sizes_survive_replace_pickle_asdict() -> None:
    c = cfg(2, max_num_seqs=10, graph_capture_sizes=(6, 3))
    r = dataclasses.replace(c, seed=7)
    assert r.graph_capture_sizes == (6, 3) and r.seed == 7
    assert r.graph_capture_sizes() == [3, 6]
    cleared = dataclasses.replace(c, graph_capture_sizes=None)
    assert cleared.graph_capture_sizes.given is None
    assert pickle.loads(pickle.dumps(c)) == c
    assert dataclasses.asdict(c)["graph_capture_sizes"] == (6, 3)
    assert c != cfg(2, max_num_seqs=10)
    assert "graph_capture_sizes=(6, 3)" in repr(c)


@pytest.mark.parametrize(
    ("k", "sizes"),
    [
        (2, (3, 4)),  # 4 is not a multiple of 3
        (1, (3,)),
        (3, (4, 6)),
        (2, (0,)),  # non-positive
        (2, (-3,)),
        (2, (33,)),  # above the cap 10 * 3 = 30 (and not a multiple)
        (2, (33.0,)),
        (2, "3"),
    ],
)
def test_bad_user_capture_sizes(k: int, sizes: Any) -> None:
    with raises_naming("graph_capture_sizes"):
        cfg(k, max_num_seqs=10, graph_capture_sizes=sizes)


def test_user_capture_size_above_cap() -> None:
    with pytest.raises(ConfigError, match="graph_capture_sizes") as info:
        cfg(2, max_num_seqs=10, graph_capture_sizes=(3, 33))
    assert "30" in str(info.value)


def test_user_capture_sizes_without_spec() -> None:
    c = cfg(None, max_num_seqs=10, graph_capture_sizes=(5, 1, 7))
    assert c.graph_capture_sizes() == [1, 5, 7]


def test_capture_batch_size() -> None:
    c = cfg(3, max_num_seqs=100)
    assert c.capture_batch_size(4) == 1
    assert c.capture_batch_size(400) == 100
    assert c.capture_batch_size(128) == 32
    for bad in (6, 401, 1, 0, -4):
        with pytest.raises(ConfigError):
            c.capture_batch_size(bad)
    assert cfg(None).capture_batch_size(7) == 7


def test_captured_size_for_edges() -> None:
    c = cfg(2, max_num_seqs=10)  # [3, 6, 12, 24, 30]
    assert c.captured_size_for(1) == 3
    assert c.captured_size_for(2) == 6
    assert c.captured_size_for(3) == 12  # 9 tokens -> 12
    assert c.captured_size_for(4) == 12  # exactly a captured size
    assert c.captured_size_for(5) == 24
    assert c.captured_size_for(8) == 24
    assert c.captured_size_for(9) == 30
    assert c.captured_size_for(10) == 30  # the cap itself
    assert c.captured_size_for(11) is None  # above the largest
    with pytest.raises(ValueError):
        c.captured_size_for(0)


def test_captured_size_for_holds_batch() -> None:
    for k in (1, 2, 3):
        c = cfg(k, max_num_seqs=300, max_num_batched_tokens=300 * (k + 1))
        sizes = c.graph_capture_sizes()
        for bsz in range(1, 301):
            size = c.captured_size_for(bsz)
            assert size is not None
            assert size >= bsz * (k + 1)
            assert c.capture_batch_size(size) >= bsz
            smaller = [s for s in sizes if s < size]
            assert all(s < bsz * (k + 1) for s in smaller)
        assert c.captured_size_for(301) is None


def test_captured_size_for_user_sizes() -> None:
    c = cfg(1, max_num_seqs=10, graph_capture_sizes=(8, 2))
    assert c.captured_size_for(1) == 2
    assert c.captured_size_for(2) == 8
    assert c.captured_size_for(4) == 8
    assert c.captured_size_for(5) is None


# ------------------------------------------------------------------ KV planning


def test_kv_bytes_per_block_counts_mtp_layer() -> None:
    # 2 * (4 layers + 1 mtp) * 16 * 2 heads * 32 dim * 4 bytes
    c = cfg(2, block_size=16)
    assert c.num_mtp_layers == 1
    assert c.kv_bytes_per_block(4, 2, 32) == 2 * 5 * 16 * 2 * 32 * 4 == 40960
    assert c.kv_bytes_per_block(4, 2, 32, dtype_bytes=8) == 81920
    off = cfg(None, block_size=16)
    assert off.num_mtp_layers == 0
    assert off.kv_bytes_per_block(4, 2, 32) == 2 * 4 * 16 * 2 * 32 * 4 == 32768
    assert cfg(2, dtype="float64").kv_bytes_per_block(4, 2, 32) == 81920


def test_kv_bytes_per_block_function() -> None:
    got = kv_bytes_per_block(
        num_layers=2, num_mtp_layers=1, block_size=8, num_kv_heads=4, head_dim=16, dtype_bytes=8
    )
    assert got == 2 * 3 * 8 * 4 * 16 * 8
    dims = {"block_size": 8, "num_kv_heads": 4, "head_dim": 16, "dtype_bytes": 8}
    with raises_naming("num_layers"):
        kv_bytes_per_block(num_layers=0, num_mtp_layers=1, **dims)
    with raises_naming("num_mtp_layers"):
        kv_bytes_per_block(num_layers=2, num_mtp_layers=-1, **dims)


def test_blocks_per_seq() -> None:
    # 1024 + k=2 slots -> ceil(1026 / 16) = 65
    assert cfg(2).max_slots_per_seq() == 1026
    assert cfg(2).max_blocks_per_seq() == 65
    assert cfg(None).max_slots_per_seq() == 1024
    assert cfg(None).max_blocks_per_seq() == 64
    assert cfg(3, max_model_len=13, block_size=16).max_blocks_per_seq() == 1
    assert cfg(3, max_model_len=14, block_size=16).max_blocks_per_seq() == 2


def test_resolve_num_kv_blocks_explicit() -> None:
    c = cfg(2, num_kv_blocks=100)
    assert c.resolve_num_kv_blocks(4, 2, 32) == 100


def test_resolve_num_kv_blocks_explicit_takes_precedence() -> None:
    c = cfg(2, num_kv_blocks=100, kv_cache_memory_bytes=10**9)
    assert c.resolve_num_kv_blocks(4, 2, 32) == 100


def test_resolve_num_kv_blocks_from_budget() -> None:
    # 40960 bytes per block with MTP (see above); 10 MiB // 40960 = 256
    c = cfg(2, kv_cache_memory_bytes=10 * 1024 * 1024)
    assert c.resolve_num_kv_blocks(4, 2, 32) == 256
    # without speculation a block is 32768 bytes: 320 blocks
    off = cfg(None, kv_cache_memory_bytes=10 * 1024 * 1024)
    assert off.resolve_num_kv_blocks(4, 2, 32) == 320
    # a remainder is dropped
    assert cfg(2, kv_cache_memory_bytes=40960 * 70 + 40959).resolve_num_kv_blocks(4, 2, 32) == 70


def test_resolve_num_kv_blocks_default() -> None:
    c = cfg(2, max_num_seqs=4, max_model_len=100, block_size=16)
    # ceil((100 + 2) / 16) = 7 blocks per sequence, 4 sequences
    assert c.default_num_kv_blocks() == 28
    assert c.resolve_num_kv_blocks(4, 2, 32) == 28


def test_budget_too_small_for_one_sequence() -> None:
    # 65 blocks are needed for one 1024-token sequence with k=2
    ok = cfg(2, kv_cache_memory_bytes=40960 * 65)
    assert ok.resolve_num_kv_blocks(4, 2, 32) == 65
    small = cfg(2, kv_cache_memory_bytes=40960 * 65 - 1)
    with raises_naming("kv_cache_memory_bytes"):
        small.resolve_num_kv_blocks(4, 2, 32)


def test_explicit_blocks_too_few_for_one_sequence() -> None:
    assert cfg(2, num_kv_blocks=65).num_kv_blocks == 65
    with pytest.raises(ConfigError, match="num_kv_blocks") as info:
        cfg(2, num_kv_blocks=64)
    assert "65" in str(info.value)
    # a small pool is fine with a small max_model_len
    assert cfg(2, num_kv_blocks=4, max_model_len=60, block_size=16).num_kv_blocks == 4


def test_num_threads_defaults_to_the_process_cores_and_refuses_bad_values() -> None:
    import os

    assert RuntimeConfig().resolve_num_threads() == len(os.sched_getaffinity(0))
    assert RuntimeConfig(num_threads=3).resolve_num_threads() == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="num_threads"):
            RuntimeConfig(num_threads=bad)  # type: ignore[arg-type]


def test_the_device_worker_thread_gets_the_configured_thread_count() -> None:
    """OpenMP keeps its thread count per thread: a thread started after Paddle was
    configured runs Paddle's own parallel loops on one thread unless it applies the
    count itself, as the device worker does (its 16-row forward was 23% slower)."""
    import ctypes
    import threading
    from pathlib import Path

    from spectrio.models.ops.paddle_setup import configure_paddle, paddle, use_configured_threads

    lib_path = Path(paddle.__file__).parent / "libs" / "libiomp5.so"
    if not lib_path.exists():
        pytest.skip("this Paddle build ships no libiomp5 to ask")
    omp = ctypes.CDLL(str(lib_path))
    before = configure_paddle()
    try:
        configure_paddle(3)  # not the process default, which a new thread starts from
        seen: dict[str, int] = {}

        def probe(name: str, apply: bool) -> None:
            if apply:
                use_configured_threads()
            seen[name] = omp.omp_get_max_threads()

        for name, apply in (("bare", False), ("applied", True)):
            thread = threading.Thread(target=probe, args=(name, apply))
            thread.start()
            thread.join()
        assert seen["applied"] == 3 and seen["bare"] != 3
    finally:
        configure_paddle(before if before is not None else 1)
