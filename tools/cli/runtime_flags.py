"""The command-line flags that build a RuntimeConfig, shared by ``generate``, ``serve`` and
``replay``: generated from the config dataclasses, one flag per field.

Every field of :class:`~spectrio.core.config.RuntimeConfig` and of
:class:`~spectrio.core.config.SpeculativeConfig` has exactly one flag, and its help text
lives here, in :data:`RUNTIME_FLAGS`, and nowhere else. A field added to either
dataclass without an entry here fails at import (and in ``tests/test_runtime_flags.py``),
so the CLI cannot fall behind the config. The flag's type, choices and default come from
the field itself.

A flag that is not given leaves its field alone: the field keeps the dataclass default,
or the value from ``--config FILE`` (TOML or JSON, ``runtime/config_file.py``). Flags
given win over the file, field by field.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

from spectrio.core.config import (
    DTYPE_BYTES,
    ROLES,
    SPEC_METHODS,
    RuntimeConfig,
    SpeculativeConfig,
)

__all__ = [
    "RUNTIME_FLAGS",
    "FlagSpec",
    "add_runtime_flags",
    "flag_overrides",
    "parse_runtime_flags",
    "runtime_config",
    "runtime_flag_specs",
]

_DEST: Final = "runtime."  # namespace attributes: runtime.<field> / runtime.speculative.<field>


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """The flag of one config field: ``path`` is the field (``speculative.<name>`` for a
    SpeculativeConfig field), ``flag`` its option string (a ``--x`` / ``--no-x`` pair
    for a bool), ``help`` its text without the default, which is added from the field."""

    path: str
    flag: str
    help: str
    metavar: str | None = None


RUNTIME_FLAGS: Final[tuple[FlagSpec, ...]] = (
    FlagSpec(
        "model",
        "--model",
        "'bundled', 'smollm2', a checkpoint folder, a .gguf file or 'synthetic:...' "
        "(models/doubles/synthetic.py)",
        "PATH",
    ),
    FlagSpec("dtype", "--dtype", "compute dtype"),
    FlagSpec("max_num_seqs", "--max-num-seqs", "most requests in one step's batch", "N"),
    FlagSpec(
        "max_num_batched_tokens",
        "--max-num-batched-tokens",
        "most tokens one step computes (>= max_num_seqs * (k + 1))",
        "N",
    ),
    FlagSpec(
        "max_model_len",
        "--max-model-len",
        "most tokens per request, prompt and output together",
        "N",
    ),
    FlagSpec("block_size", "--block-size", "tokens per KV block", "N"),
    FlagSpec(
        "num_kv_blocks",
        "--num-kv-blocks",
        "KV blocks per cache ('none': from "
        "--kv-cache-memory-bytes, else enough for max_num_seqs full-length requests)",
        "N",
    ),
    FlagSpec(
        "kv_cache_memory_bytes",
        "--kv-cache-memory-bytes",
        "KV cache budget in bytes, when --num-kv-blocks is not given",
        "BYTES",
    ),
    FlagSpec("role", "--role", "which steps this runtime runs"),
    FlagSpec(
        "graph_capture_sizes",
        "--graph-capture-sizes",
        "explicit capture sizes, each a multiple of k + 1",
        "N",
    ),
    FlagSpec(
        "tensor_parallel_size",
        "--tensor-parallel-size",
        "ranks in the tensor-parallel group (started here as follower processes, "
        "or by `python -m paddle.distributed.launch`; docs/tensor_parallel.md)",
        "N",
    ),
    FlagSpec(
        "enable_overlap",
        "--overlap",
        "overlap scheduling: plan step n+1 while step n runs on the device",
    ),
    FlagSpec(
        "enable_prefix_caching",
        "--prefix-caching",
        "reuse the KV of full prompt blocks that requests share (target and MTP); requests "
        "with different cache_salt never share (--no-prefix-caching: off)",
    ),
    FlagSpec(
        "seed",
        "--runtime-seed",
        "seed of the runtime's shared generator (requests "
        "without a seed of their own draw from it)",
        "N",
    ),
    FlagSpec(
        "num_threads",
        "--threads",
        "CPU math threads ('none': every core this process may use)",
        "N",
    ),
    FlagSpec(
        "stall_timeout_s",
        "--stall-timeout-s",
        "seconds with open requests and no completed step, or with the publisher held by "
        "one record sink, after which the runtime reports itself unhealthy (/health 503); "
        "a sink holding the publisher half as long is logged",
        "S",
    ),
    FlagSpec(
        "speculative.method",
        "--spec",
        "speculative decoding with the model's MTP draft head (--no-spec: off, one token per "
        "step; --spec-method picks another draft method)",
    ),
    FlagSpec(
        "speculative.num_speculative_tokens",
        "--k",
        "most drafted tokens per sequence per step (1..5)",
        "K",
    ),
    FlagSpec(
        "speculative.num_model_steps",
        "--num-model-steps",
        "MTP substeps per step (1..k; 'none': k)",
        "N",
    ),
    FlagSpec(
        "speculative.adaptive",
        "--adaptive",
        "let each step draft 0..k tokens, "
        "whichever the measured acceptance and step times say is fastest "
        "(--no-adaptive: always k)",
    ),
    FlagSpec(
        "speculative.prompt_lookup_max",
        "--prompt-lookup-max",
        "n-gram drafting: the longest suffix of a request's tokens looked up earlier in it",
        "N",
    ),
    FlagSpec(
        "speculative.prompt_lookup_min",
        "--prompt-lookup-min",
        "n-gram drafting: the shortest suffix looked up",
        "N",
    ),
    FlagSpec(
        "speculative.draft_model",
        "--draft-model",
        "--spec-method draft_model: the model that drafts (a name, folder or .gguf file "
        "whose vocabulary is the target's; 'none': the target itself)",
        "PATH",
    ),
    FlagSpec(
        "speculative.draft_layers",
        "--draft-layers",
        "--spec-method draft_model: draft with the model's first N layers only "
        "(self-speculation with the target; 'none': all of them)",
        "N",
    ),
    FlagSpec(
        "speculative.timing_cache",
        "--timing-cache",
        "where the adaptive policy keeps its measured step times between runs: "
        "'auto' ($SPECTRIO_CACHE_DIR, else $XDG_CACHE_HOME/spectrio or ~/.cache/spectrio), "
        "'off', or a folder",
        "DIR",
    ),
)
"""One flag per config field, in ``--help`` order. The only place their help lives."""

_SPEC_METHOD: Final = "mtp"  # what --spec selects; --spec-method names any of SPEC_METHODS
# --spec-method picks the draft method; --no-spec still turns speculation off whatever it
# says. Its own dest (outside the runtime namespace): speculative.method keeps one action.
_METHOD_FLAG: Final = "--spec-method"
_METHOD_DEST: Final = "spec_method"


def _config_fields() -> list[tuple[str, dataclasses.Field[Any], Any]]:
    """(path, field, default) of every RuntimeConfig and SpeculativeConfig field."""
    base, spec = RuntimeConfig(), SpeculativeConfig()
    out: list[tuple[str, dataclasses.Field[Any], Any]] = []
    for f in dataclasses.fields(RuntimeConfig):
        if f.name == "speculative":
            out += [
                (f"speculative.{g.name}", g, getattr(spec, g.name))
                for g in dataclasses.fields(SpeculativeConfig)
            ]
        elif f.name == "graph_capture_sizes":
            out.append((f.name, f, None))  # reads back as a planner; None: not given
        else:
            out.append((f.name, f, getattr(base, f.name)))
    return out


def _optional_int(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'none', got {text!r}") from None


def _optional_str(text: str) -> str | None:
    return None if text.strip().lower() == "none" else text


def _show(value: Any) -> str:
    return (
        "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


_COMMAND_DEFAULTS = "runtime_command_defaults"


def runtime_flag_specs() -> list[tuple[FlagSpec, dataclasses.Field[Any], Any]]:
    """Every config field with its flag and default, in :data:`RUNTIME_FLAGS` order.
    Raises ``RuntimeError`` when a field has no flag or a flag names no field."""
    fields = {path: (f, default) for path, f, default in _config_fields()}
    specs = {s.path: s for s in RUNTIME_FLAGS}
    missing = sorted(set(fields) - set(specs))
    extra = sorted(set(specs) - set(fields))
    if missing or extra or len(specs) != len(RUNTIME_FLAGS):
        raise RuntimeError(
            f"tools/cli/runtime_flags.py is out of step with core/config.py: fields without a "
            f"flag {missing}, flags without a field {extra}"
        )
    return [(s, *fields[s.path]) for s in RUNTIME_FLAGS]


def _argument(spec: FlagSpec, f: dataclasses.Field[Any], default: Any) -> dict[str, Any]:
    """argparse keywords for one field, from its annotation and default."""
    kind = str(f.type).replace(" ", "")
    kw: dict[str, Any] = {"dest": _DEST + spec.path, "default": argparse.SUPPRESS}
    shown = f" (default: {_show(default)})"
    if spec.path == "speculative.method":
        return {
            **kw,
            "action": argparse.BooleanOptionalAction,
            "help": spec.help + f" (default: {'on' if default else 'off'})",
        }
    if kind == "bool":
        return {**kw, "action": argparse.BooleanOptionalAction, "help": spec.help + shown}
    if spec.path == "dtype":
        kw["choices"] = tuple(DTYPE_BYTES)
    elif spec.path == "role":
        kw["choices"] = ROLES
    elif kind == "int":
        kw["type"] = int
    elif kind == "float":
        kw["type"] = float
    elif kind == "int|None":
        kw["type"] = _optional_int
    elif kind == "str|None":
        kw["type"] = _optional_str
    elif kind == "_CaptureSizesField":
        kw.update(type=int, nargs="+")
        shown = " (default: planned from max_num_seqs and k)"
    elif kind != "str":
        raise RuntimeError(f"{spec.path}: no flag type for a field of type {kind}")
    if spec.metavar is not None:
        kw["metavar"] = spec.metavar
    return {**kw, "help": spec.help + shown}


def add_runtime_flags(
    p: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None
) -> None:
    """One flag per RuntimeConfig / SpeculativeConfig field, then ``--config``.

    ``defaults``: this command's own defaults for top-level fields (``spectrio generate``
    runs one request, so one batch slot), shown in the help and applied by
    :func:`runtime_config` beneath ``--config`` and the flags."""
    own = dict(defaults or {})
    group = p.add_argument_group(
        "runtime", "the RuntimeConfig fields (flags given win over --config)"
    )
    for spec, f, default in runtime_flag_specs():
        group.add_argument(spec.flag, **_argument(spec, f, own.get(spec.path, default)))
        if spec.path == "speculative.method":
            group.add_argument(
                _METHOD_FLAG,
                dest=_METHOD_DEST,
                default=argparse.SUPPRESS,
                choices=SPEC_METHODS,
                help=f"the draft method (default: {default}): 'mtp', the model's MTP draft "
                "head, or 'ngram', prompt lookup (needs no draft weights)",
            )
    group.add_argument(
        "--config",
        type=str,
        default=None,
        metavar="FILE",
        help="RuntimeConfig as a TOML or JSON file (runtime/config_file.py); flags given "
        "on the command line win over it, field by field",
    )
    p.set_defaults(**{_COMMAND_DEFAULTS: own})


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the command line gave, as a table of the config file's shape
    (SpeculativeConfig fields in a ``speculative`` table); fields not given are absent."""
    table: dict[str, Any] = {}
    given = vars(args)
    for spec in RUNTIME_FLAGS:
        dest = _DEST + spec.path
        if dest not in given:
            continue
        value = given[dest]
        if spec.path == "speculative.method":
            value = _SPEC_METHOD if value else None
        if isinstance(value, list):
            value = tuple(value)
        head, _, name = spec.path.rpartition(".")
        (table.setdefault(head, {}) if head else table)[name] = value
    method = given.get(_METHOD_DEST)
    if method is not None:
        speculative = table.setdefault("speculative", {})
        if speculative.get("method", method) is not None:  # --no-spec wins
            speculative["method"] = method
    return table


def runtime_config(
    args: argparse.Namespace, defaults: Mapping[str, Any] | None = None
) -> RuntimeConfig:
    """The config the flags describe, over ``--config FILE`` when given, over
    ``defaults`` (a command's own defaults, for fields neither sets); raises ConfigError
    naming the bad field."""
    from spectrio.runtime.config_file import config_from_table, merge_tables, read_table

    if defaults is None:
        defaults = getattr(args, _COMMAND_DEFAULTS, None)
    table = merge_tables({}, defaults or {})
    if getattr(args, "config", None):
        table = merge_tables(table, read_table(args.config))
    return config_from_table(merge_tables(table, flag_overrides(args)))


def parse_runtime_flags(argv: Sequence[str]) -> RuntimeConfig:
    """The config for ``argv`` (runtime flags only): for tests and embedding scripts."""
    p = argparse.ArgumentParser(prog="spectrio")
    add_runtime_flags(p)
    return runtime_config(p.parse_args(list(argv)))


runtime_flag_specs()  # a field without a flag fails at import, not at first use
