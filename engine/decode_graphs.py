"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at engine start.

A graph's batch is its rows, one per token the step computes: a decoding sequence takes one
row, and with speculative decoding one more per draft token, at the positions after its newest
token. Every row is a query of one token attending to its own context, as the decode kernel
computes it: a draft's row has a context one longer than the row before it, and the same
block table. So a step of drafts (a verify step) replays the same graphs as a plain decode step.

Lifecycle, per engine:
  start: static input buffers allocated, every row padding -> per captured batch size, largest
         first (smaller graphs reuse its pool memory): warm-up forwards (they compile the Triton
         kernels), then a capture of the model forward into one shared memory pool
  step:  graph_batch_size (decoding sequences only? fits?) -> pad_decode_inputs (host arrays
         padded to the bucket) -> StaticDecodeBuffers.fill (one copy per buffer) -> replay ->
         the real rows' hidden states, in the step's order; logits, sampling and the drafts'
         check run eagerly after it, as for any step
  a step that does not fit (a prompt chunk of more than one token, more rows than the largest
  bucket, a context beyond the static block table) runs the eager forward instead

Padding rows hold token 0 at position 0 with slot -1 (the KV write skips negative slots) and a
context of 1 token in block 0; their outputs are discarded. Nothing inside a graph depends on a
host value: the attention metadata points at the static buffers, and its max_decode_seq_len is
the static capacity (block-table width * block_size), so the decode kernel's partition count
(default_num_splits of capacity, batch size, KV heads) is fixed per bucket at capture.

With drafts, a graph's attention metadata also groups each sequence's rows
(``row_starts``), so the decode kernel reads a sequence's K/V once for its token and drafts.

Graphs run only on CUDA with the Triton attention backend (``use_decode_graphs``).
``EagerCapturer`` stands in for CUDA graphs elsewhere, so CPU tests run everything around the
capture (padding, static buffers, metadata, row selection) exactly as the CUDA path does.
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.forward_context import ForwardContext, set_forward_context
from engine.host_to_device import copy_to_device
from engine.models.registry import CausalLM
from engine.scheduler.outputs import ScheduledSequence
from engine.step_inputs import decode_tokens

PAD_SLOT = -1  # slot_mapping of a padding row: its K/V are not written
_SMALL_BATCH_SIZES = (1, 2, 4)
_BATCH_SIZE_STEP = 8  # above the small sizes, every multiple of this is captured ...
_LARGE_BATCH_SIZE = 256  # ... up to this one; above it every multiple of _LARGE_BATCH_SIZE_STEP
_LARGE_BATCH_SIZE_STEP = 16
_NUM_WARMUPS = 2
# torch allows one graph capture at a time per process; engines of several workers may share one
_CAPTURE_LOCK = threading.Lock()

Replay = Callable[[], None]


def use_decode_graphs(enforce_eager: bool, device: torch.device, attention_backend: str) -> bool:
    """Decode steps replay CUDA graphs only on CUDA, with the Triton attention backend."""
    return not enforce_eager and device.type == "cuda" and attention_backend == "triton"


def capture_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The buckets: 1, 2, 4, every multiple of 8 to 256, of 16 above, and ``max_batch_size``
    itself (none above it)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = {size for size in _SMALL_BATCH_SIZES if size <= max_batch_size}
    sizes.update(
        range(_BATCH_SIZE_STEP, min(max_batch_size, _LARGE_BATCH_SIZE) + 1, _BATCH_SIZE_STEP)
    )
    sizes.update(range(_LARGE_BATCH_SIZE, max_batch_size + 1, _LARGE_BATCH_SIZE_STEP))
    sizes.add(max_batch_size)
    return tuple(sorted(sizes))


def max_decode_rows(max_num_seqs: int, rows_per_seq: int, max_num_batched_tokens: int) -> int:
    """The most rows a decode step can have: ``max_num_seqs`` sequences of ``rows_per_seq``
    rows each (1 + num_speculative_tokens with drafts), within the step's token budget."""
    return min(max_num_seqs * rows_per_seq, max_num_batched_tokens)


def padded_batch_size(num_rows: int, batch_sizes: SequenceOf[int]) -> int | None:
    """The smallest of the sorted ``batch_sizes`` >= ``num_rows``; None if 0 or above them."""
    if num_rows < 1:
        return None
    index = bisect.bisect_left(batch_sizes, num_rows)
    return batch_sizes[index] if index < len(batch_sizes) else None


