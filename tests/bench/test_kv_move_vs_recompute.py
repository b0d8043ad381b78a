"""The pure parts of ``bench.kv_move_vs_recompute``: the crossover finder on given costs, the
affine fits and move weights, and the larger model's config."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.kv_move_vs_recompute import (
    find_crossover,
    fit_line,
    large_model_spec,
    lengths_held,
    move_weights,
)
from engine.model_config import load_model_config

LENGTHS = [16, 64, 256, 1024]


def test_moving_cheaper_everywhere_has_no_crossover() -> None:
    crossover = find_crossover(LENGTHS, [1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4])
    assert crossover.kind == "move_always"
    assert crossover.estimate_tokens is None
    assert crossover.statement() == "moving is cheaper at every measured length"


def test_recomputing_cheaper_at_short_lengths_crosses_where_the_lines_meet() -> None:
    # move - recompute: +2 at 64, -2 at 256, so the costs meet halfway: 160 tokens
    crossover = find_crossover(LENGTHS, [1.0, 2.0, 8.0, 30.0], [4.0, 4.0, 6.0, 10.0])
    assert crossover.kind == "crossover"
    assert (crossover.recompute_cheaper_up_to, crossover.move_cheaper_from) == (64, 256)
    assert crossover.estimate_tokens == pytest.approx(160.0)
    assert not crossover.non_monotonic
    assert "below ~160 tokens" in crossover.statement()


def test_the_crossover_is_past_the_last_length_where_recomputing_won() -> None:
    # moving wins at 16, recomputing at 64, moving from 256: the crossover is after 64
    crossover = find_crossover(LENGTHS, [5.0, 1.0, 9.0, 30.0], [1.0, 3.0, 5.0, 10.0])
    assert (crossover.kind, crossover.recompute_cheaper_up_to) == ("crossover", 64)
    assert crossover.non_monotonic
    assert crossover.estimate_tokens == pytest.approx(64 + 2 / 6 * 192)


def test_recomputing_cheaper_everywhere() -> None:
    crossover = find_crossover(LENGTHS, [0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 1.0, 1.0])
    assert crossover.kind == "recompute_always"
    assert crossover.recompute_cheaper_up_to == 1024
    assert crossover.statement() == "recomputing is cheaper at every measured length"


def test_equal_costs_count_as_moving_being_cheaper() -> None:
    assert find_crossover([16, 64], [1.0, 2.0], [1.0, 2.0]).kind == "move_always"


@pytest.mark.parametrize(
    ("lengths", "recompute", "move"),
    [([16, 64], [1.0], [1.0, 2.0]), ([], [], []), ([64, 16], [1.0, 2.0], [1.0, 2.0])],
)
def test_the_finder_rejects_unmatched_or_unordered_points(
    lengths: list[int], recompute: list[float], move: list[float]
) -> None:
    with pytest.raises(ValueError):
        find_crossover(lengths, recompute, move)


def test_fit_line_recovers_an_exact_line() -> None:
    intercept, slope = fit_line([16.0, 64.0, 256.0], [0.5 + 0.01 * x for x in (16, 64, 256)])
    assert (intercept, slope) == (pytest.approx(0.5), pytest.approx(0.01))
    with pytest.raises(ValueError):
        fit_line([1.0, 1.0], [2.0, 3.0])


def test_move_weights_are_in_tokens_of_compute_per_token_moved() -> None:
    lengths = [16, 64, 256]
    recompute = [0.001 * n for n in lengths]  # 1 ms a token, no fixed cost
    move = [0.002 + 0.0001 * n for n in lengths]  # 2 ms fixed, 0.1 ms a token
    weights = move_weights(lengths, recompute, move)
    assert weights["per_length"]["16"] == pytest.approx(move[0] / recompute[0])
    assert weights["fit"]["weight"] == pytest.approx(0.1)
    assert weights["fit"]["fixed_tokens"] == pytest.approx(2.0)
    assert "fit" not in move_weights([16], [1.0], [2.0])


def test_lengths_past_the_models_positions_are_skipped() -> None:
    assert lengths_held([16, 511, 512, 4096], 512) == ([16, 511], [512, 4096])


def test_the_large_model_config_is_llama_1b_shaped_and_loads(tmp_path: Path) -> None:
    spec = large_model_spec(num_layers=3, vocab_size=1024)
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        2048,
        32,
        8,
        64,
    )
    assert (spec.num_layers, spec.intermediate_size, spec.vocab_size) == (3, 8192, 1024)
    assert large_model_spec(num_layers=2).vocab_size == 128256
    config = load_model_config(spec.write_config(tmp_path, 4097, "float32"))
    assert config.num_layers == 3
    assert config.num_kv_heads == 8
    assert config.max_position_embeddings == 4097
    # per token: every layer's K and V, 8 heads of 64, 4 bytes each
    assert spec.kv_bytes_per_token("float32") == 3 * 2 * 8 * 64 * 4
