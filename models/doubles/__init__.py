"""spectrio.models.doubles: stand-ins for the real model, for tests and benchmarks; not serving
code. ``reference`` is the oracle (plain greedy generation with the target alone, which
every losslessness test compares against); ``synthetic`` a device that costs a chosen time
and accepts drafts at chosen rates (``--model synthetic:...``), so a benchmark measures the
runtime alone.

Public names: ``reference`` (the module), ``SyntheticModel``, ``SyntheticSpec``,
``load_synthetic``, ``is_synthetic``; each imported on first use."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

_EXPORTS = {
    "reference": "spectrio.models.doubles.reference",
    "SyntheticModel": "spectrio.models.doubles.synthetic",
    "SyntheticSpec": "spectrio.models.doubles.synthetic",
    "load_synthetic": "spectrio.models.doubles.synthetic",
    "is_synthetic": "spectrio.models.doubles.synthetic",
}

__all__ = [
    "SyntheticModel",
    "SyntheticSpec",
    "is_synthetic",
    "load_synthetic",
    "reference",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.models.doubles import reference
    from spectrio.models.doubles.synthetic import (
        SyntheticModel,
        SyntheticSpec,
        is_synthetic,
        load_synthetic,
    )
