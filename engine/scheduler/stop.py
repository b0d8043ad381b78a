"""When a sequence is done, after a token was appended."""

from __future__ import annotations

from collections.abc import Collection

from engine.sequence import FinishReason, Sequence


def finish_reason_after_append(
    seq: Sequence, eos_token_ids: Collection[int]
) -> FinishReason | None:
    params = seq.params
    token = seq.token_ids[-1]
    num_output = seq.num_output_tokens
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
    if seq.num_tokens >= seq.max_total_tokens:
        return "length"
    return None


def banned_token_ids(
    seq: Sequence, eos_token_ids: Collection[int], num_drafts_before: int = 0
) -> tuple[int, ...]:
    """Tokens that may not be sampled yet because ``min_tokens`` is not reached (at the
    position after ``num_drafts_before`` of a step's draft tokens)."""
    params = seq.params
    if seq.num_output_tokens + num_drafts_before >= params.min_tokens:
        return ()
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return tuple(sorted(banned))
