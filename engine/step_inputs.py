"""Host-side arrays of a step's tokens, one row per token the forward runs, as the eager
runner and the CUDA-graph runner both feed them to the model."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np

from engine.scheduler.outputs import ScheduledSequence


@dataclass(frozen=True, slots=True)
class DecodeTokens:
    """Per row, in step order: the token it feeds, where, and the slot its K/V go. An entry
    takes a row per query token: a decoding sequence one (its newest token) and one more per
    draft (speculative decoding), at the positions after it."""

    input_ids: np.ndarray  # [num_rows] int64
    positions: np.ndarray  # [num_rows] int64: the token's position (its context length - 1)
    # [num_cache_groups, num_rows] int64: block_id * block_size + offset of that position, in
    # each KV cache group's blocks
    slot_mapping: np.ndarray


def decode_tokens(
    entries: SequenceOf[ScheduledSequence], block_size: int, num_groups: int = 1
) -> DecodeTokens:
    num_entries = len(entries)
    if all(e.num_query_tokens == 1 for e in entries):  # a decode step without drafts
        positions = np.fromiter((e.start_position for e in entries), np.int64, num_entries)
        input_ids = np.fromiter((e.newest_token_id for e in entries), np.int64, num_entries)
        blocks = np.stack(
            [
                np.fromiter(
                    (e.seq.block_tables[group][e.start_position // block_size] for e in entries),
                    np.int64,
                    num_entries,
                )
                for group in range(num_groups)
            ]
        )
    else:
        counts = np.fromiter((e.num_query_tokens for e in entries), np.int64, num_entries)
        entry_index = np.repeat(np.arange(num_entries, dtype=np.int64), counts)
        starts = np.fromiter((e.start_position for e in entries), np.int64, num_entries)
        first_rows = np.cumsum(counts) - counts
        rows = np.arange(len(entry_index), dtype=np.int64)
        positions = starts[entry_index] + rows - first_rows[entry_index]
        input_ids = np.fromiter(
            (token for e in entries for token in e.query_token_ids()), np.int64, len(rows)
        )
        row_entries = entry_index.tolist()
        row_blocks = (positions // block_size).tolist()
        blocks = np.stack(
            [
                np.fromiter(
                    (
                        entries[entry].seq.block_tables[group][block]
                        for entry, block in zip(row_entries, row_blocks)
                    ),
                    np.int64,
                    len(rows),
                )
                for group in range(num_groups)
            ]
        )
    slot_mapping = blocks * block_size + positions % block_size
    return DecodeTokens(input_ids, positions, slot_mapping)
