"""Pure-torch attention over a latent KV cache (multi-head latent attention, DeepSeek): the
reference every backend starts from.

The cache holds one entry per token and layer, ``[1, num_blocks, block_size, 1, width]``: the
token's latent vector, then its rotary key part. Attention runs in the absorbed form, as MQA
with a single KV head: a query head (already projected into the latent space, with its rotary
part after it) scores each context entry whole, and the output is the softmax-weighted sum of
the entries' first ``value_dim`` elements (the latent). Prompt chunks take one SDPA per
sequence over its gathered context with a bottom-right causal mask; decode rows one padded,
masked SDPA for the batch.

A quantized cache (float8 e4m3 or int8 elements) has one scale per layer for the whole entries
(``kv_scales``, [1, 1] float32): entries are stored as engine/kv_cache/kv_quantization.py's
``quantize_kv`` stores them and read back as what they stand for, in the query's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache.kv_quantization import dequantize_kv, quantize_kv


def write_latent(
    cache_layer: torch.Tensor,  # [1, num_blocks, block_size, 1, width]
    entries: torch.Tensor,  # [num_tokens, width]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    kv_scales: torch.Tensor | None = None,  # [1, 1] fp32: a quantized cache's
) -> None:
    """Scatter the new tokens' entries into their cache slots (quantized by ``kv_scales`` into
    a quantized cache)."""
    _, num_blocks, block_size, _, width = cache_layer.shape
    # .view (not reshape) so a non-viewable cache fails loudly instead of writing to a copy
    slots = cache_layer.view(num_blocks * block_size, width)
    if kv_scales is not None:
        entries = quantize_kv(entries[:, None], kv_scales[0], cache_layer.dtype)[:, 0]
        # index_copy_ moves float8 elements as their bytes
        slots, entries = slots.view(torch.uint8), entries.view(torch.uint8)
    slots.index_copy_(0, slot_mapping, entries)


def latent_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, width]
    cache_layer: torch.Tensor,  # [1, num_blocks, block_size, 1, width]
    metadata: AttentionMetadata,
    scale: float,
    value_dim: int,
    kv_scales: torch.Tensor | None = None,  # [1, 1] fp32: a quantized cache's
) -> torch.Tensor:  # [num_tokens, num_heads, value_dim]
    """Causal attention of each new token over its sequence's entries in the cache."""
    outputs = []
    entries = cache_layer[0, :, :, 0]  # [num_blocks, block_size, width]
    starts = metadata.prefill_query_start_loc
    for seq, seq_len in enumerate(metadata.prefill_seq_lens):
        context = _gather(entries, metadata.prefill_block_tables[seq : seq + 1], seq_len)
        context = _read(context, kv_scales, query.dtype)
        outputs.append(_prefill(query[starts[seq] : starts[seq + 1]], context[0], scale, value_dim))
    if metadata.num_decode_seqs > 0:
        decode_query = query[metadata.num_prefill_tokens : metadata.num_tokens]
        outputs.append(_decode(decode_query, entries, metadata, scale, value_dim, kv_scales))
    if not outputs:
        return query.new_empty(0, query.shape[1], value_dim)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _gather(
    entries: torch.Tensor,  # [num_blocks, block_size, width]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    max_len: int,
) -> torch.Tensor:  # [num_seqs, max_len, width]: each sequence's first max_len entries
    block_size, width = entries.shape[1], entries.shape[2]
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks]
    gathered = entries.index_select(0, tables.reshape(-1))
    return gathered.view(tables.shape[0], num_blocks * block_size, width)[:, :max_len]


def _read(
    gathered: torch.Tensor,  # [..., width]: entries as the cache stores them
    kv_scales: torch.Tensor | None,  # [1, 1] fp32: a quantized cache's
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., width] of ``dtype``
    """What gathered entries stand for: themselves in a float cache."""
    if kv_scales is None:
        return gathered
    return dequantize_kv(gathered[..., None, :], kv_scales[0], dtype)[..., 0, :]


def _prefill(
    query: torch.Tensor,  # [query_len, num_heads, width]: one sequence's new tokens
    context: torch.Tensor,  # [seq_len, width]: its whole context, new tokens last
    scale: float,
    value_dim: int,
) -> torch.Tensor:  # [query_len, num_heads, value_dim]
    """New token j of query_len sees context positions <= seq_len - query_len + j."""
    query_len, seq_len = query.shape[0], context.shape[0]
    context_pos = torch.arange(seq_len, device=query.device)
    query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
    seen = context_pos[None, :] <= query_pos[:, None]  # [query_len, seq_len]
    keys = context[None, None]  # [1, 1, seq_len, width]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],  # [1, num_heads, query_len, width]
        keys,
        keys[..., :value_dim],
        attn_mask=seen,
        scale=scale,
        enable_gqa=True,
    )  # [1, num_heads, query_len, value_dim]
    return out[0].transpose(0, 1)


def _decode(
    query: torch.Tensor,  # [num_decode_seqs, num_heads, width]
    entries: torch.Tensor,  # [num_blocks, block_size, width]
    metadata: AttentionMetadata,
    scale: float,
    value_dim: int,
    kv_scales: torch.Tensor | None = None,  # [1, 1] fp32: a quantized cache's
) -> torch.Tensor:  # [num_decode_seqs, num_heads, value_dim]
    """Every decode row at once over its padded context, the padding masked. A row's heads
    are the rows of one SDPA sequence against the single KV head."""
    seq_lens = metadata.decode_seq_lens
    max_len = metadata.max_decode_seq_len
    gathered = _gather(entries, metadata.decode_block_tables, max_len)
    keys = _read(gathered, kv_scales, query.dtype)[:, None]  # [seqs, 1, len, width]
    positions = torch.arange(max_len, device=query.device)
    seen = positions[None, :] < seq_lens[:, None]  # [num_decode_seqs, max_len]
    out = F.scaled_dot_product_attention(
        query[:, None],  # [num_decode_seqs, 1, num_heads, width]
        keys,
        keys[..., :value_dim],
        attn_mask=seen[:, None, None, :],
        scale=scale,
    )  # [num_decode_seqs, 1, num_heads, value_dim]
    return out[:, 0]
