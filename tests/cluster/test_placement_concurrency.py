"""A worker slow to accept a request (mid-step) holds up neither other requests' routing nor
their tokens: the router does not hold its lock while a worker accepts, and counts the request
towards that worker while it waits, whatever load reports come back meanwhile."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
import ray

from engine import SamplingParams
from engine.messages import GenerateRequest, KVCursor, OutputBatch, TokenEvent, WorkerLoad
from router.cluster import Cluster, WorkerHandle
from router.cluster_config import ClusterConfig

pytestmark = pytest.mark.timeout(120)


@ray.remote(max_concurrency=4)
class GatedWorker:
    """A decode worker's actor interface whose ``submit`` waits for a gate, as a real one
    waits for its engine step to end; an accepted request gets one final token."""

    def __init__(self, worker_id: str, gated: bool) -> None:
        self.worker_id = worker_id
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.num_accepting = 0
        self.outputs: queue.Queue[OutputBatch] = queue.Queue()

    def ready(self) -> bool:
        return True

    def submit(self, request: GenerateRequest) -> bool:
        self.num_accepting += 1
        self.gate.wait(60)
        event = TokenEvent(request.request_id, 0, 0, 7, None, "length")
        self.outputs.put(OutputBatch(self.worker_id, [event]))
        return True

    def accepting(self) -> int:
        return self.num_accepting

    def open_gate(self) -> None:
        self.gate.set()

    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        while True:
            yield self.outputs.get()

    def load(self, kv_cursor: KVCursor | None = None) -> WorkerLoad:
        return WorkerLoad(self.worker_id, 0, 0, 0, 0.0)  # (its cache holds nothing)

    def abort(self, request_id: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _colocated_cluster(*workers: WorkerHandle) -> Cluster:
    """A router over the given worker actors, its output pumps and load reports running."""
    config = ClusterConfig(model_dir="unused", num_prefill=0, num_decode=len(workers))
    cluster = Cluster(config, list(workers))
    cluster.start_threads()
    cluster.poll_until_reported()
    return cluster


async def _first_token(cluster: Cluster, prompt: list[int]) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    return [event.token_id async for event in cluster.generate(prompt, params)][0]


def test_a_worker_slow_to_accept_does_not_stall_other_requests(ray_session: None) -> None:
    gated, fast = GatedWorker.remote("decode-0", True), GatedWorker.remote("decode-1", False)
    cluster = _colocated_cluster(
        WorkerHandle("decode-0", "decode", gated), WorkerHandle("decode-1", "decode", fast)
    )

    def first_token(prompt: list[int]) -> Coroutine[Any, Any, int]:
        return _first_token(cluster, prompt)

    async def main() -> None:
        slow = asyncio.create_task(first_token([1, 2, 3]))  # least loaded, by id: decode-0
        while ray.get(gated.accepting.remote()) == 0:
            await asyncio.sleep(0.01)
        # A load report taken now does not show the request waiting at decode-0's door;
        # the router still counts it there.
        cluster.poll_until_reported(time.monotonic())
        # routed to decode-1 and answered while decode-0 still holds the first request
        assert await asyncio.wait_for(first_token([4, 5]), timeout=10) == 7
        assert not slow.done()
        gated.open_gate.remote()
        assert await asyncio.wait_for(slow, timeout=10) == 7

    try:
        asyncio.run(main())
    finally:
        cluster.shutdown()


def test_a_burst_of_requests_is_placed_at_once_not_a_few_at_a_time(ray_session: None) -> None:
    """Twelve requests arrive while the worker is mid-step: all twelve wait at the worker
    together (asyncio's default executor would let only cpu_count + 4 of them route at once,
    the others queued behind a whole step)."""
    burst = 12
    gated = GatedWorker.options(max_concurrency=burst + 4).remote("decode-0", True)
    cluster = _colocated_cluster(WorkerHandle("decode-0", "decode", gated))

    async def main() -> None:
        tasks = [asyncio.create_task(_first_token(cluster, [1, i + 2])) for i in range(burst)]
        deadline = asyncio.get_running_loop().time() + 20
        while ray.get(gated.accepting.remote()) < burst:
            assert asyncio.get_running_loop().time() < deadline, ray.get(gated.accepting.remote())
            await asyncio.sleep(0.01)
        gated.open_gate.remote()
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=20) == [7] * burst

    try:
        asyncio.run(main())
    finally:
        cluster.shutdown()
