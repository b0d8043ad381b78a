"""CUDA graphs of decode steps on a GPU, against the same engine run eagerly (bf16, Triton).

Why graph and eager results can be bitwise equal here: with max_model_len 256 the decode
kernel runs one partition in both (a graph sizes it by the static capacity, 256 tokens; eager
by the batch's longest context), and with every context longer than 32 tokens both walk it in
tiles of 64. What may still differ are the GEMMs of a padded batch (cuBLAS may pick another
kernel for another number of rows), hence the logits test's bf16 tolerance.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.attention.selector import get_attention_backend
from engine.decode_graphs import CudaGraphCapturer, DecodeGraphs, capture_batch_sizes
from engine.engine_config import CacheConfig, LoadConfig
from engine.kv_cache.budget import KVBudget, KVLayout
from engine.memory_profile import decode_graph_bytes
from engine.model_config import load_model_config
from engine.model_loader import load_model
from engine.scheduler import SchedulerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_MODEL_LEN = 256
PROMPT_LENGTHS = (33, 40, 57, 64, 90, 120, 150, 200)
OUTPUT_LENGTHS = (50, 5, 16, 1, 33, 8, 40, 20)


def _engine(
    llama_dir: Path,
    *,
    enforce_eager: bool,
    max_num_seqs: int = 16,
    max_capture: int = 256,
    async_scheduling: bool = False,
) -> LLMEngine:
    return LLMEngine(
        LoadConfig(
            str(llama_dir),
            dtype="bfloat16",
            device="cuda",
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=enforce_eager,
            max_capture_batch_size=max_capture,
        ),
        CacheConfig(block_size=16, budget=KVBudget(num_blocks=512), attention_backend="triton"),
        SchedulerConfig(max_num_seqs=max_num_seqs, async_scheduling=async_scheduling),
    )


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]


def _generate(
    engine: LLMEngine, prompts: list[list[int]], output_lengths: tuple[int, ...]
) -> list[list[int]]:
    """Greedy, past eos, every request added before the first step."""
    for index, (prompt, num_tokens) in enumerate(zip(prompts, output_lengths, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        engine.add_request(str(index), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step().finished:
            outputs[output.request_id] = output.outputs[0].token_ids
    return [outputs[str(index)] for index in range(len(prompts))]


def _record_logits(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    recorded: list[torch.Tensor] = []
    compute_logits: Callable[[torch.Tensor], torch.Tensor] = engine.model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        recorded.append(logits.clone())
        return logits

    monkeypatch.setattr(engine.model, "compute_logits", recording)
    return recorded


def test_greedy_tokens_with_graphs_match_eager(llama_dir: Path) -> None:
    graphed = _engine(llama_dir, enforce_eager=False)
    eager = _engine(llama_dir, enforce_eager=True)
    assert graphed.runner.decode_graphs is not None and eager.runner.decode_graphs is None
    assert graphed.runner.decode_graphs.batch_sizes == (1, 2, 4, 8, 16)
    prompts = _prompts(PROMPT_LENGTHS)
    expected = _generate(eager, prompts, OUTPUT_LENGTHS)
    assert _generate(graphed, prompts, OUTPUT_LENGTHS) == expected
    # decode steps of 7 down to 1 sequence: buckets 8, 4, 2 and 1 all replayed
    assert set(graphed.runner.decode_graphs.num_replays) == {1, 2, 4, 8}


def test_decode_steps_replay_their_bucket_and_larger_ones_run_eagerly(llama_dir: Path) -> None:
    graphed = _engine(llama_dir, enforce_eager=False, max_num_seqs=8, max_capture=4)
    graphs = graphed.runner.decode_graphs
    assert graphs is not None and graphs.batch_sizes == (1, 2, 4)
    assert not graphed.kv_cache.any()  # capture and warm-ups wrote no KV (padding rows only)
    eager = _engine(llama_dir, enforce_eager=True, max_num_seqs=8)
    prompts = _prompts((33, 34, 40, 48, 64, 80, 96, 128))
    output_lengths = (1, 2, 3, 4, 5, 6, 7, 8)
    got = _generate(graphed, prompts, output_lengths)
    assert got == _generate(eager, prompts, output_lengths)
    # one prefill step, then decode steps of 7, 6, 5 (eager: above 4), 4, 3 (pads to 4), 2, 1
    assert graphs.num_replays == Counter({4: 2, 2: 1, 1: 1})
    assert graphed.stats.num_steps == eager.stats.num_steps == 8


def test_logits_with_graphs_match_eager(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    graphed = _engine(llama_dir, enforce_eager=False)
    eager = _engine(llama_dir, enforce_eager=True)
    graph_logits = _record_logits(graphed, monkeypatch)
    eager_logits = _record_logits(eager, monkeypatch)
    prompts = _prompts(PROMPT_LENGTHS[:5])  # 5 sequences: padded to 8, then 4, 2, 1
    output_lengths = (12, 3, 6, 9, 2)
    _generate(graphed, prompts, output_lengths)
    _generate(eager, prompts, output_lengths)
    assert graphed.runner.decode_graphs is not None
    assert sum(graphed.runner.decode_graphs.num_replays.values()) == 11  # every decode step
    assert [t.shape for t in graph_logits] == [t.shape for t in eager_logits]
    for graph_step, eager_step in zip(graph_logits, eager_logits, strict=True):
        torch.testing.assert_close(graph_step, eager_step, rtol=1.6e-2, atol=1e-2)


def test_async_scheduling_gives_the_tokens_of_stepping_in_turn(llama_dir: Path) -> None:
    """Each decode step replays its graph with its tokens fed on the device from the step
    before, launched before that step's tokens reached the host."""
    in_turn = _engine(llama_dir, enforce_eager=False)
    ahead = _engine(llama_dir, enforce_eager=False, async_scheduling=True)
    prompts = _prompts(PROMPT_LENGTHS)
    assert _generate(ahead, prompts, OUTPUT_LENGTHS) == _generate(in_turn, prompts, OUTPUT_LENGTHS)
    assert ahead.runner.decode_graphs is not None
    assert sum(ahead.runner.decode_graphs.num_replays.values()) >= max(OUTPUT_LENGTHS) - 1


