"""Routing policies over synthetic load reports."""

from __future__ import annotations

import pytest

from engine.messages import WorkerLoad
from router.placements import make_policy
from router.policies import (
    LeastLoaded,
    NoWorkerError,
    PrefixAffinity,
    RoundRobin,
    RoutingInfo,
)


def load(worker_id: str, queued: int = 0, kv: float = 0.0, running: int = 0) -> WorkerLoad:
    return WorkerLoad(worker_id, 0, running, queued, kv)


def req(tokens: list[int], salt: str | None = None) -> RoutingInfo:
    return RoutingInfo("r", tokens, salt)


def test_round_robin_cycles_each_pool() -> None:
    policy = RoundRobin()
    loads = [load("b"), load("a"), load("c")]
    assert [policy.choose_prefill(req([1]), loads) for _ in range(4)] == ["a", "b", "c", "a"]
    assert [policy.choose_decode(req([1]), loads) for _ in range(2)] == ["a", "b"]


def test_least_loaded_prefill_by_queued_tokens_decode_by_kv_then_running() -> None:
    policy = LeastLoaded()
    assert policy.choose_prefill(req([1]), [load("a", queued=900), load("b", queued=10)]) == "b"
    decodes = [
        load("a", kv=0.5, running=1),
        load("b", kv=0.2, running=9),
        load("c", kv=0.2, running=3),
    ]
    assert policy.choose_decode(req([1]), decodes) == "c"


def test_no_live_worker_is_an_error() -> None:
    with pytest.raises(NoWorkerError, match="prefill"):
        LeastLoaded().choose_prefill(req([1]), [])


def test_prefix_affinity_follows_shared_prefix_and_salt() -> None:
    policy = PrefixAffinity(block_size=4, min_prefix_blocks=2)
    loads = [load("a"), load("b", queued=5)]
    system = list(range(100, 112))  # three full blocks
    assert policy.choose_prefill(req(system + [1, 2]), loads) == "a"
    # b is now less loaded, but a holds the shared prefix
    loads = [load("a", queued=50), load("b")]
    assert policy.choose_prefill(req(system + [7, 8, 9]), loads) == "a"
    # another tenant's identical prompt hashes differently: least loaded wins
    assert policy.choose_prefill(req(system + [7], salt="t2"), loads) == "b"
    # a short shared prefix (one block) is not worth the detour
    assert policy.choose_prefill(req(system[:4] + [5, 5, 5, 5, 5]), loads) == "b"


def test_prefix_affinity_is_bounded_by_load() -> None:
    policy = PrefixAffinity(block_size=4, max_extra_tokens=100)
    system = list(range(100, 112))
    policy.choose_prefill(req(system), [load("a"), load("b", queued=1)])
    assert policy.choose_prefill(req(system + [1]), [load("a", queued=500), load("b")]) == "b"


def test_prefix_affinity_forgets_oldest_blocks_beyond_its_budget() -> None:
    policy = PrefixAffinity(block_size=2, min_prefix_blocks=1, max_remembered_blocks=4)
    policy.choose_prefill(req([1, 2, 3, 4]), [load("a"), load("b", queued=1)])
    policy.choose_prefill(req([9, 9, 8, 8, 7, 7]), [load("a", queued=1), load("b")])
    loads = [load("a", queued=1), load("b")]
    assert policy.choose_prefill(req([1, 2, 3, 4, 5]), loads) == "b"  # a's first block forgotten


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="round_robin, least_loaded, prefix_affinity"):
        make_policy("random", 16)
