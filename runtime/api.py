"""The public embedding API: ``open_runtime``, ``Runtime.generate`` and ``Runtime.chat``.

:func:`open_runtime` is here; :class:`Runtime` is :mod:`spectrio.runtime.engine`'s, and
:class:`Delta` and :class:`RequestStream` are :mod:`spectrio.runtime.streams`' (all three
keep this module as their public path)."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import structlog
import trio

from spectrio.core.config import ConfigError, RuntimeConfig
from spectrio.models import LoadedModel, load
from spectrio.models.ops.paddle_setup import MKL_CPU_TYPE, configure_paddle
from spectrio.runtime.engine import Runtime
from spectrio.runtime.streams import Delta, RequestStream
from spectrio.runtime.tp import TPGroup

__all__ = ["Delta", "RequestStream", "Runtime", "open_runtime"]

log = structlog.get_logger("spectrio.runtime")


@asynccontextmanager
async def open_runtime(
    config: RuntimeConfig | None = None,
    *,
    encoded_channels: bool = False,
    warmup: bool = True,
    shutdown_timeout: float = 30.0,
    loaded: LoadedModel | None = None,
) -> AsyncIterator[Runtime]:
    """Load the model, run the warm-up pass over ``config.warmup_num_tokens()`` tokens,
    start the five stages, and yield the running :class:`Runtime`.

    ``loaded``: a checkpoint already loaded (:func:`spectrio.models.load`) to run instead
    of loading ``config.model``; one rank only, in ``config.dtype``. Runtimes may share
    one: their steps then take turns on it (the model's ``step_lock``), since a forward
    pass stages its inputs in buffers the model owns. ``spectrio bench --interleave``
    runs the cases it compares on one copy of the weights (why: its ``run_interleaved``).

    On exit, requests still streaming end with ``finish_reason="abort"`` (reason
    ``"shutdown"``); the control channel closes, the scheduler lets the steps in flight
    return, and the stages end on their channels' end. A stage that does not end within
    ``shutdown_timeout`` seconds is cancelled. If the engine died (a stage failed),
    leaving the block raises its :class:`EngineDead`.
    """
    config = config or RuntimeConfig()
    threads = configure_paddle(config.resolve_num_threads())
    log.info("paddle configured", threads=threads, mkl_cpu_type=MKL_CPU_TYPE)
    group: TPGroup | None = None
    if loaded is not None:
        if config.tensor_parallel_size > 1:
            raise ConfigError("loaded: a preloaded model runs on one rank only")
        if loaded.model.dtype != config.dtype:
            raise ConfigError(
                f"loaded: the model is {loaded.model.dtype}, the config asks for {config.dtype}"
            )
    elif config.tensor_parallel_size > 1:
        from spectrio.runtime.tp_start import start_group

        group, loaded = await start_group(config, warmup)
    else:
        # Serving only: the runtime's own copy needs no unfused weights.
        loaded = await trio.to_thread.run_sync(
            partial(load, serving=True), config.model, config.model_dtype
        )
    draft: LoadedModel | None = None
    draft_name = config.speculative.draft_model
    if draft_name is not None:
        if group is not None:
            raise ConfigError(
                "draft_model: a draft model of its own runs on one rank only; with tensor "
                "parallelism the target drafts for itself (draft_model=None, draft_layers)"
            )
        draft = await trio.to_thread.run_sync(
            partial(load, serving=True), draft_name, config.model_dtype
        )
    try:
        rt = Runtime(config, loaded, encoded_channels, group, draft)
        if warmup:
            seconds = await trio.to_thread.run_sync(
                rt.workspace.warmup,
                config.warmup_num_tokens(),
                config.max_model_len,
                abandon_on_cancel=group is not None,
            )
            log.info(
                "warm-up pass done", tokens=config.warmup_num_tokens(), seconds=round(seconds, 3)
            )
    except BaseException:
        if group is not None:
            group.stop_followers(kill=True)
        raise
    # Everything loaded so far (the model, Paddle's and the host's modules) lives as long
    # as the process: move it out of the collector's way, so full collections stay short.
    gc.freeze()
    try:
        async with trio.open_nursery() as nursery:
            await rt._start(nursery)
            try:
                yield rt
            finally:
                rt._shutdown("shutdown")
                if rt._control is not None:
                    rt._control.close()
                with trio.move_on_after(shutdown_timeout) as waited:
                    waited.shield = True
                    await rt._stopped.wait()
                if waited.cancelled_caught:
                    log.warning("stages did not end in time; cancelling", seconds=shutdown_timeout)
                nursery.cancel_scope.cancel()
                rt._kept_timings.keep(rt._actor)
    finally:
        if group is not None:
            from spectrio.runtime.tp_start import stop_group

            with trio.CancelScope(shield=True):
                await stop_group(group, dead=rt._dead is not None)
    if rt._dead is not None:  # also for a caller that never waited on the engine
        raise rt._dead
