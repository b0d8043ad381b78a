"""Peak activation memory of a worst-case step, measured once at start-up on CUDA.

The KV cache gets what is left of the GPU budget after the weights and this peak: a dummy step
that fills the per-step token budget with prompt tokens runs through the real runner against a
temporary cache just big enough for it, and the allocator's high-water mark is read. Sampling
a full batch of rows is added as an estimate (logits, probabilities, a sort's values and
indices per row).
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.kv_cache.budget import KVLayout
from engine.model_runner import ModelRunner
from engine.models.registry import CausalLM
from engine.sampling import SamplingParams
from engine.scheduler.outputs import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence

_SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 4 + 8  # logits, probs, sorted values, sort indices


def peak_activation_bytes(
    model: CausalLM,
    layout: KVLayout,
    attn_backend: AttentionBackend,
    device: torch.device,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    vocab_size: int,
) -> int:
    """Bytes a worst-case step allocates beyond the weights (0 off CUDA: not measurable)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_worst_case_step(model, layout, attn_backend, device, max_num_batched_tokens, max_model_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak + max_num_seqs * vocab_size * _SAMPLER_BYTES_PER_LOGIT)


def run_worst_case_step(
    model: CausalLM,
    layout: KVLayout,
    attn_backend: AttentionBackend,
    device: torch.device,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> None:
    """One step of prompt tokens filling the token budget, against a temporary cache."""
    seq_len = max(1, min(max_num_batched_tokens, max_model_len - 1))
    num_seqs = -(-max_num_batched_tokens // seq_len)
    blocks_per_seq = -(-seq_len // layout.block_size)
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    cache = torch.zeros(layout.shape(num_seqs * blocks_per_seq), dtype=layout.dtype, device=device)
    runner = ModelRunner(model, cache, attn_backend, frozenset(), device)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    entries = []
    for index in range(num_seqs):
        seq = Sequence(-1 - index, "profile", [0] * seq_len, params, seq_len + 1)
        seq.block_table = list(range(index * blocks_per_seq, (index + 1) * blocks_per_seq))
        entries.append(ScheduledSequence(seq, 0, seq_len, (seq,)))
    runner.execute(SchedulerOutput(entries, [], num_seqs * seq_len, 0))