def test_a_decode_step_launches_and_samples_without_waiting_for_the_gpu(
    llama_dir: Path,
) -> None:
    """What async scheduling's overlap needs: building, launching and sampling a graphed
    decode step (greedy, sampled, seeded and penalised rows) never synchronises with the
    device; only the tokens' trip to the host does."""
    engine = _engine(llama_dir, enforce_eager=False)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=8, ignore_eos=True),
    ]
    for index, (prompt, params) in enumerate(zip(_prompts((40, 57, 64, 90)), kinds)):
        engine.add_request(str(index), prompt, params)
    engine.step()  # the prompts
    runner, scheduler = engine.runner, engine.scheduler
    first = scheduler.schedule()
    launched = runner.launch(first)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # the work of an async step while the GPU runs the step before
        sampled = runner.sample(launched)
        ahead = scheduler.schedule(step_in_flight=True)
        launched_ahead = runner.launch(ahead)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(entry.awaits_sampled_token for entry in ahead.scheduled) and ahead.scheduled
    scheduler.update(first, sampled.result())
    scheduler.update(ahead, runner.sample(launched_ahead).result())
    assert all(seq.num_output_tokens == 3 for seq in scheduler.running)
    assert runner.decode_graphs is not None and sum(runner.decode_graphs.num_replays.values()) == 2


def test_kv_budget_reserves_what_the_graphs_hold(llama_dir: Path) -> None:
    """The start-up estimate of the graphs' memory (charged to the KV budget) against what
    capturing every bucket allocates at its high-water mark: static buffers, the largest
    graph's activations (the smaller ones reuse its pool) and each graph's output."""
    device = torch.device("cuda")
    config = load_model_config(llama_dir)
    model = load_model(llama_dir, config, torch.bfloat16, device)
    backend = get_attention_backend("triton", device)
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, 16, torch.bfloat16)
    batch_sizes = capture_batch_sizes(256)
    estimate = decode_graph_bytes(
        model, layout, backend, device, batch_sizes=batch_sizes, max_model_len=MAX_MODEL_LEN
    )
    cache = torch.zeros(layout.shape(64), dtype=torch.bfloat16, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    graphs = DecodeGraphs(
        model,
        cache,
        backend,
        max_model_len=MAX_MODEL_LEN,
        batch_sizes=batch_sizes,
        capturer=CudaGraphCapturer(device),
    )
    torch.cuda.synchronize(device)
    held = torch.cuda.max_memory_allocated(device) - before
    assert graphs.batch_sizes == batch_sizes
    assert 0.9 * held <= estimate <= 1.5 * held + (1 << 20), (estimate, held)
