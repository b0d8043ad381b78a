"""The CPU backend: C kernels (engine/kernels/cpu) for K/V writes, prefill and decode, each
reading the sequences' blocks in place.

A sliding-window layer's kernels start each sequence at the first block its windows reach;
soft-capped logits and attention sinks are computed by the kernels too.
Decode attention on CPU is bound by memory traffic; the reference gathers every decode
sequence's blocks into a buffer each layer before SDPA reads them again, the kernel reads
them once. Prefill attention is bound by compute: the kernel runs the whole step's prefill
sequences in one call, in register-blocked tiles (1.2-2.2x torch's flash attention for CPU,
docs/benchmarks.md). The kernels serve float32 caches and quantized ones (float8 e4m3, int8,
with their per-head scales) whose queries and new K/V are float32: they store into a quantized
cache bit for bit as the reference does, and read its elements in place, applying the scales to
the logits and outputs (a quarter of a float32 cache's bytes read per token). Other caches take
the reference path throughout.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.per_step import PerStep
from engine.attention.torch_ref import TorchAttentionBackend
from engine.kernels.checks import QUANTIZED_KV_DTYPES
from engine.kernels.cpu.kv_cache_write import write_kv_cache_cpu
from engine.kernels.cpu.paged_decode_attention import paged_decode_attention_cpu
from engine.kernels.cpu.paged_prefill_attention import paged_prefill_attention_cpu

PrefillIndex = tuple[torch.Tensor, torch.Tensor]  # query_start_loc, seq_lens (int64)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._prefill_index: PerStep[PrefillIndex] = PerStep()  # query_start_loc, seq_lens

    def write_kv(
        self,
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> None:
        if _kernels_take(kv_cache_layer, key):
            write_kv_cache_cpu(kv_cache_layer, key, value, slot_mapping, kv_scales)
        else:
            super().write_kv(kv_cache_layer, key, value, slot_mapping, kv_scales)

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
        if not _kernels_take(kv_cache_layer, query):
            return super()._prefill_all(
                query,
                kv_cache_layer,
                metadata,
                scale,
                sliding_window,
                logit_softcap,
                sinks,
                kv_scales,
            )
        starts, seq_lens = self._prefill_index.get(metadata, lambda: _prefill_index(metadata))
        return paged_prefill_attention_cpu(
            query.contiguous(),
            kv_cache_layer,
            metadata.prefill_block_tables,
            starts,
            seq_lens,
            scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            sinks=sinks,
            kv_scales=kv_scales,
        )

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
        if not _kernels_take(kv_cache_layer, query):
            return super()._decode(
                query,
                kv_cache_layer,
                metadata,
                scale,
                sliding_window,
                logit_softcap,
                sinks,
                kv_scales,
            )
        return paged_decode_attention_cpu(
            query.contiguous(),
            kv_cache_layer,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            sinks=sinks,
            kv_scales=kv_scales,
        )


def _kernels_take(
    kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    rows: torch.Tensor,  # the query, or the new keys: what the kernel reads besides the cache
) -> bool:
    """The kernels serve a CPU cache of float32, or of float8 e4m3 / int8 with float32 rows."""
    if kv_cache_layer.device.type != "cpu":
        return False
    if kv_cache_layer.dtype == torch.float32:
        return True
    return kv_cache_layer.dtype in QUANTIZED_KV_DTYPES and rows.dtype == torch.float32


def _prefill_index(metadata: AttentionMetadata) -> PrefillIndex:
    return (
        torch.tensor(metadata.prefill_query_start_loc, dtype=torch.int64),
        torch.tensor(metadata.prefill_seq_lens, dtype=torch.int64),
    )
