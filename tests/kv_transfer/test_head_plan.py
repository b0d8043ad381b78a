"""The KV heads each rank pair moves between workers of different tensor-parallel sizes."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.parallel.shard import rank_kv_heads
from kv_transfer.head_plan import HeadMove, moves_between, plan_head_moves


def rank_heads(num_kv_heads: int, size: int) -> list[range]:
    """Each rank's KV heads, as a worker of ``size`` ranks holds them."""
    return [rank_kv_heads(num_kv_heads, rank, size) for rank in range(size)]


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("prefill_size", [1, 2, 4, 8])
@pytest.mark.parametrize("decode_size", [1, 2, 4, 8])
def test_every_decode_rank_gets_exactly_its_heads_from_ranks_that_hold_them(
    num_kv_heads: int, prefill_size: int, decode_size: int
) -> None:
    prefill, decode = rank_heads(num_kv_heads, prefill_size), rank_heads(num_kv_heads, decode_size)
    moves = plan_head_moves(prefill, decode)
    for decode_rank, wanted in enumerate(decode):
        received = [
            (head, move) for move in moves if move.decode_rank == decode_rank for head in move.heads
        ]
        assert sorted(head for head, _ in received) == list(wanted)  # each once, no others
        for head, move in received:
            source_heads = prefill[move.prefill_rank]
            assert head in source_heads
            offset = head - move.heads.start
            assert source_heads[move.source_first + offset] == head
            assert wanted[move.target_first + offset] == head


def test_heads_from_one_rank_move_as_one_range() -> None:
    # prefill TP 1 (heads 0-3) -> decode TP 2: one move per decode rank, two heads each
    moves = plan_head_moves([range(0, 4)], [range(0, 2), range(2, 4)])
    assert moves == [HeadMove(0, 0, range(0, 2), 0, 0), HeadMove(0, 1, range(2, 4), 2, 0)]
    # prefill TP 2 -> decode TP 1: the decode rank hears from both
    moves = plan_head_moves([range(0, 2), range(2, 4)], [range(0, 4)])
    assert moves == [HeadMove(0, 0, range(0, 2), 0, 0), HeadMove(1, 0, range(2, 4), 0, 2)]
    assert moves_between(moves, 1, 0) == [moves[1]]
    assert moves_between(moves, 1, 1) == []


def test_replicated_heads_are_sent_by_every_holder_in_turn() -> None:
    # MQA (1 KV head) on prefill TP 4 and decode TP 4: each decode rank hears from its own
    # prefill rank, not all four from rank 0
    moves = plan_head_moves(rank_heads(1, 4), rank_heads(1, 4))
    assert Counter(m.prefill_rank for m in moves) == {0: 1, 1: 1, 2: 1, 3: 1}
    # 2 KV heads over prefill TP 4 (each held twice), decode TP 2 (each decode rank one head)
    moves = plan_head_moves(rank_heads(2, 4), rank_heads(2, 2))
    assert [(m.prefill_rank, m.decode_rank, m.heads) for m in moves] == [
        (0, 0, range(0, 1)),
        (3, 1, range(1, 2)),
    ]


def test_a_head_no_prefill_rank_holds_is_named() -> None:
    with pytest.raises(ValueError, match="decode rank 1 holds KV head 3, which no prefill rank"):
        plan_head_moves([range(0, 3)], [range(0, 2), range(2, 4)])


@pytest.mark.parametrize(
    ("prefill", "decode", "message"),
    [
        ([], [range(0, 1)], "a prefill worker has at least one rank"),
        ([range(0, 1)], [range(0, 0)], "decode rank 0 must hold a non-empty range"),
        ([range(0, 4, 2)], [range(0, 1)], "prefill rank 0 must hold a non-empty range"),
    ],
)
def test_malformed_rank_heads_are_refused(
    prefill: list[range], decode: list[range], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan_head_moves(prefill, decode)
