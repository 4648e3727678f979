"""Every checkpoint problem a new user can hit ends the CLI with ``error: ...`` and exit
status 2, no traceback, and raises :class:`CheckpointError` (or
:class:`ModelConfigError`) with the same message from the embedding API."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from safetensors.numpy import load_file, save_file

from spectrio import RuntimeConfig, open_runtime
from spectrio.errors import CheckpointError, ModelConfigError
from spectrio.models import load
from spectrio.tools.cli.commands import main

ARCHS = Path(__file__).resolve().parent / "data" / "archs"


def _folder(tmp_path: Path) -> Path:
    """A loadable Qwen2 folder (weights in index shards) with a tokenizer of 20 tokens."""
    folder = tmp_path / "model"
    shutil.copytree(ARCHS / "qwen2", folder)
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(20)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    return folder


def _edit_config(**changes: object) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))

    return edit


def _drop_tensor(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    file = folder / index["weight_map"].pop(name)
    tensors = load_file(str(file))
    del tensors[name]
    save_file(tensors, str(file))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _corrupt(folder: Path) -> None:
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])


def _missing_shard(folder: Path) -> None:
    sorted(folder.glob("*.safetensors"))[-1].unlink()


def _big_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(500)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))


CASES: dict[str, tuple[Callable[[Path], None] | None, str]] = {
    "no such path": (None, r"neither a name .* a directory nor a \.gguf file"),
    "unknown architecture": (
        _edit_config(architectures=["MambaForCausalLM"]),
        "unknown architecture 'MambaForCausalLM'",
    ),
    "unknown field": (
        _edit_config(attn_logit_softcapping=30.0),
        "config field 'attn_logit_softcapping' is not implemented for Qwen2ForCausalLM",
    ),
    "unsupported rope": (
        _edit_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        "rope_scaling type 'yarn' is not supported",
    ),
    "missing tensor": (_drop_tensor, "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    "corrupt file": (_corrupt, "corrupt or unreadable safetensors file"),
    "missing shard": (_missing_shard, "lists shard .* which is missing"),
    "tokenizer mismatch": (_big_tokenizer, "tokenizer has 500 tokens but .* 96 rows"),
}


def _model_arg(tmp_path: Path, case: str) -> str:
    edit, _ = CASES[case]
    if edit is None:
        return str(tmp_path / "no" / "such" / "dir")
    folder = _folder(tmp_path)
    edit(folder)
    return str(folder)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_prints_error_and_exits_2(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model_arg(tmp_path, case)
    code = main(["generate", "hi", "--model", model, "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert __import__("re").search(CASES[case][1], lines[0]), lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("case", sorted(CASES))
def test_embedding_api_raises_the_same_message(tmp_path: Path, case: str) -> None:
    model = _model_arg(tmp_path, case)
    with pytest.raises((CheckpointError, ModelConfigError), match=CASES[case][1]) as direct:
        load(model)

    async def run() -> None:
        with trio.fail_after(60):
            async with open_runtime(RuntimeConfig(model=model)):
                pass

    with pytest.raises((CheckpointError, ModelConfigError)) as api:
        trio.run(run)
    assert str(api.value) == str(direct.value)


def test_a_real_process_exits_2_without_a_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "spectrio.tools.cli", "generate", "x", "--model",
         str(tmp_path / "no" / "such" / "dir")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    # one line for the user, nothing else: no traceback, and no warning of Paddle's
    # import (it warns when ccache is missing, which CI's machine may well be)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model "), proc.stderr


def test_convert_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 32)
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.gguf" in err and "Traceback" not in err
    assert main(["convert", str(tmp_path / "none.gguf"), str(tmp_path / "out")]) == 2
    assert "no such file" in capsys.readouterr().err
