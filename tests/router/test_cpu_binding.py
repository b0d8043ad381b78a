"""Cores for the workers of a local cluster, and the cores left for everything else."""

from __future__ import annotations

import os
import threading

import pytest

from router.cluster_config import ClusterConfig
from router.cpu_binding import bind_this_thread, plan_cpu_binding, threads_per_worker


def test_each_worker_gets_cores_of_its_own_and_the_rest_is_left_over() -> None:
    plan = plan_cpu_binding([7, 3, 5, 1, 2], num_workers=2, threads_per_worker=2)
    assert plan.worker_cpus == ((1, 2), (3, 5))
    assert plan.other_cpus == (7,)


def test_one_core_must_be_left_for_the_gateway() -> None:
    with pytest.raises(ValueError, match=r"needs 2 cores for 2 worker\(s\) of 1 thread\(s\) each"):
        plan_cpu_binding([0, 1], num_workers=2, threads_per_worker=1)
    assert plan_cpu_binding([0, 1], num_workers=1, threads_per_worker=1).other_cpus == (1,)


@pytest.mark.parametrize(("num_cpus", "threads"), [(0, 1), (0.5, 1), (1, 1), (2, 2), (2.5, 2)])
def test_a_worker_runs_as_many_threads_as_whole_cpus_it_reserves(
    num_cpus: float, threads: int
) -> None:
    assert threads_per_worker(num_cpus) == threads


def test_binding_is_for_a_ray_the_command_starts() -> None:
    with pytest.raises(ValueError, match="--bind-worker-cpus"):
        ClusterConfig(model_dir="m", address="auto", bind_worker_cpus=True)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_bound_thread_and_the_threads_it_starts_run_on_its_cores_only() -> None:
    core = min(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}

    def bound() -> None:
        bind_this_thread([core])
        child = threading.Thread(target=lambda: seen.update(child=os.sched_getaffinity(0)))
        child.start()
        child.join()
        seen["self"] = os.sched_getaffinity(0)

    before = os.sched_getaffinity(0)
    thread = threading.Thread(target=bound)
    thread.start()
    thread.join()
    assert seen == {"self": {core}, "child": {core}}
    assert os.sched_getaffinity(0) == before  # the caller's thread is not touched
