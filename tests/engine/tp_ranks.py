"""Runs a test function as every rank of a fresh tensor-parallel group: rank 0 in the test
process, ranks 1 .. N-1 in spawned worker processes that a test module starts once and reuses.

A rank function is a module-level function ``fn(group, *args)`` whose result pickles; its
module must import without pytest's fixtures (the workers import it by name). Each ``run``
joins a new gloo group on loopback, so one failed case leaves the pool usable.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch

from engine.parallel.group import ProcessGroupRanks, free_port

HOST = "127.0.0.1"
RankFn = Callable[..., Any]  # fn(group, *args) -> a picklable result
_Task = tuple[
    int, RankFn, tuple[Any, ...], int, int, int, float
]  # run id, fn, args, port, rank, size, timeout


class RankPool:
    """``num_workers`` spawned processes, each ready to be one rank (1 .. num_workers) of a group."""

    def __init__(self, num_workers: int, *, result_timeout_s: float = 60.0) -> None:
        context = mp.get_context("spawn")
        self._tasks = [context.Queue() for _ in range(num_workers)]
        self._results = context.Queue()
        self._workers = [
            context.Process(target=_serve, args=(tasks, self._results), daemon=True)
            for tasks in self._tasks
        ]
        for worker in self._workers:
            worker.start()
        self._result_timeout_s = result_timeout_s  # how long a run waits for a worker's result
        self._next_run = 0

    def run(self, fn: RankFn, *args: Any, size: int, timeout_s: float = 30.0) -> list[Any]:
        """Every rank's ``fn(group, *args)`` result, in rank order; raises if any rank raised."""
        if not 1 <= size <= len(self._workers) + 1:
            raise ValueError(f"size {size} needs 1 .. {len(self._workers) + 1} ranks")
        run_id, self._next_run = self._next_run, self._next_run + 1
        port = free_port(HOST)
        for rank in range(1, size):
            self._tasks[rank - 1].put((run_id, fn, args, port, rank, size, timeout_s))
        failures: list[str] = []
        results: dict[int, Any] = {}
        try:
            results[0] = _run_rank(fn, args, port, 0, size, timeout_s)
        except Exception:
            failures.append(f"rank 0:\n{traceback.format_exc()}")
        for rank, ok, value in self._collect(run_id, size - 1):
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
        if failures:
            raise RuntimeError("\n".join(failures))
        return [results[rank] for rank in range(size)]

    def _collect(self, run_id: int, count: int) -> list[tuple[int, bool, Any]]:
        collected: list[tuple[int, bool, Any]] = []
        while len(collected) < count:
            try:
                item_run, rank, ok, value = self._results.get(timeout=self._result_timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"{count - len(collected)} rank workers gave no result within "
                    f"{self._result_timeout_s} s"
                ) from None
            if item_run == run_id:  # a result of an earlier, abandoned run is dropped
                collected.append((rank, ok, value))
        return collected

    def close(self) -> None:
        for tasks in self._tasks:
            tasks.put(None)
        for worker in self._workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
                worker.join()


def _run_rank(
    fn: RankFn, args: tuple[Any, ...], port: int, rank: int, size: int, timeout_s: float
) -> Any:
    group = ProcessGroupRanks.join("gloo", HOST, port, rank, size, timeout_s)
    try:
        return fn(group, *args)
    finally:
        group.close()


def _serve(tasks: Any, results: Any) -> None:
    """A worker's loop: one task at a time until None."""
    torch.set_num_threads(1)  # several ranks share the machine's cores
    while (task := tasks.get()) is not None:
        run_id, fn, args, port, rank, size, timeout_s = task
        try:
            results.put((run_id, rank, True, _run_rank(fn, args, port, rank, size, timeout_s)))
        except Exception:
            results.put((run_id, rank, False, traceback.format_exc()))
