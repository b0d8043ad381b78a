"""Memory a worker needs beside its weights and KV cache, measured once at start-up on CUDA.

The KV cache gets what is left of the GPU budget after the weights and two amounts:
- the peak activations of a worst-case step: a dummy step that fills the per-step token budget
  with prompt tokens runs through the real runner against a temporary cache just big enough for
  it, and the allocator's high-water mark is read. Sampling a full batch of rows is added as an
  estimate (logits, probabilities, a sort's values and indices per row);
- what the CUDA graphs of decode steps hold, when they are captured: their static input
  buffers, the largest graph's activations in the graphs' own memory pool (which the eager
  steps cannot reuse; the smaller graphs reuse it) and every graph's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.decode_graphs import DecodeGraphs, EagerCapturer
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.budget import KVLayout
from engine.model_runner import ModelRunner
from engine.models.registry import CausalLM
from engine.sampling import SamplingParams
from engine.scheduler.outputs import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence

_SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 4 + 8  # logits, probs, sorted values, sort indices
T = TypeVar("T")


def peak_activation_bytes(
    model: CausalLM,
    layout: KVLayout,
    attn_backend: AttentionBackend,
    device: torch.device,
    *,
    max_num_batched_tokens: int,
    max_num_sample_rows: int,
    max_model_len: int,
    vocab_size: int,
) -> int:
    """Bytes a worst-case step allocates beyond the weights (0 off CUDA: not measurable);
    ``max_num_sample_rows``: rows of logits a step samples from at most (a sequence's token
    and each of its drafts take one)."""
    if device.type != "cuda":
        return 0
    peak, _ = _peak_allocated_bytes(
        device,
        lambda: run_worst_case_step(
            model, layout, attn_backend, device, max_num_batched_tokens, max_model_len
        ),
    )
    torch.cuda.empty_cache()
    return int(peak + max_num_sample_rows * vocab_size * _SAMPLER_BYTES_PER_LOGIT)


def run_worst_case_step(
    model: CausalLM,
    layout: KVLayout,
    attn_backend: AttentionBackend,
    device: torch.device,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> None:
    """One step of prompt tokens filling the token budget, against a temporary cache, and the
    logits of each sequence's last token (sampling them is estimated, not run). Every rank of a
    tensor-parallel worker runs the same step: its forward and logits are collectives."""
    seq_len = max(1, min(max_num_batched_tokens, max_model_len - 1))
    num_seqs = -(-max_num_batched_tokens // seq_len)
    blocks_per_seq = -(-seq_len // layout.block_size)
    # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]
    cache = torch.zeros(layout.shape(num_seqs * blocks_per_seq), dtype=layout.dtype, device=device)
    runner = ModelRunner(model, cache, attn_backend, frozenset(), device)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    entries = []
    for index in range(num_seqs):
        seq = Sequence(-1 - index, "profile", [0] * seq_len, params, seq_len + 1)
        blocks = range(index * blocks_per_seq, (index + 1) * blocks_per_seq)
        # every cache group writes the same blocks: a profile reads no value back
        seq.block_tables = [BlockTable(blocks) for _ in range(layout.num_cache_groups)]
        entries.append(ScheduledSequence(seq, 0, seq_len, (seq,)))
    launched = runner.launch(SchedulerOutput(entries, [], num_seqs * seq_len, 0))
    last_rows = np.arange(1, num_seqs + 1, dtype=np.int64) * seq_len - 1
    with torch.inference_mode():
        runner.logits_at(launched.hidden, last_rows)


def decode_graph_bytes(
    model: CausalLM,
    layout: KVLayout,
    attn_backend: AttentionBackend,
    device: torch.device,
    *,
    batch_sizes: tuple[int, ...],
    max_model_len: int,
    max_rows_per_seq: int = 1,
) -> int:
    """Bytes the decode graphs of ``batch_sizes`` (sorted) hold (0 off CUDA: not measurable).

    The largest bucket's forward runs eagerly from the graphs' static buffers against a
    one-block cache (every row is padding, reading block 0), so the attention metadata, and
    with it the decode kernel's split count, is the one the graph is captured with. It runs on
    a stream of its own, as the capture does: cuBLAS gives each stream its own workspace.
    """
    if device.type != "cuda":
        return 0

    def build_on_a_side_stream() -> DecodeGraphs:
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
            return build_largest_decode_graph(
                model, layout, attn_backend, device, batch_sizes, max_model_len, max_rows_per_seq
            )

    peak, graphs = _peak_allocated_bytes(device, build_on_a_side_stream)
    peak -= layout.bytes_per_block  # the one-block cache
    row_bytes = graphs.output_row_bytes()
    del graphs
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:  # the side stream's workspace, counted above
        clear_workspaces()
    torch.cuda.empty_cache()
    return int(peak + sum(batch_sizes[:-1]) * row_bytes)


def build_largest_decode_graph(
    model: CausalLM,
    layout: KVLayout,
    attn_backend: AttentionBackend,
    device: torch.device,
    batch_sizes: tuple[int, ...],
    max_model_len: int,
    max_rows_per_seq: int = 1,
) -> DecodeGraphs:
    """The largest bucket of ``batch_sizes`` run once, eagerly, against a one-block cache (with
    the graphs' grouping of a sequence's rows: ``max_rows_per_seq``)."""
    cache = torch.zeros(layout.shape(1), dtype=layout.dtype, device=device)
    return DecodeGraphs(
        model,
        cache,
        attn_backend,
        max_model_len=max_model_len,
        batch_sizes=batch_sizes[-1:],
        capturer=EagerCapturer(),
        max_rows_per_seq=max_rows_per_seq,
        num_cache_groups=layout.num_cache_groups,
    )


def _peak_allocated_bytes(device: torch.device, run: Callable[[], T]) -> tuple[int, T]:
    """How far ``run`` raised the device's allocated bytes at its high-water mark, and what it
    returned."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, result
