"""Where a tensor-parallel worker's ranks run: together, in one Ray placement group.

A worker of N ranks is N Ray actors: rank 0 (the prefill or decode actor, which schedules)
and N - 1 follower ranks (``router.actors.RankActor``), which rank 0 starts itself. Its
collectives run over loopback (gloo) or NVLink/PCIe (NCCL), so the ranks must share a node:
the worker's placement group has one bundle per rank, packed onto one node (``STRICT_PACK``),
each bundle what one rank reserves (``--worker-num-cpus`` / ``--worker-num-gpus`` and the
pool's custom resource). Rank r runs in bundle r. A worker of one rank has no group: Ray places
its actor as before.

The launcher creates a worker's group with the worker and removes it when the slot starts
another worker or the cluster stops; the follower ranks, owned by rank 0's actor, go when it
goes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# Ray refuses a bundle that reserves nothing; a worker of no CPU reservation (tests,
# ``--worker-num-cpus 0``) reserves this much per rank instead, which any node has.
MIN_BUNDLE_CPUS = 0.001


def rank_bundle(
    num_cpus: float, num_gpus: float, resources: Mapping[str, float]
) -> dict[str, float]:
    """What one rank of a worker reserves on its node."""
    bundle = {"CPU": max(num_cpus, MIN_BUNDLE_CPUS)}
    if num_gpus > 0:
        bundle["GPU"] = num_gpus
    bundle.update(resources)
    return bundle


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where each rank of one worker goes, and what each reserves there."""

    group: Any | None  # the worker's placement group; None: one rank, placed by Ray freely
    bundle: dict[str, float]  # what each rank reserves (rank_bundle)

    @classmethod
    def create(cls, name: str, size: int, bundle: dict[str, float]) -> RankPlacement:
        """A placement group of ``size`` bundles on one node for a worker of ``size`` ranks
        (none for one rank). Not waited for: the worker's actors wait in it until Ray places
        it."""
        if size == 1:
            return cls(None, bundle)
        group = placement_group([dict(bundle)] * size, strategy="STRICT_PACK", name=name)
        return cls(group, bundle)

    def options(self, rank: int) -> dict[str, Any]:
        """Ray actor options that put rank ``rank``'s actor in its bundle, reserving what the
        bundle holds (none for a worker of one rank: its actor class has its reservation).
        Tasks and actors the rank's actor starts are placed as their own options say."""
        if self.group is None:
            return {}
        strategy = PlacementGroupSchedulingStrategy(
            self.group,
            placement_group_bundle_index=rank,
            placement_group_capture_child_tasks=False,
        )
        resources = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        return {
            "num_cpus": self.bundle["CPU"],
            "num_gpus": self.bundle.get("GPU", 0),
            "resources": resources,
            "scheduling_strategy": strategy,
        }

    def placed(self, timeout_s: float) -> bool:
        """Whether Ray has placed the group's bundles, waiting ``timeout_s`` at most (a
        worker of one rank has none: True)."""
        if self.group is None:
            return True
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        return bool(ready)

    def remove(self) -> None:
        """Give the group's reservations back (its actors, if still alive, are killed)."""
        if self.group is not None:
            remove_placement_group(self.group)
