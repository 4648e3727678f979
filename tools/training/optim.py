"""The learning-rate schedule and the optimizer both trainings use."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["lr_at", "optimizer"]


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``peak`` to 10% by progress 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def optimizer(params: list[Any], lr: float) -> Any:
    from spectrio.models.ops.paddle_setup import paddle

    decay = {p.name for p in params if p.ndim == 2}
    return paddle.optimizer.AdamW(
        learning_rate=lr,
        parameters=params,
        weight_decay=0.1,
        apply_decay_param_fun=lambda name: name in decay,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
        beta2=0.95,
    )
