"""The Ray actors of the pools: a worker of either role (``WorkerActor``: router/worker_host.py's
``WorkerHost`` in a process of its own) and a tensor-parallel worker's follower ranks
(``RankActor``), with the handles a prefill actor uses for a decode one and rank 0 for its ranks.

The worker classes (and torch) are imported inside the actor processes only, so this module,
like the rest of the router, imports without torch on a CPU head node. Every method is a typed
pass-through; a decode actor answers every hand-off call through one, ``handoff``, which runs
the typed call (``engine.messages.handoff``) on its worker. Actors are threaded
(``max_concurrency``) so a blocking KV receive, an output stream and load reports proceed side
by side.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import ray

from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.messages import HandoffCall
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from engine.startup_heap import freeze_startup_heap
from kv_transfer.policy import TransferConfig
from kv_transfer.rank_calls import RankCall
from router.cpu_binding import bind_this_thread
from router.gil_switch import hand_off_the_gil_sooner
from router.rank_placement import RankPlacement
from router.worker_host import RoleChange, WorkerHost, WorkerSpec

if TYPE_CHECKING:
    from engine.parallel.rank_model import RankModel
    from kv_transfer.rank_port import RankKVPort

logger = logging.getLogger(__name__)
ACTOR_CONCURRENCY = 32
T = TypeVar("T")


class WorkerActor(WorkerHost):
    """A worker of either role (router/worker_host.py) in a process of its own: bound to its
    cores, with its follower ranks' actors (a tensor-parallel worker), its data-plane sockets
    on this node's address."""

    def __init__(
        self,
        spec: WorkerSpec,
        cpus: tuple[int, ...] = (),
        placement: RankPlacement | None = None,  # where its follower ranks go
    ) -> None:
        hand_off_the_gil_sooner()
        if cpus:  # before the engine and its threads start
            bind_this_thread(cpus)
        spec = dataclasses.replace(spec, transfer=_bind_to_node(spec.transfer))
        # (its followers' handles are kept: Ray ends an actor whose handles are all gone)
        parallel, self._followers = _start_followers(
            spec.load,
            spec.cache,
            spec.scheduler,
            spec.speculative,
            spec.parallel,
            placement,
            spec.transfer,
        )
        super().__init__(
            dataclasses.replace(spec, parallel=parallel),
            [RayRankPeer(handle) for handle in self._followers],
            _decode_peers,
        )
        freeze_startup_heap()  # (its model, engine and loop are built)

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def change_role(self, spec: WorkerSpec, keep_kv_cache: bool = True) -> RoleChange:
        spec = dataclasses.replace(spec, transfer=_bind_to_node(spec.transfer))
        return super().change_role(spec, keep_kv_cache)


