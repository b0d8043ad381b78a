"""Each rank's heads, MLP columns and vocab rows, and the errors for sizes a model cannot split."""

from __future__ import annotations

from typing import Any

import pytest

from engine.model_config import ModelConfig, parse_model_config
from engine.parallel.shard import TensorParallelShard


def _config(heads: int, kv_heads: int, **overrides: Any) -> ModelConfig:
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 16,
        "max_position_embeddings": 512,
    }
    raw.update(overrides)
    return parse_model_config(raw)


def _shards(config: ModelConfig, size: int) -> list[TensorParallelShard]:
    return [TensorParallelShard.of(config, rank, size) for rank in range(size)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "q_heads", "kv"),
    [
        # GQA: 4 query heads over 2 KV heads
        (4, 2, 1, [range(0, 4)], [range(0, 2)]),
        (4, 2, 2, [range(0, 2), range(2, 4)], [range(0, 1), range(1, 2)]),
        (4, 2, 4, [range(i, i + 1) for i in range(4)], [range(0, 1)] * 2 + [range(1, 2)] * 2),
        # MHA: a KV head per query head
        (4, 4, 2, [range(0, 2), range(2, 4)], [range(0, 2), range(2, 4)]),
        (4, 4, 4, [range(i, i + 1) for i in range(4)], [range(i, i + 1) for i in range(4)]),
        # MQA: the one KV head on every rank
        (4, 1, 2, [range(0, 2), range(2, 4)], [range(0, 1)] * 2),
        (4, 1, 4, [range(i, i + 1) for i in range(4)], [range(0, 1)] * 4),
    ],
)
def test_heads_per_rank(
    heads: int, kv_heads: int, size: int, q_heads: list[range], kv: list[range]
) -> None:
    config = _config(heads, kv_heads)
    shards = _shards(config, size)
    assert [s.q_heads for s in shards] == q_heads
    assert [s.kv_heads for s in shards] == kv
    assert [s.num_kv_heads for s in shards] == [len(r) for r in kv]
    group_size = heads // kv_heads  # query heads that read one KV head
    for shard in shards:  # every query head a rank computes reads a KV head that rank holds
        assert {q // group_size for q in shard.q_heads} <= set(shard.kv_heads)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_mlp_columns_and_vocab_rows_tile_the_model(size: int) -> None:
    config = _config(4, 2)
    shards = _shards(config, size)
    assert [c for s in shards for c in s.intermediate] == list(range(128))
    assert [row for s in shards for row in s.vocab] == list(range(1024))
    assert all(s.vocab_rows == 1024 // size and s.size == size for s in shards)
    assert [s.rank for s in shards] == list(range(size))


def test_vocab_that_does_not_divide_pads_the_last_rank() -> None:
    config = _config(3, 3, vocab_size=1000, hidden_size=48, intermediate_size=96)
    shards = _shards(config, 3)
    assert [s.vocab for s in shards] == [range(0, 334), range(334, 668), range(668, 1002)]
    assert all(s.vocab_rows == 334 for s in shards)  # rank 2's rows 1000, 1001 are padding


def test_whole_is_rank_0_of_1() -> None:
    config = _config(4, 2)
    whole = TensorParallelShard.whole(config)
    assert whole == TensorParallelShard(
        0, 1, range(4), range(2), range(128), range(0), range(0), range(0), range(1024), 1024
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "overrides", "rank", "size", "message"),
    [
        (4, 2, {}, 0, 3, "tensor_parallel_size 3 must divide num_attention_heads 4"),
        (12, 6, {}, 0, 4, "tensor_parallel_size 4 must divide num_key_value_heads 6"),
        (12, 4, {}, 0, 6, "tensor_parallel_size 6 must be a multiple of num_key_value_heads 4"),
        (
            8,
            4,
            {"intermediate_size": 4},
            0,
            8,
            "tensor_parallel_size 8 must divide intermediate_size 4",
        ),
        (4, 2, {}, 0, 0, "tensor_parallel_size 0 must be at least 1"),
        (4, 2, {}, 2, 2, r"rank 2 must be in 0 \.\. 1 \(tensor_parallel_size 2\)"),
        (4, 2, {}, -1, 2, r"rank -1 must be in 0 \.\. 1"),
    ],
)
def test_errors_name_the_field_and_the_numbers(
    heads: int, kv_heads: int, overrides: dict[str, Any], rank: int, size: int, message: str
) -> None:
    config = _config(heads, kv_heads, **{"hidden_size": heads * 16, **overrides})
    with pytest.raises(ValueError, match=message):
        TensorParallelShard.of(config, rank, size)


def _moe_config(num_experts: int, expert_width: int, shared_width: int = 0) -> ModelConfig:
    overrides: dict[str, Any] = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "num_experts": num_experts,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": expert_width,
        "shared_expert_intermediate_size": shared_width,
    }
    return _config(4, 2, **overrides)


@pytest.mark.parametrize(
    ("num_experts", "size", "runs"),
    [
        (8, 2, [range(0, 4), range(4, 8)]),
        (8, 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
        (6, 4, [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]),  # the first take more
        (4, 4, [range(i, i + 1) for i in range(4)]),
    ],
)
def test_expert_parallelism_deals_out_whole_experts(
    num_experts: int, size: int, runs: list[range]
) -> None:
    config = _moe_config(num_experts, expert_width=24, shared_width=16)
    shards = [TensorParallelShard.of(config, rank, size, True) for rank in range(size)]
    assert [s.experts for s in shards] == runs
    assert all(s.expert_intermediate == range(24) for s in shards)  # every column of each
    # the shared expert and the dense parts split by columns as without it
    plain = _shards(config, size)
    assert [s.shared_expert_intermediate for s in shards] == [
        s.shared_expert_intermediate for s in plain
    ]
    assert [s.q_heads for s in shards] == [s.q_heads for s in plain]
    assert all(s.expert_parallel and s.holds_expert_down_bias for s in shards)
    assert [s.holds_expert_down_bias for s in plain] == [True] + [False] * (size - 1)
    assert all(s.experts == range(num_experts) for s in plain)


def test_expert_parallelism_takes_expert_widths_the_ranks_cannot_split() -> None:
    config = _moe_config(8, expert_width=6)  # 6 columns: not split by 4 ranks
    with pytest.raises(ValueError, match="must divide moe_intermediate_size 6 .*expert"):
        TensorParallelShard.of(config, 0, 4)
    shard = TensorParallelShard.of(config, 3, 4, True)
    assert (shard.experts, shard.expert_intermediate) == (range(6, 8), range(6))


def test_expert_parallelism_needs_an_expert_per_rank() -> None:
    config = _moe_config(2, expert_width=16)
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size 4 with expert parallelism must "
        "be at most the routed experts, num_experts 2",
    ):
        TensorParallelShard.of(config, 0, 4, True)


def test_expert_parallelism_leaves_a_dense_model_as_it_was() -> None:
    config = _config(4, 2)
    assert TensorParallelShard.of(config, 1, 2, True) == TensorParallelShard.of(config, 1, 2)
