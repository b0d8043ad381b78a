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
import gc
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

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

if TYPE_CHECKING:  # (imported in the actors' processes only: they import torch)
    from decode_worker.worker import DecodeWorker
    from engine.parallel.rank_model import LoadedWeights
    from prefill_worker.worker import PrefillWorker

logger = logging.getLogger(__name__)
ACTOR_CONCURRENCY = 32
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """The worker an actor runs: its role, its id and its configs (the launcher's, per role)."""

    role: str  # "prefill" | "decode"
    worker_id: str
    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    transfer: TransferConfig
    parallel: ParallelConfig | None = None  # None: one rank
    speculative: SpeculativeConfig | None = None  # a decode worker's (prefill never drafts)
    # a prefill worker's: the decode workers it hands off to (by id), and each one's ranks
    decode_handles: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    decode_tp: int = 1

    @property
    def num_ranks(self) -> int:
        return 1 if self.parallel is None else self.parallel.tensor_parallel_size


class WorkerActor:
    """A prefill or a decode worker (``spec.role``), in a process of its own. ``change_role``
    makes it a worker of the other role in place (router/rebalancer.py): the process and the
    model's weights stay, the KV cache and the engine are built anew for the new role."""

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
        self.spec = dataclasses.replace(spec, parallel=parallel)
        self._role_lock = threading.Lock()  # held while it changes role
        self._worker: PrefillWorker | DecodeWorker | None = _build_worker(
            self.spec, [RayRankPeer(handle) for handle in self._followers], None
        )

    # ---- either role ----------------------------------------------------------------------
    def ready(self) -> str:
        return self._current().worker_id

    def profile_latency(self) -> int:
        """Run the start-up latency profile (engine/latency_profile.py); the steps it ran."""
        from engine.latency_profile import run_latency_profile_in_loop

        return run_latency_profile_in_loop(self._current().loop)

    def kv_cache_scales(self) -> KVCacheScales | None:
        """Its quantized cache's scales (the cluster hands them to every other worker)."""
        return self._current().engine.kv_cache_scales

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def submit(
        self, request: GenerateRequest, decode_worker_id: str | None = None, fetch_blocks: int = 0
    ) -> bool:
        """Queue a request: on a decode worker (colocated, or a resume) without
        ``decode_worker_id``; on a prefill worker with the decode worker it hands off to. False
        when a decode worker runs it already."""
        if decode_worker_id is None:
            return self._decode().submit(request)
        self._prefill().submit(request, decode_worker_id, fetch_blocks)
        return True

    def abort(self, request_id: str) -> None:
        self._current().abort(request_id)

    def load(self, kv_cursor: KVCursor | None = None) -> WorkerLoad:
        return self._current().load(kv_cursor)

    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        """A gateway's outputs from the worker it runs now, until that worker stops (a change
        of role ends it: the outputs of the new worker are read under its own id)."""
        yield from self._current().stream(gateway_id)

    def shutdown(self) -> None:
        with self._role_lock:
            if self._worker is not None:
                self._worker.shutdown()

    def change_role(self, spec: WorkerSpec) -> str:
        """Stop the worker it runs (what that one still holds is lost: its requests were moved
        elsewhere first) and run ``spec``'s, of the other role, on the same weights; its id.
        Only a worker of one rank changes in place (its ranks' processes would have to follow:
        the rebalancer starts a new worker for several)."""
        if spec.num_ranks != 1 or self.spec.num_ranks != 1:
            raise ValueError("only a worker of one rank changes role in place")
        with self._role_lock:
            leaving, self._worker = self._worker, None
            if leaving is None:
                raise RuntimeError(f"{self.spec.worker_id} has stopped")
            weights = leaving.engine.loaded_weights()
            device = leaving.engine.device
            leaving.shutdown()
            del leaving  # its KV cache goes before the new one is allocated
            _free_device_memory(device)
            spec = dataclasses.replace(spec, transfer=_bind_to_node(spec.transfer))
            worker = _build_worker(spec, [], weights)
            self.spec = spec  # (first: a call that finds the new worker reads its role)
            self._worker = worker
        logger.warning("now %s worker %s", spec.role, spec.worker_id)
        return spec.worker_id

    def _current(self) -> PrefillWorker | DecodeWorker:
        worker = self._worker
        if worker is None:
            raise RuntimeError(f"{self.spec.worker_id} is changing role")
        return worker

    # ---- a decode worker ------------------------------------------------------------------
    def has_request(self, request_id: str) -> bool:
        """Whether its decode worker runs the request (a prefill worker runs none to the end)."""
        worker = self._current()
        return self.spec.role == "decode" and cast("DecodeWorker", worker).has_request(request_id)

    def handoff(self, call: HandoffCall[T]) -> T:
        """Answer a prefill worker's hand-off call (sent by ``RayDecodePeer``)."""
        return call.run_on(self._decode())

    def _decode(self) -> DecodeWorker:
        worker = self._current()
        if self.spec.role != "decode":
            raise RuntimeError(f"{worker.worker_id} is a prefill worker, not a decode worker")
        return cast("DecodeWorker", worker)

    # ---- a prefill worker -----------------------------------------------------------------
    def retarget(self, request_id: str, decode_worker_id: str) -> bool:
        return self._prefill().retarget(request_id, decode_worker_id)

    def add_decode_peers(self, decode_handles: Mapping[str, Any]) -> None:
        self._prefill().add_decode_peers(_decode_peers(decode_handles))

    def forget_decode_peer(self, decode_worker_id: str) -> None:
        worker = self._current()
        if self.spec.role == "prefill":  # (a decode worker has no decode peers)
            cast("PrefillWorker", worker).forget_decode_peer(decode_worker_id)

    def rejoin(self, decode_handles: Mapping[str, Any]) -> WorkerLoad:
        """Learn the decode workers that joined while this one was out of rotation (stalled),
        then report load: the router's probe before it takes this worker back."""
        self.add_decode_peers(decode_handles)
        return self._prefill().load()

    def _prefill(self) -> PrefillWorker:
        worker = self._current()
        if self.spec.role != "prefill":
            raise RuntimeError(f"{worker.worker_id} is a decode worker, not a prefill worker")
        return cast("PrefillWorker", worker)


def _build_worker(
    spec: WorkerSpec, follower_ranks: list[RayRankPeer], weights: LoadedWeights | None
) -> PrefillWorker | DecodeWorker:
    """``spec``'s worker (the worker classes, and torch, are imported in the actor only)."""
    if spec.role == "decode":
        from decode_worker.worker import DecodeWorker

        return DecodeWorker(
            spec.worker_id,
            spec.load,
            spec.cache,
            spec.scheduler,
            spec.transfer,
            spec.speculative,
            spec.parallel,
            follower_ranks,
            weights,
        )
    from prefill_worker.worker import PrefillWorker

    return PrefillWorker(
        spec.worker_id,
        spec.load,
        spec.cache,
        spec.scheduler,
        spec.transfer,
        _decode_peers(spec.decode_handles),
        spec.parallel,
        follower_ranks,
        spec.decode_tp,
        weights,
    )


def _free_device_memory(device: Any) -> None:
    """Give the caching allocator's free blocks back to the device (a GPU's), so that the KV
    cache of the next engine is sized to the memory really free."""
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


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


def remote_worker_actor(**options: Any) -> Any:
    remote: Any = ray.remote
    return remote(max_concurrency=ACTOR_CONCURRENCY, **options)(WorkerActor)
