"""Every error spectrio raises on purpose has one base, :class:`SpectrioError`.

This module imports nothing from spectrio, so every layer can raise these. The
refusals keep ``ValueError`` as a second base, so ``except ValueError`` written
against earlier versions still catches them.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "CheckpointError",
    "ConfigError",
    "EngineDead",
    "InvalidRequest",
    "ModelConfigError",
    "RefusalCode",
    "SpectrioError",
]


class SpectrioError(Exception):
    """The base of every error spectrio raises on purpose."""


class ConfigError(SpectrioError, ValueError):
    """A configuration value breaks a rule; the message names the field and the rule."""


class ModelConfigError(SpectrioError, ValueError):
    """A config.json that does not describe a model this package can build."""


class CheckpointError(SpectrioError, ValueError):
    """A checkpoint that cannot be loaded completely and exactly."""


class EngineDead(SpectrioError, RuntimeError):
    """A pipeline stage (or a rank) failed; the runtime stopped. Raised in every caller that
    was waiting on it. ``stage`` names where it failed and ``cause`` is what it raised."""

    def __init__(self, stage: str, cause: BaseException | str) -> None:
        self.stage = stage
        self.cause = cause
        what = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"engine dead: stage {stage!r} failed: {what}")


RefusalCode = Literal[
    "wrong_type",
    "invalid_field",
    "invalid_params",
    "empty_prompt",
    "prompt_too_long",
    "no_chat_template",
    "invalid_constraint",
]
"""Which class of refusal an :class:`InvalidRequest` is. The values are the wire's
:class:`spectrio.wire.schema.ErrorCode` values, so the server reports it unchanged."""


class InvalidRequest(SpectrioError, ValueError):
    """A request the runtime refuses. ``str(exc)`` is ``"<field>: <rule>, got <value>"``;
    ``field`` names the field (``"prompt"``, ``"messages"``, ``"request_id"`` or a sampling
    parameter), ``rule`` states what it must be, ``code`` classifies the refusal."""

    def __init__(
        self,
        field: str,
        rule: str | None = None,
        *,
        got: object = ...,
        at: int | None = None,
        code: RefusalCode = "invalid_field",
    ) -> None:
        if rule is None:  # InvalidRequest("field: rule ...") as a plain message
            field, _, rule = field.partition(": ")
        message = f"{field}: {rule}"
        if got is not ...:
            message += f", got {show_value(got)}"
            if at is not None:
                message += f" at index {at}"
        super().__init__(message)
        self.field = field
        self.rule = rule
        self.code: RefusalCode = code


def show_value(value: object, limit: int = 60) -> str:
    """``repr(value)``, shortened to ``limit`` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
