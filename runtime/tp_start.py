"""Starting and stopping a tensor-parallel group from rank 0, on the Trio side."""

from __future__ import annotations

from functools import partial

import structlog
import trio

from spectrio.core.config import ConfigError, RuntimeConfig
from spectrio.errors import EngineDead
from spectrio.models import LoadedModel
from spectrio.models.architecture.parallel import check_divisible, load_sharded
from spectrio.models.loading.loader import model_config
from spectrio.runtime.kv_sizing import num_kv_blocks
from spectrio.runtime.tp import GroupEnv, GroupSetup, TPGroup, check_can_join

log = structlog.get_logger("spectrio.runtime.tp")

__all__ = ["start_group", "stop_group"]


async def _watch_start(group: TPGroup) -> None:
    """While the group forms: a started follower that exits fails the start."""
    while True:
        dead = group.dead_rank()
        if dead is not None:
            raise EngineDead(f"rank {dead[0]}", dead[1])
        await trio.sleep(0.2)


async def start_group(config: RuntimeConfig, warmup: bool) -> tuple[TPGroup, LoadedModel]:
    """Form the group with this process as rank 0 and load rank 0's shard.

    Launched by ``paddle.distributed.launch`` (its rank environment is set), this must be
    rank 0 of a group of ``tensor_parallel_size``; otherwise the followers are started
    here on 127.0.0.1. The model's divisibility is checked before anything starts."""
    size = config.tensor_parallel_size
    # GGUF files and heads beside a model included: the config load() will give.
    model_cfg = model_config(config.model)
    check_divisible(model_cfg, size)
    check_can_join()
    env = GroupEnv.from_environ()
    if env is None:
        env = GroupEnv.local(size)
        spawn = True
    else:
        if env.size != size:
            raise ConfigError(
                f"tensor_parallel_size: {size}, but the launcher started "
                f"{env.size} ranks (PADDLE_TRAINERS_NUM)"
            )
        if env.rank != 0:
            raise ConfigError(
                f"tensor parallel: open_runtime runs on rank 0 only; this is rank {env.rank} "
                "(run `python -m spectrio.runtime.tp_follower` there)"
            )
        spawn = False
    group = TPGroup(env)
    try:
        if spawn:
            group.spawn_followers()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_start, group)
            tp = await trio.to_thread.run_sync(group.join, abandon_on_cancel=True)
            num_blocks = num_kv_blocks(config, model_cfg)
            setup = GroupSetup(
                # The name, not the path: a named model's shipped head is found by name.
                model=str(config.model),
                dtype=config.model_dtype,
                num_blocks=num_blocks,
                block_size=config.block_size,
                warmup_tokens=config.warmup_num_tokens() if warmup else 0,
                max_model_len=config.max_model_len,
                num_threads=config.resolve_num_threads(),
                speculative=config.speculative,
            )
            assert group.link is not None
            await trio.to_thread.run_sync(group.link.send_setup, setup, abandon_on_cancel=True)
            loaded = await trio.to_thread.run_sync(
                partial(load_sharded, serving=True),
                config.model,
                tp,
                config.model_dtype,
                abandon_on_cancel=True,
            )
            nursery.cancel_scope.cancel()
    except BaseException:
        group.stop_followers(kill=True)
        raise
    log.info("tensor-parallel group up", size=size, spawned=spawn)
    return group, loaded


async def stop_group(group: TPGroup, *, dead: bool) -> None:
    """After the stages ended (the device worker sent the stop message): let started
    followers exit, killing any that do not within 10 s; after a failure, kill them at
    once (they may be blocked in a collective with a dead peer)."""
    if dead:
        group.stop_followers(kill=True)
    else:
        await trio.to_thread.run_sync(group.stop_followers, 10.0)
    log.info("tensor-parallel group stopped", dead=dead)
