"""Ray actors around the plain worker classes, and the handle a prefill actor uses for a decode one.

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
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import ray

from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.kv_cache.kv_quantization import KVCacheScales
from engine.messages import GenerateRequest, HandoffCall, KVCursor, OutputBatch, WorkerLoad
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from kv_transfer.policy import TransferConfig
from kv_transfer.rank_calls import RankCall, RankPort
from router.cpu_binding import bind_this_thread
from router.gil_switch import hand_off_the_gil_sooner
from router.rank_placement import RankPlacement

logger = logging.getLogger(__name__)
ACTOR_CONCURRENCY = 32
T = TypeVar("T")


class DecodeActor:
    def __init__(
        self,
        worker_id: str,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        transfer: TransferConfig,
        cpus: tuple[int, ...] = (),
        speculative: SpeculativeConfig | None = None,
        parallel: ParallelConfig | None = None,  # None: one rank
        placement: RankPlacement | None = None,  # where its follower ranks go
    ) -> None:
        hand_off_the_gil_sooner()
        if cpus:  # before the engine and its threads start
            bind_this_thread(cpus)
        from decode_worker.worker import DecodeWorker

        transfer = _bind_to_node(transfer)
        # (its followers' handles are kept: Ray ends an actor whose handles are all gone)
        parallel, self._followers = _start_followers(
            load, cache, scheduler, speculative, parallel, placement, transfer
        )
        self.worker = DecodeWorker(
            worker_id,
            load,
            cache,
            scheduler,
            transfer,
            speculative,
            parallel,
            [RayRankPeer(handle) for handle in self._followers],
        )

    def ready(self) -> str:
        return self.worker.worker_id

    def profile_latency(self) -> int:
        """Run the start-up latency profile (engine/latency_profile.py); the steps it ran."""
        from engine.latency_profile import run_latency_profile_in_loop

        return run_latency_profile_in_loop(self.worker.loop)

    def kv_cache_scales(self) -> KVCacheScales | None:
        """Its quantized cache's scales (the cluster hands them to every other worker)."""
        return self.worker.engine.kv_cache_scales

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def submit(self, request: GenerateRequest) -> bool:
        return self.worker.submit(request)

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def has_request(self, request_id: str) -> bool:
        return self.worker.has_request(request_id)

    def handoff(self, call: HandoffCall[T]) -> T:
        """Answer a prefill worker's hand-off call (sent by ``RayDecodePeer``)."""
        return call.run_on(self.worker)

    def load(self, kv_cursor: KVCursor | None = None) -> WorkerLoad:
        return self.worker.load(kv_cursor)

    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        yield from self.worker.stream(gateway_id)

    def shutdown(self) -> None:
        self.worker.shutdown()


class RayDecodePeer:
    """A prefill worker's handle on a decode actor (``engine.messages.DecodePeer``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def send(self, call: HandoffCall[T]) -> Future[T]:
        future: Future[T] = self.handle.handoff.remote(call).future()
        return future


class PrefillActor:
    def __init__(
        self,
        worker_id: str,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        transfer: TransferConfig,
        decode_handles: Mapping[str, Any],
        cpus: tuple[int, ...] = (),
        parallel: ParallelConfig | None = None,  # None: one rank
        placement: RankPlacement | None = None,  # where its follower ranks go
        decode_tp: int = 1,  # the ranks of each decode worker
    ) -> None:
        hand_off_the_gil_sooner()
        if cpus:  # before the engine and its threads start
            bind_this_thread(cpus)
        from prefill_worker.worker import PrefillWorker

        transfer = _bind_to_node(transfer)
        peers = _decode_peers(decode_handles)
        parallel, self._followers = _start_followers(
            load, cache, scheduler, None, parallel, placement, transfer
        )
        follower_ranks = [RayRankPeer(handle) for handle in self._followers]
        self.worker = PrefillWorker(
            worker_id, load, cache, scheduler, transfer, peers, parallel, follower_ranks, decode_tp
        )

    def ready(self) -> str:
        return self.worker.worker_id

    def profile_latency(self) -> int:
        """Run the start-up latency profile (engine/latency_profile.py); the steps it ran."""
        from engine.latency_profile import run_latency_profile_in_loop

        return run_latency_profile_in_loop(self.worker.loop)

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def submit(
        self, request: GenerateRequest, decode_worker_id: str, fetch_blocks: int = 0
    ) -> None:
        self.worker.submit(request, decode_worker_id, fetch_blocks)

    def retarget(self, request_id: str, decode_worker_id: str) -> bool:
        return self.worker.retarget(request_id, decode_worker_id)

    def add_decode_peers(self, decode_handles: Mapping[str, Any]) -> None:
        self.worker.add_decode_peers(_decode_peers(decode_handles))

    def forget_decode_peer(self, decode_worker_id: str) -> None:
        self.worker.forget_decode_peer(decode_worker_id)

    def rejoin(self, decode_handles: Mapping[str, Any]) -> WorkerLoad:
        """Learn the decode workers that joined while this one was out of rotation (stalled),
        then report load: the router's probe before it takes this worker back."""
        self.add_decode_peers(decode_handles)
        return self.worker.load()

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def load(self, kv_cursor: KVCursor | None = None) -> WorkerLoad:
        return self.worker.load(kv_cursor)

    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        yield from self.worker.stream(gateway_id)

    def shutdown(self) -> None:
        self.worker.shutdown()


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
        self._port: RankPort | None = None  # set once its shard is built
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
            try:
                self._port = RankKVPort(
                    built.kv_cache,
                    built.shard.kv_heads,
                    self.transfer.host,
                    built.model_config.cache_groups.handshake_name,
                    None if built.kv_cache_scales is None else built.kv_cache_scales.per_layer,
                )
                self._built.set()
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


def remote_decode_actor(**options: Any) -> Any:
    remote: Any = ray.remote
    return remote(max_concurrency=ACTOR_CONCURRENCY, **options)(DecodeActor)


def remote_prefill_actor(**options: Any) -> Any:
    remote: Any = ray.remote
    return remote(max_concurrency=ACTOR_CONCURRENCY, **options)(PrefillActor)
