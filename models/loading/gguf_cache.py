"""A GGUF file's Hugging Face folder, converted once and kept in the cache folder.

A load that widens a GGUF file's weights to float32 parameters (training, the dense
forward, ``spectrio convert``, a runtime with ``SPECTRIO_GGUF_BLOCKS=0``) would
dequantize every weight in NumPy each time. The folder
:func:`spectrio.models.loading.convert.convert_gguf` writes holds the same weights, exactly
(float32 holds every dequantized value), the same config, tokenizer and chat template,
and opens in a fraction of a second. So the first such load converts the file into
``<cache>/gguf/<key>/`` and every one after that reads the folder;
``tests/test_gguf_cache.py`` checks that both give the same model. A runtime serving the
file's quantized blocks (the default) reads the file itself and never converts it.

Invariants:

* **The key names the file's bytes as the file system reports them**: its resolved path,
  size and modification time, and :data:`FORMAT`, the version of what the folder holds.
  A file rewritten in place gets a new key; a stale folder is never read for it.
* **A folder in the cache is complete.** It is written under a temporary name beside its
  final one and renamed into place, so a crash or a concurrent converter (tensor-parallel
  ranks start together) leaves either nothing or a whole folder; the loser of a race
  discards its copy.
* **The cache never stands in the way.** Set ``SPECTRIO_GGUF_CACHE=0`` to read the file
  itself every time (or to a folder, to keep the conversions there instead); a conversion
  that fails (a full disk, a read-only cache folder) is logged and the file is read
  directly. A converted folder takes the float32 size of the weights (about 4x a Q4
  file); delete ``<cache>/gguf/`` to reclaim it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import structlog

from spectrio.cache_dir import cache_subfolder, publish_folder
from spectrio.models.loading import gguf_vocab

log = structlog.get_logger("spectrio.models.loading.gguf_cache")

__all__ = ["CACHE_ENV", "FORMAT", "cached_folder", "cached_tokenizer_json", "gguf_cache_root"]

CACHE_ENV = "SPECTRIO_GGUF_CACHE"
FORMAT = 1
"""Bump when what a converted folder holds, or how, changes: old folders are then ignored."""

_SHARD_BYTES = 64 << 20  # at most one shard's tensors are held while converting


def gguf_cache_root() -> Path | None:
    """Where converted folders live: ``$SPECTRIO_GGUF_CACHE`` when it names a folder,
    else ``<cache>/gguf``; None when it is ``0``, ``off``, ``false`` or ``no``."""
    return cache_subfolder(CACHE_ENV, "gguf")


def _key(path: Path) -> str:
    real = path.resolve()
    st = real.stat()
    ident = f"{FORMAT}\0{real}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def cached_folder(path: Path) -> Path | None:
    """The converted folder of the GGUF file ``path``, converting it on first use; None
    when the cache is off or the conversion failed (read the file itself then)."""
    root = gguf_cache_root()
    if root is None:
        return None
    folder = root / _key(path)
    if (folder / "config.json").is_file():
        return folder
    from spectrio.models.loading.convert import convert_gguf  # the slow path only

    def convert(tmp: Path) -> None:
        log.info("converting the GGUF file once into the cache", src=str(path), out=str(folder))
        convert_gguf(path, tmp, "float32", shard_bytes=_SHARD_BYTES)
        (tmp / "SOURCE").write_text(f"{path.resolve()}\n")

    try:
        publish_folder(folder, "config.json", convert)
    except OSError as exc:
        log.warning(
            "could not cache the converted GGUF file; reading it directly",
            src=str(path),
            error=str(exc),
        )
        return None
    return folder


def cached_tokenizer_json(path: Path, build: Callable[[], str | None]) -> str | None:
    """The ``tokenizers`` JSON that ``build`` makes of the GGUF file ``path``'s vocabulary,
    kept in ``<cache>/gguf/<key>.tokenizer.json``: rebuilding it from the header's tokens
    and merges is a third of a second of every load, a served file's first token
    included. The key is :func:`_key`'s (the file's path, size and modification time)
    and the source of :mod:`spectrio.models.loading.gguf_vocab`, which builds it, so a
    rewritten file or a changed builder is never served a stale tokenizer. A file
    without a vocabulary (None) is not kept; a cache that cannot be written is skipped
    with a warning, never an error. The file is written whole under a temporary name and
    renamed into place, so a reader finds it complete or not at all."""
    root = gguf_cache_root()
    if root is None:
        return build()
    builder = hashlib.sha256(Path(gguf_vocab.__file__).read_bytes()).hexdigest()[:12]
    kept = root / f"{_key(path)}-{builder}.tokenizer.json"
    try:
        return kept.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    raw = build()
    if raw is None:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{kept.name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(raw)
        os.replace(tmp, kept)
    except OSError as exc:
        log.warning("could not keep the GGUF file's tokenizer", src=str(path), error=str(exc))
    return raw
