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
from engine.speculative.config import SpeculativeConfig
from router.actors import remote_worker_actor
from router.cluster_config import ClusterConfig
from router.cpu_binding import CpuBinding
from router.rank_placement import RankPlacement, rank_bundle
from router.worker_host import WorkerSpec

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
        # the decode pool's; the prefill pool's too for a prediction layer ("mtp"), whose KV the
        # prefill workers compute into the blocks they hand off (they never draft)
        self._speculative = config.speculative
        common = {"num_cpus": config.worker_num_cpus, "num_gpus": config.worker_num_gpus}
        self._resources = {"prefill": config.prefill_resources, "decode": config.decode_resources}
        self._actor_cls = {
            role: remote_worker_actor(**common, resources=resources or None)
            for role, resources in self._resources.items()
        }
        self._parallel = {role: config.parallel_config(role) for role in ("prefill", "decode")}
        cpus, gpus = config.worker_num_cpus, config.worker_num_gpus
        self._bundles = {
            role: rank_bundle(cpus, gpus, resources) for role, resources in self._resources.items()
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

    def spec(self, role: str, worker_id: str, decode_handles: Mapping[str, Any]) -> WorkerSpec:
        """The worker ``role``'s pool runs as ``worker_id``; a prefill one reaches the decode
        workers of ``decode_handles`` (by id)."""
        decode = role == "decode"
        return WorkerSpec(
            role,
            worker_id,
            self._load,
            self._cache,
            self._scheduler if decode else self._prefill_scheduler,
            self._transfer,
            self._parallel[role],
            self._speculative if decode or _prefill_computes(self._speculative) else None,
            {} if decode else dict(decode_handles),
            self._parallel["decode"].tensor_parallel_size,
        )

    def launch(self, slot: WorkerSlot, worker_id: str, decode_handles: Mapping[str, Any]) -> Any:
        """A new actor for ``slot``; a prefill one reaches the decode workers of
        ``decode_handles`` (by id)."""
        spec = self.spec(slot.role, worker_id, decode_handles)
        placement = self._place(slot, worker_id, spec.num_ranks)
        return (
            self._actor_cls[slot.role]
            .options(**placement.options(0))
            .remote(spec, slot.cpus, placement)
        )

    def changes_in_place(self) -> bool:
        """Whether a worker changes role in its own processes (``WorkerActor.change_role``):
        when both pools' workers have as many ranks and reserve the same resources, so that
        the reservations of its ranks fit the other role as well."""
        sizes = {p.tensor_parallel_size for p in self._parallel.values()}
        return len(sizes) == 1 and self._resources["prefill"] == self._resources["decode"]

    def move_placement(self, from_slot: str, to_slot: str) -> None:
        """A worker changed role in place: its ranks' placement group (if it has one) is now
        the new slot's, given back with that slot."""
        placement = self._placements.pop(from_slot, None)
        if placement is not None:
            self._placements[to_slot] = placement

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

    def placed(self, slot_name: str, timeout_s: float) -> bool:
        """Whether Ray placed the ranks of the worker started in ``slot_name`` within
        ``timeout_s`` (a worker of one rank, without a group, counts as placed: Ray places its
        actor as any other)."""
        placement = self._placements.get(slot_name)
        return placement is None or placement.placed(timeout_s)

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


def _prefill_computes(speculative: SpeculativeConfig | None) -> bool:
    """Whether prefill workers compute what the speculative decoding reads: a prediction layer's
    KV, one more slot of the model's cache, from the model's hidden states."""
    return speculative is not None and speculative.method == "mtp"