def graph_batch_size(
    step: SequenceOf[ScheduledSequence],
    batch_sizes: SequenceOf[int],
    max_seq_len: int,
    max_rows_per_seq: int = 1,
) -> int | None:
    """The bucket a step replays at; None: it runs eagerly.

    Only steps of decoding sequences (each computes its newest token, and its drafts if it has
    any: ``max_rows_per_seq`` rows at most) whose contexts, drafts included, fit
    ``max_seq_len`` (the static block table's capacity) and whose rows fit the largest bucket
    run from a graph.
    """
    if any(
        entry.num_new_tokens != 1 or entry.num_query_tokens > max_rows_per_seq for entry in step
    ):
        return None
    if any(entry.start_position + entry.num_query_tokens > max_seq_len for entry in step):
        return None
    return padded_batch_size(sum(entry.num_query_tokens for entry in step), batch_sizes)


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """One decode step's inputs on the host, padded to a captured batch size."""

    num_rows: int  # real rows, one per token computed: [0, num_rows); the rows after are padding
    input_ids: np.ndarray  # [batch_size] int64: the row's token; 0 for padding
    positions: np.ndarray  # [batch_size] int64: its position; 0 for padding
    # [num_cache_groups, batch_size] int64: its KV slot in each cache group; PAD_SLOT for padding
    slot_mapping: np.ndarray
    seq_lens: np.ndarray  # [batch_size] int64: its context, itself included; 1 for padding
    # [num_cache_groups, batch_size, num_columns] int64: the blocks holding each row's context
    # in each cache group (num_columns: the most any row needs), padded with block 0, which
    # padding rows read; a sequence's rows all get the blocks of its last one
    block_tables: np.ndarray
    # [batch_size + 1] int64: rows row_starts[g] .. [g + 1] are one sequence's (its token, then
    # its drafts), then each padding row alone, then empty groups up to batch_size of them
    row_starts: np.ndarray

    @property
    def batch_size(self) -> int:
        return len(self.input_ids)


