"""The tensor-parallel group's collectives over real gloo groups of 2 and 3 ranks (one rank in
this process, the others in spawned workers), and the deadline on every wait."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.parallel.group import ProcessGroupRanks, SingleRank, TensorParallelGroup, free_port
from tests.engine.tp_ranks import HOST, RankPool

SHORT_TIMEOUT_S = 1.5
SLACK_S = 2.0  # what a busy 2-core machine may add to a deadline before the error surfaces


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    ranks = RankPool(num_workers=2)
    yield ranks
    ranks.close()


def _collectives(group: TensorParallelGroup) -> dict[str, Any]:
    rank = group.rank
    reduced = group.all_reduce(torch.tensor([1.0, float(rank)]))
    # [2, 2] per rank -> [2, 2 * size], rank r's columns at 2r, 2r + 1
    gathered = group.all_gather(torch.tensor([[rank, 10 * rank], [100 * rank, -rank]]))
    broadcast = group.broadcast(torch.full((3,), float(rank + 7)))
    obj = group.broadcast_object({"step": 3, "ids": torch.arange(4)} if rank == 0 else None)
    return {
        "reduced": reduced,
        "gathered": gathered,
        "broadcast": broadcast,
        "object": obj,
        "least": group.min_int(40 - 3 * rank),  # the last rank holds the least
    }


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_agree_on_every_rank(pool: RankPool, size: int) -> None:
    results = pool.run(_collectives, size=size)
    expected_gathered = torch.cat(
        [torch.tensor([[r, 10 * r], [100 * r, -r]]) for r in range(size)], dim=-1
    )
    for rank, result in enumerate(results):
        assert result["reduced"].tolist() == [size, sum(range(size))], f"rank {rank}"
        assert torch.equal(result["gathered"], expected_gathered), f"rank {rank}"
        assert result["broadcast"].tolist() == [7.0, 7.0, 7.0], f"rank {rank}"
        assert result["object"]["step"] == 3 and result["object"]["ids"].tolist() == [0, 1, 2, 3]
        assert result["least"] == 40 - 3 * (size - 1), f"rank {rank}"


def test_single_rank_returns_its_inputs() -> None:
    group = SingleRank()
    tensor = torch.arange(6.0).view(2, 3)
    assert group.all_reduce(tensor) is tensor and group.all_gather(tensor) is tensor
    assert group.broadcast(tensor) is tensor
    assert group.broadcast_object({"a": 1}) == {"a": 1} and group.min_int(5) == 5
    assert (group.rank, group.size) == (0, 1)


def test_join_times_out_when_a_rank_never_joins() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 0 of 2 joining the tensor-parallel group"):
        ProcessGroupRanks.join("gloo", HOST, free_port(HOST), 0, 2, SHORT_TIMEOUT_S)
    assert time.monotonic() - started < SHORT_TIMEOUT_S + SLACK_S


def _stall_after_join(group: TensorParallelGroup, stall_s: float) -> dict[str, Any]:
    """Rank 0 all-reduces while the others sleep past the group's deadline."""
    if group.rank != 0:
        time.sleep(stall_s)
        return {}
    started = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
    except OSError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - started}
    return {"error": None}


def test_a_stalled_peer_times_the_collective_out(pool: RankPool) -> None:
    results = pool.run(_stall_after_join, SHORT_TIMEOUT_S + 1.0, size=2, timeout_s=SHORT_TIMEOUT_S)
    outcome = results[0]
    assert outcome["error"] == "TimeoutError", outcome
    assert "rank 0 of 2: all_reduce" in outcome["message"]
    assert SHORT_TIMEOUT_S - 0.1 <= outcome["s"] < SHORT_TIMEOUT_S + SLACK_S


def _peer_leaves(group: TensorParallelGroup) -> dict[str, Any]:
    """Rank 1 closes its group; rank 0's next collective must fail within the deadline."""
    if group.rank != 0:
        group.close()
        return {}
    started = time.monotonic()
    try:
        group.broadcast_object("anyone?")
        group.all_reduce(torch.ones(2))
    except (TimeoutError, ConnectionError) as exc:
        return {"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - started}
    return {"error": None}


def test_a_peer_that_leaves_fails_the_collective_within_the_deadline(pool: RankPool) -> None:
    outcome = pool.run(_peer_leaves, size=2, timeout_s=SHORT_TIMEOUT_S)[0]
    assert outcome["error"] in ("TimeoutError", "ConnectionError"), outcome
    assert "rank 0 of 2" in outcome["message"]
    assert outcome["s"] < SHORT_TIMEOUT_S + SLACK_S


def test_a_closed_group_refuses_collectives() -> None:
    group = ProcessGroupRanks.join("gloo", HOST, free_port(HOST), 0, 1, SHORT_TIMEOUT_S)
    assert group.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
    group.close()
    group.close()
    with pytest.raises(ConnectionError, match="rank 0's tensor-parallel group is closed"):
        group.all_reduce(torch.ones(1))


@pytest.mark.parametrize(
    ("backend", "rank", "size", "message"),
    [
        ("mpi", 0, 2, "backend 'mpi' is not one of"),
        ("gloo", 0, 0, "tensor_parallel_size 0 must be at least 1"),
        ("gloo", 2, 2, r"rank 2 must be in 0 .. 1 \(tensor_parallel_size 2\)"),
    ],
)
def test_join_names_the_bad_field(backend: str, rank: int, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProcessGroupRanks.join(backend, HOST, free_port(HOST), rank, size, SHORT_TIMEOUT_S)
