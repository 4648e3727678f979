"""A tensor-parallel group: its rank environment, the plan link from rank 0, followers.

One group, one decision. Rank 0 owns the scheduler, the sampler and the publisher; each
step its device worker broadcasts the *resolved* step plan (msgspec bytes in a uint8
tensor, after an int64 header ``[kind, length]``) before the draft stage, and every rank
then runs draft and verify in lockstep. Followers never sample, so they cannot diverge;
they bind no socket and write no output.

The rank environment is the one ``paddle.distributed.launch`` sets (checked against
Paddle 3.3): ``PADDLE_TRAINER_ID``, ``PADDLE_TRAINERS_NUM``, ``PADDLE_TRAINER_ENDPOINTS``,
``PADDLE_CURRENT_ENDPOINT``, ``PADDLE_MASTER`` (the TCP store) and
``PADDLE_DISTRI_BACKEND`` (``gloo`` on CPU). Without it, rank 0 makes one on 127.0.0.1
and starts the followers itself (``python -m spectrio.runtime.tp_follower``). A follower
needs nothing else: rank 0 broadcasts the :class:`GroupSetup` (model, dtype, cache size)
once the group is up, so every rank builds the same shapes.

Failure. gloo reports a peer whose process died at the next collective (the kernel
closes its sockets), and rank 0 broadcasts a keep-alive every second while idle, so a
dead follower is noticed within seconds, not at the collective timeout. For followers
it started, rank 0 also watches the processes, which names the rank. Followers die
with their parent (``PR_SET_PDEATHSIG``) and exit when rank 0's sockets close.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import structlog

from spectrio.core.config import SpeculativeConfig
from spectrio.core.messages import StepPlan
from spectrio.errors import ConfigError
from spectrio.models import SpectrioForCausalLM
from spectrio.models.architecture.parallel import TPShard
from spectrio.models.ops.paddle_setup import paddle
from spectrio.stages.device.grammar import GrammarCompiler
from spectrio.stages.device.workspace import Workspace

log = structlog.get_logger("spectrio.runtime.tp")

__all__ = [
    "GroupEnv",
    "GroupSetup",
    "PlanLink",
    "TPGroup",
    "make_workspace",
]

KEEPALIVE_S = 1.0
"""Rank 0 broadcasts a keep-alive this often while idle: it keeps followers inside the
collective timeout and notices a dead peer within about this long."""

_PLAN, _KEEPALIVE, _STOP, _SETUP = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class GroupEnv:
    """The ``paddle.distributed.launch`` rank environment of one rank."""

    rank: int
    size: int
    endpoints: tuple[str, ...]
    master: str
    backend: str = "gloo"

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> GroupEnv | None:
        """The launcher's environment, or None when this process was not launched as part
        of a group (no ``PADDLE_TRAINERS_NUM``, or 1)."""
        env = dict(os.environ if environ is None else environ)
        try:
            size = int(env.get("PADDLE_TRAINERS_NUM", "1"))
            if size <= 1:
                return None
            rank = int(env["PADDLE_TRAINER_ID"])
            endpoints = tuple(env["PADDLE_TRAINER_ENDPOINTS"].split(","))
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"tensor parallel: incomplete rank environment ({exc})") from None
        master = env.get("PADDLE_MASTER") or endpoints[0]
        return cls(rank, size, endpoints, master, env.get("PADDLE_DISTRI_BACKEND", "gloo"))

    @classmethod
    def local(cls, size: int) -> GroupEnv:
        """A fresh group on 127.0.0.1 with free ports (this process is rank 0)."""
        ports = _free_ports(size + 1)
        return cls(0, size, tuple(f"127.0.0.1:{p}" for p in ports[1:]), f"127.0.0.1:{ports[0]}")

    def environ(self, rank: int) -> dict[str, str]:
        return {
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_TRAINERS_NUM": str(self.size),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(self.endpoints),
            "PADDLE_CURRENT_ENDPOINT": self.endpoints[rank],
            "PADDLE_MASTER": self.master,
            "PADDLE_DISTRI_BACKEND": self.backend,
        }


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_joined: GroupEnv | None = None


def check_can_join() -> None:
    """A process joins one group in its life (Paddle keeps the default process group and
    its TCP store for good): refuse a second one clearly instead of a collective timeout."""
    if _joined is not None:
        raise ConfigError(
            "tensor_parallel_size: this process already formed a tensor-parallel group "
            f"(rank {_joined.rank} of {_joined.size}); Paddle cannot form another in the "
            "same process: open the next group runtime in a new process"
        )


def init_collectives(env: GroupEnv) -> TPShard:
    """Join the group (blocks until every rank has joined)."""
    import paddle.distributed as dist

    global _joined
    check_can_join()
    _joined = env

    os.environ.update(env.environ(env.rank))
    dist.init_parallel_env()
    if dist.get_rank() != env.rank or dist.get_world_size() != env.size:
        raise ConfigError(
            f"tensor parallel: joined as rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"expected {env.rank} of {env.size} (a group was already initialised?)"
        )
    return TPShard(env.rank, env.size)


class GroupSetup(msgspec.Struct, kw_only=True, frozen=True):
    """What rank 0 tells the followers once the group is up."""

    model: str
    dtype: str
    num_blocks: int
    block_size: int
    warmup_tokens: int  # 0: no warm-up pass
    max_model_len: int
    num_threads: int
    speculative: SpeculativeConfig | None = None  # the draft method every rank runs


class PlanLink:
    """Rank 0 to every rank: one message per step (or keep-alive, setup, stop), as a
    ``[kind, length]`` header broadcast and then ``length`` bytes."""

    def __init__(self, tp: TPShard) -> None:
        self.tp = tp
        self._encoder = msgspec.msgpack.Encoder()
        self._plan_decoder = msgspec.msgpack.Decoder(StepPlan)
        self._setup_decoder = msgspec.msgpack.Decoder(GroupSetup)
        self._header = paddle.zeros([2], dtype="int64")
        self.messages_sent = 0

    def _send(self, kind: int, payload: bytes = b"") -> None:
        import paddle.distributed as dist

        self._header[0] = kind
        self._header[1] = len(payload)
        dist.broadcast(self._header, src=0)
        if payload:
            dist.broadcast(paddle.to_tensor(np.frombuffer(payload, dtype=np.uint8)), src=0)
        self.messages_sent += 1

    def _recv(self) -> tuple[int, bytes]:
        import paddle.distributed as dist

        dist.broadcast(self._header, src=0)
        kind, length = (int(v) for v in self._header.numpy())
        if not length:
            return kind, b""
        buf = paddle.zeros([length], dtype="uint8")
        dist.broadcast(buf, src=0)
        return kind, buf.numpy().tobytes()

    # rank 0
    def send_setup(self, setup: GroupSetup) -> None:
        self._send(_SETUP, self._encoder.encode(setup))

    def send_plan(self, plan: StepPlan) -> None:
        self._send(_PLAN, self._encoder.encode(plan))

    def send_keepalive(self) -> None:
        self._send(_KEEPALIVE)

    def send_stop(self) -> None:
        self._send(_STOP)

    # followers
    def recv_setup(self) -> GroupSetup:
        kind, payload = self._recv()
        if kind != _SETUP:
            raise RuntimeError(f"tensor parallel: expected the group setup, got message {kind}")
        return self._setup_decoder.decode(payload)

    def recv_plan(self) -> StepPlan | None:
        """The next step's plan; None when rank 0 stops the group. Keep-alives are
        consumed here."""
        while True:
            kind, payload = self._recv()
            if kind == _PLAN:
                return self._plan_decoder.decode(payload)
            if kind == _STOP:
                return None
            if kind != _KEEPALIVE:
                raise RuntimeError(f"tensor parallel: unexpected message kind {kind}")


def make_workspace(
    model: SpectrioForCausalLM,
    num_blocks: int,
    block_size: int,
    speculative: SpeculativeConfig | None = None,
    draft_model: SpectrioForCausalLM | None = None,
    *,
    grammar: GrammarCompiler | None = None,
) -> Workspace:
    """A :class:`Workspace` whose caches hold this rank's KV heads. ``grammar``: the
    compiler of structured output's constraints (each rank has its own, and every rank
    keeps the grammar state: its drafts are cut by it)."""
    return Workspace(
        model,
        num_blocks,
        block_size,
        speculative,
        num_kv_heads=getattr(model, "num_local_kv_heads", None),
        draft_model=draft_model,
        grammar=grammar,
    )


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class TPGroup:
    """Rank 0's handle on the group: the link, and the follower processes it started
    (none for a launcher-started group)."""

    def __init__(self, env: GroupEnv) -> None:
        self.env = env
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.tp: TPShard | None = None
        self.link: PlanLink | None = None
        self._lock = threading.Lock()

    @property
    def spawned(self) -> bool:
        return bool(self.procs)

    def spawn_followers(self, log_level: str = "warning") -> None:
        """Start ranks 1..n-1 on this machine."""
        for rank in range(1, self.env.size):
            env = {**os.environ, **self.env.environ(rank), "SPECTRIO_LOG_LEVEL": log_level}
            self.procs[rank] = subprocess.Popen(  # noqa: S603 - our own interpreter and module
                [sys.executable, "-m", "spectrio.runtime.tp_follower"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - prctl only
                start_new_session=True,  # a terminal's Ctrl-C goes to rank 0, which stops it
            )
            log.info("follower started", rank=rank, pid=self.procs[rank].pid)

    def join(self) -> TPShard:
        """Join as rank 0 (blocking; run it off the event loop)."""
        self.tp = init_collectives(self.env)
        self.link = PlanLink(self.tp)
        return self.tp

    def dead_rank(self) -> tuple[int, str] | None:
        """A follower this process started that has exited, with how; None if all run."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"status {code}"
                return rank, f"follower rank {rank} (pid {proc.pid}) exited with {how}"
        return None

    def blame(self, wait: float = 1.0) -> tuple[int, str] | None:
        """After a failed collective: which started follower died (waiting up to ``wait``
        seconds for its exit to show)."""
        deadline = time.monotonic() + wait
        while True:
            found = self.dead_rank()
            if found is not None or not self.procs or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def stop_followers(self, timeout: float = 10.0, *, kill: bool = False) -> None:
        """Wait for the followers to exit (after a stop message), then kill what is left;
        ``kill`` kills at once (they may be stuck in a collective)."""
        deadline = time.monotonic() + (0.0 if kill else timeout)
        for rank, proc in self.procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("follower did not stop; killing it", rank=rank, pid=proc.pid)
                proc.kill()
                proc.wait()
