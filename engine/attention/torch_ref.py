"""Pure-torch attention over the paged KV cache: the reference backend, CPU and GPU.

Prefill sequences are handled one at a time: gather the context from its blocks, one SDPA
with a bottom-right-aligned causal mask. Decode sequences: on CPU, in chunks small enough to
stay in cache, gather only their own blocks back to back and run one SDPA per sequence;
elsewhere, gather into a padded [num_seqs, max_len] layout for one masked SDPA. Gathers go
to a reused workspace. A sliding-window layer takes each sequence (each decode row) alone:
its blocks from the first one its new tokens' windows reach, masked per token. Soft-capped
logits and attention sinks, which SDPA cannot compute, take each sequence (each decode row)
alone through an explicit softmax (``_explicit_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache.kv_quantization import dequantize_kv, quantize_kv

# gathered K+V per CPU decode chunk: at 16-48 seqs of 100-440 tokens, 1 MiB beat 256 KiB and
# 4 MiB, and beat one padded gather for the whole batch by 20-40 % per step (2-core EPYC)
_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class _DecodeChunk:
    """Decode seqs whose K/V are gathered together, their blocks back to back, into the
    decode workspace; the per-seq K/V views onto it serve every layer of the step."""

    block_ids: torch.Tensor  # [num_chunk_blocks] int64: the first seq's blocks, then the next's
    gathered: torch.Tensor  # [2, num_chunk_blocks, block_numel]: where the gather writes
    keys: list[torch.Tensor]  # per seq, in batch order: [1, num_kv_heads, seq_len, head_dim]
    values: list[torch.Tensor]  # the same for V


def _decode_chunk(
    tables: torch.Tensor,
    seq_lens: list[int],
    rows: list[int],
    workspace: torch.Tensor,  # flat, at least 2 * num_chunk_blocks * block_numel
    cache_shape: torch.Size,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
) -> _DecodeChunk:
    _, _, block_size, num_kv_heads, head_dim = cache_shape
    block_numel = block_size * num_kv_heads * head_dim
    parts, spans, start = [], [], 0
    for row in rows:
        num_seq_blocks = -(-seq_lens[row] // block_size)
        parts.append(tables[row, :num_seq_blocks])
        spans.append((start, seq_lens[row]))
        start += num_seq_blocks * block_size
    block_ids = torch.cat(parts)
    gathered = workspace[: 2 * block_ids.numel() * block_numel].view(2, -1, block_numel)
    kv = gathered.view(2, 1, start, num_kv_heads, head_dim).transpose(2, 3)
    keys = [kv[0, :, :, first : first + seq_len] for first, seq_len in spans]
    values = [kv[1, :, :, first : first + seq_len] for first, seq_len in spans]
    return _DecodeChunk(block_ids, gathered, keys, values)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None  # flat buffer gathered prefill K/V go to
        self._decode_workspace: torch.Tensor | None = None  # ... and CPU decode chunks' K/V
        # this step's CPU decode chunks, memoised on its metadata for the other layers
        self._step_chunks: tuple[AttentionMetadata, list[_DecodeChunk]] | None = None

    def write_kv(
        self,
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> None:
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
        # .view (not reshape) so a non-viewable cache fails loudly instead of writing to a copy
        slots = kv_cache_layer.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        if kv_scales is not None:
            key = quantize_kv(key, kv_scales[0], kv_cache_layer.dtype)
            value = quantize_kv(value, kv_scales[1], kv_cache_layer.dtype)
            # index_copy_ moves float8 elements as their bytes
            slots, key, value = (
                slots.view(torch.uint8),
                key.view(torch.uint8),
                value.view(torch.uint8),
            )
        slots[0].index_copy_(0, slot_mapping, key)
        slots[1].index_copy_(0, slot_mapping, value)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] fp32
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        outputs = []
        if metadata.num_prefill_seqs > 0:
            prefill_query = query[: metadata.num_prefill_tokens]
            outputs.append(
                self._prefill_all(
                    prefill_query,
                    kv_cache_layer,
                    metadata,
                    scale,
                    sliding_window,
                    logit_softcap,
                    sinks,
                    kv_scales,
                )
            )
        if metadata.num_decode_seqs > 0:
            decode_query = query[metadata.num_prefill_tokens :]
            outputs.append(
                self._decode(
                    decode_query,
                    kv_cache_layer,
                    metadata,
                    scale,
                    sliding_window,
                    logit_softcap,
                    sinks,
                    kv_scales,
                )
            )
        if not outputs:
            return torch.empty_like(query)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def _prefill_all(
        self,
        query: torch.Tensor,  # [num_prefill_tokens, num_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] fp32
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> torch.Tensor:  # [num_prefill_tokens, num_heads, head_dim]
        if logit_softcap is not None or sinks is not None:
            starts = metadata.prefill_query_start_loc
            pieces = [
                (query[starts[seq] : starts[seq + 1]], metadata.prefill_block_tables[seq], seq_len)
                for seq, seq_len in enumerate(metadata.prefill_seq_lens)
            ]
            return self._explicit(
                pieces, kv_cache_layer, scale, sliding_window, logit_softcap, sinks, kv_scales
            )
        outputs = [
            self._prefill(query, kv_cache_layer, metadata, i, scale, sliding_window, kv_scales)
            for i in range(metadata.num_prefill_seqs)
        ]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def _prefill(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the whole batch
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        seq_index: int,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> torch.Tensor:  # [query_len, num_heads, head_dim]
        start = metadata.prefill_query_start_loc[seq_index]
        end = metadata.prefill_query_start_loc[seq_index + 1]
        seq_len = metadata.prefill_seq_lens[seq_index]
        num_blocks = _num_blocks(seq_len, kv_cache_layer)
        table = metadata.prefill_block_tables[seq_index]
        if sliding_window is not None:
            return self._windowed(
                query[start:end], kv_cache_layer, table, seq_len, scale, sliding_window, kv_scales
            )
        block_table = table[None, :num_blocks]
        kv = self._gather(kv_cache_layer, block_table, kv_scales, query.dtype)[:, 0, :seq_len]
        return _prefill_attention(query[start:end], kv, scale)

    def _windowed(
        self,
        query: torch.Tensor,  # [query_len, num_heads, head_dim]: a sequence's new tokens
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        table: torch.Tensor,  # [max_blocks] int64: the sequence's block table
        seq_len: int,  # its context length after this step
        scale: float,
        window: int,
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> torch.Tensor:  # [query_len, num_heads, head_dim]
        """A sequence's new tokens over the blocks their windows reach, masked per token."""
        query_len, num_heads, _ = query.shape
        block_size, num_kv_heads = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
        first_block = max(0, seq_len - query_len - window + 1) // block_size
        blocks = table[None, first_block : _num_blocks(seq_len, kv_cache_layer)]
        first = first_block * block_size
        kv = self._gather(kv_cache_layer, blocks, kv_scales, query.dtype)[:, 0, : seq_len - first]
        context_pos = torch.arange(first, seq_len, device=query.device)
        query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        seen = (context_pos[None, :] <= query_pos[:, None]) & (
            context_pos[None, :] > query_pos[:, None] - window
        )  # [query_len, seq_len - first]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],  # [1, num_heads, query_len, head_dim]
            kv[0].transpose(0, 1)[None],  # [1, num_kv_heads, context, head_dim]
            kv[1].transpose(0, 1)[None],
            attn_mask=seen,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        return out[0].transpose(0, 1)

    def _explicit(
        self,
        # per sequence (decode row): its rows of query [query_len, num_heads, head_dim], its
        # block table [max_blocks] int64, its context length after the step; one at least
        pieces: list[tuple[torch.Tensor, torch.Tensor, int]],
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        scale: float,
        window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None,  # [num_heads] fp32
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> torch.Tensor:  # [num_rows, num_heads, head_dim]: the pieces' rows, in order
        """Each piece's rows over the blocks their windows reach (all of them without a
        window), through ``_explicit_attention``."""
        block_size = kv_cache_layer.shape[2]
        outputs = []
        for rows, table, seq_len in pieces:
            query_len = rows.shape[0]
            first_seen = 0 if window is None else max(0, seq_len - query_len - window + 1)
            first_block = first_seen // block_size
            blocks = table[None, first_block : _num_blocks(seq_len, kv_cache_layer)]
            first = first_block * block_size
            kv = self._gather(kv_cache_layer, blocks, kv_scales, rows.dtype)
            kv = kv[:, 0, : seq_len - first]
            context_pos = torch.arange(first, seq_len, device=rows.device)
            query_pos = torch.arange(seq_len - query_len, seq_len, device=rows.device)
            seen = context_pos[None, :] <= query_pos[:, None]  # [query_len, context]
            if window is not None:
                seen &= context_pos[None, :] > query_pos[:, None] - window
            outputs.append(
                _explicit_attention(rows, kv[0], kv[1], seen, scale, logit_softcap, sinks)
            )
        return torch.cat(outputs)

    def _decode(
        self,
        query: torch.Tensor,  # [num_decode_seqs, num_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] fp32
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> torch.Tensor:  # [num_decode_seqs, num_heads, head_dim]
        if logit_softcap is not None or sinks is not None:  # a row at a time, explicitly
            tables = metadata.decode_block_tables
            pieces = [
                (query[row : row + 1], tables[row], seq_len)
                for row, seq_len in enumerate(metadata.decode_seq_lens.tolist())
            ]
            return self._explicit(
                pieces, kv_cache_layer, scale, sliding_window, logit_softcap, sinks, kv_scales
            )
        if sliding_window is not None:  # a row at a time, over the blocks its window reaches
            seq_lens = metadata.decode_seq_lens.tolist()
            tables = metadata.decode_block_tables
            rows = [
                self._windowed(
                    query[row : row + 1],
                    kv_cache_layer,
                    tables[row],
                    seq_len,
                    scale,
                    sliding_window,
                    kv_scales,
                )
                for row, seq_len in enumerate(seq_lens)
            ]
            return torch.cat(rows)
        if query.device.type == "cpu" and kv_scales is None:
            return self._decode_varlen(query, kv_cache_layer, metadata, scale)
        num_blocks = _num_blocks(metadata.max_decode_seq_len, kv_cache_layer)
        tables = metadata.decode_block_tables[:, :num_blocks]
        kv = self._gather(kv_cache_layer, tables, kv_scales, query.dtype)
        return _decode_attention(query, kv, metadata.decode_seq_lens, scale)

    def _decode_varlen(
        self,
        query: torch.Tensor,  # [num_decode_seqs, num_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_decode_seqs, num_heads, head_dim]
        """CPU: per chunk of seqs, gather only their own blocks (no padding) into a buffer
        small enough to stay in cache, then one SDPA per seq reads it from there.

        Decode attention on CPU is bound by memory traffic: padding every seq to the longest
        wastes copies, and a whole batch's gathered K/V spills the cache before SDPA reads it.
        The chunks and their per-seq K/V views are built once per step for every layer, so a
        seq costs one SDPA call per layer and no view ops.
        """
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache_layer.shape[3]
        blocks = kv_cache_layer.view(2, kv_cache_layer.shape[1], -1)  # [2, num_blocks, numel]
        # per seq [1, num_kv_heads, group, head_dim]: 4-D, as CPU flash SDPA needs
        queries = iter(query.view(num_seqs, 1, num_kv_heads, -1, head_dim).unbind(0))
        outputs = []
        for chunk in self._decode_chunks(metadata, kv_cache_layer):
            torch.index_select(blocks[0], 0, chunk.block_ids, out=chunk.gathered[0])
            torch.index_select(blocks[1], 0, chunk.block_ids, out=chunk.gathered[1])
            for key, value in zip(chunk.keys, chunk.values):
                outputs.append(
                    F.scaled_dot_product_attention(next(queries), key, value, scale=scale)
                )
        return torch.cat(outputs).view(num_seqs, num_heads, head_dim)

    def _decode_chunks(
        self, metadata: AttentionMetadata, kv_cache_layer: torch.Tensor
    ) -> list[_DecodeChunk]:
        """The step's decode seqs in cache-sized chunks; reused by every layer of the step."""
        cached, workspace = self._step_chunks, self._decode_workspace
        fresh = workspace is not None and _fits(workspace, 0, kv_cache_layer)
        if cached is not None and cached[0] is metadata and fresh:
            return cached[1]
        _, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
        token_bytes = 2 * num_kv_heads * head_dim * kv_cache_layer.element_size()
        seq_lens = metadata.decode_seq_lens.tolist()
        groups: list[list[int]] = [[]]
        group_tokens = [0]
        for row, seq_len in enumerate(seq_lens):
            if group_tokens[-1] * token_bytes >= _CHUNK_BYTES:
                groups.append([])
                group_tokens.append(0)
            groups[-1].append(row)
            group_tokens[-1] += -(-seq_len // block_size) * block_size
        numel = 2 * max(group_tokens) * num_kv_heads * head_dim
        if workspace is None or not _fits(workspace, numel, kv_cache_layer):
            workspace = self._decode_workspace = _new_workspace(numel, kv_cache_layer)
        tables = metadata.decode_block_tables
        chunks = [
            _decode_chunk(tables, seq_lens, rows, workspace, kv_cache_layer.shape)
            for rows in groups
        ]
        self._step_chunks = (metadata, chunks)
        return chunks

    def _gather(
        self,
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, num_seq_blocks] int64
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
        dtype: torch.dtype | None = None,  # what a quantized cache's values are read as
    ) -> torch.Tensor:  # [2, num_seqs, num_seq_blocks * block_size, num_kv_heads, head_dim]
        """Copy the seqs' blocks into a reused workspace (a quantized cache's read as the
        values they stand for, in ``dtype``).

        A fresh allocation of this size costs more in page faults than the copy itself on
        CPU, so the buffer lives across calls.
        """
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
        num_seqs, num_seq_blocks = block_tables.shape
        block_numel = block_size * num_kv_heads * head_dim
        flat_tables = block_tables.reshape(-1)
        blocks = kv_cache_layer.view(2, num_blocks, block_numel)
        out = self._workspace_view(2 * flat_tables.numel() * block_numel, kv_cache_layer)
        out = out.view(2, flat_tables.numel(), block_numel)
        torch.index_select(blocks[0], 0, flat_tables, out=out[0])
        torch.index_select(blocks[1], 0, flat_tables, out=out[1])
        out = out.view(2, num_seqs, num_seq_blocks * block_size, num_kv_heads, head_dim)
        if kv_scales is None:
            return out
        assert dtype is not None, "a quantized cache is read as a dtype"
        return torch.stack([dequantize_kv(out[plane], kv_scales[plane], dtype) for plane in (0, 1)])

    def _workspace_view(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        workspace = self._workspace
        if workspace is None or not _fits(workspace, numel, like):
            workspace = self._workspace = _new_workspace(numel, like)
        return workspace[:numel]


def _fits(workspace: torch.Tensor, numel: int, like: torch.Tensor) -> bool:
    """A reused workspace serves ``numel`` elements like ``like`` (and inference mode
    tensors cannot be written outside inference mode)."""
    return (
        workspace.numel() >= numel
        and workspace.dtype == like.dtype
        and workspace.device == like.device
        and (not workspace.is_inference() or torch.is_inference_mode_enabled())
    )


def _new_workspace(numel: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(numel, dtype=like.dtype, device=like.device)


def _num_blocks(seq_len: int, kv_cache_layer: torch.Tensor) -> int:
    block_size = kv_cache_layer.shape[2]
    return -(-seq_len // block_size)


def _prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    kv: torch.Tensor,  # [2, seq_len, num_kv_heads, head_dim]: the whole context
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """New token j of query_len sees context positions <= seq_len - query_len + j."""
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads = kv.shape[1], kv.shape[2]
    mask: torch.Tensor | None = None
    if query_len != seq_len:
        context_pos = torch.arange(seq_len, device=query.device)
        query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        mask = context_pos[None, :] <= query_pos[:, None]  # [query_len, seq_len]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],  # [1, num_heads, query_len, head_dim]
        kv[0].transpose(0, 1)[None],  # [1, num_kv_heads, seq_len, head_dim]
        kv[1].transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [1, num_heads, query_len, head_dim]
    return out[0].transpose(0, 1)


def _explicit_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [context, num_kv_heads, head_dim]
    value: torch.Tensor,  # [context, num_kv_heads, head_dim]
    seen: torch.Tensor,  # [query_len, context] bool: which positions each query row sees
    scale: float,
    logit_softcap: float | None,
    sinks: torch.Tensor | None,  # [num_heads] fp32
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Attention with the softmax written out, in transformers' order: logits ``scale * q . k``,
    soft-capped, masked, the sink's logit appended as one more column, softmax in float32, the
    sink's column dropped, then the weighted sum of values."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    keys = key.transpose(0, 1).repeat_interleave(group, dim=0)  # [num_heads, context, head_dim]
    values = value.transpose(0, 1).repeat_interleave(group, dim=0)
    logits = torch.matmul(query.transpose(0, 1), keys.transpose(1, 2)) * scale  # [h, q, ctx]
    if logit_softcap is not None:
        logits = torch.tanh(logits / logit_softcap) * logit_softcap
    logits = logits.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(logits.dtype).view(num_heads, 1, 1).expand(-1, logits.shape[1], 1)
        logits = torch.cat((logits, sink_column), dim=-1)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        weights = weights[..., :-1]
    return torch.matmul(weights, values).transpose(0, 1)  # [query_len, num_heads, head_dim]


def _decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv: torch.Tensor,  # [2, num_seqs, max_len, num_kv_heads, head_dim], padded past seq_lens
    seq_lens: torch.Tensor,  # [num_seqs] int64
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """All decode seqs at once, the padding past each seq_len masked.

    The queries of one KV head's group are laid out as rows of one SDPA "sequence"
    ([num_seqs, num_kv_heads, group, head_dim]), which on CPU beats both enable_gqa and
    repeating K/V.
    """
    num_seqs, num_heads, head_dim = query.shape
    max_len, num_kv_heads = kv.shape[2], kv.shape[3]
    positions = torch.arange(max_len, device=query.device)
    mask = positions[None, :] < seq_lens[:, None]  # [num_seqs, max_len]
    out = F.scaled_dot_product_attention(
        query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),
        kv[0].transpose(1, 2),  # [num_seqs, num_kv_heads, max_len, head_dim]
        kv[1].transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )  # [num_seqs, num_kv_heads, group, head_dim]
    return out.reshape(num_seqs, num_heads, head_dim)
