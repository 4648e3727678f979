"""Checkpoint loading: exact round trips and a clear error for every kind of bad checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from conftest import tiny_model
from safetensors.numpy import load_file, save_file

from spectrio.models import CheckpointError, load, save_checkpoint

IDS = paddle.to_tensor(np.array([[3, 14, 15, 92, 65, 35]], dtype=np.int64))


def _logits(model: object) -> np.ndarray:
    with paddle.no_grad():
        return model.forward_dense(IDS)[0].numpy()  # type: ignore[attr-defined]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    save_checkpoint(tiny_model(), tmp_path)
    return tmp_path


@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_gives_identical_logits(tmp_path: Path, tie: bool) -> None:
    model = tiny_model(tie=tie)
    save_checkpoint(model, tmp_path)
    loaded = load(tmp_path)
    np.testing.assert_array_equal(_logits(loaded.model), _logits(model))
    assert loaded.config == model.config
    assert loaded.tokenizer is None


def test_hugging_face_names_and_layout(ckpt: Path) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape == (97, 32)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)  # [out, in]
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == (64, 32)
    # The MTP layer sits after the target's layers, named as DeepSeek-V3 names it.
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
        "self_attn.o_proj.weight",
    ):
        assert f"model.layers.2.{name}" in tensors
    assert tensors["model.layers.2.eh_proj.weight"].shape == (32, 64)


def _rewrite(ckpt: Path, edit: object) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_tensor_is_named(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor 'model.layers.1.mlp.up_proj.weight' \(expected shape \[64, 32\]\)",
    ):
        load(ckpt)


def test_missing_mtp_tensor_is_named(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.pop("model.layers.2.hnorm.weight"))
    with pytest.raises(CheckpointError, match="model.layers.2.hnorm.weight"):
        load(ckpt)


def test_wrong_shape_is_named(ckpt: Path) -> None:
    def edit(t: dict[str, np.ndarray]) -> None:
        t["model.layers.0.self_attn.v_proj.weight"] = np.zeros((32, 32), np.float32)

    _rewrite(ckpt, edit)
    with pytest.raises(
        CheckpointError,
        match=r"'model.layers.0.self_attn.v_proj.weight' has shape \[32, 32\], expected \[16, 32\]",
    ):
        load(ckpt)


def test_unexpected_tensor_is_named(ckpt: Path) -> None:
    def edit(t: dict[str, np.ndarray]) -> None:
        t["model.layers.7.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)

    _rewrite(ckpt, edit)
    with pytest.raises(
        CheckpointError, match="unexpected tensor 'model.layers.7.mlp.up_proj.weight'"
    ):
        load(ckpt)


def test_deepseek_shared_copies_are_accepted(ckpt: Path) -> None:
    def edit(t: dict[str, np.ndarray]) -> None:
        t["model.layers.2.embed_tokens.weight"] = t["model.embed_tokens.weight"].copy()
        t["model.layers.2.shared_head.head.weight"] = t["model.embed_tokens.weight"].copy()

    before = _logits(load(ckpt).model)
    _rewrite(ckpt, edit)
    np.testing.assert_array_equal(_logits(load(ckpt).model), before)


def test_unknown_architecture(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown architecture 'MambaForCausalLM'"):
        load(ckpt)


def test_config_missing_field(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing required field.*hidden_size"):
        load(ckpt)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_file_is_named(ckpt: Path, damage: str) -> None:
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt or unreadable"):
        load(ckpt)


def test_no_weights_and_no_folder(tmp_path: Path, ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load(ckpt)
    with pytest.raises(CheckpointError, match="neither a name .* a directory nor a .gguf file"):
        load(tmp_path / "nope")


def test_sharded_checkpoint_loads_and_duplicates_fail(ckpt: Path) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    (ckpt / "model.safetensors").unlink()
    save_file({n: tensors[n] for n in names[::2]}, str(ckpt / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(ckpt / "model-00002-of-00002.safetensors"))
    load(ckpt)
    save_file({names[0]: tensors[names[0]]}, str(ckpt / "model-extra.safetensors"))
    with pytest.raises(CheckpointError, match="more than one file"):
        load(ckpt)


def test_float64_load(ckpt: Path) -> None:
    loaded = load(ckpt, dtype="float64")
    assert loaded.model.dtype == "float64"
    with pytest.raises(ValueError, match="dtype"):
        load(ckpt, dtype="float16")


def _hf_llama_config(ckpt: Path, **extra: object) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    for key in ("num_nextn_predict_layers", "model_type"):
        cfg.pop(key)
    cfg.update(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_scaling": None,
            "torch_dtype": "float32",
            **extra,
        }
    )
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_plain_hugging_face_llama_checkpoint_loads_without_mtp(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.2.")])
    _hf_llama_config(ckpt)
    loaded = load(ckpt)
    assert loaded.model.mtp is None and loaded.config.num_nextn_predict_layers == 0
    assert loaded.config.architectures == ("LlamaForCausalLM",)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"sliding_window": 16}, "sliding_window=16 is not supported"),
        ({"quantization_config": {"quant_method": "gptq"}}, "field 'quantization_config'"),
    ],
)
def test_features_we_do_not_implement_are_refused(
    ckpt: Path, extra: dict[str, object], message: str
) -> None:
    _hf_llama_config(ckpt, **extra)
    with pytest.raises(CheckpointError, match=message):
        load(ckpt)


def test_checkpoint_is_written_as_a_llama_with_the_mtp_layer_riding_along(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1
    # What a Llama loader needs to build exactly this model.
    assert (
        cfg["hidden_act"] == "silu" and cfg["attention_bias"] is False and cfg["mlp_bias"] is False
    )
    assert cfg["rope_scaling"] is None and cfg["head_dim"] == 8 and cfg["torch_dtype"] == "float32"
    loaded = load(ckpt)
    assert loaded.model.mtp is not None and loaded.config.num_nextn_predict_layers == 1
    ids = IDS[:, :-1]
    with paddle.no_grad():
        _, hidden, _ = loaded.model.forward_dense(ids)
        got = loaded.model.mtp_forward_dense(IDS[:, 1:], hidden)[0].numpy()
        _, hidden, _ = tiny_model().forward_dense(ids)
        want = tiny_model().mtp_forward_dense(IDS[:, 1:], hidden)[0].numpy()
    np.testing.assert_array_equal(got, want)


def test_first_bundled_naming_still_loads(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update({"model_type": "spectrio_mtp", "architectures": ["SpectrioMTPForCausalLM"]})
    for key in (
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "rope_scaling",
        "head_dim",
        "torch_dtype",
    ):
        cfg.pop(key)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    loaded = load(ckpt)
    assert loaded.model.mtp is not None
    np.testing.assert_array_equal(_logits(loaded.model), _logits(tiny_model()))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_float16_storage_is_widened_to_the_model_dtype(tmp_path: Path, dtype: str) -> None:
    model = tiny_model()
    save_checkpoint(model, tmp_path, dtype="float16")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {np.dtype("float16")}
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float16"
    loaded = load(tmp_path, dtype=dtype)  # type: ignore[arg-type]
    assert loaded.model.dtype == dtype
    # Every weight is the float16 value, widened exactly.
    for name, param in loaded.model.named_parameters():
        original = dict(model.named_parameters())[name].numpy()
        np.testing.assert_array_equal(param.numpy(), original.astype(np.float16).astype(dtype))


def test_unknown_storage_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="storage dtype"):
        save_checkpoint(tiny_model(), tmp_path, dtype="int8")


def test_ml_dtypes_is_imported_for_the_first_bfloat16_tensor_only(tmp_path: Path) -> None:
    """Importing ``ml_dtypes`` costs about a second of start-up: loading a model without
    a bfloat16 tensor never imports it, and the first bfloat16 tensor read does (its
    values widened exactly)."""
    import subprocess
    import sys

    import ml_dtypes

    values = np.array([[1.5, -2.25], [3.0, 0.0078125]], dtype=np.float32)
    path = tmp_path / "bf16.safetensors"
    save_file({"w": values.astype(ml_dtypes.bfloat16)}, str(path))
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from safetensors import safe_open\n"
        "from spectrio.models import load\n"
        "from spectrio.models.loading.checkpoint import read_float_slice\n"
        "load('bundled', serving=True)\n"
        "assert 'ml_dtypes' not in sys.modules, 'imported at load'\n"
        f"with safe_open({str(path)!r}, framework='numpy') as f:\n"
        "    got = read_float_slice(f.get_slice('w'), None, 0, 0)\n"
        "assert got.dtype == np.float32, got.dtype\n"
        "assert 'ml_dtypes' in sys.modules\n"
        "print(got.tolist())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(values.tolist())
