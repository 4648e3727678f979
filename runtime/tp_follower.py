"""A follower rank of a tensor-parallel group: ``python -m spectrio.runtime.tp_follower``.

It reads the ``paddle.distributed.launch`` rank environment (:mod:`spectrio.runtime.tp`),
joins the group, takes the :class:`~spectrio.runtime.tp.GroupSetup` from rank 0, loads
its shard, warms up, then runs each step rank 0 broadcasts: the draft and verify stages
in lockstep with rank 0. It never samples, publishes, binds a socket or writes output;
it exits 0 when rank 0 stops the group and non-zero when the group breaks.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

from spectrio.errors import ConfigError

log = structlog.get_logger("spectrio.runtime.tp_follower")


def run_follower() -> int:
    from spectrio.models.architecture.parallel import load_sharded
    from spectrio.models.ops.paddle_setup import configure_paddle
    from spectrio.runtime.tp import GroupEnv, PlanLink, init_collectives, make_workspace
    from spectrio.stages.device import draft as draft_stage
    from spectrio.stages.device import verify as verify_stage

    env = GroupEnv.from_environ()
    if env is None or env.rank == 0:
        raise ConfigError(
            "tp_follower: needs the rank environment of a follower (PADDLE_TRAINER_ID >= 1, "
            "PADDLE_TRAINERS_NUM >= 2, PADDLE_TRAINER_ENDPOINTS, PADDLE_MASTER)"
        )
    tp = init_collectives(env)
    link = PlanLink(tp)
    setup = link.recv_setup()
    configure_paddle(setup.num_threads)
    loaded = load_sharded(setup.model, tp, setup.dtype, serving=True)  # type: ignore[arg-type]
    grammar = None
    if loaded.tokenizer is not None:  # every rank cuts drafts by the same grammar state
        from spectrio.stages.device.grammar import GrammarCompiler

        grammar = GrammarCompiler(
            loaded.tokenizer, loaded.config.vocab_size, loaded.config.eos_token_ids
        )
        grammar.start()  # beside the warm-up, not inside a step rank 0 waits on
    ws = make_workspace(
        loaded.model, setup.num_blocks, setup.block_size, setup.speculative, grammar=grammar
    )
    if setup.warmup_tokens:
        ws.warmup(setup.warmup_tokens, setup.max_model_len)
    log.info("follower ready", rank=tp.rank, size=tp.size)
    steps = 0
    while True:
        plan = link.recv_plan()
        if plan is None:
            log.info("follower stopped", rank=tp.rank, steps=steps)
            return 0
        plan = draft_stage.draft(ws, plan)
        verify_stage.verify(ws, plan)
        ws.end_step(plan)
        steps += 1


def _configure_logging(level: str) -> None:
    """Log to stderr at ``level`` (the serving CLI's format; stdout stays unused)."""
    numeric = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            numeric if isinstance(numeric, int) else logging.WARNING
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


def main() -> int:
    _configure_logging(os.environ.get("SPECTRIO_LOG_LEVEL", "warning"))
    try:
        return run_follower()
    except Exception:
        log.exception("follower failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
