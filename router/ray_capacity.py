"""Whether the CPUs, GPUs and custom resources of a Ray this process starts can hold the
workers, said before start-up.

Ray keeps an actor it cannot place pending for ever, and without these checks `pdserve serve
--device cuda` on one GPU with the default pools (two workers of one GPU each), `--prefill 2
--decode 2` on a 2-core machine (four workers of one CPU each), or ``--prefill-resource`` on a
Ray that has no such resource, would wait silently. A joined
cluster (``--address``) may grow with its autoscaler, so it is not checked. Ray packs
fractional GPU requests onto whole GPUs, a GPU holding ``floor(1 / share)`` actors of a share
below one; a request of one or more GPUs takes that many whole GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from router.cluster_config import ClusterConfig

_EPSILON = 1e-6  # Ray's resource arithmetic is in 1e-4 units: 1 / 0.33 holds 3, not 3.03


def gpus_shortfall(
    num_workers: int, gpus_per_worker: float, num_gpus: float, unit: str = "workers"
) -> str | None:
    """Why ``num_workers`` actors of ``gpus_per_worker`` GPUs do not fit ``num_gpus``, or None.
    ``unit``: what the actors are called in the message ("worker ranks" under tensor
    parallelism, where each rank of a worker is an actor of its own)."""
    if num_workers == 0 or gpus_per_worker <= 0:
        return None
    whole_gpus = math.floor(num_gpus + _EPSILON)
    if gpus_per_worker < 1:
        workers_per_gpu = math.floor(1 / gpus_per_worker + _EPSILON)
        capacity, needed = whole_gpus * workers_per_gpu, math.ceil(num_workers / workers_per_gpu)
    else:
        gpus_each = math.ceil(gpus_per_worker - _EPSILON)
        capacity, needed = whole_gpus // gpus_each, num_workers * gpus_each
    if num_workers <= capacity:
        return None
    if whole_gpus == 0:
        advice = "use --device cpu, or run where Ray sees the GPUs"
    elif gpus_per_worker >= 1:
        advice = (
            "share GPUs with --worker-num-gpus 0.5 (KV then goes over cuda_ipc), "
            "or run colocated workers with --prefill 0"
        )
    else:
        advice = "give each a smaller share with --worker-num-gpus, or use fewer workers"
    return (
        f"{num_workers} {unit} of --worker-num-gpus {gpus_per_worker:g} need {needed} "
        f"GPU{'s' if needed != 1 else ''}; this machine's Ray has {whole_gpus}: {advice}"
    )


def cpus_shortfall(
    num_workers: int, cpus_per_worker: float, num_cpus: float, unit: str = "workers"
) -> str | None:
    """Why ``num_workers`` actors of ``cpus_per_worker`` CPUs do not fit ``num_cpus`` (Ray
    divides CPUs freely), or None. ``unit`` as for ``gpus_shortfall``."""
    needed = num_workers * cpus_per_worker
    if needed <= num_cpus + _EPSILON:
        return None
    share = math.floor(100 * num_cpus / num_workers) / 100 if num_workers else 0.0
    smaller = f"--worker-num-cpus {share:g}" if share > 0 else "--worker-num-cpus 0"
    return (
        f"{num_workers} {unit} of --worker-num-cpus {cpus_per_worker:g} need {needed:g} CPUs; "
        f"this machine's Ray has {num_cpus:g}: give each a smaller share with {smaller} "
        "(0: no reservation), or use fewer workers"
    )


def resources_shortfall(
    config: ClusterConfig, cluster_resources: Mapping[str, float]
) -> str | None:
    """Why the custom Ray resources of ``--prefill-resource`` / ``--decode-resource`` (one
    unit per worker) are not in ``cluster_resources`` (``ray.cluster_resources()``), or None."""
    needed: dict[str, float] = {}
    flags: dict[str, str] = {}  # resource -> the flag that asked for it first
    for flag, num_workers, resources in (
        ("--prefill-resource", config.num_prefill, config.prefill_resources),
        ("--decode-resource", config.num_decode, config.decode_resources),
    ):
        for name, amount in resources.items():
            needed[name] = needed.get(name, 0.0) + num_workers * amount
            flags.setdefault(name, flag)
    for name, amount in needed.items():
        have = float(cluster_resources.get(name, 0.0))
        if amount > have + _EPSILON:
            return (
                f"{flags[name]} {name}: the workers need {amount:g} of Ray resource {name!r}; "
                f"this machine's Ray has {have:g}: join a cluster whose nodes declare it "
                f"(--address auto), or leave the flag out"
            )
    return None
