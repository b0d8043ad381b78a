"""Stopping the worker actors at once: every worker is asked to shut down, and all are killed
together once each has answered or one grace period has passed, so a hung worker costs the
grace period once rather than once per worker; the threads that read their outputs are joined
against one deadline."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

SHUTDOWN_GRACE_S = 3.0  # for the workers' own shutdown (engine thread, KV channels), together


def stop_actors(actors: Sequence[Any], grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Asks every actor to ``shutdown()``, waits up to ``grace_s`` for all of them together,
    then kills them all (one already gone is skipped)."""
    calls = []
    for actor in actors:
        with contextlib.suppress(Exception):  # its process is gone
            calls.append(actor.shutdown.remote())
    if calls:
        with contextlib.suppress(Exception):  # Ray itself is going
            ray.wait(calls, num_returns=len(calls), timeout=grace_s)
    for actor in actors:
        with contextlib.suppress(Exception):  # gone already
            ray.kill(actor, no_restart=True)


def join_threads(threads: Sequence[threading.Thread], timeout_s: float) -> list[threading.Thread]:
    """Joins ``threads`` against one deadline ``timeout_s`` away; returns those still running
    (daemon threads end with the process)."""
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return [thread for thread in threads if thread.is_alive()]
