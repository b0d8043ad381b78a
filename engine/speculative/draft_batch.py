"""One drafter forward's batch: runs of consecutive positions of sequences, laid out as the
model runner lays out a step (runs of several tokens first, as prompt chunks, then runs of one,
as decodes), on the sequences' cache group 0 block tables."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.forward_context import ForwardContext
from engine.host_to_device import to_device
from engine.kernels.linear import padded_rows
from engine.parallel.step_commands import ForwardInputs
from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens of one sequence a draft forward runs."""

    seq: Sequence
    start: int  # the first token's position
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class ChunkForward:
    """A forward of chunks on the device: its inputs (in the runner's order, not the chunks'),
    and where each chunk's tokens sit in it."""

    input_ids: torch.Tensor  # [rows] int64: the chunks' tokens, then the padding's zeros
    positions: torch.Tensor  # [rows] int64
    context: ForwardContext  # to run the forward in (set_forward_context)
    inputs: ForwardInputs  # the batch on the host (what a tensor-parallel follower builds from)
    # [tokens] int64: for each of the forward's token rows, its row among the chunks' tokens
    # in the chunks' own order (to gather per-token inputs such as hidden states)
    source_rows: np.ndarray
    _last_rows: tuple[int, ...]  # chunk index -> the forward's row of its last token

    @property
    def num_padding_rows(self) -> int:
        return self.inputs.num_padding_rows

    def last_rows(self, chunk_indices: SequenceOf[int]) -> np.ndarray:
        """[len(chunk_indices)] int64: the rows of those chunks' last tokens."""
        return np.asarray([self._last_rows[i] for i in chunk_indices], dtype=np.int64)


def chunk_forward(
    chunks: list[Chunk],
    kv_cache: torch.Tensor,  # [num_slots, kv_planes, num_blocks, block_size, heads, head_dim]
    attn_backend: AttentionBackend,
    pads_rows: bool,  # packed linears: rows padded to a bucket
) -> ChunkForward:
    """The forward of ``chunks`` (in any order) on ``kv_cache``'s device."""
    device = kv_cache.device
    order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) == 1)
    ordered = [chunks[i] for i in order]
    input_ids, inputs, last_rows = _forward_inputs(ordered, int(kv_cache.shape[3]), pads_rows)
    ends = np.cumsum([len(c.token_ids) for c in chunks], dtype=np.int64)
    starts = ends - np.asarray([len(c.token_ids) for c in chunks], dtype=np.int64)
    source_rows = np.concatenate([np.arange(starts[i], ends[i], dtype=np.int64) for i in order])
    last_row_of = [0] * len(chunks)
    for i, row in zip(order, last_rows):
        last_row_of[i] = row
    positions, metadata = inputs.on_device(device)
    return ChunkForward(
        input_ids=to_device(np.asarray(input_ids, dtype=np.int64), torch.long, device),
        positions=positions,
        context=ForwardContext.for_groups(metadata, kv_cache, attn_backend),
        inputs=inputs,
        source_rows=source_rows,
        _last_rows=tuple(last_row_of),
    )


def rows_with_padding(
    source: torch.Tensor,  # [rows, width]
    rows: np.ndarray,  # [tokens] int64: the row of ``source`` each token row of a forward reads
    num_padding_rows: int,  # the forward's rows past its tokens
) -> torch.Tensor:  # [tokens + num_padding_rows, width]: those rows, then zeros
    """What a drafter's forward reads per row (hidden states), its padding rows zeros."""
    held = source.index_select(0, to_device(rows, None, source.device))
    if num_padding_rows:
        held = torch.cat([held, held.new_zeros(num_padding_rows, held.shape[1])])
    return held


def _forward_inputs(
    chunks: list[Chunk], block_size: int, pads_rows: bool
) -> tuple[list[int], ForwardInputs, list[int]]:
    """The input ids, batch and last row of each chunk of a forward of ``chunks``, those of more
    than one token first (the runner's order: prefills, then decodes). ``pads_rows``: the rows
    padded to a bucket (packed linears), the input ids with zeros."""
    bs = block_size
    prefills = [c for c in chunks if len(c.token_ids) > 1]
    decodes = chunks[len(prefills) :]
    if any(len(c.token_ids) > 1 for c in decodes):
        raise ValueError("chunks of several tokens must come before those of one")
    input_ids = [token for c in chunks for token in c.token_ids]
    positions = [np.arange(c.start, c.start + len(c.token_ids), dtype=np.int64) for c in chunks]
    slots = [
        c.seq.block_tables[0].array[pos // bs] * bs + pos % bs for c, pos in zip(chunks, positions)
    ]
    ends = np.cumsum([len(c.token_ids) for c in chunks]).tolist()
    num_prefill_tokens = ends[len(prefills) - 1] if prefills else 0
    decode_lens = np.asarray([c.start + 1 for c in decodes], dtype=np.int64)
    padding = padded_rows(len(input_ids)) - len(input_ids) if pads_rows else 0
    input_ids.extend([0] * padding)
    inputs = ForwardInputs(
        positions=np.concatenate(positions),
        slot_mapping=np.concatenate(slots)[None, :],
        num_prefill_seqs=len(prefills),
        num_prefill_tokens=num_prefill_tokens,
        num_decode_seqs=len(decodes),
        prefill_query_start_loc=[0, *ends[: len(prefills)]],
        prefill_seq_lens=[c.start + len(c.token_ids) for c in prefills],
        prefill_block_tables=_block_tables(prefills),
        decode_seq_lens=decode_lens,
        decode_block_tables=_block_tables(decodes),
        max_decode_seq_len=int(decode_lens.max()) if decodes else 0,
        num_padding_rows=padding,
    )
    return input_ids, inputs, [end - 1 for end in ends]


def _block_tables(chunks: list[Chunk]) -> np.ndarray:
    """[1, len(chunks), max_blocks] int64: each chunk's sequence's cache group 0 table."""
    width = max((len(c.seq.block_tables[0]) for c in chunks), default=0)
    tables = np.zeros((1, len(chunks), width), dtype=np.int64)
    for row, chunk in enumerate(chunks):
        table = chunk.seq.block_tables[0]
        tables[0, row, : len(table)] = table.array
    return tables
