"""Argmax-changing logit edits applied before greedy and sampled decoding alike.

In order: banned tokens -> -inf; repetition penalty (HF rule: a positive logit is divided by
the penalty, a negative one multiplied, for every token seen in prompt + output); presence and
frequency penalties (output tokens only, as vLLM and OpenAI: subtract
``frequency * count + presence * (count > 0)``). Rows that ask for none of these are not
touched, and when no row asks, the logits are returned as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.host_to_device import to_device
from engine.sampling.messages import SamplingRow
from engine.sampling.params import SamplingParams


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], *, inplace: bool = False
) -> torch.Tensor:
    """Return ``logits`` [B, V] with bans and penalties applied; the input is modified only
    with ``inplace`` (for a caller that owns a copy already).

    Work is sparse: only the (row, token) pairs named by the rows are read and written, so
    the cost grows with the number of context tokens, not with B * V.
    """
    banned = [i for i, row in enumerate(rows) if len(row.banned_token_ids) > 0]
    repeated = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    counted = [
        i
        for i, row in enumerate(rows)
        if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0
    ]
    if not (banned or repeated or counted):
        return logits
    if not inplace:
        logits = logits.clone()
    if banned:
        row_idx, token_idx = flat_index(banned, [rows[i].banned_token_ids for i in banned], logits)
        logits[row_idx, token_idx] = float("-inf")
    if repeated:
        _apply_repetition(logits, rows, repeated)
    if counted:
        _apply_presence_frequency(logits, rows, counted)
    return logits


def _apply_repetition(logits: torch.Tensor, rows: Sequence[SamplingRow], use: list[int]) -> None:
    seen = [[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in use]
    row_idx, token_idx = flat_index(use, seen, logits)  # [n] pairs, duplicates allowed
    penalty = _per_row(rows, lambda p: p.repetition_penalty, logits)[row_idx]  # [n]
    values = logits[row_idx, token_idx]  # [n]
    # A duplicate pair writes the same value twice, so no dedup is needed.
    logits[row_idx, token_idx] = torch.where(values > 0, values / penalty, values * penalty)


def _apply_presence_frequency(
    logits: torch.Tensor, rows: Sequence[SamplingRow], use: list[int]
) -> None:
    vocab_size = logits.shape[1]
    row_idx, token_idx = flat_index(use, [rows[i].output_token_ids for i in use], logits)
    pairs, counts = torch.unique(row_idx * vocab_size + token_idx, return_counts=True)  # [m]
    row_idx, token_idx = pairs // vocab_size, pairs % vocab_size
    frequency = _per_row(rows, lambda p: p.frequency_penalty, logits)[row_idx]  # [m]
    presence = _per_row(rows, lambda p: p.presence_penalty, logits)[row_idx]  # [m]
    logits[row_idx, token_idx] -= frequency * counts.to(logits.dtype) + presence


def flat_index(
    positions: list[int], token_id_lists: Sequence[Sequence[int]], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs [total] for the ragged token id lists of rows ``positions``
    (also used by ``logit_bias``)."""
    lengths = [len(ids) for ids in token_id_lists]
    flat_ids = itertools.chain.from_iterable(token_id_lists)
    flat = np.fromiter(flat_ids, dtype=np.int64, count=sum(lengths))
    token_idx = to_device(flat, torch.long, like.device)
    repeats = to_device(lengths, torch.long, like.device)
    row_idx = to_device(positions, torch.long, like.device).repeat_interleave(
        repeats,
        output_size=len(flat),  # known size: no device sync
    )
    return row_idx, token_idx


def _per_row(
    rows: Sequence[SamplingRow], value: Callable[[SamplingParams], float], like: torch.Tensor
) -> torch.Tensor:
    """One value per row [B], as a tensor beside ``like``."""
    return to_device([value(row.params) for row in rows], like.dtype, like.device)
