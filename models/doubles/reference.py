"""The oracle: plain greedy autoregressive generation with the target alone.

Dense attention over a contiguous past, one token at a time, no paging and no
speculation. Every losslessness test compares against this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from spectrio.models.architecture.model import SpectrioForCausalLM
from spectrio.models.ops.paddle_setup import paddle


@dataclasses.dataclass
class ReferenceOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop token) or "length"


def greedy_generate(
    model: SpectrioForCausalLM,
    prompt_ids: Sequence[int],
    max_tokens: int,
    eos_token_id: int | None = None,
    stop_token_ids: Sequence[int] = (),
) -> ReferenceOutput:
    """Greedy continuation of ``prompt_ids``. A stop token is emitted, then generation ends."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    limit = model.config.max_position_embeddings
    if len(prompt_ids) >= limit:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens leaves no room under {limit} positions"
        )
    stops = set(stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
    out: list[int] = []
    with paddle.no_grad():
        logits, _, past = model.forward_dense(_ids([list(prompt_ids)]))
        while True:
            token = int(paddle.argmax(logits[0, -1]).numpy())
            out.append(token)
            if token in stops:
                return ReferenceOutput(out, "stop")
            if len(out) >= max_tokens or len(prompt_ids) + len(out) >= limit:
                return ReferenceOutput(out, "length")
            logits, _, past = model.forward_dense(_ids([[token]]), past)


def greedy_mtp_drafts(
    model: SpectrioForCausalLM, contexts: Sequence[Sequence[int]], num_steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """Dense MTP drafting after each of ``contexts`` (equal lengths, batched).

    The target reads a context and picks its greedy next token g1; MTP substep j then
    proposes the token after its input. Returns ``(target_greedy [B, n+1], drafts [B, n])``:
    the target's own greedy continuation g1..g{n+1} and the drafts d2..d{n+1}, so
    ``drafts[:, j]`` is the MTP's guess for ``target_greedy[:, j + 1]``.
    """
    if num_steps < 1:
        raise ValueError("num_steps must be >= 1")
    ids = np.asarray(contexts, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise ValueError("contexts must be non-empty and of equal length")
    with paddle.no_grad():
        logits, hidden, past = model.forward_dense(paddle.to_tensor(ids))
        target = [paddle.argmax(logits[:, -1], axis=-1)]
        for _ in range(num_steps):
            logits, _, past = model.forward_dense(target[-1].unsqueeze(-1), past)
            target.append(paddle.argmax(logits[:, -1], axis=-1))
        # MTP position p pairs h_p with token p+1: the context shifted by one, then g1.
        shifted = paddle.concat([paddle.to_tensor(ids[:, 1:]), target[0].unsqueeze(-1)], axis=1)
        logits, mtp_hidden, mtp_past = model.mtp_forward_dense(shifted, hidden)
        drafts = []
        for step in range(num_steps):
            drafts.append(paddle.argmax(logits[:, -1], axis=-1))
            if step + 1 < num_steps:
                logits, mtp_hidden, mtp_past = model.mtp_forward_dense(
                    drafts[-1].unsqueeze(-1), mtp_hidden[:, -1:], mtp_past
                )
    return (
        paddle.stack(target, axis=1).numpy().astype(np.int64),
        paddle.stack(drafts, axis=1).numpy().astype(np.int64),
    )


def _ids(rows: list[list[int]]) -> paddle.Tensor:
    return paddle.to_tensor(np.asarray(rows, dtype=np.int64))
