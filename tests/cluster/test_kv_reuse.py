"""The cluster knows its caches, on a local Ray: a conversation's next turn computes only its new
tokens where the earlier turns' KV lives, and the router's index equals every worker's cache
after churn and a worker's replacement."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from engine import LLM, SamplingParams
from engine.messages import WorkerCounters
from router.cluster import Cluster
from router.kv_aware import KVAwareWeights
from tests.fixtures.local_cluster import local_cluster_config

pytestmark = pytest.mark.timeout(240)
BLOCK = 8  # local_cluster_config's block size


@pytest.fixture
def start_cluster(ray_session: None) -> Iterator:  # type: ignore[type-arg]
    started: list[Cluster] = []

    def start(**overrides: object) -> Cluster:
        started.append(Cluster.start(local_cluster_config(overrides.pop("model_dir"), **overrides)))  # type: ignore[arg-type]
        return started[-1]

    yield start
    for cluster in started:
        cluster.shutdown()


def _generate(
    cluster: Cluster, prompt: list[int], max_tokens: int, salt: str | None = None
) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def collect() -> list[int]:
        return [e.token_id async for e in cluster.generate(prompt, params, cache_salt=salt)]

    return asyncio.run(asyncio.wait_for(collect(), 60))


def _counters(cluster: Cluster) -> dict[str, WorkerCounters]:
    cluster.poll_until_reported(time.monotonic())
    return {s.worker_id: s.load.counters for s in cluster.worker_statuses() if s.load}


def _prefill_tokens(cluster: Cluster) -> dict[str, int]:
    return {w: c.num_prefill_tokens for w, c in _counters(cluster).items()}


def test_a_conversations_next_turn_computes_only_its_new_tokens(
    start_cluster,  # type: ignore[no-untyped-def]
    llama_dir: Path,
) -> None:
    """1P1D: turn 1 is prefilled by the prefill worker and decoded by the decode worker, which
    then holds the prompt and the reply. Turn 2 (all of turn 1, its reply, new user tokens) goes
    to that decode worker, which computes only the new tokens (and the part of turn 1's last
    block it had not filled): token for token what a cold engine answers. Another tenant's same
    prompt shares none of it."""
    cluster = start_cluster(model_dir=llama_dir, num_prefill=1, num_decode=1)
    rng = random.Random(5)
    turn_1 = [rng.randrange(3, 250) for _ in range(61)]
    reply_1 = _generate(cluster, turn_1, max_tokens=24)
    user_2 = [rng.randrange(3, 250) for _ in range(13)]
    turn_2 = turn_1 + reply_1 + user_2
    before = _prefill_tokens(cluster)
    assert before == {"prefill-0": len(turn_1), "decode-0": 0}
    reply_2 = _generate(cluster, turn_2, max_tokens=12)
    after = _prefill_tokens(cluster)
    cached = (len(turn_1) + len(reply_1) - 1) // BLOCK * BLOCK  # turn 1's full blocks
    assert after == {"prefill-0": len(turn_1), "decode-0": len(turn_2) - cached}
    assert len(turn_2) - cached < len(user_2) + BLOCK
    assert cluster.local_prefills()["cached"] == 1
    cold = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=BLOCK)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert reply_2 == cold.generate([turn_2], params)[0].outputs[0].token_ids

    # the same conversation under another tenant's salt finds nothing of it anywhere
    _generate(cluster, turn_2, max_tokens=2, salt="tenant-b")
    other = _prefill_tokens(cluster)
    assert sum(other.values()) - sum(after.values()) == len(turn_2)
    assert cluster.local_prefills()["cached"] == 1


def test_a_prefill_worker_copies_the_conversation_when_its_decode_worker_should_not_compute(
    start_cluster,  # type: ignore[no-untyped-def]
    llama_dir: Path,
) -> None:
    """1P1D with decode workers' tokens weighed dear: turn 2 goes to the prefill worker, which
    copies turn 1's reply from the decode worker over the lend channel, computes only the new
    tokens, and hands back only the blocks the decode worker does not hold. The decode worker
    computes nothing; the reply is a cold engine's."""
    weights = KVAwareWeights(local_prefill_weight=100.0)
    cluster = start_cluster(model_dir=llama_dir, num_prefill=1, num_decode=1, kv_aware=weights)
    rng = random.Random(6)
    turn_1 = [rng.randrange(3, 250) for _ in range(61)]
    reply_1 = _generate(cluster, turn_1, max_tokens=24)
    turn_2 = turn_1 + reply_1 + [rng.randrange(3, 250) for _ in range(13)]
    bytes_before = _counters(cluster)["decode-0"].num_kv_transfer_bytes
    reply_2 = _generate(cluster, turn_2, max_tokens=12)
    cached = (len(turn_1) + len(reply_1) - 1) // BLOCK  # turn 1's full blocks, on decode-0
    assert _prefill_tokens(cluster) == {
        "prefill-0": len(turn_1) + len(turn_2) - cached * BLOCK,
        "decode-0": 0,
    }
    stats = cluster.placements.prefix_hit_stats()
    assert stats is not None and stats.num_fetches == 1
    assert stats.fetched_tokens == (cached - len(turn_1) // BLOCK) * BLOCK
    # the hand-off back: the blocks after the cached ones (turn 2 has 98 tokens: 13 blocks)
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4
    moved = _counters(cluster)["decode-0"].num_kv_transfer_bytes - bytes_before
    assert moved == (-(-len(turn_2) // BLOCK) - cached) * block_bytes
    cold = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=BLOCK)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert reply_2 == cold.generate([turn_2], params)[0].outputs[0].token_ids


def _held(actor: object) -> dict[tuple[str, int], frozenset[bytes]]:
    ref = actor.__ray_call__.remote(  # type: ignore[attr-defined]
        lambda self: self.worker.loop.call(
            lambda engine: engine.block_manager.cached_block_hashes()
        )
    )
    return ray.get(ref, timeout=30)  # type: ignore[no-any-return]


def _send_many(cluster: Cluster, rng: random.Random, num_requests: int) -> None:
    systems = [[rng.randrange(3, 250) for _ in range(rng.randrange(16, 48))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def one(prompt: list[int], salt: str | None) -> None:
        async for _ in cluster.generate(prompt, params, cache_salt=salt):
            pass

    async def main() -> None:
        for start in range(0, num_requests, 8):
            await asyncio.gather(
                *(
                    one(
                        rng.choice(systems) + [rng.randrange(3, 250) for _ in range(9)],
                        rng.choice([None, "tenant-b"]),
                    )
                    for _ in range(min(8, num_requests - start))
                )
            )

    asyncio.run(asyncio.wait_for(main(), 120))


def _assert_index_exact(cluster: Cluster) -> None:
    """Once every worker's engine is idle and has reported, the index equals each cache."""
    cluster.poll_until_reported(time.monotonic())
    index = cluster.pool.kv_index
    assert index is not None
    for worker in cluster.pool.workers.values():
        if worker.alive:
            assert index.holdings(worker.worker_id) == _held(worker.actor), worker.worker_id


def test_the_index_equals_every_cache_after_churn_and_a_replaced_worker(
    start_cluster,  # type: ignore[no-untyped-def]
    llama_dir: Path,
) -> None:
    cluster = start_cluster(
        model_dir=llama_dir, num_prefill=2, num_decode=1, num_kv_blocks=48, restart_delay_s=0.1
    )
    rng = random.Random(9)
    _send_many(cluster, rng, 48)
    _assert_index_exact(cluster)
    killed = cluster.pool.workers["prefill-0"]
    ray.kill(killed.actor)
    deadline = time.monotonic() + 120
    while not any(
        w.alive and w.slot == killed.slot and w is not killed for w in cluster.pool.workers.values()
    ):
        if time.monotonic() > deadline:
            pytest.fail("no worker replaced prefill-0 within 120 s")
        time.sleep(0.1)
    assert cluster.pool.kv_index is not None
    assert cluster.pool.kv_index.holdings("prefill-0") == {}
    _send_many(cluster, rng, 32)
    _assert_index_exact(cluster)
