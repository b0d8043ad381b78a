"""The router's KV index: built from the workers' own KV events, it equals what each worker's
cache holds, block for block, after churn, a worker's loss, and a router restart."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.kv_cache.kv_events import KVEventLog
from engine.messages import KVBlocksEvent, KVCursor, KVEventBatch, KVEventsReply
from engine.sampling.params import SamplingParams
from router.cluster import Cluster, WorkerHandle
from router.kv_index import KVIndex, PrefixHits
from tests.router.fake_actors import use_fake_ray
from tests.router.loop_actors import LoopCluster, loop_cluster

H = [bytes([n]) * 16 for n in range(8)]


def _stored(*hashes: bytes, tier: str = "device", group: int = 0) -> KVBlocksEvent:
    return KVBlocksEvent("stored", tier, group, hashes)  # type: ignore[arg-type]


def _removed(*hashes: bytes, tier: str = "device") -> KVBlocksEvent:
    return KVBlocksEvent("removed", tier, 0, hashes)  # type: ignore[arg-type]


def _follow(index: KVIndex, worker_id: str, log: KVEventLog) -> None:
    """One poll: the worker answers the index's cursor from its log."""
    index.apply(worker_id, log.since(index.cursor(worker_id)))


def test_the_index_follows_a_log_by_snapshot_then_batches() -> None:
    log, index = KVEventLog(), KVIndex()
    log.append((_stored(H[0], H[1], H[2]),))
    _follow(index, "w", log)  # its first ask: a snapshot
    assert index.holdings("w") == {("device", 0): frozenset(H[:3])}
    log.append((_removed(H[2]), _stored(H[2], tier="host")))
    log.append((_stored(H[3], group=1),))
    _follow(index, "w", log)
    assert index.holdings("w") == log.holdings()
    cursor = index.cursor("w")
    assert cursor == KVCursor(log.log_id, 3)
    _follow(index, "w", log)  # nothing new: nothing changes
    assert index.cursor("w") == cursor and index.holdings("w") == log.holdings()


def test_a_batch_applied_twice_counts_once_and_a_gap_resets_the_worker() -> None:
    index = KVIndex()
    index.apply("w", KVEventsReply("log", 1, None, ()))  # another log, no snapshot: reset
    assert index.cursor("w") == KVCursor("")
    log = KVEventLog()
    log.append((_stored(H[0]),))
    _follow(index, "w", log)
    log.append((_stored(H[1]),))
    reply = log.since(index.cursor("w"))
    index.apply("w", reply)
    index.apply("w", reply)  # (a repeated answer)
    assert index.holdings("w") == {("device", 0): frozenset(H[:2])}
    gap = KVEventsReply(log.log_id, 4, None, (KVEventBatch(4, (_stored(H[5]),)),))
    index.apply("w", gap)  # batch 3 never came
    assert index.cursor("w") == KVCursor("") and index.holdings("w") == {}
    _follow(index, "w", log)  # the next ask brings a snapshot
    assert index.holdings("w") == log.holdings()


def test_batches_from_the_output_stream_apply_once_and_a_gap_waits_for_the_poll() -> None:
    log, index = KVEventLog(), KVIndex()
    index.follow("w", log.after(0))  # a worker the poll has not brought yet: not followed
    assert index.cursor("w") == KVCursor("")
    log.append((_stored(H[0]),))
    _follow(index, "w", log)  # the poll's snapshot, at batch 1
    stale = log.since(index.cursor("w"))  # a poll answer still on its way (nothing new)
    log.append((_stored(H[1]),))
    log.append((_removed(H[0]),))
    index.follow("w", log.after(1))  # the output stream: batches 2 and 3
    assert index.cursor("w") == KVCursor(log.log_id, 3)
    index.apply("w", stale)  # behind the stream: changes nothing, resets nothing
    assert index.cursor("w") == KVCursor(log.log_id, 3)
    assert index.holdings("w") == log.holdings()
    log.append((_stored(H[2]),))
    log.append((_stored(H[3]),))
    index.follow("w", log.after(4))  # batch 5 without 4: left to the poll
    assert index.cursor("w") == KVCursor(log.log_id, 3)
    _follow(index, "w", log)
    assert index.cursor("w") == KVCursor(log.log_id, 5)
    assert index.holdings("w") == log.holdings()


def test_a_log_that_dropped_batches_resyncs_the_index_by_snapshot() -> None:
    log, index = KVEventLog(max_batches=3), KVIndex()
    _follow(index, "w", log)
    rng = random.Random(3)
    for _ in range(50):  # many batches between two polls: the log keeps the latest 3
        block = rng.choice(H)
        log.append((_stored(block) if rng.random() < 0.6 else _removed(block),))
    _follow(index, "w", log)
    assert index.holdings("w") == log.holdings()


