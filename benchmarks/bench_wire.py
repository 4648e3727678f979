"""Wire benchmark: a ``spectrio serve`` subprocess publishes, this process consumes.

Submits ``--batch`` concurrent requests (held-out prompts, ``ignore_eos``) over the
ROUTER socket, reads every step from the PUSH socket, reassembles and detokenises the
streams, and reports tokens per second published and decoded (first submit to last
finish) and the bytes per step on the output socket (envelope + record frames).

Run: ``python benchmarks/bench_wire.py [--batch 64 256] [--k 3] [--logprobs off 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from spectrio.core.params import SamplingParams
from spectrio.models import load
from spectrio.tools.measurement.bench import bench_prompts
from spectrio.wire.client import Client, StreamAssembler


def run_case(
    batch: int, k: int, logprobs: int | None, max_tokens: int, prompt_tokens: int
) -> dict[str, object]:
    prompts = bench_prompts(batch, prompt_tokens, "bundled")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.toml"
        cfg.write_text(
            f"max_num_seqs = {batch}\nmax_num_batched_tokens = {max(2048, batch * (k + 1))}\n"
            f"max_model_len = 512\n[speculative]\nnum_speculative_tokens = {k}\n"
        )
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spectrio.tools.cli",
                "serve",
                "--config",
                str(cfg),
                "--run-dir",
                tmp,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert server.stdout is not None
            endpoints = json.loads(server.stdout.readline())
            tok = load("bundled").tokenizer
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            pull = ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.RCVTIMEO, 120_000)
            pull.connect(endpoints["outputs"])
            assembler = StreamAssembler(tok)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
            with Client(endpoints["requests"], None, stream=False) as client:
                t0 = time.perf_counter()
                for p in prompts:
                    client.submit(p, params)
                done, tokens, steps, nbytes = 0, 0, 0, 0
                while done < batch:
                    frames = pull.recv_multipart()
                    steps += 1
                    nbytes += sum(len(f) for f in frames)
                    for chunk in assembler.feed(frames):
                        tokens += len(chunk.token_ids)
                        done += chunk.finished
                wall = time.perf_counter() - t0
            pull.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {
        "batch": batch,
        "k": k,
        "logprobs": logprobs,
        "tokens": tokens,
        "seconds": round(wall, 2),
        "tokens_per_second": round(tokens / wall, 1),
        "steps": steps,
        "bytes_per_step": round(nbytes / steps, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--logprobs", nargs="+", default=["off", "5"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    args = p.parse_args(argv)
    print(
        f"machine: {platform.machine()} cores={os.cpu_count()}; "
        f"k={args.k} max_tokens={args.max_tokens}"
    )
    for b in args.batch:
        for lp in args.logprobs:
            row = run_case(
                b, args.k, None if lp == "off" else int(lp), args.max_tokens, args.prompt_tokens
            )
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
