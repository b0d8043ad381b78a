"""The kv_aware policy: a prompt goes to the prefill worker whose cache holds most of it, weighed
against queues, as the workers' own KV events say; tenants never route by each other's hits."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.kv_cache.kv_events import KVEventLog
from engine.kv_cache.prefix_hash import extend_block_hashes
from engine.messages import KVBlocksEvent, WorkerLoad
from engine.sampling.params import SamplingParams
from router.cluster import Cluster
from router.gateway.metrics import GatewayMetrics, SloTargets
from router.kv_aware import KVAware, KVAwareWeights, Reuse
from router.kv_index import KVIndex
from router.policies import NoWorkerError, RoutingInfo
from tests.router.fake_actors import use_fake_ray
from tests.router.loop_actors import loop_cluster

BLOCK = 4
SYSTEM = list(range(10, 34))  # 6 blocks
PROMPT = SYSTEM + [90, 91, 92]  # 27 tokens: 6 full blocks a cache can serve
UNIT_QUEUE = KVAwareWeights(queue_weight=1.0)  # a queued token weighs as one to compute


def _load(worker_id: str, queued: int = 0) -> WorkerLoad:
    return WorkerLoad(worker_id, 0, 0, queued, 0.0)


def _caching(index: KVIndex, worker_id: str, tokens: list[int], *, salt: str | None = None,
             host_from: int | None = None) -> None:  # fmt: skip
    """``worker_id``'s log tells it stored the full blocks of ``tokens`` (from block
    ``host_from`` on, in its host tier)."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BLOCK, salt)
    split = len(hashes) if host_from is None else host_from
    log = KVEventLog()
    events = [KVBlocksEvent("stored", "device", 0, tuple(hashes[:split]))]
    if split < len(hashes):
        events.append(KVBlocksEvent("stored", "host", 0, tuple(hashes[split:])))
    log.append(tuple(events))
    index.apply(worker_id, log.since(index.cursor(worker_id)))


def test_the_worker_holding_the_prefix_wins_until_its_queue_outweighs_it() -> None:
    index = KVIndex()
    _caching(index, "b", SYSTEM)
    policy = KVAware(BLOCK, index, UNIT_QUEUE)
    request = RoutingInfo("r", PROMPT)
    assert policy.choose_prefill(request, [_load("a"), _load("b")]) == "b"
    # b saves 24 tokens of compute: a queue 20 tokens longer than a's is worth it, 30 is not
    assert policy.choose_prefill(request, [_load("a"), _load("b", queued=20)]) == "b"
    assert policy.choose_prefill(request, [_load("a"), _load("b", queued=30)]) == "a"
    lazy = KVAware(BLOCK, index, KVAwareWeights(queue_weight=0.5))
    assert lazy.choose_prefill(request, [_load("a"), _load("b", queued=30)]) == "b"
    assert policy.stats.num_routed == 3 and policy.stats.device_hit_tokens == 48


def test_without_hits_it_chooses_as_least_loaded() -> None:
    policy = KVAware(BLOCK, KVIndex())
    loads = [_load("a", queued=50), _load("b", queued=5), _load("c", queued=5)]
    assert policy.choose_prefill(RoutingInfo("r", PROMPT), loads) == "b"
    with pytest.raises(NoWorkerError, match="prefill"):
        policy.choose_prefill(RoutingInfo("r", PROMPT), [])


def test_host_hits_count_at_their_weight() -> None:
    index = KVIndex()
    _caching(index, "a", SYSTEM[:12])  # 3 blocks on device
    _caching(index, "b", SYSTEM, host_from=1)  # 1 on device, 5 in its host tier
    request = RoutingInfo("r", PROMPT)
    loads = [_load("a"), _load("b")]
    # a: 15 to compute; b: 3 to compute + 0.1 * 20 host tokens = 5
    assert KVAware(BLOCK, index).choose_prefill(request, loads) == "b"
    # a host hit as dear as computing: a (15) is no worse than b (3 + 20)
    dear = KVAware(BLOCK, index, KVAwareWeights(host_hit_weight=1.0))
    assert dear.choose_prefill(request, loads) == "a"
    policy = KVAware(BLOCK, index)
    policy.choose_prefill(request, loads)
    assert (policy.stats.device_hit_tokens, policy.stats.host_hit_tokens) == (4, 20)


def test_a_tenant_never_routes_by_another_tenants_hits() -> None:
    index = KVIndex()
    _caching(index, "b", SYSTEM, salt="tenant-1")
    policy = KVAware(BLOCK, index)
    loads = [_load("a"), _load("b", queued=1)]
    assert policy.choose_prefill(RoutingInfo("r", PROMPT, "tenant-1"), loads) == "b"
    assert policy.choose_prefill(RoutingInfo("r", PROMPT, "tenant-2"), loads) == "a"
    assert policy.choose_prefill(RoutingInfo("r", PROMPT, None), loads) == "a"


