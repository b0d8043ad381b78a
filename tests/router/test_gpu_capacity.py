"""A local Ray's GPUs against the workers' GPU shares: a clear error before start-up instead of
actors Ray keeps pending for ever."""

from __future__ import annotations

import pytest

from router.gpu_capacity import gpus_shortfall


@pytest.mark.parametrize(
    ("num_workers", "gpus_per_worker", "num_gpus"),
    [(2, 0.5, 1), (3, 0.33, 1), (8, 1, 8), (2, 2, 4), (4, 0.5, 2), (2, 0, 0), (0, 1, 0)],
)
def test_workers_that_fit(num_workers: int, gpus_per_worker: float, num_gpus: float) -> None:
    assert gpus_shortfall(num_workers, gpus_per_worker, num_gpus) is None


def test_one_gpu_and_the_default_pools_is_refused_with_the_way_out() -> None:
    message = gpus_shortfall(2, 1.0, 1)
    assert message is not None
    assert "2 workers of --worker-num-gpus 1 need 2 GPUs; this machine's Ray has 1" in message
    assert "--worker-num-gpus 0.5" in message and "--prefill 0" in message


@pytest.mark.parametrize(
    ("num_workers", "gpus_per_worker", "num_gpus", "needed"),
    [(5, 0.5, 2, 3), (3, 2, 4, 6), (4, 0.34, 1, 2)],  # 0.34: two per GPU, not three
)
def test_shortfalls_count_whole_gpus(
    num_workers: int, gpus_per_worker: float, num_gpus: float, needed: int
) -> None:
    message = gpus_shortfall(num_workers, gpus_per_worker, num_gpus)
    assert message is not None and f"need {needed} GPUs" in message


def test_no_gpu_at_all_points_at_the_cpu() -> None:
    message = gpus_shortfall(2, 0.5, 0)
    assert message is not None and "--device cpu" in message
