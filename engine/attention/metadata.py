"""Layout of one step's flattened token batch, as attention backends see it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Tokens of all scheduled sequences are concatenated into one batch of ``num_tokens`` rows.

    Sequences with more than one new token (prompt chunks) come first ("prefill" part);
    sequences with exactly one new token come after ("decode" part). Before attention runs,
    each new token's K/V has already been written to its slot, so both parts read the whole
    context (cached prefix + new tokens) from the paged cache.
    """

    num_prefill_seqs: int  # sequences with > 1 new token, first in the batch
    num_prefill_tokens: int  # their new tokens: rows [0, num_prefill_tokens) of q/k/v
    num_decode_seqs: int  # sequences with exactly 1 new token: the last num_decode_seqs rows
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset per new token
    prefill_query_start_loc: list[int]  # [num_prefill_seqs + 1] row offsets of each prefill seq
    prefill_seq_lens: list[int]  # [num_prefill_seqs] context length after this step (cached + new)
    prefill_block_tables: torch.Tensor  # [num_prefill_seqs, max_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor  # [num_decode_seqs] int64 context length incl. the new token
    decode_block_tables: torch.Tensor  # [num_decode_seqs, max_blocks] int64, padded with 0
    # a bound on decode_seq_lens known on the host: their max (0 when there are no decodes), or
    # for a captured decode graph the static block table's capacity (engine/decode_graphs.py)
    max_decode_seq_len: int
    # In a decode graph a sequence's drafts (speculative decoding) are decode rows too, after
    # its newest token, each with its own context (one token longer than the row before). Rows
    # decode_row_starts[g] .. [g + 1] are then one sequence's ([num_groups + 1] int32 from 0 to
    # num_decode_seqs; a group of at most max_decode_rows_per_seq rows, maybe none), which a
    # backend may attend to together, reading the sequence's K/V once. None: each row alone.
    decode_row_starts: torch.Tensor | None = None
    max_decode_rows_per_seq: int = 1

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs
