"""A moved module's old import path keeps working and names the new one."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

from spectrio._moved import moved_modules


def test_old_path_warns_and_gives_the_same_objects() -> None:
    moved_modules({"spectrio.core.probe_old_record": "spectrio.core.record"})
    sys.modules.pop("spectrio.core.probe_old_record", None)
    with pytest.warns(DeprecationWarning, match="moved to spectrio.core.record"):
        old = importlib.import_module("spectrio.core.probe_old_record")
    new = importlib.import_module("spectrio.core.record")
    # The old name is the new module itself: patching through it patches what callers use.
    assert old is new and old.record_width is new.record_width
    assert new.__name__ == "spectrio.core.record"  # the new module is left as it was


def test_unknown_old_path_still_fails() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("spectrio.core.no_such_module_ever")


def _stages_moves() -> dict[str, str]:
    import spectrio.stages

    return dict(spectrio.stages.MOVED)


@pytest.mark.parametrize("old", sorted(_stages_moves()))
def test_every_old_stages_path_imports_and_names_its_new_one(old: str) -> None:
    """issue 59 grouped ``stages/`` by thread: each module's flat path still imports."""
    new = _stages_moves()[old]
    parent, _, leaf = old.rpartition(".")
    with warnings.catch_warnings():  # a parent that moved too (stages.draft)
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module(parent)
    saved = vars(sys.modules[parent]).get(leaf)
    sys.modules.pop(old, None)
    try:
        with pytest.warns(DeprecationWarning, match=f"moved to {re.escape(new)};"):
            module = importlib.import_module(old)
        target = importlib.import_module(new)
        for name in getattr(target, "__all__", []):
            assert getattr(module, name) is getattr(target, name), (old, name)
        if hasattr(target, "__path__"):  # a moved package's submodules import through it
            for sub in [o for o in _stages_moves() if o.startswith(old + ".")]:
                sys.modules.pop(sub, None)
                with pytest.warns(DeprecationWarning):
                    importlib.import_module(sub)
                sys.modules.pop(sub, None)
    finally:  # leave the package as other tests find it
        sys.modules.pop(old, None)
        if parent in sys.modules:
            vars(sys.modules[parent]).pop(leaf, None)
            if saved is not None:
                setattr(sys.modules[parent], leaf, saved)


def _models_moves() -> dict[str, str]:
    import spectrio.models

    moves: dict[str, str] = spectrio.models._MOVED  # type: ignore[attr-defined]
    return moves


@pytest.mark.parametrize("old", sorted(_models_moves()))
def test_every_old_models_path_imports_and_names_its_new_one(old: str) -> None:
    """issue 59 split ``models/`` into rooms: each module's flat path still imports."""
    new = _models_moves()[old]
    parent, _, leaf = old.rpartition(".")
    sys.modules.pop(old, None)
    try:
        with pytest.warns(DeprecationWarning, match=f"moved to {re.escape(new)};"):
            module = importlib.import_module(old)
        target = importlib.import_module(new)
        public = getattr(target, "__all__", None) or [
            n for n in vars(target) if not n.startswith("_")
        ]
        for name in public:
            assert getattr(module, name) is getattr(target, name), (old, name)
    finally:  # leave the package as other tests find it
        sys.modules.pop(old, None)
        vars(sys.modules[parent]).pop(leaf, None)  # the import set the copy there


def test_old_models_paths_name_no_module_that_exists() -> None:
    """An old path is only an alias: no file of that name is left beside the rooms."""
    root = Path(__file__).resolve().parents[1] / "models"
    for old in _models_moves():
        assert not (root / f"{old.rpartition('.')[2]}.py").exists(), old


def test_the_repository_imports_no_old_path() -> None:
    """Old paths are for outside users; the project's own code imports the new ones."""
    import spectrio.models

    moves = {**_models_moves(), **_stages_moves()}
    exported = {f"spectrio.models.{name}" for name in spectrio.models.__all__}
    root = Path(__file__).resolve().parents[1]
    bad: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if any(part.startswith(".") or part == "build" for part in path.relative_to(root).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                names = [n for n in names if n == node.module or n not in exported]
            bad += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n in moves]
    assert not bad, "\n".join(bad)