class RayDecodePeer:
    """A prefill worker's handle on a decode actor (``engine.messages.DecodePeer``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def send(self, call: HandoffCall[T]) -> Future[T]:
        future: Future[T] = self.handle.handoff.remote(call).future()
        return future


class RankActor:
    """A follower rank of a tensor-parallel worker: its shard of the model and of the KV cache,
    running the model calls its rank 0 broadcasts each step (engine/parallel/follower.py), on
    a thread of its own, and answering its rank 0's calls on its KV port (``kv``: its ends of
    the rank pairs' channels of a hand-off). Rank 0's actor starts it and owns it: Ray ends it
    when rank 0's actor ends. When its group stops (rank 0's stop command) or fails, its
    process exits."""

    def __init__(
        self,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        speculative: SpeculativeConfig | None,
        parallel: ParallelConfig,
        rank: int,
        transfer: TransferConfig,
    ) -> None:
        hand_off_the_gil_sooner()
        self.rank = rank
        self.transfer = transfer
        self._port: RankKVPort | None = None  # set once its shard is built
        self._built = threading.Event()
        thread = threading.Thread(
            target=self._follow,
            args=(load, cache, scheduler, speculative, parallel),
            name=f"tp-rank-{rank}",
            daemon=True,
        )
        thread.start()

    def ready(self) -> int:
        return self.rank

    def kv(self, call: RankCall[T]) -> T:
        """Answer rank 0's call on this rank's KV port (sent by ``RayRankPeer``)."""
        if not self._built.wait(self.transfer.timeout_s) or self._port is None:
            raise RuntimeError(
                f"rank {self.rank} has not built its KV cache within {self.transfer.timeout_s:g} s"
            )
        return call.run_on(self._port)

    def _follow(
        self,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        speculative: SpeculativeConfig | None,
        parallel: ParallelConfig,
    ) -> None:
        from engine.parallel.follower import build_follower
        from kv_transfer.rank_port import RankKVPort

        exit_code = 0
        try:
            follower, built = build_follower(
                load, cache, scheduler, speculative, parallel, self.rank
            )

            def serve_kv(built: RankModel) -> None:
                """Its KV port on the cache it holds now (after a change of role, the old
                role's channels close with the old port)."""
                old = self._port
                self._port = RankKVPort(
                    built.kv_cache,
                    built.shard.kv_heads,
                    self.transfer.host,
                    built.model_config.cache_groups.handshake_name,
                    None if built.kv_cache_scales is None else built.kv_cache_scales.per_layer,
                )
                if old is not None:
                    old.close_all()

            try:
                serve_kv(built)
                follower.on_rebuilt = serve_kv
                self._built.set()
                freeze_startup_heap()  # (its shard of the model is built)
                follower.run()
            finally:
                follower.group.close()
        except BaseException:  # its group failed: rank 0 fails its step and leaves rotation
            logger.exception("tensor-parallel rank %d stopped", self.rank)
            exit_code = 1
        os._exit(exit_code)  # nothing of a rank outlives its group


class RayRankPeer:
    """Rank 0's handle on a follower rank's KV port (``kv_transfer.rank_calls.RankPeer``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def send(self, call: RankCall[T]) -> Future[T]:
        future: Future[T] = self.handle.kv.remote(call).future()
        return future


def _start_followers(
    load: LoadConfig,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    speculative: SpeculativeConfig | None,
    parallel: ParallelConfig | None,
    placement: RankPlacement | None,
    transfer: TransferConfig,
) -> tuple[ParallelConfig | None, list[Any]]:
    """Start the follower ranks of a worker of several ranks, each in its bundle of the
    worker's placement group (this node), on the port of the group's store that this rank 0
    will host: the worker's parallel config with that port (as given for one rank), and the
    followers' actor handles. The followers join when rank 0's engine builds the group."""
    if parallel is None or parallel.tensor_parallel_size == 1:
        return parallel, []
    if placement is None:
        raise ValueError("a worker of several ranks needs their placement")
    from engine.parallel.group import free_port

    parallel = dataclasses.replace(parallel, port=free_port(parallel.host))
    remote: Any = ray.remote
    # threaded: its KV port's calls (a blocking accept, transfers) run beside each other
    rank_actor = remote(max_concurrency=ACTOR_CONCURRENCY)(RankActor)
    followers = [
        rank_actor.options(**placement.options(rank)).remote(
            load, cache, scheduler, speculative, parallel, rank, transfer
        )
        for rank in range(1, parallel.tensor_parallel_size)
    ]
    return parallel, followers


def _decode_peers(decode_handles: Mapping[str, Any]) -> dict[str, RayDecodePeer]:
    return {worker_id: RayDecodePeer(handle) for worker_id, handle in decode_handles.items()}


def _bind_to_node(transfer: TransferConfig) -> TransferConfig:
    """Data-plane sockets bind to this node's cluster address, never a wildcard."""
    if transfer.host != "auto":
        return transfer
    return dataclasses.replace(transfer, host=ray.util.get_node_ip_address())


def remote_worker_actor(**options: Any) -> Any:
    remote: Any = ray.remote
    return remote(max_concurrency=ACTOR_CONCURRENCY, **options)(WorkerActor)
