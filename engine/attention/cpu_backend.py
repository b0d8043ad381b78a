"""The CPU backend: C kernels (engine/kernels/cpu) for K/V writes, prefill and decode, each
reading the sequences' blocks in place.

A sliding-window layer's kernels start each sequence at the first block its windows reach;
soft-capped logits and attention sinks are computed by the kernels too.
Decode attention on CPU is bound by memory traffic; the reference gathers every decode
sequence's blocks into a buffer each layer before SDPA reads them again, the kernel reads
them once. Prefill attention is bound by compute: the kernel runs the whole step's prefill
sequences in one call, in register-blocked tiles (1.2-2.2x torch's flash attention for CPU,
docs/benchmarks.md). The kernels serve float32 caches, bfloat16 ones with bfloat16 queries and
new K/V (a bfloat16 model's: its elements widened to float32 as they are read, the attention
computed in float32 and its output rounded to bfloat16 once; the reference's bfloat16 SDPA on
this CPU took several times as long), and quantized ones (float8 e4m3, int8, with their
per-head scales) whose queries and new K/V are float32 or bfloat16 (widened to float32
first): they store into a quantized cache bit for bit as the reference does, and read its
elements in place, applying the scales to the logits and outputs (a quarter of a float32
cache's bytes read per token). Other caches take the reference path throughout.

A latent cache (multi-head latent attention) runs through the prefill kernel, its one plane
read as both keys and values by every query head (MQA over whole entries; the latent part of
each output kept), a decode row as a prompt of one new token: every query head shares each
entry, so the attention is bound by compute, which the prefill kernel's register-blocked tiles
serve (1.4-1.8x the decode kernel's speed at 16 heads of 288 on the 2-core EPYC). Its blocks
are read in place, where the reference gathers every sequence's context into a buffer and runs
SDPA over it. The values' rotary tail is summed with them and dropped (an extra
qk_rope_head_dim / kv_lora_rank of the value work, an eighth for DeepSeek-V3).
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
_FLOAT_ROWS = (torch.float32, torch.bfloat16)  # the rows a quantized cache's kernels take


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._prefill_index: PerStep[PrefillIndex] = PerStep()  # query_start_loc, seq_lens
        # a latent cache's decode rows as prompts of one token: their query_start_loc
        self._decode_rows: PerStep[torch.Tensor] = PerStep()

    def write_kv(
        self,
        kv_cache_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] fp32: a quantized cache's
    ) -> None:
        if _kernels_take(kv_cache_layer, key):
            if kv_scales is not None:  # quantized from float32 rows (as quantize_kv divides)
                key, value = key.float(), value.float()
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
        out = paged_prefill_attention_cpu(
            query.float().contiguous(),
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
        return out.to(query.dtype)

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
        out = paged_decode_attention_cpu(
            query.float().contiguous(),
            kv_cache_layer,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            sinks=sinks,
            kv_scales=kv_scales,
        )
        return out.to(query.dtype)

    def forward_latent(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, width]: absorbed into the latent space
        cache_layer: torch.Tensor,  # [1, num_blocks, block_size, 1, width]
        metadata: AttentionMetadata,
        scale: float,
        value_dim: int,  # the entries' first value_dim elements are the values (the latent)
        kv_scales: torch.Tensor | None = None,  # [1, 1] fp32: a quantized cache's
    ) -> torch.Tensor:  # [num_tokens, num_heads, value_dim]
        if not _kernels_take(cache_layer, query):
            return super().forward_latent(query, cache_layer, metadata, scale, value_dim, kv_scales)
        num_prefill_tokens = metadata.num_prefill_tokens
        outputs = []
        if metadata.num_prefill_seqs > 0:
            starts, seq_lens = self._prefill_index.get(metadata, lambda: _prefill_index(metadata))
            outputs.append(
                paged_prefill_attention_cpu(
                    query[:num_prefill_tokens].float().contiguous(),
                    cache_layer,
                    metadata.prefill_block_tables,
                    starts,
                    seq_lens,
                    scale,
                    kv_scales=kv_scales,
                )
            )
        if metadata.num_decode_seqs > 0:
            num_rows = metadata.num_decode_seqs
            rows = self._decode_rows.get(
                metadata, lambda: torch.arange(num_rows + 1, dtype=torch.int64)
            )
            outputs.append(
                paged_prefill_attention_cpu(
                    query[num_prefill_tokens : metadata.num_tokens].float().contiguous(),
                    cache_layer,
                    metadata.decode_block_tables,
                    rows,
                    metadata.decode_seq_lens,
                    scale,
                    kv_scales=kv_scales,
                )
            )
        if not outputs:
            return query.new_empty(0, query.shape[1], value_dim)
        whole = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return whole[..., :value_dim].to(query.dtype)


def _kernels_take(
    kv_cache_layer: torch.Tensor,  # [planes, num_blocks, block_size, num_kv_heads, head_dim]
    rows: torch.Tensor,  # the query, or the new keys: what the kernel reads besides the cache
) -> bool:
    """The kernels serve a CPU cache of float32 or bfloat16 with rows of its type, or of float8
    e4m3 / int8 with float32 or bfloat16 rows (a bfloat16 model's, widened first)."""
    if kv_cache_layer.device.type != "cpu":
        return False
    if kv_cache_layer.dtype in (torch.float32, torch.bfloat16):
        return rows.dtype == kv_cache_layer.dtype
    return kv_cache_layer.dtype in QUANTIZED_KV_DTYPES and rows.dtype in _FLOAT_ROWS


def _prefill_index(metadata: AttentionMetadata) -> PrefillIndex:
    return (
        torch.tensor(metadata.prefill_query_start_loc, dtype=torch.int64),
        torch.tensor(metadata.prefill_seq_lens, dtype=torch.int64),
    )
