"""A minimal hand-rolled paged-KV driver for model tests: allocate blocks, build metadata, run.

Blocks are handed out in a shuffled order so block tables are non-contiguous, and block 0
(the padding value of block tables) belongs to a real sequence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.forward_context import ForwardContext, set_forward_context
from engine.model_config import ModelConfig
from engine.models.registry import CausalLM


@dataclass
class PagedSeq:
    token_ids: list[int]  # the whole sequence, known up front (teacher forcing)
    block_ids: list[list[int]]  # per KV cache group, enough blocks for all of token_ids
    num_computed: int = 0  # tokens whose K/V are already in the cache
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] fp32 per computed token


class PagedRunner:
    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        num_blocks: int = 256,
        block_size: int = 4,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_groups = config.cache_groups.num_groups
        # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]
        shape = (
            config.cache_groups.num_slots,
            config.kv_planes,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
        )
        self.kv_cache = torch.zeros(shape, dtype=dtype)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.free_blocks.remove(0)
        self.free_blocks.insert(0, 0)  # the first sequence owns block 0
        self.backend = TorchAttentionBackend()

    def new_seq(self, token_ids: list[int]) -> PagedSeq:
        num_blocks = -(-len(token_ids) // self.block_size)
        block_ids = []
        for _ in range(self.num_groups):
            block_ids.append(self.free_blocks[:num_blocks])
            self.free_blocks = self.free_blocks[num_blocks:]
        return PagedSeq(list(token_ids), block_ids)

    def step(self, chunks: list[tuple[PagedSeq, int]]) -> None:
        """Run one forward over ``num_new_tokens`` of each seq; appends their logits to seq."""
        prefills = [(s, n) for s, n in chunks if n > 1]
        decodes = [(s, n) for s, n in chunks if n == 1]
        ordered = prefills + decodes
        input_ids, positions = [], []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]
        for seq, num_new in ordered:
            for pos in range(seq.num_computed, seq.num_computed + num_new):
                input_ids.append(seq.token_ids[pos])
                positions.append(pos)
                for group, blocks in enumerate(seq.block_ids):
                    block = blocks[pos // self.block_size]
                    slots[group].append(block * self.block_size + pos % self.block_size)
        metadata = tuple(
            self._metadata(prefills, decodes, slots[group], group)
            for group in range(self.num_groups)
        )
        context = ForwardContext.for_groups(metadata, self.kv_cache, self.backend)
        with torch.no_grad(), set_forward_context(context):
            hidden = self.model.forward(torch.tensor(input_ids), torch.tensor(positions))
            logits = self.model.compute_logits(hidden)  # [num_tokens, vocab]
        assert logits.dtype == torch.float32
        rows = iter(logits)
        for seq, num_new in ordered:
            seq.logits.extend(next(rows) for _ in range(num_new))
            seq.num_computed += num_new

    def _metadata(
        self,
        prefills: list[tuple[PagedSeq, int]],
        decodes: list[tuple[PagedSeq, int]],
        slots: list[int],
        group: int,
    ) -> AttentionMetadata:
        start_loc = [0]
        for _, num_new in prefills:
            start_loc.append(start_loc[-1] + num_new)
        decode_lens = [s.num_computed + 1 for s, _ in decodes]
        return AttentionMetadata(
            num_prefill_seqs=len(prefills),
            num_prefill_tokens=start_loc[-1],
            num_decode_seqs=len(decodes),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            prefill_query_start_loc=start_loc,
            prefill_seq_lens=[s.num_computed + n for s, n in prefills],
            prefill_block_tables=_block_table([s for s, _ in prefills], group),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long),
            decode_block_tables=_block_table([s for s, _ in decodes], group),
            max_decode_seq_len=max(decode_lens, default=0),
        )


def _block_table(seqs: list[PagedSeq], group: int) -> torch.Tensor:
    """[num_seqs, max_blocks] of cache group ``group``, padded with 0."""
    max_blocks = max((len(s.block_ids[group]) for s in seqs), default=0)
    table = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    for i, seq in enumerate(seqs):
        table[i, : len(seq.block_ids[group])] = torch.tensor(seq.block_ids[group])
    return table
