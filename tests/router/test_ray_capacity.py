"""A local Ray's CPUs, GPUs and custom resources against the workers' needs: a clear error before
start-up instead of actors Ray keeps pending for ever."""

from __future__ import annotations

import pytest

from router.cluster_config import ClusterConfig
from router.ray_capacity import cpus_shortfall, gpus_shortfall, resources_shortfall


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


def _pools(prefill: str | None, decode: str | None, num_prefill: int = 1) -> ClusterConfig:
    return ClusterConfig(
        "model",
        num_prefill=num_prefill,
        num_decode=2,
        prefill_resources={prefill: 1.0} if prefill else {},
        decode_resources={decode: 1.0} if decode else {},
    )


@pytest.mark.parametrize(
    ("config", "resources"),
    [
        (_pools(None, None), {"CPU": 2.0}),
        (_pools("prefill", "decode"), {"prefill": 1.0, "decode": 2.0}),
        (_pools("pd", "pd"), {"pd": 3.0}),  # one resource for both pools: 1 + 2
        (_pools("prefill", "decode", num_prefill=0), {"decode": 2.0}),  # colocated: no prefill
    ],
)
def test_custom_resources_that_are_there(
    config: ClusterConfig, resources: dict[str, float]
) -> None:
    assert resources_shortfall(config, resources) is None


def test_a_custom_resource_a_local_ray_lacks_is_refused_naming_the_flag() -> None:
    """A local Ray has no custom resources: Ray kept the workers pending for ever."""
    message = resources_shortfall(_pools("prefill", "decode"), {"CPU": 2.0, "prefill": 1.0})
    assert message is not None
    assert message.startswith(
        "--decode-resource decode: the workers need 2 of Ray resource 'decode'; "
        "this machine's Ray has 0"
    )
    assert "--address auto" in message


def test_a_resource_shared_by_both_pools_counts_both() -> None:
    message = resources_shortfall(_pools("pd", "pd"), {"pd": 2.0})
    assert message is not None and "--prefill-resource pd: the workers need 3" in message


@pytest.mark.parametrize(
    ("num_workers", "cpus_per_worker", "num_cpus"),
    [(2, 1, 2), (4, 0.5, 2), (4, 0, 2), (3, 0.33, 1), (0, 1, 0)],
)
def test_cpu_shares_that_fit(num_workers: int, cpus_per_worker: float, num_cpus: float) -> None:
    assert cpus_shortfall(num_workers, cpus_per_worker, num_cpus) is None


def test_four_workers_of_one_cpu_on_two_cores_are_refused_with_the_way_out() -> None:
    """Before, `pdserve serve --prefill 2 --decode 2` on a 2-core machine started the decode
    workers and waited for ever for the prefill ones, saying nothing."""
    message = cpus_shortfall(4, 1.0, 2)
    assert message == (
        "4 workers of --worker-num-cpus 1 need 4 CPUs; this machine's Ray has 2: give each a "
        "smaller share with --worker-num-cpus 0.5 (0: no reservation), or use fewer workers"
    )
    assert "--worker-num-cpus 0.33" in (cpus_shortfall(3, 0.5, 1) or "")
