"""Tensor-parallel workers on Ray: a colocated worker of two ranks (two actors in one placement
group) serves greedy requests exactly as the offline engine of one rank does; a rank that dies
takes its whole worker out of rotation, and its requests finish elsewhere, each token once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from engine import SamplingParams
from router.cluster import Cluster
from router.rank_placement import RankPlacement, rank_bundle
from tests.cluster.tp_workload import (
    all_running,
    followers,
    offline_tokens,
    random_prompts,
    run_all,
    run_all_killing,
)
from tests.fixtures.local_cluster import local_cluster_config

pytestmark = pytest.mark.timeout(300)

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = random_prompts(seed=31)


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[list[int]]:
    return offline_tokens(llama_dir, PROMPTS, PARAMS, block_size=8)


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, ray_session: None, llama_dir: Path
) -> Iterator[Cluster]:
    config = local_cluster_config(
        llama_dir, num_prefill=0, num_decode=request.param, decode_tp=2, restart_delay_s=0.2
    )
    started = Cluster.start(config)
    yield started
    started.shutdown()


def _ranks_of(actor: Any) -> tuple[int, int]:
    """(tensor-parallel size, KV heads in its cache) of a worker's rank 0."""
    ref = actor.__ray_call__.remote(
        lambda self: (self.worker.engine.group.size, self.worker.engine.kv_cache.shape[4])
    )
    return tuple(ray.get(ref))  # type: ignore[return-value]


@pytest.mark.parametrize("cluster", [1], indirect=True)
def test_a_worker_of_two_ranks_serves_what_one_rank_does(
    cluster: Cluster, expected: list[list[int]]
) -> None:
    (worker,) = cluster.pool.workers.values()
    assert _ranks_of(worker.actor) == (2, 1)  # two ranks, each with 1 of the 2 KV heads
    assert len(followers(worker.actor)) == 1
    assert run_all(cluster, PROMPTS, PARAMS) == expected


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_lost_rank_takes_its_worker_out_and_its_requests_finish_elsewhere(
    cluster: Cluster, expected: list[list[int]]
) -> None:
    victim = cluster.pool.workers["decode-0"]
    (follower,) = followers(victim.actor)
    # kill decode-0's follower rank once both workers are streaming tokens
    killed_while_running, outputs = run_all_killing(
        cluster, PROMPTS, PARAMS, follower, lambda c: all_running(c, "decode", 2)
    )
    assert killed_while_running
    assert outputs == expected  # every request complete, each token once
    # decode-0's rank 0 left with its rank; the slot started a whole new worker of two ranks
    deadline = time.monotonic() + 120
    while "decode-0-r1" not in cluster.pool.workers and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not cluster.pool.workers["decode-0"].alive
    replacement = cluster.pool.workers["decode-0-r1"]
    assert _ranks_of(replacement.actor) == (2, 1)
    # one placement group per live worker: the lost worker's was given back
    groups = ray.util.placement_group_table().values()
    assert sum(group["state"] == "CREATED" for group in groups) == 2


def test_a_group_is_placed_where_a_node_has_room_and_not_where_none_has(ray_session: None) -> None:
    """``RankPlacement.placed``: a worker's ranks are placed on this machine's Ray, but not if
    they reserve a resource no node has, within the time allowed."""
    fits = RankPlacement.create("pdserve-fits", 2, rank_bundle(0.0, 0.0, {}))
    never = RankPlacement.create("pdserve-never", 2, rank_bundle(0.0, 0.0, {"no_such_node": 1}))
    try:
        assert fits.placed(timeout_s=60)
        assert not never.placed(timeout_s=0.5)
        assert RankPlacement.create("pdserve-one", 1, rank_bundle(0.0, 0.0, {})).placed(0.0)
    finally:
        fits.remove()
        never.remove()