def pad_decode_inputs(
    step: SequenceOf[ScheduledSequence], batch_size: int, block_size: int, num_groups: int = 1
) -> DecodeInputs:
    """The inputs of a decode ``step`` (entries as ``graph_batch_size`` takes them) padded to
    ``batch_size`` rows, with the tables of ``num_groups`` KV cache groups."""
    real = decode_tokens(step, block_size, num_groups)
    num_rows = len(real.positions)
    if not 1 <= num_rows <= batch_size:
        raise ValueError(f"a step of {num_rows} rows does not pad to {batch_size}")
    positions = np.zeros(batch_size, dtype=np.int64)
    positions[:num_rows] = real.positions
    input_ids = np.zeros(batch_size, dtype=np.int64)
    input_ids[:num_rows] = real.input_ids
    slot_mapping = np.full((num_groups, batch_size), PAD_SLOT, dtype=np.int64)
    slot_mapping[:, :num_rows] = real.slot_mapping
    seq_lens = np.ones(batch_size, dtype=np.int64)
    seq_lens[:num_rows] = real.positions + 1
    blocks_needed = -(-seq_lens // block_size)  # [batch_size]
    block_tables = np.zeros((num_groups, batch_size, int(blocks_needed.max())), dtype=np.int64)
    first_row = 0
    for entry in step:
        end = first_row + entry.num_query_tokens
        needed = blocks_needed[end - 1]  # the sequence's last row has the longest context
        for group, table in enumerate(entry.seq.block_tables):
            block_tables[group, first_row:end, :needed] = table.array[:needed]
        first_row = end
    row_starts = np.full(batch_size + 1, batch_size, dtype=np.int64)
    num_groups = len(step) + batch_size - num_rows  # the sequences, then the padding rows
    row_starts[1 : len(step) + 1] = np.cumsum([entry.num_query_tokens for entry in step])
    row_starts[len(step) + 1 : num_groups + 1] = np.arange(num_rows + 1, batch_size + 1)
    row_starts[0] = 0
    return DecodeInputs(
        num_rows, input_ids, positions, slot_mapping, seq_lens, block_tables, row_starts
    )


@dataclass(frozen=True, slots=True)
class StaticDecodeBuffers:
    """The device tensors every captured graph reads its inputs from (a graph of batch size b
    reads the first b rows). Allocated with every row padding."""

    input_ids: torch.Tensor  # [max_batch_size] int64
    positions: torch.Tensor  # [max_batch_size] int64
    slot_mapping: torch.Tensor  # [num_cache_groups, max_batch_size] int64
    seq_lens: torch.Tensor  # [max_batch_size] int64
    # [num_cache_groups, max_batch_size, max_blocks_per_seq] int64; columns past a row's context
    # may hold blocks of an earlier step: the decode kernel reads no block beyond seq_lens
    block_tables: torch.Tensor
    row_starts: torch.Tensor  # [max_batch_size + 1] int64: a graph of b reads the first b + 1
    no_prefill_block_tables: torch.Tensor  # [0, max_blocks_per_seq] int64

    @classmethod
    def allocate(
        cls,
        max_batch_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
        num_groups: int = 1,
    ) -> StaticDecodeBuffers:
        def filled(shape: tuple[int, ...], value: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=device)

        return cls(
            input_ids=filled((max_batch_size,), 0),
            positions=filled((max_batch_size,), 0),
            slot_mapping=filled((num_groups, max_batch_size), PAD_SLOT),
            seq_lens=filled((max_batch_size,), 1),
            block_tables=filled((num_groups, max_batch_size, max_blocks_per_seq), 0),
            row_starts=torch.arange(max_batch_size + 1, dtype=torch.int64, device=device),
            no_prefill_block_tables=filled((0, max_blocks_per_seq), 0),
        )

    def fill(self, inputs: DecodeInputs) -> None:
        """Copy a step's padded inputs into the first ``inputs.batch_size`` rows."""
        groups, rows, columns = inputs.block_tables.shape
        max_groups, max_rows, max_columns = self.block_tables.shape
        if rows > max_rows or columns > max_columns or groups != max_groups:
            raise ValueError(
                f"inputs of {groups} cache groups x {rows} rows x {columns} blocks do not fit "
                f"the static buffers' {max_groups} x {max_rows} x {max_columns}"
            )
        copy_to_device(self.input_ids[:rows], inputs.input_ids)
        copy_to_device(self.positions[:rows], inputs.positions)
        copy_to_device(self.slot_mapping[:, :rows], inputs.slot_mapping)
        copy_to_device(self.seq_lens[:rows], inputs.seq_lens)
        copy_to_device(self.block_tables[:, :rows, :columns], inputs.block_tables)
        copy_to_device(self.row_starts[: rows + 1], inputs.row_starts)

    def metadata(
        self, batch_size: int, max_seq_len: int, max_rows_per_seq: int = 1
    ) -> tuple[AttentionMetadata, ...]:
        """The batch layout a graph of ``batch_size`` rows is captured with, in each cache
        group; a sequence's rows are grouped for the attention when it may have drafts
        (``max_rows_per_seq`` > 1)."""
        return tuple(
            AttentionMetadata(
                num_prefill_seqs=0,
                num_prefill_tokens=0,
                num_decode_seqs=batch_size,
                slot_mapping=self.slot_mapping[group, :batch_size],
                prefill_query_start_loc=[0],
                prefill_seq_lens=[],
                prefill_block_tables=self.no_prefill_block_tables,
                decode_seq_lens=self.seq_lens[:batch_size],
                decode_block_tables=self.block_tables[group, :batch_size],
                max_decode_seq_len=max_seq_len,  # a bound, not the step's max: no host value
                decode_row_starts=(
                    self.row_starts[: batch_size + 1] if max_rows_per_seq > 1 else None
                ),
                max_decode_rows_per_seq=max_rows_per_seq,
            )
            for group in range(len(self.slot_mapping))
        )


class GraphCapturer(Protocol):
    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        """Record ``forward``; returns a replay call and the tensor each replay rewrites."""


class CudaGraphCapturer:
    """Captures into ``torch.cuda.CUDAGraph``s sharing one memory pool, after warm-ups on the
    capture stream (they compile the Triton kernels and set up cuBLAS outside the capture)."""

    def __init__(self, device: torch.device, num_warmups: int = _NUM_WARMUPS) -> None:
        self.device = device
        self.num_warmups = num_warmups
        with torch.cuda.device(device):
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)  # every capture on it, as the pool wants

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # the static buffers and the cache are ready
            with torch.cuda.stream(self.stream):
                for _ in range(self.num_warmups):
                    forward()
            torch.cuda.synchronize(self.device)
            with (
                _CAPTURE_LOCK,
                torch.cuda.graph(
                    graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
                ),
            ):
                output = forward()
        return functools.partial(self._replay, graph), output

    def _replay(self, graph: torch.cuda.CUDAGraph) -> None:
        with torch.cuda.device(self.device):
            graph.replay()  # on the current stream, after the copies into the static buffers


