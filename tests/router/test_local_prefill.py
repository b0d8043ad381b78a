"""Conditional disaggregation: which prompts a disaggregated cluster prefills on their decode
worker (short ones; and, one at a time, any while the prefill pool is backed up)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.messages import GenerateRequest, WorkerLoad
from router.cluster import Cluster, WorkerHandle
from router.cluster_config import ClusterConfig
from router.local_prefill import LocalPrefillRule
from router.placements import Route


def _load(worker_id: str, num_queued_prompt_tokens: int) -> WorkerLoad:
    return WorkerLoad(worker_id, 0, 0, num_queued_prompt_tokens, 0.0)


def test_by_default_every_prompt_goes_to_the_prefill_pool() -> None:
    rule = LocalPrefillRule()
    assert rule.reason(1, [_load("prefill-0", 10**6)], _load("decode-0", 0)) is None


def test_prompts_up_to_the_length_limit_prefill_locally() -> None:
    rule = LocalPrefillRule(max_local_prompt_tokens=32)
    busy_pool = [_load("prefill-0", 0)]
    assert rule.reason(32, busy_pool, _load("decode-0", 0)) == "short"
    assert rule.reason(33, busy_pool, _load("decode-0", 0)) is None


def test_a_backed_up_prefill_pool_sends_prompts_to_an_idle_decode_worker() -> None:
    rule = LocalPrefillRule(max_prefill_queue_tokens=1000)
    backed_up = [_load("prefill-0", 1001), _load("prefill-1", 1500)]
    assert rule.reason(400, backed_up, _load("decode-0", 0)) == "backlog"
    # one prefill worker at or under the limit takes it
    assert rule.reason(400, [_load("prefill-0", 1000)], _load("decode-0", 0)) is None
    # a decode worker already prefilling a prompt takes no second one
    assert rule.reason(400, backed_up, _load("decode-0", 1)) is None
    # before the decode worker's first report, nothing is known of it
    assert rule.reason(400, backed_up, None) is None


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"max_local_prompt_tokens": -1}, "--max-local-prefill-length must be >= 0, got -1"),
        ({"max_prefill_queue_tokens": -5}, "--max-prefill-queue-tokens must be >= 0, got -5"),
    ],
)
def test_negative_limits_are_refused_naming_the_flag(kwargs: dict[str, int], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        LocalPrefillRule(**kwargs)


def _cluster(rule: LocalPrefillRule, prefill_queued: int) -> Cluster:
    """A router over one prefill and one decode worker with the given reports (no actors: only
    routing choices are made)."""
    config = ClusterConfig("unused", num_prefill=1, num_decode=1, local_prefill=rule)
    workers = [WorkerHandle("prefill-0", "prefill", None), WorkerHandle("decode-0", "decode", None)]
    cluster = Cluster(config, workers)
    for worker, queued in zip(workers, (prefill_queued, 0)):
        worker.ledger.record(_load(worker.worker_id, queued), 0.0, lambda request_id: True)
    return cluster


def _request(request_id: str, num_prompt_tokens: int) -> GenerateRequest:
    params = SamplingParams(max_tokens=4)
    return GenerateRequest(request_id, list(range(3, 3 + num_prompt_tokens)), params)


def test_the_router_routes_a_local_prompt_to_the_decode_worker_only() -> None:
    cluster = _cluster(LocalPrefillRule(max_local_prompt_tokens=16), prefill_queued=0)
    assert cluster.placements._choose(_request("short", 16)) == Route(None, "decode-0", "short")
    assert cluster.placements._choose(_request("long", 17)) == Route("prefill-0", "decode-0", None)
    # the local prompt's tokens count towards the decode worker until its reports show them
    decode_load = cluster.pool.workers["decode-0"].load
    assert decode_load is not None and decode_load.num_queued_prompt_tokens == 16


def test_during_a_backlog_the_decode_worker_takes_one_prompt_until_it_has_prefilled_it() -> None:
    cluster = _cluster(LocalPrefillRule(max_prefill_queue_tokens=1000), prefill_queued=2000)
    assert cluster.placements._choose(_request("a", 300)) == Route(None, "decode-0", "backlog")
    assert cluster.placements._choose(_request("b", 300)) == Route("prefill-0", "decode-0", None)
    # a report asked for after the worker took "a" shows no prompt queued: "a" is prefilled
    decode = cluster.pool.workers["decode-0"]
    decode.ledger.mark_held("a", 0.5)
    decode.ledger.record(_load("decode-0", 0), 1.0, lambda request_id: True)
    assert cluster.placements._choose(_request("c", 300)) == Route(None, "decode-0", "backlog")
