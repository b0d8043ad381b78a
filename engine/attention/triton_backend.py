"""Attention through the Triton kernels in engine/kernels: the GPU backend.

``write_kv`` scatters the step's new K/V with one kernel. ``forward`` runs the prefill kernel
over the prefill rows (varlen, causal, reading cached prefixes through the block tables) and
the flash-decoding kernel over the decode rows (a sequence's rows together when the metadata
groups them: a decode graph's drafts), each reading the paged cache in place; a
sliding-window layer's only from where its tokens' windows start. Both kernels soft-cap the
logits and count attention sinks when a layer has them. A quantized cache (float8 e4m3 or
int8 elements, with ``kv_scales``) is written and read by the same kernels: ``write_kv``
quantizes as engine/kv_cache/kv_quantization.py does, to the bit, and the attention kernels
read each element as ``element * scale``.

A latent cache (multi-head latent attention) has its own kernels, in
engine/kernels/latent_attention.py: ``write_latent`` scatters the entries, ``forward_latent``
runs the latent prefill kernel over the prefill rows and the latent flash-decoding kernel over
the decode rows (each row alone: a decode graph's drafts see their own contexts), split as the
KV decode kernel is, by the same ``DecodeSizing``. A quantized latent cache (one scale per
layer) is written and read by those kernels as a quantized KV cache is.

On CPU the kernels only run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how
the tests check this backend against the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend, DecodeSizing
from engine.attention.metadata import AttentionMetadata
from engine.attention.per_step import PerStep
from engine.decode_graphs import padded_batch_size
from engine.host_to_device import to_device
from engine.kernels.kv_cache_write import write_kv_cache
from engine.kernels.latent_attention import (
    latent_decode_attention,
    latent_decode_head_blocks,
    latent_prefill_attention,
    write_latent_cache,
)
from engine.kernels.paged_decode_attention import default_tokens_per_split, paged_decode_attention
from engine.kernels.paged_prefill_attention import paged_prefill_attention


@dataclass(frozen=True, slots=True)
class _PrefillIndex:
    """The step's prefill offsets as device tensors, built once and read by every layer."""

    query_start_loc: torch.Tensor  # [num_prefill_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_prefill_seqs] int32
    max_query_len: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, decode_sizing: DecodeSizing | None = None) -> None:
        """``decode_sizing``: the engine's, which fixes the decode kernel's partition size per
        batch-size bucket; None sizes each call by its own bound and batch."""
        self._prefill_index: PerStep[_PrefillIndex] = PerStep()
        self._decode_sizing = decode_sizing

    def write_kv(
        self,
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> None:
        write_kv_cache(kv_cache_layer, key, value, slot_mapping, kv_scales)

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
        num_prefill_tokens = metadata.num_prefill_tokens
        outputs = []
        if metadata.num_prefill_seqs > 0:
            index = self._prefill_index.get(
                metadata, lambda: _prefill_index(metadata, query.device)
            )
            outputs.append(
                paged_prefill_attention(
                    query[:num_prefill_tokens],
                    kv_cache_layer,
                    index.query_start_loc,
                    index.seq_lens,
                    metadata.prefill_block_tables,
                    scale,
                    index.max_query_len,
                    sliding_window=sliding_window,
                    logit_softcap=logit_softcap,
                    sinks=sinks,
                    kv_scales=kv_scales,
                )
            )
        if metadata.num_decode_seqs > 0:
            grouped = metadata.decode_row_starts is not None
            rows_per_seq = metadata.max_decode_rows_per_seq if grouped else 1
            outputs.append(
                paged_decode_attention(
                    query[num_prefill_tokens:],
                    kv_cache_layer,
                    metadata.decode_block_tables,
                    metadata.decode_seq_lens,
                    scale,
                    max_seq_len=metadata.max_decode_seq_len,
                    tokens_per_split=decode_tokens_per_split(
                        self._decode_sizing,
                        metadata.num_decode_seqs,
                        kv_cache_layer.shape[3],
                        rows_per_seq,
                    ),
                    row_starts=metadata.decode_row_starts,
                    max_rows_per_seq=metadata.max_decode_rows_per_seq,
                    sliding_window=sliding_window,
                    logit_softcap=logit_softcap,
                    sinks=sinks,
                    kv_scales=kv_scales,
                )
            )
        if not outputs:
            return torch.empty_like(query)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def write_latent(
        self,
        cache_layer: torch.Tensor,  # [1, num_blocks, block_size, 1, width]
        entries: torch.Tensor,  # [num_tokens, width]: each token's latent, then its rotary key
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: torch.Tensor | None = None,  # [1, 1] fp32: a quantized cache's
    ) -> None:
        write_latent_cache(cache_layer, entries, slot_mapping, kv_scales)

    def forward_latent(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, width]: absorbed into the latent space
        cache_layer: torch.Tensor,  # [1, num_blocks, block_size, 1, width]
        metadata: AttentionMetadata,
        scale: float,
        value_dim: int,  # the entries' first value_dim elements are the values (the latent)
        kv_scales: torch.Tensor | None = None,  # [1, 1] fp32: a quantized cache's
    ) -> torch.Tensor:  # [num_tokens, num_heads, value_dim]
        num_prefill_tokens = metadata.num_prefill_tokens
        outputs = []
        if metadata.num_prefill_seqs > 0:
            index = self._prefill_index.get(
                metadata, lambda: _prefill_index(metadata, query.device)
            )
            outputs.append(
                latent_prefill_attention(
                    query[:num_prefill_tokens],
                    cache_layer,
                    index.query_start_loc,
                    index.seq_lens,
                    metadata.prefill_block_tables,
                    scale,
                    value_dim,
                    index.max_query_len,
                    kv_scales=kv_scales,
                )
            )
        if metadata.num_decode_seqs > 0:
            num_rows = metadata.num_decode_seqs
            outputs.append(
                latent_decode_attention(
                    query[num_prefill_tokens:],
                    cache_layer,
                    metadata.decode_block_tables,
                    metadata.decode_seq_lens,
                    scale,
                    value_dim,
                    max_seq_len=metadata.max_decode_seq_len,
                    # a row's head blocks take the place of a sequence's KV heads: the
                    # programs per row and partition
                    tokens_per_split=decode_tokens_per_split(
                        self._decode_sizing, num_rows, latent_decode_head_blocks(query.shape[1])
                    ),
                    kv_scales=kv_scales,
                )
            )
        if not outputs:
            return query.new_empty(0, query.shape[1], value_dim)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def decode_tokens_per_split(
    sizing: DecodeSizing | None, num_rows: int, num_kv_heads: int, rows_per_seq: int = 1
) -> int | None:
    """The partition size of the bucket a decode batch of ``num_rows`` pads to in a CUDA graph
    (whether or not it runs from one): the same for a graph replay and the step run eagerly.
    With a sequence's rows grouped (``rows_per_seq`` > 1: its token and drafts in one
    program), the bucket is sized as the sequences it holds: a verify step splits a long
    context about as finely as a plain decode step of its sequences does, not as one of
    ``rows_per_seq`` times as many. None: the kernel sizes the call."""
    if sizing is None:
        return None
    bucket = padded_batch_size(num_rows, sizing.batch_sizes) or num_rows
    num_seqs = -(-bucket // rows_per_seq)
    return default_tokens_per_split(sizing.max_context, num_seqs, num_kv_heads)


def _prefill_index(metadata: AttentionMetadata, device: torch.device) -> _PrefillIndex:
    starts = metadata.prefill_query_start_loc
    return _PrefillIndex(
        query_start_loc=to_device(starts, torch.int32, device),
        seq_lens=to_device(metadata.prefill_seq_lens, torch.int32, device),
        max_query_len=max(end - start for start, end in zip(starts[:-1], starts[1:])),
    )
