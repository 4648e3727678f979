"""Greedy acceptance and stop truncation (pure)."""

from __future__ import annotations

from collections.abc import Sequence


def greedy_accept(drafts: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, list[int]]:
    """Accept the longest prefix of ``drafts`` equal to the target's argmax.

    ``target_argmax[i]`` is the target's greedy token after the i-th verified row, so it
    has one entry more than ``drafts``. Returns (drafts accepted, tokens emitted): the
    accepted drafts followed by the target's token at the first mismatch, or by the
    bonus token when every draft matched.
    """
    if len(target_argmax) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens, got {len(target_argmax)}")
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_argmax[accepted]:
        accepted += 1
    return accepted, list(target_argmax[: accepted + 1])


def truncate_at_stop(
    tokens: Sequence[int], stop_token_ids: Sequence[int], max_new_tokens: int
) -> tuple[list[int], str | None]:
    """Cut an accepted run at its first stop token (kept) or at the length limit.

    A stop inside the run beats the length limit when it comes first.
    """
    stops = set(stop_token_ids)
    out: list[int] = []
    for tok in tokens:
        if len(out) >= max_new_tokens:
            return out, "length"
        out.append(tok)
        if tok in stops:
            return out, "stop"
    return out, ("length" if len(out) >= max_new_tokens else None)
