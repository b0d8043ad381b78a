"""``pdserve plan`` for models with sliding-window layers: their KV is kept apart (a block holds
one cache group's layers), a sequence's sliding groups hold its window's blocks alone, a
hand-off moves those, and a decode row of a sliding layer reads its window at most, as the
engine's block manager and kernels do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.kv_cache.cache_groups import CacheGroups, cache_groups_for
from router.latency_model import StepShape
from router.planner.hardware import PRESETS, StepTimeModel
from router.planner.model_costs import ModelCosts
from router.planner.simulator import ClusterShape, Simulation, WorkerShape, WorkloadRequest
from tests.router.test_planner import LLAMA_3_8B

# Llama-3-8B's shape as Qwen2 with sliding windows of 1024 on its upper 16 layers
QWEN2_SLIDING = dict(
    LLAMA_3_8B,
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    use_sliding_window=True,
    sliding_window=1024,
    max_window_layers=16,
    max_position_embeddings=32768,
)


def test_a_token_reads_each_sliding_layers_window_at_most() -> None:
    groups = cache_groups_for(4, 64, (2, 3))  # layers 0-1 see all, 2-3 the last 64
    assert groups.mean_positions_read(10) == 10
    assert groups.mean_positions_read(1000) == (2 * 1000 + 2 * 64) / 4
    assert CacheGroups.single(4).mean_positions_read(1000) == 1000
    # pairs of tokens 41..140 (100 after 40): a full layer's 41 + ... + 140, a sliding
    # layer's 41 + ... + 64 then 64 each
    full = sum(range(41, 141))
    sliding = sum(range(41, 65)) + 76 * 64
    assert groups.mean_pairs(40, 100) == (2 * full + 2 * sliding) / 4
    assert groups.mean_pairs(0, 10) == 55  # all within the window
    assert groups.mean_pairs(500, 2) == (2 * (501 + 502) + 2 * 2 * 64) / 4
    assert CacheGroups.single(4).mean_pairs(40, 100) == full


def test_a_sliding_models_blocks_hold_one_groups_layers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_SLIDING))
    costs = ModelCosts.load(tmp_path)
    assert costs.cache_groups is not None and costs.cache_groups.windows == (None, 1024)
    assert costs.kv_bytes_per_token == 128 * 1024  # every layer's, as for Llama-3-8B
    assert costs.kv_bytes_per_block(16) == 16 * 128 * 1024 / 2  # 16 of its 32 layers
    # one sequence of 8000 tokens decoding on an H100: its full layers read 8000 positions, its
    # sliding ones 1024
    model = StepTimeModel(costs, PRESETS["h100"])
    read = costs.cache_groups.mean_positions_read(8000)
    assert read == (8000 + 1024) / 2
    shape = StepShape(0, 0, 1, 8000, decode_kv_tokens=read)
    expected = (costs.weight_bytes_read(1) + read * costs.kv_bytes_per_token) / PRESETS[
        "h100"
    ].memory_bytes_per_s
    assert model(shape) == pytest.approx(PRESETS["h100"].step_overhead_s + expected)
    # its prompt of 8000 tokens: compute-bound, the sliding layers' pairs within 1024
    pairs = costs.cache_groups.mean_pairs(0, 8000)
    assert pairs == (8000 * 8001 / 2 + (1024 * 1025 / 2 + (8000 - 1024) * 1024)) / 2
    prefill = StepShape(8000, 8000 * 8001 // 2, attention_pairs=pairs)
    unwindowed = StepShape(8000, 8000 * 8001 // 2)
    compute = (costs.flops_per_token * 8000 + costs.attention_flops_per_pair * pairs) / PRESETS[
        "h100"
    ].flops_per_s
    assert model(prefill) == pytest.approx(PRESETS["h100"].step_overhead_s + compute)
    saved = costs.attention_flops_per_pair * (8000 * 8001 / 2 - pairs) / PRESETS["h100"].flops_per_s
    assert model(unwindowed) - model(prefill) == pytest.approx(saved)


def _two_long_prompts(groups: CacheGroups | None, num_kv_blocks: int) -> list[float]:
    """TTFTs of two prompts of 1200 tokens arriving together on a colocated worker of
    ``num_kv_blocks`` blocks of 16 tokens whose step takes 10 ms + 10 us a token."""

    def step(shape: StepShape) -> float:
        return 0.010 + 1e-5 * (shape.num_prefill_tokens + shape.num_decode_tokens)

    worker = WorkerShape(1, step, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=4096)
    prompts = [WorkloadRequest(0.0, tuple(range(i, i + 1200)), 200) for i in (0, 5000)]
    simulated = Simulation(ClusterShape(worker, block_size=16, cache_groups=groups), prompts)
    return [s.ttft_s or 0.0 for s in simulated.run()]


def test_a_sliding_groups_window_leaves_room_for_more_sequences() -> None:
    """The memory of 140 blocks of all four layers: two prompts of 1200 tokens need 75 each,
    so the second waits for the first's 200 tokens to end. Kept apart (280 blocks of two
    layers), one needs 75 blocks of its full group and 5 of its window's (88 and 5 at its
    end): the second is prefilled in the next step, beside the first's decode."""
    alone = _two_long_prompts(None, 140)
    apart = _two_long_prompts(cache_groups_for(4, 64, (2, 3)), 280)
    assert alone[0] == pytest.approx(0.010 + 0.012)
    assert alone[1] > 1.0  # after the first's 199 decode steps
    assert apart == [pytest.approx(0.022), pytest.approx(0.022 + 0.010 + 0.01201)]
