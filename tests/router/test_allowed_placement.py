"""An admitted prompt is placed among the workers admission allows it (those predicted to make
its SLOs); the routing policy chooses among them, and among all where none of them can be
routed to. Routing choices only: no actors."""

from __future__ import annotations

from engine import SamplingParams
from engine.messages import GenerateRequest, WorkerLoad
from router.cluster import Cluster, WorkerHandle
from router.cluster_config import ClusterConfig
from router.latency_forecast import AllowedWorkers, Forecast
from router.placements import Route


def _cluster(num_prefill: int, num_decode: int) -> Cluster:
    config = ClusterConfig(
        "unused",
        num_prefill=num_prefill,
        num_decode=num_decode,
        router_policy="round_robin",
    )
    workers = [WorkerHandle(f"prefill-{i}", "prefill", None) for i in range(num_prefill)]
    workers += [WorkerHandle(f"decode-{i}", "decode", None) for i in range(num_decode)]
    cluster = Cluster(config, workers)
    for worker in workers:
        load = WorkerLoad(worker.worker_id, 0, 0, 0, 0.0)
        worker.ledger.record(load, 0.0, lambda request_id: True)
    return cluster


def _request(request_id: str, num_prompt_tokens: int = 40) -> GenerateRequest:
    params = SamplingParams(max_tokens=4)
    return GenerateRequest(request_id, list(range(3, 3 + num_prompt_tokens)), params)


def test_the_policy_chooses_among_the_allowed_workers_only() -> None:
    cluster = _cluster(2, 2)
    choose = cluster.placements._choose
    # round robin alone takes each worker in turn
    routes = {choose(_request(f"free{i}")) for i in range(4)}
    assert {r.prefill_id for r in routes} == {"prefill-0", "prefill-1"}
    assert {r.decode_id for r in routes} == {"decode-0", "decode-1"}
    allowed = AllowedWorkers(frozenset({"prefill-1"}), frozenset({"decode-0"}))
    for i in range(4):
        assert choose(_request(f"held{i}"), allowed) == Route("prefill-1", "decode-0", None)


def test_allowed_workers_none_of_which_is_routable_leave_the_choice_to_all() -> None:
    """Admission's workers left the rotation (or were replaced) since its forecast."""
    cluster = _cluster(2, 2)
    gone = AllowedWorkers(frozenset({"prefill-7"}), frozenset({"decode-7"}))
    routes = {cluster.placements._choose(_request(f"r{i}"), gone) for i in range(4)}
    assert {r.prefill_id for r in routes} == {"prefill-0", "prefill-1"}
    assert {r.decode_id for r in routes} == {"decode-0", "decode-1"}


def test_a_colocated_prompt_goes_to_an_allowed_worker() -> None:
    cluster = _cluster(0, 3)
    allowed = AllowedWorkers(frozenset({"decode-2"}), frozenset({"decode-2"}))
    for i in range(3):
        assert cluster.placements._choose(_request(f"r{i}"), allowed) == Route(
            None, "decode-2", None
        )


def test_a_routed_prompt_counts_its_kv_towards_its_decode_worker_at_once() -> None:
    """Until the decode worker's reports show the sequence, its decode steps' KV is charged:
    the forecast's TPOT there counts the prompts still being prefilled for it."""
    cluster = _cluster(1, 1)
    cluster.placements._choose(_request("a", 40))
    cluster.placements._choose(_request("b", 100))
    decode = cluster.pool.workers["decode-0"].load
    assert decode is not None
    assert (decode.num_running, decode.num_context_tokens) == (2, 140)
    prefill = cluster.pool.workers["prefill-0"].load
    assert prefill is not None and prefill.num_context_tokens == 0


def test_an_admitted_prompt_counts_towards_its_best_placement_until_routed() -> None:
    """Prompts admitted together, before any is routed, are each predicted behind the ones
    admitted before them; the routing replaces the hold (no double count)."""
    cluster = _cluster(2, 1)
    forecast = Forecast(0.1, 0.0, "prefill-1", 0.01, "decode-0", 0.0)
    cluster.hold_placement("a", forecast, 300, 1)
    prefill = cluster.pool.workers["prefill-1"].load
    decode = cluster.pool.workers["decode-0"].load
    assert prefill is not None and prefill.num_queued_prompt_tokens == 300
    assert decode is not None and (decode.num_running, decode.num_context_tokens) == (1, 300)
    allowed = AllowedWorkers(frozenset({"prefill-0"}), frozenset({"decode-0"}))
    cluster.placements._choose(_request("a", 300), allowed)  # routed elsewhere than held
    loads = {w: cluster.pool.workers[w].load for w in ("prefill-0", "prefill-1", "decode-0")}
    assert {
        w: (load.num_queued_prompt_tokens, load.num_running) for w, load in loads.items() if load
    } == {
        "prefill-0": (300, 0),
        "prefill-1": (0, 0),
        "decode-0": (0, 1),
    }
