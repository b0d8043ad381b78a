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
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import ray

from engine.engine_config import CacheConfig, LoadConfig
from engine.messages import GenerateRequest, HandoffCall, OutputBatch, WorkerLoad
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from kv_transfer.policy import TransferConfig
from router.cpu_binding import bind_this_thread
from router.gil_switch import hand_off_the_gil_sooner

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
    ) -> None:
        hand_off_the_gil_sooner()
        if cpus:  # before the engine and its threads start
            bind_this_thread(cpus)
        from decode_worker.worker import DecodeWorker

        transfer = _bind_to_node(transfer)
        self.worker = DecodeWorker(worker_id, load, cache, scheduler, transfer, speculative)

    def ready(self) -> str:
        return self.worker.worker_id

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

    def load(self) -> WorkerLoad:
        return self.worker.load()

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
    ) -> None:
        hand_off_the_gil_sooner()
        if cpus:  # before the engine and its threads start
            bind_this_thread(cpus)
        from prefill_worker.worker import PrefillWorker

        transfer = _bind_to_node(transfer)
        peers = _decode_peers(decode_handles)
        self.worker = PrefillWorker(worker_id, load, cache, scheduler, transfer, peers)

    def ready(self) -> str:
        return self.worker.worker_id

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def submit(self, request: GenerateRequest, decode_worker_id: str) -> None:
        self.worker.submit(request, decode_worker_id)

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

    def load(self) -> WorkerLoad:
        return self.worker.load()

    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        yield from self.worker.stream(gateway_id)

    def shutdown(self) -> None:
        self.worker.shutdown()


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