def test_prefix_hits_count_the_leading_run_on_device_then_host() -> None:
    index = KVIndex()
    log = KVEventLog()
    log.append((_stored(H[0], H[1]), _stored(H[2], H[3], tier="host"), _stored(H[5])))
    _follow(index, "w", log)
    hits = index.prefix_hits(["w", "unknown"], H[:6])
    assert hits == {"w": PrefixHits(2, 4), "unknown": PrefixHits(0, 0)}
    assert hits["w"].num_host_blocks == 2
    # a run counts from the first block: later blocks held after a miss do not
    assert index.prefix_hits(["w"], [H[4], H[0], H[1]]) == {"w": PrefixHits(0, 0)}
    assert index.prefix_hits(["w"], [H[2], H[3]]) == {"w": PrefixHits(0, 2)}
    index.forget("w")
    assert index.holdings("w") == {} and index.cursor("w") == KVCursor("")


# ---- a router over workers whose engines run here ---------------------------------------------


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    use_fake_ray(monkeypatch)
    yield


def _prompts(rng: random.Random, num_prompts: int) -> list[list[int]]:
    systems = [[rng.randrange(3, 200) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    return [
        rng.choice(systems) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 20))]
        for _ in range(num_prompts)
    ]


async def _run_all(
    cluster: Cluster, prompts: list[list[int]], salts: list[str | None], *, poll: bool = True
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    async def one(index: int) -> None:
        stream = cluster.generate(
            prompts[index], params, request_id=f"r{index}", cache_salt=salts[index]
        )
        async for _ in stream:
            pass

    for start in range(0, len(prompts), 16):  # a few at a time, polled in between
        await asyncio.gather(*(one(i) for i in range(start, min(start + 16, len(prompts)))))
        if poll:
            cluster.poll()


def _wait_until_idle(workers: LoopCluster) -> None:
    deadline = time.monotonic() + 60
    for actor in workers.actors.values():
        while actor.loop.call(lambda engine: engine.has_unfinished_requests()):
            if time.monotonic() > deadline:
                pytest.fail(f"{actor.worker_id} did not finish its requests within 60 s")
            time.sleep(0.01)
        actor.loop.call(lambda engine: None)  # (logs the last step's events)


def _held(workers: LoopCluster, worker_id: str) -> dict[tuple[str, int], frozenset[bytes]]:
    return workers.actors[worker_id].loop.call(
        lambda engine: engine.block_manager.cached_block_hashes()
    )


def test_the_index_learns_a_steps_blocks_with_its_tokens_without_a_poll(llama_dir: Path) -> None:
    """After the first poll, no other: a request's blocks reach the index with its tokens (the
    output batches carry the worker's KV events), before its client has the last one."""
    workers = loop_cluster(llama_dir, num_prefill=0, router_policy="kv_aware")
    index = workers.cluster.pool.kv_index
    assert index is not None
    try:
        prompts = [list(range(3, 60)), list(range(100, 150))]
        asyncio.run(
            asyncio.wait_for(_run_all(workers.cluster, prompts, [None, None], poll=False), 60)
        )
        held = _held(workers, "decode-0")
        assert held and index.holdings("decode-0") == held
    finally:
        workers.stop()


def test_the_index_equals_every_worker_cache_after_churn_loss_and_router_restart(
    llama_dir: Path,
) -> None:
    # caches small enough to evict all the time, into host tiers of a few dozen blocks
    workers = loop_cluster(
        llama_dir, num_prefill=3, num_kv_blocks=20, kv_offload_gb=2**-12, router_policy="kv_aware"
    )
    cluster = workers.cluster
    index = cluster.pool.kv_index
    assert index is not None
    rng = random.Random(11)
    prompts = _prompts(rng, 160)
    salts = [rng.choice([None, None, "tenant-b"]) for _ in prompts]
    try:
        asyncio.run(asyncio.wait_for(_run_all(cluster, prompts, salts), 120))
        _wait_until_idle(workers)
        cluster.poll()
        for worker_id in workers.actors:
            if worker_id.startswith("prefill"):  # (every prefill worker's tiers hold blocks)
                assert {"device", "host"} <= {t for t, _ in _held(workers, worker_id)}
            assert index.holdings(worker_id) == _held(workers, worker_id), worker_id

        # a new router over the same workers starts each from a snapshot
        handles = [WorkerHandle(a.worker_id, a.role, a) for a in workers.actors.values()]
        restarted = Cluster(cluster.config, handles)
        restarted.poll()
        assert restarted.pool.kv_index is not None
        for worker_id in workers.actors:
            assert restarted.pool.kv_index.holdings(worker_id) == _held(workers, worker_id)

        # a worker lost is forgotten at once; the others stay exact as churn goes on
        workers.actors["prefill-1"].dead = True
        cluster.poll()
        assert index.holdings("prefill-1") == {}
        asyncio.run(asyncio.wait_for(_run_all(cluster, _prompts(rng, 40), [None] * 40), 120))
        _wait_until_idle(workers)
        cluster.poll()
        for worker_id in ("prefill-0", "prefill-2", "decode-0"):
            assert index.holdings(worker_id) == _held(workers, worker_id), worker_id
    finally:
        workers.stop()