# The public names each split module had before it was split (7962a8c): every one still
# imports from the old path, and from the module itself where it stayed a public path.
SPLIT_MODULES: dict[str, tuple[str, ...]] = {
    "spectrio.tools.trace": (
        "DeltaLike",
        "Header",
        "Line",
        "PromptLine",
        "ResultBuilder",
        "RunSummary",
        "TRACE_FORMAT",
        "TRACE_VERSION",
        "Tokenizer",
        "Trace",
        "TraceError",
        "TraceRecorder",
        "TraceRequest",
        "TraceResult",
        "TraceWriter",
        "acceptance",
        "add_trace_parser",
        "config_from_fields",
        "format_summary",
        "import_main",
        "import_prompts",
        "load_tokenizer",
        "parse_lines",
        "read_trace",
        "runtime_fields",
        "show_main",
        "summarize",
        "write_trace",
    ),
    "spectrio.tools.bench": (
        "BREAKDOWN",
        "FIXED_512_BYTES",
        "PROMPT_STRIDE",
        "REPEAT_WORKLOAD_HEAD",
        "RequestTrace",
        "SCHEMA",
        "WORKLOADS",
        "agreement",
        "bench_prompts",
        "fixed_layout_bytes",
        "json_row",
        "latency_summary",
        "main",
        "parse_case_k",
        "poisson_arrivals",
        "round_order",
        "run_case",
        "run_interleaved",
        "spec_config",
        "summary_table",
        "timing_summary",
        "trace_path",
    ),
    "spectrio.tools.train_mtp": (
        "Batch",
        "Columns",
        "Features",
        "MESSAGE_TOKENS",
        "PartialGenerations",
        "Run",
        "Sequences",
        "accepted_per_substep",
        "attach_fresh_layer",
        "build_parser",
        "build_prompts",
        "chain_logits",
        "compute_features",
        "current_head_state",
        "frequent_tokens",
        "log",
        "main",
        "make_batch",
        "sample_picks",
        "soft_labels",
        "text_windows",
        "train",
        "user_messages",
        "window_starts",
    ),
    "spectrio.tools.train": (
        "DEFAULT_MODEL",
        "Phase",
        "Trainer",
        "build_parser",
        "chain_accepted",
        "chain_layer",
        "chain_mask",
        "encode_split",
        "heldout_eval",
        "log",
        "lr_at",
        "main",
        "mtp_chain",
        "plot_curves",
        "sample_windows",
        "target_chain",
    ),
    "spectrio.tools.serve_cli": (
        "API_KEY_ENV",
        "add_client_parser",
        "add_keys_parser",
        "add_serve_parser",
        "build_parser",
        "client_main",
        "keys_main",
        "log",
        "main",
        "runtime_config_tp",
        "serve_main",
    ),
    "spectrio.models.model": (
        "DecoderModel",
        "ForwardOutput",
        "HeadLayouts",
        "MTPLayer",
        "SharedHead",
        "SpectrioForCausalLM",
        "build_model",
    ),
    "spectrio.models.gguf_file": (
        "GGUFFile",
        "GGUF_MAGIC",
        "ORIGINAL_CONTEXT",
        "PRE_TOKENIZERS",
        "ROPE_FREQS",
        "ROPE_FREQS_RTOL",
        "SPACE",
        "TOKENIZER_MODELS",
        "is_gguf",
        "llama3_scaling",
        "rope_divisors",
        "spm_merges",
    ),
    "spectrio.stages.scheduling": (
        "IDLE_UNTIMED_S",
        "Scheduler",
        "Sequence",
        "UNTIMED_AFTER_IDLE",
        "draft_slots",
    ),
    "spectrio.stages.spec_policy": (
        "Remaining",
        "STEP_FIXED_SEQS",
        "SpecPolicy",
        "batch_bucket",
        "scale_to_bucket",
    ),
    "spectrio.wire.client": (
        "AsyncClient",
        "Chunk",
        "Client",
        "ClientTimeout",
        "Context",
        "DEFAULT_TIMEOUT_S",
        "Messages",
        "Prompt",
        "RequestRefused",
        "SequenceGap",
        "StreamAssembler",
        "bundled_tokenizer",
        "open_client",
        "tokenizer_for",
    ),
    "spectrio.http_api.app": (
        "BearerAuth",
        "DONE",
        "EventStream",
        "Exchange",
        "Handle",
        "Item",
        "build_app",
        "error_response",
        "log",
        "read_body",
        "run_choices",
    ),
}


@pytest.mark.parametrize("old", sorted(SPLIT_MODULES))
def test_a_split_module_keeps_every_public_name(old: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(old)
    missing = [name for name in SPLIT_MODULES[old] if not hasattr(module, name)]
    assert not missing, (old, missing)


def test_python_m_on_an_old_path_names_the_new_one() -> None:
    import subprocess

    run = subprocess.run(
        [sys.executable, "-m", "spectrio.stages.scheduling"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "moved to spectrio.stages.planning.scheduler" in run.stderr
