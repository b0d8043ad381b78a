"""vLLM's bad words: the last token of a banned sequence gets -inf right after the rest of it.

As ``vllm/v1/sample/ops/bad_words.py``: for each of a row's ``bad_words_token_ids`` sequences,
when the row's OUTPUT tokens so far end with all of the sequence but its last token, that last
token's logit becomes -inf; a one-token sequence is banned at every step. Prompt tokens never
count (vLLM passes ``output_token_ids`` only): a prompt that ends with a sequence's prefix does
not ban its last token at the first output step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.messages import SamplingRow
from engine.sampling.penalties import flat_index


def ban_bad_words(logits: torch.Tensor, rows: Sequence[SamplingRow], use: list[int]) -> None:
    """Set -inf, in place in ``logits`` [B, V], where rows ``use`` would complete a bad word."""
    banned = [_banned_token_ids(rows[i]) for i in use]
    row_idx, token_idx = flat_index(use, banned, logits)  # [n] pairs, duplicates harmless
    logits[row_idx, token_idx] = float("-inf")


def _banned_token_ids(row: SamplingRow) -> list[int]:
    output = row.output_token_ids
    banned = []
    for sequence in row.params.bad_words_token_ids:
        num_prefix = len(sequence) - 1
        if num_prefix > len(output):
            continue
        if num_prefix == 0 or list(output[-num_prefix:]) == list(sequence[:-1]):
            banned.append(sequence[-1])
    return banned
