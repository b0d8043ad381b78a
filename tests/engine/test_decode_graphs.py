"""Decode-step graphs without a GPU: buckets, eligibility, padding into static buffers, and the
whole graph path with EagerCapturer standing in for CUDA graphs (Triton's interpreter)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.backend import DecodeSizing
from engine.attention.selector import get_attention_backend
from engine.attention.triton_backend import decode_tokens_per_split
from engine.decode_graphs import (
    PAD_SLOT,
    DecodeGraphs,
    EagerCapturer,
    StaticDecodeBuffers,
    capture_batch_sizes,
    graph_batch_size,
    max_decode_rows,
    pad_decode_inputs,
    padded_batch_size,
    use_decode_graphs,
)
from engine.engine_config import LoadConfig
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.budget import KVLayout
from engine.memory_profile import build_largest_decode_graph, decode_graph_bytes
from engine.model_config import load_model_config
from engine.model_loader import load_model
from engine.scheduler.outputs import ScheduledSequence
from engine.sequence import Sequence
from router.cli import build_parser
from router.cluster_config import ClusterConfig

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def _entry(
    token_ids: list[int], block_table: list[int], start: int, num_new: int = 1
) -> ScheduledSequence:
    seq = Sequence(0, "r", token_ids, SamplingParams(), len(token_ids) + 8)
    seq.block_tables = [BlockTable(block_table)]
    return ScheduledSequence(seq, start, num_new, (seq,))


def _decode(num_tokens: int, block_table: list[int]) -> ScheduledSequence:
    """A sequence of ``num_tokens`` tokens computing its last one."""
    return _entry(list(range(100, 100 + num_tokens)), block_table, num_tokens - 1)


# ---- buckets and eligibility --------------------------------------------------------------
def test_capture_batch_sizes() -> None:
    sizes = capture_batch_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24)
    assert sizes[-1] == 256 and len(sizes) == 3 + 32
    assert all(size % 8 == 0 for size in sizes[3:])
    # above 256 every multiple of 16 (a verify step has a row per draft besides its token)
    larger = capture_batch_sizes(300)
    assert larger[: len(sizes)] == sizes
    assert larger[len(sizes) :] == (272, 288, 300)
    assert capture_batch_sizes(20) == (1, 2, 4, 8, 16, 20)  # the maximum itself is a bucket
    assert capture_batch_sizes(3) == (1, 2, 3)
    assert capture_batch_sizes(1) == (1,)
    with pytest.raises(ValueError, match="max_batch_size"):
        capture_batch_sizes(0)


@pytest.mark.parametrize(
    ("num_seqs", "expected"), [(0, None), (1, 1), (3, 4), (5, 8), (8, 8), (17, 24), (257, None)]
)
def test_padded_batch_size(num_seqs: int, expected: int | None) -> None:
    assert padded_batch_size(num_seqs, capture_batch_sizes(256)) == expected


def test_graph_batch_size_takes_decode_only_steps_that_fit() -> None:
    sizes = capture_batch_sizes(4)
    decodes = [_decode(5, [7, 3]), _decode(9, [1, 2, 6])]
    assert graph_batch_size(decodes, sizes, max_seq_len=16) == 2
    assert graph_batch_size(decodes[:1] * 3, sizes, max_seq_len=16) == 4
    # a one-token prompt chunk computes one token too: it may run from a graph
    one_token_chunk = _entry([5, 6, 7], [4], start=2)
    assert graph_batch_size([one_token_chunk], sizes, max_seq_len=16) == 1
    prompt_chunk = _entry([5, 6, 7], [4], start=0, num_new=3)
    assert graph_batch_size([prompt_chunk, *decodes], sizes, max_seq_len=16) is None
    assert graph_batch_size(decodes * 3, sizes, max_seq_len=16) is None  # 6 > largest bucket
    assert graph_batch_size(decodes, sizes, max_seq_len=8) is None  # context 9 > capacity 8
    assert graph_batch_size([], sizes, max_seq_len=16) is None


def _drafting(
    num_tokens: int, block_table: list[int], drafts: tuple[int, ...]
) -> ScheduledSequence:
    """A sequence of ``num_tokens`` tokens computing its last one, then ``drafts``."""
    entry = _decode(num_tokens, block_table)
    return replace(entry, draft_token_ids=drafts)


def test_the_largest_bucket_has_a_row_per_draft_within_the_token_budget() -> None:
    assert max_decode_rows(256, 1, 8192) == 256
    assert max_decode_rows(256, 1 + 4, 8192) == 1280
    assert max_decode_rows(256, 1 + 4, 1024) == 1024


def test_grouped_rows_are_split_as_the_sequences_they_hold() -> None:
    """8k contexts of 8 KV heads: a batch of 1 (bucket 1) splits its context into 32
    partitions of 256; 5 verify rows (bucket 8) taken one program per row would get 8, taken
    per sequence (2 of 5 rows in a bucket of 8) again 32."""
    sizing = DecodeSizing(max_context=8192, batch_sizes=capture_batch_sizes(64))
    assert decode_tokens_per_split(sizing, 1, num_kv_heads=8) == 256
    assert decode_tokens_per_split(sizing, 5, num_kv_heads=8) == 1024
    assert decode_tokens_per_split(sizing, 5, num_kv_heads=8, rows_per_seq=5) == 256
    assert decode_tokens_per_split(None, 5, num_kv_heads=8) is None


def test_a_sequence_with_drafts_takes_a_row_per_token() -> None:
    sizes = capture_batch_sizes(8)
    step = [_drafting(5, [7, 3], (1, 2, 3)), _decode(9, [1, 2, 6])]
    assert graph_batch_size(step, sizes, 16, max_rows_per_seq=4) == 8  # 4 + 1 rows
    assert graph_batch_size(step * 2, sizes, 16, max_rows_per_seq=4) is None  # 10 rows > 8
    # the last draft sits at position 7: a context of 8 fits a capacity of 8, not of 7
    assert graph_batch_size(step[:1], sizes, 8, max_rows_per_seq=4) == 4
    assert graph_batch_size(step[:1], sizes, 7, max_rows_per_seq=4) is None
    # more drafts than the graphs group per sequence: eager
    assert graph_batch_size(step, sizes, 16, max_rows_per_seq=3) is None
    assert graph_batch_size(step, sizes, 16) is None


def test_graphs_only_on_cuda_with_triton() -> None:
    cuda = torch.device("cuda")
    assert use_decode_graphs(False, cuda, "triton")
    assert not use_decode_graphs(True, cuda, "triton")
    assert not use_decode_graphs(False, cuda, "torch")
    assert not use_decode_graphs(False, CPU, "triton")


def test_load_config_checks_max_capture_batch_size() -> None:
    assert not LoadConfig("some/dir").enforce_eager
    with pytest.raises(ValueError, match="max_capture_batch_size"):
        LoadConfig("some/dir", max_capture_batch_size=0)


def test_serve_flag_reaches_the_workers_load_config() -> None:
    assert build_parser().parse_args(["serve", "--enforce-eager"]).enforce_eager
    assert not build_parser().parse_args(["serve"]).enforce_eager
    assert ClusterConfig("some/dir", enforce_eager=True).load_config().enforce_eager


# ---- padding into static buffers ----------------------------------------------------------
def test_pad_decode_inputs() -> None:
    step = [
        _decode(6, [9, 4, 8]),  # position 5: block 4, offset 1; a block beyond its context
        _decode(1, [3]),  # position 0: block 3, offset 0
        _decode(9, [5, 2, 7]),  # position 8: block 7, offset 0
    ]
    inputs = pad_decode_inputs(step, batch_size=4, block_size=BLOCK_SIZE)
    assert inputs.num_rows == 3 and inputs.batch_size == 4
    assert inputs.input_ids.tolist() == [105, 100, 108, 0]
    assert inputs.positions.tolist() == [5, 0, 8, 0]
    assert inputs.seq_lens.tolist() == [6, 1, 9, 1]
    assert inputs.slot_mapping.tolist() == [[4 * 4 + 1, 3 * 4, 7 * 4, PAD_SLOT]]
    # columns: the most blocks a context needs (3); each row only the blocks its context uses
    assert inputs.block_tables.tolist() == [[[9, 4, 0], [3, 0, 0], [5, 2, 7], [0, 0, 0]]]
    assert inputs.row_starts.tolist() == [0, 1, 2, 3, 4]  # each row alone
    assert all(a.dtype == np.int64 for a in (inputs.input_ids, inputs.block_tables))


def test_pad_decode_inputs_gives_each_draft_a_row_after_its_sequences_token() -> None:
    step = [
        _drafting(3, [9, 4], (50, 51, 52)),  # positions 2..5: blocks 9 (2, 3) and 4 (4, 5)
        _decode(6, [3, 5]),  # position 5: block 5, offset 1
        _drafting(1, [8], (60,)),  # positions 0, 1: block 8
    ]
    inputs = pad_decode_inputs(step, batch_size=8, block_size=BLOCK_SIZE)
    assert inputs.num_rows == 7 and inputs.batch_size == 8
    assert inputs.input_ids.tolist() == [102, 50, 51, 52, 105, 100, 60, 0]
    assert inputs.positions.tolist() == [2, 3, 4, 5, 5, 0, 1, 0]
    assert inputs.seq_lens.tolist() == [3, 4, 5, 6, 6, 1, 2, 1]
    assert inputs.slot_mapping.tolist() == [[38, 39, 16, 17, 21, 32, 33, PAD_SLOT]]
    # a sequence's rows share the blocks of its last row (each reads only its own context)
    assert inputs.block_tables.tolist() == [[[9, 4]] * 4 + [[3, 5], [8, 0], [8, 0], [0, 0]]]
    # groups: the three sequences' rows, the padding row alone, then empty ones up to 8
    assert inputs.row_starts.tolist() == [0, 4, 5, 7, 8, 8, 8, 8, 8]


def test_pad_decode_inputs_rejects_a_step_larger_than_the_batch() -> None:
    with pytest.raises(ValueError, match="3 rows does not pad to 2"):
        pad_decode_inputs([_decode(2, [1])] * 3, batch_size=2, block_size=BLOCK_SIZE)


def test_static_buffers_start_as_padding_and_take_a_step() -> None:
    buffers = StaticDecodeBuffers.allocate(8, 5, CPU)
    assert buffers.slot_mapping.tolist() == [[PAD_SLOT] * 8]
    assert buffers.seq_lens.tolist() == [1] * 8
    assert not buffers.block_tables.any() and not buffers.input_ids.any()
    buffers.block_tables.fill_(99)  # stale blocks of an earlier step
    step = [_decode(6, [9, 4]), _decode(3, [1])]
    buffers.fill(pad_decode_inputs(step, batch_size=4, block_size=BLOCK_SIZE))
    assert buffers.input_ids[:4].tolist() == [105, 102, 0, 0]
    assert buffers.slot_mapping.tolist() == [[17, 6, PAD_SLOT, PAD_SLOT] + [PAD_SLOT] * 4]
    assert buffers.seq_lens[:4].tolist() == [6, 3, 1, 1]
    # the columns the step needs are written; the rest keep stale blocks nothing reads
    assert buffers.block_tables[0, :4].tolist() == [
        [9, 4, 99, 99, 99],
        [1, 0, 99, 99, 99],
        [0, 0, 99, 99, 99],
        [0, 0, 99, 99, 99],
    ]
    assert (buffers.block_tables[0, 4:] == 99).all()


def test_each_cache_group_gets_its_own_slots_and_tables() -> None:
    """A model of two KV cache groups (sliding and full layers): a row's slot and its blocks
    come from each group's table, and the graph's metadata of group g views row g of the
    buffers."""
    full = _decode(6, [9, 4])
    full.seq.block_tables.append(BlockTable([-1, 7]))  # the windowed group gave block 0 back
    inputs = pad_decode_inputs([full], batch_size=2, block_size=BLOCK_SIZE, num_groups=2)
    assert inputs.slot_mapping.tolist() == [[17, PAD_SLOT], [29, PAD_SLOT]]
    assert inputs.block_tables.tolist() == [[[9, 4], [0, 0]], [[-1, 7], [0, 0]]]
    buffers = StaticDecodeBuffers.allocate(4, 3, CPU, num_groups=2)
    buffers.fill(inputs)
    first, second = buffers.metadata(2, max_seq_len=3 * BLOCK_SIZE)
    assert second.slot_mapping.tolist() == [29, PAD_SLOT]
    assert second.decode_block_tables.tolist() == [[-1, 7, 0], [0, 0, 0]]
    assert first.decode_block_tables.tolist() == [[9, 4, 0], [0, 0, 0]]
    assert first.decode_seq_lens.data_ptr() == second.decode_seq_lens.data_ptr()
    with pytest.raises(ValueError, match="1 cache groups x 1 rows x 2 blocks do not fit"):
        buffers.fill(pad_decode_inputs([_decode(6, [9, 4])], 1, BLOCK_SIZE))


def test_static_buffers_reject_inputs_that_do_not_fit() -> None:
    buffers = StaticDecodeBuffers.allocate(4, 2, CPU)
    with pytest.raises(ValueError, match="do not fit the static buffers"):
        buffers.fill(pad_decode_inputs([_decode(9, [1, 2, 3])], 1, BLOCK_SIZE))  # 3 blocks > 2


def test_captured_metadata_views_the_static_buffers() -> None:
    buffers = StaticDecodeBuffers.allocate(8, 5, CPU)
    (metadata,) = buffers.metadata(4, max_seq_len=5 * BLOCK_SIZE)
    assert (metadata.num_prefill_seqs, metadata.num_prefill_tokens) == (0, 0)
    assert metadata.num_decode_seqs == metadata.num_tokens == 4
    assert metadata.max_decode_seq_len == 20  # the capacity, not the step's longest context
    for view, buffer in (
        (metadata.slot_mapping, buffers.slot_mapping),
        (metadata.decode_seq_lens, buffers.seq_lens),
        (metadata.decode_block_tables, buffers.block_tables),
    ):
        assert view.shape[0] == 4 and view.data_ptr() == buffer.data_ptr()
    assert tuple(metadata.decode_block_tables.shape) == (4, 5)
    assert metadata.decode_row_starts is None  # no drafts: rows are not grouped
    # with drafts, the rows are grouped by the step's row starts (each row alone until filled)
    (grouped,) = buffers.metadata(4, max_seq_len=5 * BLOCK_SIZE, max_rows_per_seq=3)
    assert grouped.max_decode_rows_per_seq == 3 and grouped.decode_row_starts is not None
    assert grouped.decode_row_starts.tolist() == [0, 1, 2, 3, 4]
    assert grouped.decode_row_starts.data_ptr() == buffers.row_starts.data_ptr()
    buffers.fill(pad_decode_inputs([_drafting(5, [7, 3], (1, 2))], 4, BLOCK_SIZE))
    assert grouped.decode_row_starts.tolist() == [0, 3, 4, 4, 4]


# ---- the graph path end to end, with EagerCapturer ----------------------------------------
PROMPT_LENGTHS = (1, 5, 17, 40, 70, 33)
OUTPUT_LENGTHS = (14, 3, 9, 6, 12, 1)
# all prompts run in the first step; decode steps then run 5, 5, 4, 4, 4, 3, 3, 3, 2, 2, 2,
# 1, 1 sequences: 5 is past the largest bucket (4), 3 pads to 4
EXPECTED_REPLAYS = Counter({4: 6, 2: 3, 1: 2})
NUM_EAGER_DECODE_STEPS = 2


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in PROMPT_LENGTHS]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in OUTPUT_LENGTHS]


def _triton_llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", device="cpu", attention_backend="triton")


def _record_logits(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    recorded: list[torch.Tensor] = []
    compute_logits: Callable[[torch.Tensor], torch.Tensor] = llm.engine.model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        recorded.append(logits.clone())
        return logits

    monkeypatch.setattr(llm.engine.model, "compute_logits", recording)
    return recorded


def _with_eager_graphs(llm: LLM, max_batch_size: int) -> DecodeGraphs:
    engine = llm.engine
    assert engine.runner.decode_graphs is None  # CPU: the engine captures none itself
    graphs = DecodeGraphs(
        engine.model,
        engine.kv_cache,
        engine.runner.attn_backend,
        max_model_len=engine.max_model_len,
        batch_sizes=capture_batch_sizes(max_batch_size),
        capturer=EagerCapturer(),
        num_cache_groups=engine.model_config.cache_groups.num_groups,
    )
    engine.runner.decode_graphs = graphs
    return graphs


def test_decode_graph_profile_runs_the_largest_bucket_of_padding_rows(llama_dir: Path) -> None:
    config = load_model_config(llama_dir)
    model = load_model(llama_dir, config, torch.float32, CPU)
    backend = get_attention_backend("triton", CPU)
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, 16, torch.float32)
    graphs = build_largest_decode_graph(model, layout, backend, CPU, (1, 2, 6), 200)
    assert graphs.batch_sizes == (6,)  # only the largest: the smaller graphs reuse its memory
    assert graphs.max_seq_len == 208  # the capacity the graph's attention metadata carries
    assert graphs.output_row_bytes() == config.hidden_size * 4
    assert (graphs.buffers.slot_mapping == -1).all()  # all padding: one cache block is enough
    # a drafting engine's graphs group a sequence's rows: the profile runs them so too
    grouped = build_largest_decode_graph(model, layout, backend, CPU, (1, 10), 200, 5)
    assert grouped.max_rows_per_seq == 5
    profiled = decode_graph_bytes(
        model, layout, backend, CPU, batch_sizes=(1, 2, 6), max_model_len=200
    )
    assert profiled == 0  # only measured on CUDA


def test_capture_writes_no_kv(llama_dir: Path) -> None:
    llm = _triton_llm(llama_dir)
    _with_eager_graphs(llm, max_batch_size=4)  # one forward per bucket, every row padding
    assert not llm.engine.kv_cache.any()


def test_graph_steps_match_eager_steps(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eager = _triton_llm(llama_dir)
    graphed = _triton_llm(llama_dir)
    graphs = _with_eager_graphs(graphed, max_batch_size=4)
    eager_logits = _record_logits(eager, monkeypatch)
    graph_logits = _record_logits(graphed, monkeypatch)
    prompts = _prompts()
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, _params())]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, _params())]
    assert got == expected
    assert [len(t) for t in got] == list(OUTPUT_LENGTHS)
    assert graphs.num_replays == EXPECTED_REPLAYS
    num_decode_steps = sum(EXPECTED_REPLAYS.values()) + NUM_EAGER_DECODE_STEPS
    assert graphed.engine.stats.num_steps == 1 + num_decode_steps
    # the same rows each step, to the bit: a graph's decode attention covers the static
    # capacity (two partitions of 256 tokens at max_model_len 512), an eager step only its
    # longest context (one), and a sequence's result depends on its own partitions only
    assert [t.shape for t in graph_logits] == [t.shape for t in eager_logits]
    for graph_step, eager_step in zip(graph_logits, eager_logits, strict=True):
        assert torch.equal(graph_step, eager_step)


def test_async_scheduled_steps_replay_with_their_awaited_tokens(llama_dir: Path) -> None:
    """With async scheduling a graphed decode step is launched before the step before has
    given its tokens: they are written into the static input buffer on the device."""
    eager = _triton_llm(llama_dir)
    ahead = LLM(
        str(llama_dir),
        dtype="float32",
        device="cpu",
        attention_backend="triton",
        async_scheduling=True,
    )
    graphs = _with_eager_graphs(ahead, max_batch_size=4)
    prompts = _prompts()
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, _params())]
    assert [o.outputs[0].token_ids for o in ahead.generate(prompts, _params())] == expected
    assert sum(graphs.num_replays.values()) >= sum(EXPECTED_REPLAYS.values())


def test_graph_steps_of_a_model_with_sliding_and_full_layers_match_eager_steps(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 2 (window 24 on layers 0 and 2, layer 1 full: three KV cache groups): each
    group's slots and tables reach its layers from the static buffers, the windowed groups'
    tables with the blocks they gave back, and the tokens and logits equal eager steps'."""
    model_dir = model_dirs["Gemma2ForCausalLM"]
    eager = LLM(str(model_dir), dtype="float32", device="cpu")
    graphed = LLM(str(model_dir), dtype="float32", device="cpu")
    graphs = _with_eager_graphs(graphed, max_batch_size=4)
    assert graphs.buffers.block_tables.shape[0] == 3
    eager_logits = _record_logits(eager, monkeypatch)
    graph_logits = _record_logits(graphed, monkeypatch)
    prompts = _prompts()
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, _params())]
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, _params())] == expected
    assert graphs.num_replays == EXPECTED_REPLAYS
    assert (graphs.buffers.block_tables == -1).any()  # a window gave blocks back
    for graph_step, eager_step in zip(graph_logits, eager_logits, strict=True):
        torch.testing.assert_close(graph_step, eager_step, atol=1e-5, rtol=0)
