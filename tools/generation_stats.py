"""Moved: per-request statistics are
:class:`spectrio.stages.output_processor.RequestStats`, part of the one output processor.
``GenerationStats`` keeps working as its name here (the CLI and bench read it). It counts
steps and tokens from a request's deltas and takes acceptance from the final delta: the
scheduler's one count, never counted again."""

from __future__ import annotations

from spectrio.stages.output_processor import RequestStats as GenerationStats

__all__ = ["GenerationStats"]
