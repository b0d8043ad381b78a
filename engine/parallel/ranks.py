"""Starts and stops the follower processes of a tensor-parallel worker on this machine.

Lifecycle: ``FollowerProcesses.start`` spawns ranks 1 .. N-1 (each runs
engine/parallel/follower.py's ``run_follower`` and joins the group that rank 0 hosts on
loopback) -> rank 0 builds its engine in the calling process and steps it -> ``stop``: after
rank 0 sent its stop command each follower exits on its own; one that has not within the grace
time is terminated, then killed. Followers are daemonic, and each also exits when the process
that started it does, so none outlives its worker.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.process import BaseProcess

from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig

STOP_GRACE_S = 10.0  # how long a follower gets to leave after rank 0's stop command


class FollowerProcesses:
    """The processes of ranks 1 .. N-1, in rank order."""

    def __init__(self, processes: list[BaseProcess]) -> None:
        self._processes = processes

    @classmethod
    def start(
        cls,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        speculative: SpeculativeConfig | None,
        parallel: ParallelConfig,
    ) -> FollowerProcesses:
        """Spawn a process per follower rank (spawn: a fresh interpreter, no forked torch)."""
        from engine.parallel.follower import run_follower

        context = multiprocessing.get_context("spawn")
        processes: list[BaseProcess] = []
        for rank in range(1, parallel.tensor_parallel_size):
            process = context.Process(
                target=run_follower,
                args=(load, cache, scheduler, speculative, parallel, rank),
                name=f"pdserve-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            processes.append(process)
        return cls(processes)

    @property
    def pids(self) -> list[int]:
        """The followers' process ids, rank 1 first."""
        return [p.pid for p in self._processes if p.pid is not None]

    def exited(self, wait_s: float = 0.0) -> list[str]:
        """What ended each follower that is no longer running ("rank R (pid P) exited with
        code C"), after waiting up to ``wait_s`` in all for those still going down (a peer
        sees a dead process's sockets close before its parent can reap it)."""
        deadline = time.monotonic() + wait_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        return [
            f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
            for rank, process in enumerate(self._processes, start=1)
            if not process.is_alive()
        ]

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Wait up to ``grace_s`` for the followers to exit, then terminate (and kill) the
        rest. Idempotent."""
        deadline = time.monotonic() + grace_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.terminate()
                process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join()
