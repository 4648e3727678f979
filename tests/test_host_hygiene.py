"""Issue 15 item 10: importing spectrio and running a runtime leaves the host process as it
was. Paddle installs C-level handlers for SIGTERM and the fatal signals behind Python's
back, and configures the root logger, when it is imported; spectrio imports it in one
place (``spectrio.models.ops.paddle_setup``), under ``host_state_kept``, which puts both back.

Each check runs in a fresh interpreter that sets its own state first, as a host
application would, then imports spectrio and runs a request."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HOST = textwrap.dedent(
    """
    import faulthandler, json, logging, os, signal, sys, time

    got = []
    def handler(signum, frame):
        got.append(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    faulthandler.enable()  # C-level handlers for SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL
    root = logging.getLogger()
    before = (root.level, list(root.handlers))

    import trio
    from spectrio import RuntimeConfig, SamplingParams, open_runtime

    async def main():
        async with open_runtime(RuntimeConfig(max_model_len=128)) as rt:
            ids = []
            async for delta in rt.generate("def f(x):", SamplingParams(max_tokens=4)):
                ids += delta.token_ids
            return ids

    ids = trio.run(main)
    after = (root.level, list(root.handlers))
    if sys.argv[1:] != ["segv"]:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 5
    while sys.argv[1:] != ["segv"] and len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    logging.basicConfig(level=logging.DEBUG, format="HOST-LOG %(message)s")
    logging.getLogger("host").debug("configured by the host")
    print(json.dumps({
        "tokens": len(ids),
        "signals": got,
        "root_unchanged": before == after,
        "root_level": logging.getLogger().level,
    }), flush=True)
    if sys.argv[1:] == ["segv"]:
        os.kill(os.getpid(), signal.SIGSEGV)  # faulthandler's report, not Paddle's banner
    """
)


def run_host(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HOST, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_the_hosts_signal_handlers_and_root_logger_survive_spectrio() -> None:
    proc = run_host()
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 4
    assert result["signals"] == [signal.SIGTERM, signal.SIGINT]  # the host's handlers ran
    assert result["root_unchanged"]
    assert result["root_level"] == 10  # the host's basicConfig took effect
    assert "HOST-LOG configured by the host" in proc.stderr


def test_the_hosts_fatal_signal_handlers_survive_spectrio() -> None:
    """``faulthandler`` (the host's C-level handler for SIGSEGV) still reports a crash
    after spectrio ran, instead of Paddle's banner."""
    proc = run_host("segv")
    assert proc.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in proc.stderr, proc.stderr[-3000:]
    assert "C++ Traceback" not in proc.stderr and "FatalError" not in proc.stderr


def _imports_paddle(tree: ast.AST) -> list[int]:
    """Lines of ``import paddle`` / ``from paddle ...`` that can be the first import of
    Paddle: any, except ``paddle.<submodule>`` after the guarded import in the same scope."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(
            a.name == "paddle" or a.name.startswith("paddle.") for a in node.names
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "paddle":
            lines.append(node.lineno)
    return lines


def test_paddle_is_imported_only_through_paddle_setup() -> None:
    """Every module of the package takes Paddle from ``spectrio.models.ops.paddle_setup``;
    a direct ``import paddle`` must follow that import in the same module."""
    offenders = []
    packages = ["models", "core", "stages", "runtime", "wire", "tools", "spectrio_root"]
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name == "paddle_setup.py":
                continue
            source = path.read_text()
            direct = _imports_paddle(ast.parse(source))
            if not direct:
                continue
            guard = source.find("from spectrio.models.ops.paddle_setup import")
            first = min(direct)
            guard_line = source[:guard].count("\n") + 1 if guard >= 0 else None
            if guard_line is None or guard_line > first:
                offenders.append(f"{path.relative_to(ROOT)}:{first}")
    assert offenders == []