class EagerCapturer:
    """Stands in for CUDA graphs without a GPU: a replay runs ``forward`` again and copies its
    result into the tensor the capture returned."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        output = forward()
        return functools.partial(self._replay, forward, output), output

    @staticmethod
    def _replay(forward: Callable[[], torch.Tensor], output: torch.Tensor) -> None:
        output.copy_(forward())


class DecodeGraphs:
    """The model forward of decode steps (drafts included), captured once per batch size in
    ``batch_sizes`` (rows, sorted, as ``capture_batch_sizes`` gives them) and replayed from
    static inputs."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,  # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]
        attn_backend: AttentionBackend,
        *,
        max_model_len: int,
        batch_sizes: SequenceOf[int],
        capturer: GraphCapturer,
        max_rows_per_seq: int = 1,
        num_cache_groups: int = 1,
    ) -> None:
        """``max_rows_per_seq``: 1 + num_speculative_tokens with drafts; above 1, the attention
        takes a sequence's rows together (engine/kernels/paged_decode_attention.py).
        ``num_cache_groups``: the model's KV cache groups (engine/kv_cache/cache_groups.py)."""
        self.block_size = kv_cache.shape[3]
        self.batch_sizes = tuple(batch_sizes)
        self.max_rows_per_seq = max_rows_per_seq
        max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.max_seq_len = max_blocks_per_seq * self.block_size  # the static capacity
        self.num_cache_groups = num_cache_groups
        self.buffers = StaticDecodeBuffers.allocate(
            self.batch_sizes[-1], max_blocks_per_seq, kv_cache.device, num_cache_groups
        )
        self.num_replays: Counter[int] = Counter()  # batch size -> steps replayed at it
        self._replays: dict[int, Replay] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # batch size -> [batch_size, hidden_size]
        with torch.inference_mode():
            for batch_size in reversed(self.batch_sizes):
                metadata = self.buffers.metadata(batch_size, self.max_seq_len, max_rows_per_seq)
                context = ForwardContext.for_groups(metadata, kv_cache, attn_backend)
                forward = functools.partial(self._forward, model, context, batch_size)
                self._replays[batch_size], self._outputs[batch_size] = capturer.capture(forward)

    def output_row_bytes(self) -> int:
        """Bytes of one row of a graph's output (one token's hidden state)."""
        output = self._outputs[self.batch_sizes[-1]]
        return output.shape[1] * output.element_size()

    def _forward(self, model: CausalLM, context: ForwardContext, batch_size: int) -> torch.Tensor:
        with set_forward_context(context):
            return model.forward(
                self.buffers.input_ids[:batch_size], self.buffers.positions[:batch_size]
            )  # [batch_size, hidden_size]

    def prepare(
        self,
        step: SequenceOf[ScheduledSequence],
        awaited: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Callable[[], torch.Tensor] | None:
        """Copy a step's padded inputs into the static buffers; the call returned replays its
        graph and gives the real rows' hidden states, [num_rows, hidden_size] in the step's
        order (valid until the next replay). ``awaited``: rows [r] and their token ids [r] on
        the device, written over those rows' placeholders (async scheduling). None: the step
        cannot run from a graph (see graph_batch_size)."""
        batch_size = graph_batch_size(
            step, self.batch_sizes, self.max_seq_len, self.max_rows_per_seq
        )
        if batch_size is None:
            return None
        inputs = pad_decode_inputs(step, batch_size, self.block_size, self.num_cache_groups)
        self.buffers.fill(inputs)
        if awaited is not None:
            self.buffers.input_ids.index_copy_(0, *awaited)
        return functools.partial(self._replay, batch_size, inputs.num_rows)

    def _replay(self, batch_size: int, num_rows: int) -> torch.Tensor:
        self._replays[batch_size]()
        self.num_replays[batch_size] += 1
        return self._outputs[batch_size][:num_rows]
