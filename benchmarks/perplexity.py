"""A model file's perplexity over a text, measured through spectrio's HTTP server.

Each window of the text is sent to ``POST /v1/completions`` as token ids with ``echo``,
``logprobs: 0`` and ``max_tokens: 0`` (the prompt scored, nothing generated: the way
evaluation tools score a text), so the figure is the served model's own, prompt
logprobs and all (docs/http.md).

The windows follow llama.cpp's ``llama-perplexity`` protocol, so the two figures can be
compared for the same file and text:

* the whole text is tokenized once, with the BOS token in front when the model's
  tokenizer adds one (``tokenizer(text)``);
* it is cut into non-overlapping chunks of ``-c`` tokens (the tail that does not fill a
  chunk is dropped), at most ``--chunks`` of them;
* when the tokenizer adds a BOS, each chunk's first token is replaced by BOS, so every
  chunk starts as a document does;
* in each chunk only the second half is scored: the tokens at positions ``c/2 + 1`` to
  ``c - 1``, each given every token before it in its chunk (``c - 1 - c/2`` tokens per
  chunk), so every scored token has at least ``c/2`` tokens of context;
* perplexity is ``exp`` of the mean negative log-likelihood over all scored tokens.

Usage (from a clone, in the project's environment)::

    python benchmarks/perplexity.py --model FILE.gguf --text TEXT.txt -c 512 --chunks 20
    python benchmarks/perplexity.py --model FILE.gguf --text TEXT.txt --url http://127.0.0.1:8000

Without ``--url`` it starts ``spectrio serve --http 127.0.0.1:0 --no-zmq --model FILE``
(no speculation: it changes no logprob, only speed) and stops it at the end. With
``--url`` it scores on a running server; ``--model`` is still read, for its tokenizer
(it must be the file that server serves). A progress line per chunk goes to stderr; the
summary (perplexity, tokens scored, seconds) to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from spectrio.models.loading.loader import load_tokenizer

START_TIMEOUT_S = 600.0


def windows(
    tokens: Sequence[int], ctx: int, chunks: int | None, bos: int | None
) -> list[list[int]]:
    """The text's non-overlapping chunks of ``ctx`` tokens (llama-perplexity's), each
    starting with ``bos`` when the model adds one."""
    count = len(tokens) // ctx
    if chunks is not None:
        count = min(count, chunks)
    out = []
    for j in range(count):
        window = list(tokens[j * ctx : (j + 1) * ctx])
        if bos is not None:
            window[0] = bos
        out.append(window)
    return out


def scored_half(token_logprobs: Sequence[float | None], ctx: int) -> list[float]:
    """The logprobs llama-perplexity counts in a chunk of ``ctx`` tokens: those of the
    tokens at positions ``ctx // 2 + 1 .. ctx - 1`` (``token_logprobs[k]`` is token k's
    logprob given tokens ``0 .. k - 1``; the first token has none)."""
    if len(token_logprobs) != ctx:
        raise ValueError(f"{len(token_logprobs)} logprobs for a chunk of {ctx} tokens")
    out = token_logprobs[ctx // 2 + 1 : ctx]
    if any(v is None for v in out):
        raise ValueError("a scored token has no logprob")
    return [float(v) for v in out if v is not None]


def bos_of(tokenizer: object) -> int | None:
    """The BOS id the tokenizer puts in front of a text, or None when it adds none."""
    plain = tokenizer.encode("a")  # type: ignore[attr-defined]
    prompt = tokenizer.encode_prompt("a")  # type: ignore[attr-defined]
    if len(prompt) == len(plain) + 1 and prompt[1:] == plain:
        return int(prompt[0])
    return None


@contextmanager
def served(model: str, ctx: int, extra: Sequence[str]) -> Iterator[str]:
    """``spectrio serve --http`` on a free port for ``model``; yields its base URL."""
    cmd = [
        sys.executable, "-m", "spectrio.tools.cli", "serve", "--http", "127.0.0.1:0",
        "--no-zmq", "--model", model, "--no-spec", "--timing-cache", "off",
        "--max-model-len", str(ctx + 16), *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise SystemExit(f"perplexity: the server did not start (exit {proc.poll()}): {cmd}")
        yield str(json.loads(line)["http"])
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def score(url: str, chunks: Sequence[list[int]], ctx: int, timeout_s: float) -> tuple[float, int]:
    """Sum of the scored tokens' logprobs and their count, chunk by chunk (progress on
    stderr)."""
    total, count = 0.0, 0
    t0 = time.perf_counter()
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s) as client:
        for j, window in enumerate(chunks):
            body = {"prompt": window, "max_tokens": 0, "echo": True, "logprobs": 0,
                    "temperature": 0}  # fmt: skip
            r = client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise SystemExit(f"perplexity: chunk {j + 1}: HTTP {r.status_code}: {r.text}")
            lps = scored_half(r.json()["choices"][0]["logprobs"]["token_logprobs"], ctx)
            total += sum(lps)
            count += len(lps)
            print(
                f"[{j + 1}/{len(chunks)}] ppl {math.exp(-total / count):.4f} "
                f"(chunk {math.exp(-sum(lps) / len(lps)):.4f}, {count} tokens, "
                f"{time.perf_counter() - t0:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    return total, count


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Perplexity of a model file over a text, through spectrio's HTTP "
        "server (llama-perplexity's windows)."
    )
    p.add_argument(
        "--model", required=True, help="the model (GGUF file or folder); its tokenizer cuts text"
    )
    p.add_argument("--text", required=True, type=Path, help="a UTF-8 text file")
    p.add_argument("-c", "--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    p.add_argument(
        "--url", default=None, help="a running server (http://HOST:PORT) instead of starting one"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per chunk's request")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more flag for the started server (repeat; e.g. --serve-arg=--threads=2)",
    )
    args = p.parse_args(argv)
    if args.ctx < 4:
        p.error("-c/--ctx must be at least 4")
    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        p.error(f"{args.model} has no tokenizer")
    bos = bos_of(tokenizer)
    tokens = tokenizer.encode_prompt(args.text.read_text(encoding="utf-8"))
    chunks = windows(tokens, args.ctx, args.chunks, bos)
    if not chunks:
        p.error(f"the text has {len(tokens)} tokens: fewer than one chunk of {args.ctx}")
    print(
        f"perplexity: {len(tokens)} tokens, {len(chunks)} chunks of {args.ctx}, "
        f"BOS {'id ' + str(bos) if bos is not None else 'none'}",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    if args.url is not None:
        total, count = score(args.url, chunks, args.ctx, args.timeout)
    else:
        os.environ.setdefault("SPECTRIO_LOG_LEVEL", "warning")
        with served(args.model, args.ctx, args.serve_arg) as url:
            t0 = time.perf_counter()  # scoring time, not the server's start
            total, count = score(url, chunks, args.ctx, args.timeout)
    seconds = time.perf_counter() - t0
    print(
        f"ppl {math.exp(-total / count):.4f}  tokens scored {count}  "
        f"chunks {len(chunks)} x {args.ctx}  seconds {seconds:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
