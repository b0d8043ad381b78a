"""Host-side arrays of a step's single-token (decode) sequences, as the eager runner and the
CUDA-graph runner both feed them to the model."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np

from engine.scheduler.outputs import ScheduledSequence


@dataclass(frozen=True, slots=True)
class DecodeTokens:
    """Per decode sequence, in step order: the token it feeds, where, and the slot its K/V go."""

    input_ids: np.ndarray  # [num_seqs] int64: the sequence's newest token
    positions: np.ndarray  # [num_seqs] int64: that token's position (context length - 1)
    slot_mapping: np.ndarray  # [num_seqs] int64: block_id * block_size + offset of that position


def decode_tokens(decodes: SequenceOf[ScheduledSequence], block_size: int) -> DecodeTokens:
    num_seqs = len(decodes)
    positions = np.fromiter((e.start_position for e in decodes), np.int64, num_seqs)
    input_ids = np.fromiter(
        (e.seq.token_ids[e.start_position] for e in decodes), np.int64, num_seqs
    )
    blocks = np.fromiter(
        (e.seq.block_table[e.start_position // block_size] for e in decodes), np.int64, num_seqs
    )
    return DecodeTokens(input_ids, positions, blocks * block_size + positions % block_size)
