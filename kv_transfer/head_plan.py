"""Which KV heads each pair of ranks moves when a prefill worker and a decode worker of
different tensor-parallel sizes hand off a request.

Each rank of a tensor-parallel worker holds a range of the model's KV heads (a GQA model's
heads split evenly, or one head replicated on several ranks when there are more ranks than
heads: ``engine/parallel/shard.py``). A decode rank needs exactly the heads it holds; each comes
from one prefill rank that holds it, and no decode rank is sent a head it would drop. Where
several prefill ranks hold a head (replicated), the decode ranks are spread over them, so that
no prefill rank sends every copy.

Pure and torch-free: both ends compute the same plan from the head ranges of the two workers'
ranks, which the layout handshake carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeadMove:
    """Consecutive KV heads one prefill rank sends one decode rank."""

    prefill_rank: int
    decode_rank: int
    heads: range  # the model's KV head ids moved, consecutive
    source_first: int  # where heads.start sits among the prefill rank's cached heads
    target_first: int  # where heads.start sits among the decode rank's cached heads

    @property
    def num_heads(self) -> int:
        return len(self.heads)


def plan_head_moves(
    prefill_heads: Sequence[range], decode_heads: Sequence[range]
) -> list[HeadMove]:
    """The moves that give every decode rank its heads, ordered by decode rank then head.

    ``prefill_heads[i]``: the model's KV heads prefill rank ``i`` holds (``decode_heads``
    alike). Raises ValueError naming the rank and the head when a decode rank holds a head that
    no prefill rank does (the two workers do not serve the same model's heads).
    """
    _check_ranks("prefill", prefill_heads)
    _check_ranks("decode", decode_heads)
    moves: list[HeadMove] = []
    for decode_rank, wanted in enumerate(decode_heads):
        current: HeadMove | None = None
        for head in wanted:
            holders = [rank for rank, held in enumerate(prefill_heads) if head in held]
            if not holders:
                raise ValueError(
                    f"decode rank {decode_rank} holds KV head {head}, which no prefill rank "
                    f"holds (prefill ranks hold {_describe(prefill_heads)})"
                )
            source = holders[decode_rank % len(holders)]
            extends = (
                current is not None
                and current.prefill_rank == source
                and current.heads.stop == head
            )
            if current is not None and extends:
                current = HeadMove(
                    source,
                    decode_rank,
                    range(current.heads.start, head + 1),
                    current.source_first,
                    current.target_first,
                )
                continue
            if current is not None:
                moves.append(current)
            current = HeadMove(
                source,
                decode_rank,
                range(head, head + 1),
                prefill_heads[source].index(head),
                wanted.index(head),
            )
        if current is not None:
            moves.append(current)
    return moves


def moves_between(moves: Sequence[HeadMove], prefill_rank: int, decode_rank: int) -> list[HeadMove]:
    """The moves of one rank pair (what their pairwise channel carries), in head order."""
    return [m for m in moves if m.prefill_rank == prefill_rank and m.decode_rank == decode_rank]


def _check_ranks(role: str, heads: Sequence[range]) -> None:
    if not heads:
        raise ValueError(f"a {role} worker has at least one rank; got none")
    for rank, held in enumerate(heads):
        if len(held) == 0 or held.step != 1 or held.start < 0:
            raise ValueError(
                f"{role} rank {rank} must hold a non-empty range of KV heads; got {held}"
            )


def _describe(heads: Sequence[range]) -> str:
    return ", ".join(f"{rank}: {h.start}-{h.stop - 1}" for rank, h in enumerate(heads))
