"""Stopping worker actors at once: a hung worker costs the grace period once, not once per
worker, and every actor is gone afterwards; threads are joined against one deadline."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import ray

from router.worker_shutdown import join_threads, stop_actors

pytestmark = pytest.mark.timeout(120)

GRACE_S = 2.0
WAIT_S = 60.0


class Worker:
    """Answers pings; its shutdown takes ``shutdown_s`` (a hung worker's: far longer)."""

    def __init__(self, shutdown_s: float) -> None:
        self.shutdown_s = shutdown_s

    def ping(self) -> int:
        return 1

    def shutdown(self) -> None:
        time.sleep(self.shutdown_s)


def _remote_worker(**options: Any) -> Any:
    remote: Any = ray.remote
    return remote(num_cpus=0, **options)(Worker)


def _is_gone(actor: Any) -> bool:
    """Whether the actor's process goes away: a kill lands asynchronously, so a ping sent just
    after it may still be answered; each next ping is sent once the one before is answered."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=WAIT_S)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.05)
    return False


def test_hung_workers_cost_the_grace_period_once_and_every_worker_is_gone(
    ray_session: None,
) -> None:
    actors = [
        _remote_worker(max_concurrency=2).remote(shutdown_s)
        for shutdown_s in (0.0, 600.0, 600.0, 600.0, 0.0)
    ]
    ray.get([actor.ping.remote() for actor in actors], timeout=WAIT_S)

    started = time.monotonic()
    stop_actors(actors, grace_s=GRACE_S)
    elapsed = time.monotonic() - started

    assert GRACE_S <= elapsed < 3 * GRACE_S  # one at a time: at least three grace periods
    assert all(_is_gone(actor) for actor in actors)


def test_stopping_workers_already_gone_returns_at_once(ray_session: None) -> None:
    actors = [_remote_worker().remote(0.0) for _ in range(2)]
    ray.get([actor.ping.remote() for actor in actors], timeout=WAIT_S)
    for actor in actors:
        ray.kill(actor)

    started = time.monotonic()
    stop_actors(actors, grace_s=WAIT_S)

    assert time.monotonic() - started < WAIT_S / 2


def test_threads_are_joined_against_one_deadline() -> None:
    release = threading.Event()
    threads = [threading.Thread(target=release.wait, daemon=True) for _ in range(3)]
    finished = threading.Thread(target=lambda: None)
    for thread in (*threads, finished):
        thread.start()

    started = time.monotonic()
    still_running = join_threads([*threads, finished], timeout_s=0.5)
    elapsed = time.monotonic() - started

    assert still_running == threads
    assert 0.5 <= elapsed < 1.5  # one at a time: 1.5 s
    release.set()
