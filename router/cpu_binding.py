"""Binding the workers of a local cluster to cores of their own (``--bind-worker-cpus``).

On a CPU node the engines share the cores with the gateway, Ray's own processes and, in a
benchmark, the load generator. A worker whose torch threads float over every core loses a step
to whichever of them the kernel runs in its place; a worker on cores of its own does not. So,
like vLLM on CPU (its engine bound to core 0, a core left for its API server), each worker gets
``threads_per_worker`` cores to itself and everything else shares the cores left over, of which
there must be at least one.

Only for a Ray this process starts (one node): the cores of a joined cluster's nodes are their
own operators' to divide.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CpuBinding:
    worker_cpus: tuple[tuple[int, ...], ...]  # per worker, in the order they are started
    other_cpus: tuple[int, ...]  # the gateway, the router and Ray's own processes


def threads_per_worker(worker_num_cpus: float) -> int:
    """The torch threads Ray gives a worker actor with ``worker_num_cpus`` (OMP_NUM_THREADS:
    the whole CPUs it reserves, one at least)."""
    return max(1, int(worker_num_cpus))


def plan_cpu_binding(
    available: Iterable[int], num_workers: int, threads_per_worker: int
) -> CpuBinding:
    """Cores for each worker from ``available`` (lowest first), the rest for everything else.

    Raises ValueError when the workers would leave no core for the gateway.
    """
    cpus = sorted(available)
    needed = num_workers * threads_per_worker
    if needed + 1 > len(cpus):
        raise ValueError(
            f"--bind-worker-cpus needs {needed} cores for {num_workers} worker(s) of "
            f"{threads_per_worker} thread(s) each plus 1 for the gateway, but this process "
            f"may run on {len(cpus)}; lower --worker-num-cpus or the worker count"
        )
    per_worker = tuple(
        tuple(cpus[i * threads_per_worker : (i + 1) * threads_per_worker])
        for i in range(num_workers)
    )
    return CpuBinding(per_worker, tuple(cpus[needed:]))


def bind_this_thread(cpus: Sequence[int]) -> None:
    """Run the calling thread, and the threads it starts from now on, on ``cpus`` only."""
    os.sched_setaffinity(0, cpus)


def bind_this_process(cpus: Sequence[int]) -> None:
    """Run every thread of this process, and the processes it starts, on ``cpus`` only."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
