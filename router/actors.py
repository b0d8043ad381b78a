"""Ray actors around the plain worker classes, and the handle a prefill actor uses for a decode one.

The worker classes (and torch) are imported inside the actor processes only, so this module,
like the rest of the router, imports without torch on a CPU head node. Every method is a typed
pass-through; actors are threaded (``max_concurrency``) so a blocking KV receive, an output
stream and load reports proceed side by side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import ray

from engine.engine_config import CacheConfig, LoadConfig
from engine.messages import GenerateRequest, OutputBatch, WorkerLoad
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from kv_transfer.policy import FailurePolicy, Locality, TransferConfig
from router.cpu_binding import bind_this_thread

if TYPE_CHECKING:
    from engine.handoff import PrefillResult, Reservation
    from kv_transfer import ChannelRendezvous, TransferTicket

ACTOR_CONCURRENCY = 32


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

    def reserve(
        self, request_id: str, num_tokens: int, handoff_id: str, channel_id: str | None
    ) -> Reservation | None:
        return self.worker.reserve(request_id, num_tokens, handoff_id, channel_id)

    def pin_channel(self, request_id: str, handoff_id: str, channel_id: str) -> bool:
        return self.worker.pin_channel(request_id, handoff_id, channel_id)

    def cancel_reservation(self, request_id: str, handoff_id: str) -> None:
        self.worker.cancel_reservation(request_id, handoff_id)

    def connect_channel(
        self, rendezvous: ChannelRendezvous, request_id: str, handoff_id: str
    ) -> bool:
        return self.worker.connect_channel(rendezvous, request_id, handoff_id)

    def locality(self) -> Locality:
        return self.worker.locality()

    def receive(
        self,
        channel_id: str,
        result: PrefillResult,
        ticket: TransferTicket,
        block_ids: list[int],
        gateway_id: str,
        policy: FailurePolicy,
    ) -> bool:
        return self.worker.receive(channel_id, result, ticket, block_ids, gateway_id, policy)

    def admit_without_kv(self, result: PrefillResult, gateway_id: str) -> None:
        self.worker.admit_without_kv(result, gateway_id)

    def load(self) -> WorkerLoad:
        return self.worker.load()

    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        yield from self.worker.stream(gateway_id)

    def shutdown(self) -> None:
        self.worker.shutdown()


class RayDecodePeer:
    """A prefill worker's handle on a decode actor; every call answers with a future."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def reserve(
        self, request_id: str, num_tokens: int, handoff_id: str, channel_id: str | None
    ) -> Future[Reservation | None]:
        ref = self.handle.reserve.remote(request_id, num_tokens, handoff_id, channel_id)
        return ref.future()

    def pin_channel(self, request_id: str, handoff_id: str, channel_id: str) -> Future[bool]:
        return self.handle.pin_channel.remote(request_id, handoff_id, channel_id).future()

    def cancel_reservation(self, request_id: str, handoff_id: str) -> Future[None]:
        return self.handle.cancel_reservation.remote(request_id, handoff_id).future()

    def connect_channel(
        self, rendezvous: ChannelRendezvous, request_id: str, handoff_id: str
    ) -> Future[bool]:
        return self.handle.connect_channel.remote(rendezvous, request_id, handoff_id).future()

    def locality(self) -> Future[Locality]:
        return self.handle.locality.remote().future()

    def receive(
        self,
        channel_id: str,
        result: PrefillResult,
        ticket: TransferTicket,
        block_ids: list[int],
        gateway_id: str,
        policy: FailurePolicy,
    ) -> Future[bool]:
        ref = self.handle.receive.remote(channel_id, result, ticket, block_ids, gateway_id, policy)
        return ref.future()

    def admit_without_kv(self, result: PrefillResult, gateway_id: str) -> Future[None]:
        return self.handle.admit_without_kv.remote(result, gateway_id).future()


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
