"""bench.plan_roofline: its four shapes are what they say (the planner reads the experts, the
windows and the latent attention), a step's roofline shape counts a sliding layer's window, and a run of the tiny
size against a preset writes each shape's measured steps beside the roofline's predictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.plan_roofline import (
    SIZES,
    decode_shape,
    main,
    shape_configs,
    with_counts_left_out,
    write_model,
)
from engine.kv_cache.cache_groups import cache_groups_for
from engine.messages import StepTiming
from router.planner.model_costs import ModelCosts

pytestmark = pytest.mark.timeout(300)


def test_the_shapes_are_dense_a_mixture_sliding_and_latent(tmp_path: Path) -> None:
    size = SIZES["cpu"]
    configs = shape_configs(size)
    costs = {
        name: ModelCosts.load(write_model(tmp_path / name, config), size.dtype)
        for name, config in configs.items()
    }
    dense, moe, sliding, mla = costs["dense"], costs["moe"], costs["sliding"], costs["mla"]
    # two experts of eight a token, together as wide as the dense MLP: the same FLOPs a token,
    # four times the MLP's weights stored
    assert (moe.num_experts, moe.experts_per_token) == (8, 2)
    assert moe.flops_per_token == pytest.approx(dense.flops_per_token, rel=1e-6)
    mlp = 3 * size.hidden * size.intermediate * size.layers * 4  # float32
    assert moe.routed_expert_bytes == pytest.approx(4 * mlp)
    assert dense.cache_groups is None and moe.cache_groups is None
    assert sliding.cache_groups is not None
    assert sorted(sliding.cache_groups.windows, key=str) == sorted([None, size.window], key=str)
    # latent attention: the cache holds the latent and the rotary key a token and layer; a
    # pair costs the absorbed form's FLOPs, and without the count the up-projected form's
    rank, rope = 4 * size.head_dim, size.head_dim // 2
    assert mla.kv_bytes_per_token == size.layers * (rank + rope) * 4
    assert mla.attention_flops_per_pair == size.layers * 2 * size.heads * (2 * rank + rope)
    up_projected = with_counts_left_out("mla", mla, configs["mla"]).attention_flops_per_pair
    assert up_projected == size.layers * 2 * size.heads * (2 * size.head_dim + rope)
    assert with_counts_left_out("moe", moe, configs["moe"]).routed_expert_bytes == 0
    assert with_counts_left_out("dense", dense, configs["dense"]) == dense


def test_a_decode_steps_shape_reads_a_sliding_layers_window() -> None:
    """Four rows at position 1000 of a model whose 2 of 4 layers slide with a window of 100:
    the full layers read 1001 positions a row, the sliding ones 100."""
    timing = StepTiming(0, 0, 4, 4 * 1001, 0.01)
    plain = decode_shape(timing, None)
    assert plain.decode_kv_tokens is None and plain.decode_context_tokens == 4 * 1001
    sliding = cache_groups_for(4, 100, (2, 3))
    shape = decode_shape(timing, sliding)
    assert shape.decode_kv_tokens == pytest.approx(4 * (1001 + 100) / 2)
    assert shape.attention_pairs == pytest.approx(4 * (1001 + 100) / 2)


def test_a_tiny_run_sets_each_step_beside_the_roofline(tmp_path: Path) -> None:
    out = tmp_path / "roofline.json"
    assert main(["--size", "tiny", "--hardware", "h100", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    size = SIZES["tiny"]
    points = {(r["shape"], r["kind"], r["batch"], r["context"]): r for r in results}
    for shape in ("dense", "moe", "sliding", "mla"):
        assert (shape, "prompt", 1, 0) in points
        for context in size.contexts:
            for batch in size.batch_sizes:
                point = points[(shape, "decode", batch, context)]
                assert point["steps"] >= 5 and point["measured_ms"] > 0
                assert point["ratio"] == pytest.approx(point["measured_ms"] / point["predicted_ms"])
    # the counts: one token reads 2 of 8 experts, not all; past the window, a sliding layer
    # reads its window, not the whole context; a dense model has no count to leave out
    one = points[("moe", "decode", 1, size.contexts[0])]
    assert one["predicted_ms"] < one["without_count_ms"]
    long = points[("sliding", "decode", max(size.batch_sizes), max(size.contexts))]
    assert long["predicted_ms"] < long["without_count_ms"]
    dense = points[("dense", "decode", 1, size.contexts[0])]
    assert dense["predicted_ms"] == dense["without_count_ms"]