def test_a_prompt_of_whole_blocks_leaves_its_last_block_to_compute() -> None:
    index = KVIndex()
    _caching(index, "b", SYSTEM)
    policy = KVAware(BLOCK, index)
    assert len(policy.prompt_hashes(RoutingInfo("r", SYSTEM))) == 5
    policy.choose_prefill(RoutingInfo("r", SYSTEM), [_load("a"), _load("b")])
    assert policy.stats.device_hit_tokens == 20  # 5 blocks: the engine computes the last one


def test_a_decode_worker_holding_the_conversation_prefills_the_rest_itself() -> None:
    """Turn 2 of a conversation: its decode worker holds turn 1's prompt and reply (6 blocks);
    the prefill worker holds the prompt only (3 blocks): the decode worker computes less."""
    index = KVIndex()
    _caching(index, "d1", SYSTEM)
    _caching(index, "p", SYSTEM[:12])
    policy = KVAware(BLOCK, index, UNIT_QUEUE, fetch=False)
    request = RoutingInfo("r", PROMPT)
    prefills, decodes = [_load("p")], [_load("d0"), _load("d1")]
    assert policy.choose_reuse(request, prefills, decodes) == Reuse("d1", None, 0)  # 3 vs 15
    assert policy.stats.device_hit_tokens == 24
    # its own queue, or a dearer local token, sends the prompt to the prefill pool
    busy = [_load("d0"), _load("d1", queued=20)]
    assert policy.choose_reuse(request, prefills, busy) is None
    dear = KVAware(
        BLOCK, index, KVAwareWeights(queue_weight=1.0, local_prefill_weight=6.0), fetch=False
    )
    assert dear.choose_reuse(request, prefills, decodes) is None  # 18 vs 15
    # a prefill worker holding as much wins the tie: the decode batch is left alone
    _caching(index, "p", SYSTEM)
    assert policy.choose_reuse(request, prefills, decodes) is None
    assert KVAware(BLOCK, KVIndex()).choose_reuse(request, prefills, decodes) is None


def test_a_prefill_worker_copies_the_prefix_when_the_decode_worker_should_not_compute() -> None:
    """The same turn 2, but the decode worker holding the conversation is busy (or its tokens
    dear): the prefill worker copies the 12 tokens it lacks from it (at the move weight),
    computes the 3 after them, and hands them back to it."""
    index = KVIndex()
    _caching(index, "d1", SYSTEM)
    _caching(index, "p", SYSTEM[:12])
    policy = KVAware(BLOCK, index, UNIT_QUEUE)
    request = RoutingInfo("r", PROMPT)
    prefills = [_load("p")]
    busy = [_load("d0"), _load("d1", queued=20)]
    # local: 3 + 20 queued; pooled: 15; the fetch: 3 + 0.05 * 12 moved
    assert policy.choose_reuse(request, prefills, busy) == Reuse("d1", "p", 6)
    assert policy.stats.device_hit_tokens == 24
    # the local prefill wins where it is cheaper (3 against 3.6)
    assert policy.choose_reuse(request, prefills, [_load("d1")]) == Reuse("d1", None, 0)
    # moving as dear as computing: the prefill pool computes it (15 against 3 + 12)
    dear = KVAware(BLOCK, index, KVAwareWeights(queue_weight=1.0, move_weight=1.0))
    assert dear.choose_reuse(request, prefills, busy) is None
    # a prefill worker's queue counts against its fetch: the other one, holding less, copies
    prefills = [_load("p", queued=10), _load("q")]
    assert policy.choose_reuse(request, prefills, busy) == Reuse("d1", "q", 6)
    # the decode worker's host tier is not lent: it holds nothing to copy on device
    host_only = KVIndex()
    _caching(host_only, "d1", SYSTEM, host_from=0)
    lone = KVAware(BLOCK, host_only, UNIT_QUEUE)
    busier = [_load("d0"), _load("d1", queued=30)]  # local: 3 + 0.1 * 24 + 30; pooled: 27
    assert lone.choose_reuse(request, [_load("p")], busier) is None


def test_colocated_decode_workers_are_chosen_by_their_cache_then_as_least_loaded() -> None:
    index = KVIndex()
    _caching(index, "d1", SYSTEM)
    decodes = [WorkerLoad("d0", 0, 0, 0, 0.1), WorkerLoad("d1", 0, 5, 0, 0.6)]
    colocated = KVAware(BLOCK, index, colocated=True)
    assert colocated.choose_decode(RoutingInfo("r", PROMPT), decodes) == "d1"
    other = RoutingInfo("r", list(range(100, 130)))
    assert colocated.choose_decode(other, decodes) == "d0"  # lower KV usage
    # with a prefill pool, the decode worker a hand-off goes to is least_loaded's
    assert KVAware(BLOCK, index).choose_decode(RoutingInfo("r", PROMPT), decodes) == "d0"


