"""Checkpoint save/load in Hugging Face layout (``config.json`` + ``*.safetensors``).

Paddle keeps Linear weights as ``[in, out]``; Hugging Face files hold ``[out, in]``.
The MTP layer is stored as DeepSeek-V3 names it: ``model.layers.{num_hidden_layers}.*``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import structlog
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from spectrio.errors import CheckpointError
from spectrio.models.config import BUNDLED_DIR, DType, ModelConfig, ModelConfigError
from spectrio.models.model import SpectrioForCausalLM, build_model
from spectrio.models.paddle_setup import paddle
from spectrio.models.tokenizer import TextTokenizer

log = structlog.get_logger("spectrio.models")


# DeepSeek-V3 stores copies of the shared embedding and head inside the MTP layer;
# spectrio shares the target's, so those copies are shape-checked and not loaded.
_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


@dataclasses.dataclass
class LoadedModel:
    model: SpectrioForCausalLM
    config: ModelConfig
    tokenizer: TextTokenizer | None
    path: Path
    load_seconds: float


def hf_name(paddle_name: str, cfg: ModelConfig) -> str:
    """The Hugging Face tensor name of a parameter (the MTP layer is layer ``L``)."""
    if paddle_name.startswith("mtp."):
        return f"model.layers.{cfg.num_hidden_layers}." + paddle_name[len("mtp.") :]
    return paddle_name


def is_linear(param: paddle.Tensor, name: str) -> bool:
    """Whether a parameter is a linear weight (Paddle ``[in, out]``, Hugging Face ``[out, in]``)."""
    return param.ndim == 2 and not name.endswith("embed_tokens.weight")


STORAGE_DTYPES = ("float32", "float16")
"""Dtypes a checkpoint may be written in. ``load`` widens stored weights to the model's
dtype, so float16 halves the file at the cost of rounding each weight once."""


def state_dict_hf(model: SpectrioForCausalLM, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and layouts, as ``dtype`` arrays."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
    out: dict[str, np.ndarray] = {}
    for name, param in model.named_parameters():
        arr = param.numpy().astype(dtype)
        out[hf_name(name, model.config)] = np.ascontiguousarray(
            arr.T if is_linear(param, name) else arr
        )
    return out


def save_checkpoint(
    model: SpectrioForCausalLM, out_dir: str | Path, dtype: str = "float32"
) -> None:
    """Write ``config.json`` (a Llama config with the MTP layer riding along) and
    ``model.safetensors`` with weights stored in ``dtype`` (float32 or float16)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = state_dict_hf(model, dtype)
    model.config.save(out / "config.json", torch_dtype=dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _read_tensors(folder: Path) -> dict[str, np.ndarray]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({exc})") from exc
        for name, arr in part.items():
            if name in tensors:
                raise CheckpointError(f"{f}: tensor {name!r} appears in more than one file")
            tensors[name] = arr
    return tensors


def resolve_path(path_or_name: str | Path) -> Path:
    if str(path_or_name) == "bundled":
        return BUNDLED_DIR
    path = Path(path_or_name).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"model {str(path_or_name)!r} is neither 'bundled' nor a directory")
    return path


def refuse_unexpected(folder: Path, cfg: ModelConfig, unexpected: set[str]) -> None:
    """Raise :class:`CheckpointError` for a stored tensor the architecture does not have
    (the MTP layer's copies of shared weights and RoPE buffers are tolerated)."""
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    for name in sorted(unexpected):
        suffix = name[len(mtp_prefix) :] if name.startswith(mtp_prefix) else None
        if suffix in _SHARED_COPIES or name.endswith("rotary_emb.inv_freq"):
            continue
        raise CheckpointError(
            f"{folder}: unexpected tensor {name!r} (not part of this architecture)"
        )


def tokenizer_of(folder: Path, cfg: ModelConfig) -> TextTokenizer | None:
    """The checkpoint's ``tokenizer.json``, or None when it has none."""
    path = folder / "tokenizer.json"
    return TextTokenizer.from_file(path, eos_token_id=cfg.eos_token_id) if path.exists() else None


def load(path_or_name: str | Path = "bundled", dtype: DType = "float32") -> LoadedModel:
    """Load ``"bundled"`` or a folder with ``config.json`` and ``*.safetensors``.

    Every parameter must be present with its exact shape; anything missing, misshapen,
    unexpected or unreadable raises :class:`CheckpointError` naming it.

    ``"synthetic[:key=value,...]"`` loads the synthetic benchmark device instead
    (:mod:`spectrio.models.synthetic`).
    """
    if isinstance(path_or_name, str) and path_or_name.split(":", 1)[0] == "synthetic":
        from spectrio.models.synthetic import load_synthetic

        return load_synthetic(path_or_name, dtype)
    t0 = time.perf_counter()
    folder = resolve_path(path_or_name)
    try:
        cfg = ModelConfig.from_json(folder / "config.json")
    except ModelConfigError as exc:
        raise CheckpointError(f"{folder / 'config.json'}: {exc}") from exc
    tensors = _read_tensors(folder)
    model = build_model(cfg, dtype)
    expected: set[str] = set()
    with paddle.no_grad():
        for name, param in model.named_parameters():
            hf = hf_name(name, cfg)
            expected.add(hf)
            if hf not in tensors:
                raise CheckpointError(
                    f"{folder}: missing tensor {hf!r} (expected shape {_hf_shape(param, name)})"
                )
            arr = tensors[hf]
            want = _hf_shape(param, name)
            if list(arr.shape) != want:
                raise CheckpointError(
                    f"{folder}: tensor {hf!r} has shape {list(arr.shape)}, expected {want}"
                )
            if not np.issubdtype(arr.dtype, np.floating):
                raise CheckpointError(f"{folder}: tensor {hf!r} has non-float dtype {arr.dtype}")
            value = arr.T if is_linear(param, name) else arr
            # Widen (e.g. float16 storage) before the model sees it: compute runs in dtype.
            param.set_value(np.ascontiguousarray(value).astype(dtype))
    refuse_unexpected(folder, cfg, set(tensors) - expected)
    model.eval()
    tokenizer = tokenizer_of(folder, cfg)
    seconds = time.perf_counter() - t0
    log.info("model loaded", path=str(folder), dtype=dtype, seconds=round(seconds, 3))
    return LoadedModel(
        model=model, config=cfg, tokenizer=tokenizer, path=folder, load_seconds=seconds
    )


def _hf_shape(param: paddle.Tensor, name: str) -> list[int]:
    shape = list(param.shape)
    return shape[::-1] if is_linear(param, name) else shape
