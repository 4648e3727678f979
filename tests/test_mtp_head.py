"""Where an MTP head is found (models/loading/mtp_head.py): beside the model first, else the head
the package ships for a target with this model's fingerprint, whatever the model is
called; a shipped head keeps its checksum check. The heads here are real files: the
bundled model's MTP layer saved as a head for a headless copy of its target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_train_mtp import headless_copy

from spectrio.errors import CheckpointError
from spectrio.models import LoadedModel, load
from spectrio.models.loading.loader import model_config, open_checkpoint
from spectrio.models.loading.mtp_head import (
    HEAD_FILE,
    SHIPPED_HEADS,
    head_target,
    save_head,
    shipped_head_for,
    target_fingerprint,
)


@pytest.fixture
def target(tmp_path: Path, bundled: LoadedModel) -> Path:
    """A headless copy of the bundled target, named by nothing but its folder."""
    return headless_copy(bundled, tmp_path / "model")


@pytest.fixture
def shipped(
    tmp_path: Path, target: Path, bundled: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """The bundled MTP layer saved as a head for ``target``, shipped under another name."""
    cfg, source, _, _ = open_checkpoint(target, mtp_head=False)
    path = tmp_path / "heads" / "tiny" / HEAD_FILE
    save_head(bundled.model, path, target_fingerprint(cfg, source), dtype="float32")
    monkeypatch.setitem(SHIPPED_HEADS, "tiny", path)
    return path


def test_a_shipped_head_attaches_by_the_fingerprint(target: Path, shipped: Path) -> None:
    assert head_target(shipped) is not None and shipped_head_for(head_target(shipped)) == shipped
    loaded = load(target)  # by its path: no name to look the head up by
    assert loaded.config.has_mtp and loaded.model.mtp is not None
    assert loaded.head_path == shipped
    assert model_config(target).has_mtp  # the config alone agrees with load
    plain = load(target, mtp_head=False)
    assert not plain.config.has_mtp and plain.head_path is None


def test_another_target_gets_no_shipped_head(target: Path, shipped: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(target, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5  # another target: its fingerprint moves
    (other / "config.json").write_text(json.dumps(cfg))
    loaded = load(other)
    assert not loaded.config.has_mtp and loaded.head_path is None
    assert not model_config(other).has_mtp


def test_a_head_beside_the_model_comes_first(
    target: Path, shipped: Path, bundled: LoadedModel
) -> None:
    beside = target / HEAD_FILE
    fingerprint = head_target(shipped)
    assert fingerprint is not None
    save_head(bundled.model, beside, fingerprint)
    assert load(target).head_path == beside
    # a head beside it made for another model is refused, never passed over for the
    # shipped one
    save_head(bundled.model, beside, "0" * 32)
    with pytest.raises(CheckpointError, match="trained for another model"):
        load(target)


def test_a_shipped_head_keeps_its_checksum(target: Path, shipped: Path) -> None:
    sha = shipped.with_name(shipped.name + ".sha256")
    sha.write_text("0" * 64 + f"  {shipped.name}\n")
    with pytest.raises(CheckpointError, match="SHA-256"):
        load(target)
