"""64 concurrent requests through ``spectrio serve`` in a subprocess, over ipc and tcp.

Every token arrives exactly once and in order (sequence numbers), outputs equal the
in-process runtime's, and greedy outputs equal the reference generator's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import zmq
from pipeline_helpers import oracle, prompts

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.wire.stream_assembler import StreamAssembler
from spectrio.wire.sync_client import Client

N = 64
MAX_TOKENS = 16


def params_for(i: int) -> SamplingParams:
    if i % 8 == 7:  # some seeded sampling, compared with the in-process runtime
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=i)
    return SamplingParams(max_tokens=MAX_TOKENS)


def config_text() -> str:
    return (
        'dtype = "float64"\nmax_model_len = 256\nmax_num_seqs = 64\n'
        "max_num_batched_tokens = 1024\n[speculative]\nnum_speculative_tokens = 2\n"
    )


async def in_process(batch: list[list[int]]) -> list[list[int]]:
    cfg = RuntimeConfig(
        dtype="float64",
        max_model_len=256,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        speculative=SpeculativeConfig(num_speculative_tokens=2),
    )
    out: list[list[int]] = [[] for _ in batch]
    with trio.fail_after(300):
        async with open_runtime(cfg) as rt:

            async def one(i: int) -> None:
                async for delta in rt.generate(batch[i], params_for(i)):
                    out[i] += delta.token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(batch)):
                    nursery.start_soon(one, i)
    return out


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_64_concurrent_requests_through_a_serve_subprocess(
    transport: str, tmp_path: Path, bundled64: object
) -> None:
    base = prompts(bundled64.tokenizer)  # type: ignore[attr-defined]
    batch = [base[i % len(base)][: 4 + i % 29] for i in range(N)]
    (tmp_path / "c.toml").write_text(config_text())
    endpoints = (
        ["--run-dir", str(tmp_path / "run")]
        if transport == "ipc"
        else ["--requests", "tcp://127.0.0.1:*", "--outputs", "tcp://127.0.0.1:*"]
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spectrio.tools.cli",
            "serve",
            "--config",
            str(tmp_path / "c.toml"),
            *endpoints,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stdout is not None
        eps = json.loads(server.stdout.readline())
        assert eps["requests"].startswith(f"{transport}://")
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVTIMEO, 120_000)
        pull.connect(eps["outputs"])
        assembler = StreamAssembler(bundled64.tokenizer)  # type: ignore[attr-defined]
        got: dict[str, list[int]] = {}
        with Client(eps["requests"], None, context=ctx, stream=False) as client:
            rids = [
                client.submit(p, params_for(i), request_id=f"r{i}") for i, p in enumerate(batch)
            ]
            done: set[str] = set()
            while len(done) < N:
                for chunk in assembler.feed(pull.recv_multipart()):
                    tokens = got.setdefault(chunk.request_id, [])
                    assert chunk.seqno == len(tokens)  # exactly once, in order
                    tokens += chunk.token_ids
                    if chunk.finished:
                        done.add(chunk.request_id)
        pull.close()
        ctx.term()
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0
    want = trio.run(in_process, batch)
    for i, rid in enumerate(rids):
        assert got[rid] == want[i]
        if params_for(i).temperature == 0.0:
            assert got[rid] == oracle("float64", batch[i], MAX_TOKENS)
