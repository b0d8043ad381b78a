"""A client that leaves while its request is still being placed, over fake actors (no Ray)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from engine.sampling.params import SamplingParams
from tests.router.fake_actors import make_cluster, use_fake_ray


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    use_fake_ray(monkeypatch)
    yield


def test_a_placement_cancelled_at_shutdown_after_its_client_left_logs_no_error() -> None:
    """The client leaves while its placement waits for a thread; the router then shuts down,
    cancelling that placement. The abort-once-placed callback asked the cancelled future for
    its exception, which raised inside the event loop ("Exception in callback")."""
    cluster, _ = make_cluster(1, 1)
    busy = threading.Event()
    cluster._placing = ThreadPoolExecutor(1)  # one placement thread, kept busy below
    cluster._placing.submit(busy.wait, 5.0)
    loop_errors: list[dict[str, Any]] = []

    async def client_leaves_then_router_stops() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
        stream = cluster.generate([1, 2, 3], SamplingParams(max_tokens=2))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)  # queued behind the busy placement thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cluster._placing.shutdown(wait=False, cancel_futures=True)
        await asyncio.sleep(0.05)  # the cancelled placement's callbacks run

    try:
        asyncio.run(client_leaves_then_router_stops())
    finally:
        busy.set()
    assert loop_errors == []
    assert not cluster.placements.num_open()