def test_each_decision_is_logged_with_its_inputs(caplog: pytest.LogCaptureFixture) -> None:
    index = KVIndex()
    _caching(index, "b", SYSTEM)
    with caplog.at_level(logging.DEBUG, logger="router.kv_aware"):
        KVAware(BLOCK, index, UNIT_QUEUE).choose_prefill(
            RoutingInfo("req-7", PROMPT), [_load("a", 3), _load("b")]
        )
    (line,) = [r.getMessage() for r in caplog.records]
    assert "req-7 (27 prompt tokens) -> b" in line
    assert "a: hit device 0 host 0, queued 3, cost 30" in line
    assert "b: hit device 24 host 0, queued 0, cost 3" in line


def test_the_weights_are_checked_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--kv-aware-queue-weight"):
        KVAwareWeights(queue_weight=-1)
    with pytest.raises(ValueError, match="--kv-aware-host-hit-weight"):
        KVAwareWeights(host_hit_weight=2)
    with pytest.raises(ValueError, match="--kv-aware-local-prefill-weight"):
        KVAwareWeights(local_prefill_weight=-0.5)


# ---- a router over workers whose engines run here ---------------------------------------------


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    use_fake_ray(monkeypatch)
    yield


async def _first_token(cluster: Cluster, prompt: list[int], request_id: str, salt: str | None):  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    stream = cluster.generate(prompt, params, request_id=request_id, cache_salt=salt)
    return [event async for event in stream]


@pytest.mark.usefixtures("fake_ray")
def test_a_cluster_routes_a_shared_prefix_to_its_cache_and_counts_the_hits(
    llama_dir: Path,
) -> None:
    """Three prefill workers: a prompt sharing a long prefix with an earlier one goes where that
    one ran and computes only its new tokens; the same prompt of another tenant finds no block
    of it anywhere; the hit tokens per routed request are exported."""
    workers = loop_cluster(llama_dir, num_prefill=3, router_policy="kv_aware")
    cluster = workers.cluster
    system = list(range(3, 67))  # 8 blocks of 8
    try:
        asyncio.run(asyncio.wait_for(_first_token(cluster, system + [70, 71], "r0", None), 30))
        (first,) = [a for a in workers.actors.values() if a.loop.engine.stats.num_prefill_tokens]
        cluster.poll()  # the workers' KV events reach the index
        before = first.loop.engine.stats.num_prefill_tokens
        asyncio.run(asyncio.wait_for(_first_token(cluster, system + [80], "r1", None), 30))
        assert first.loop.engine.stats.num_prefill_tokens - before == 1  # only its new token
        computed = sum(a.loop.engine.stats.num_prefill_tokens for a in workers.actors.values())
        cluster.poll()
        asyncio.run(asyncio.wait_for(_first_token(cluster, system + [80], "r2", "t2"), 30))
        # another tenant's copy shares no block: all its 65 tokens are computed
        assert (
            sum(a.loop.engine.stats.num_prefill_tokens for a in workers.actors.values())
            == computed + 65
        )
        stats = cluster.prefix_hit_stats()
        assert stats is not None and stats.num_routed == 3 and stats.device_hit_tokens == 64
    finally:
        workers.stop()
    metrics = GatewayMetrics(
        lambda: [], dict, list, SloTargets(), prefix_hit_stats=cluster.prefix_hit_stats
    )
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {
        (s.name, s.labels.get("le", s.labels.get("tier"))): s.value
        for s in families["pdserve:routed_prefix_hit_tokens"].samples
        + families["pdserve:routed_prefix_hit_tokens_by_tier"].samples
    }
    assert samples[("pdserve:routed_prefix_hit_tokens_count", None)] == 3
    assert samples[("pdserve:routed_prefix_hit_tokens_bucket", "0")] == 2  # r0 and r2
    assert samples[("pdserve:routed_prefix_hit_tokens_bucket", "64")] == 3
    assert samples[("pdserve:routed_prefix_hit_tokens_by_tier_total", "device")] == 64


def test_a_decode_worker_near_full_is_sent_no_more_of_its_conversations() -> None:
    """The decode worker holding the conversation has used 90 % of its KV: another turn there
    (prefilled locally, or fetched and handed back) would grow it until it preempts, so the
    prompt goes the pooled way."""
    index = KVIndex()
    _caching(index, "d1", SYSTEM)
    policy = KVAware(BLOCK, index, UNIT_QUEUE)
    request = RoutingInfo("r", PROMPT)
    holder = WorkerLoad("d1", 0, 4, 0, 0.89)
    assert policy.choose_reuse(request, [_load("p")], [holder]) == Reuse("d1", None, 0)
    full = WorkerLoad("d1", 0, 4, 0, 0.9)
    assert policy.choose_reuse(request, [_load("p")], [full]) is None
    lax = KVAware(BLOCK, index, KVAwareWeights(queue_weight=1.0, holder_kv_limit=1.0))
    assert lax.choose_reuse(request, [_load("p")], [full]) == Reuse("d1", None, 0)
    with pytest.raises(ValueError, match="--kv-aware-holder-kv-limit"):
        KVAwareWeights(holder_kv_limit=0.0)
