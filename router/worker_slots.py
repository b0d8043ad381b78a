"""Starting the pools' worker actors: each in a slot of its pool, at cluster start and again
when a slot's worker died.

A slot is a place in a pool (``decode-0``): its first worker has the slot's name as its id, and
a worker started in its place after it died gets a new one (``decode-0-r1``, ``decode-0-r2``
...). A new id gives it fresh KV channels and load history, and tokens or failure reports from
an earlier worker of the slot can never pass for its own. Restarts per slot are bounded, and a
start that fails waits twice as long before the next try, so a worker that cannot start (its
model directory gone, a broken GPU) is not restarted in a tight loop.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.kv_cache.kv_quantization import KVCacheScales
from router.actors import remote_decode_actor, remote_prefill_actor
from router.cluster_config import ClusterConfig
from router.cpu_binding import CpuBinding
from router.rank_placement import RankPlacement, rank_bundle

MAX_RESTART_DELAY_S = 60.0
RELEASE_TIMEOUT_S = 5.0  # the longest the cluster's stop waits to give placement groups back  # the longest wait before a slot's next start
CALL_TIMEOUT_S = 10.0  # control calls to a worker; one that does not answer counts as dead


@dataclass(slots=True)
class WorkerSlot:
    name: str  # "decode-0": the id of the slot's first worker, the prefix of the others'
    role: str  # "prefill" | "decode"
    cpus: tuple[int, ...] = ()  # the cores its worker is bound to (none: not bound)
    restarts: int = 0  # workers started in it after its first one died
    failed_starts_in_a_row: int = 0  # starts that failed since its last worker came up
    replacing: bool = False  # a new worker is being started in it

    def worker_id(self, restart: int) -> str:
        return self.name if restart == 0 else f"{self.name}-r{restart}"

    def delay_before_next_start_s(self, first_delay_s: float) -> float:
        """The wait before the next start: ``first_delay_s``, doubled by each failed start."""
        return min(first_delay_s * 2**self.failed_starts_in_a_row, MAX_RESTART_DELAY_S)


def plan_slots(config: ClusterConfig, binding: CpuBinding | None) -> list[WorkerSlot]:
    """The pools' slots, decode first; ``binding`` gives each its cores, in that order."""
    cpus = list(binding.worker_cpus) if binding is not None else []
    cpus += [()] * (config.num_decode + config.num_prefill - len(cpus))
    decodes = [WorkerSlot(f"decode-{i}", "decode", cpus[i]) for i in range(config.num_decode)]
    prefills = [
        WorkerSlot(f"prefill-{i}", "prefill", cpus[config.num_decode + i])
        for i in range(config.num_prefill)
    ]
    return [*decodes, *prefills]


class WorkerLauncher:
    """Creates the worker actors of a cluster's slots (Ray places them; none waits here)."""

    def __init__(self, config: ClusterConfig) -> None:
        self._load, self._cache = config.load_config(), config.cache_config()
        self._scheduler, self._transfer = config.scheduler_config(), config.transfer_config()
        self._prefill_scheduler = config.prefill_scheduler_config()
        self._speculative = config.speculative  # the decode pool's only: prefill never drafts
        common = {"num_cpus": config.worker_num_cpus, "num_gpus": config.worker_num_gpus}
        self._decode_cls = remote_decode_actor(**common, resources=config.decode_resources or None)
        self._prefill_cls = remote_prefill_actor(
            **common, resources=config.prefill_resources or None
        )
        self._parallel = {role: config.parallel_config(role) for role in ("prefill", "decode")}
        cpus, gpus = config.worker_num_cpus, config.worker_num_gpus
        self._bundles = {
            "prefill": rank_bundle(cpus, gpus, config.prefill_resources),
            "decode": rank_bundle(cpus, gpus, config.decode_resources),
        }
        self._placements: dict[str, RankPlacement] = {}  # slot name -> its worker's ranks'

    @property
    def needs_kv_cache_scales(self) -> bool:
        """A quantized cache without scales given: each worker would calibrate its own, and
        workers with different scales cannot hand KV to each other."""
        return self._cache.quantized_kv and self._cache.kv_cache_scales is None

    def use_kv_cache_scales(self, scales: KVCacheScales) -> None:
        """Every worker launched from now on (restarts too) takes these scales."""
        self._cache = replace(self._cache, kv_cache_scales=scales)

    def launch(self, slot: WorkerSlot, worker_id: str, decode_handles: Mapping[str, Any]) -> Any:
        """A new actor for ``slot``; a prefill one reaches the decode workers of
        ``decode_handles`` (by id)."""
        parallel = self._parallel[slot.role]
        placement = self._place(slot, worker_id, parallel.tensor_parallel_size)
        if slot.role == "decode":
            return self._decode_cls.options(**placement.options(0)).remote(
                worker_id,
                self._load,
                self._cache,
                self._scheduler,
                self._transfer,
                slot.cpus,
                self._speculative,
                parallel,
                placement,
            )
        return self._prefill_cls.options(**placement.options(0)).remote(
            worker_id,
            self._load,
            self._cache,
            self._prefill_scheduler,
            self._transfer,
            dict(decode_handles),
            slot.cpus,
            parallel,
            placement,
            self._parallel["decode"].tensor_parallel_size,
        )

    def _place(self, slot: WorkerSlot, worker_id: str, size: int) -> RankPlacement:
        """The ranks' placement of a new worker in ``slot``; the group of the slot's worker
        before it (gone, or never started) is given back first."""
        old = self._placements.pop(slot.name, None)
        if old is not None:
            old.remove()
        placement = RankPlacement.create(f"pdserve-{worker_id}", size, self._bundles[slot.role])
        if placement.group is not None:
            self._placements[slot.name] = placement
        return placement

    def release(self, slot_name: str) -> None:
        """Give back the placement group of a slot that closed (its worker retired)."""
        placement = self._placements.pop(slot_name, None)
        if placement is not None:
            placement.remove()

    def release_all(self, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        """Give back every worker's placement group (the cluster is stopping), waiting at
        most ``timeout_s``: Ray's removal blocks for as long as its control store is
        unreachable (a Ray stopped under us), and Ray removes them anyway when this driver
        ends."""
        placements, self._placements = self._placements, {}
        if not placements:
            return

        def remove_all() -> None:
            for placement in placements.values():
                placement.remove()

        remover = threading.Thread(target=remove_all, name="release-placements", daemon=True)
        remover.start()
        remover.join(timeout_s)
