"""Block tables for the CPU attention kernels' tests: each sequence's blocks a random pick of
the cache's, rows padded two entries wider than the longest needs."""

from __future__ import annotations

import torch


def scattered_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, generator: torch.Generator
) -> torch.Tensor:  # [num_seqs, max_blocks + 2] int64
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    block_ids = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 2, dtype=torch.int64)
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor(block_ids[:count])
        block_ids = block_ids[count:]
    return tables
