"""A prefill worker's handle on a decode worker in the same process, for tests that run the
workers without Ray.

The Ray launcher gives prefill workers actor handles instead (router/actors.RayDecodePeer); both
answer with futures, so the prefill worker's hand-off code is the same either way.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from decode_worker.worker import DecodeWorker
from engine.handoff import PrefillResult, Reservation
from kv_transfer import ChannelRendezvous, TransferTicket
from kv_transfer.policy import FailurePolicy, Locality


class LocalDecodePeer:
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self._executor = ThreadPoolExecutor(8, thread_name_prefix="decode-peer")

    def reserve(
        self, request_id: str, num_tokens: int, handoff_id: str, channel_id: str | None
    ) -> Future[Reservation | None]:
        return self._executor.submit(
            self.worker.reserve, request_id, num_tokens, handoff_id, channel_id
        )

    def pin_channel(self, request_id: str, handoff_id: str, channel_id: str) -> Future[bool]:
        return self._executor.submit(self.worker.pin_channel, request_id, handoff_id, channel_id)

    def cancel_reservation(self, request_id: str, handoff_id: str) -> Future[None]:
        return self._executor.submit(self.worker.cancel_reservation, request_id, handoff_id)

    def connect_channel(
        self, rendezvous: ChannelRendezvous, request_id: str, handoff_id: str
    ) -> Future[bool]:
        return self._executor.submit(
            self.worker.connect_channel, rendezvous, request_id, handoff_id
        )

    def locality(self) -> Future[Locality]:
        return self._executor.submit(self.worker.locality)

    def receive(
        self,
        channel_id: str,
        result: PrefillResult,
        ticket: TransferTicket,
        block_ids: list[int],
        gateway_id: str,
        policy: FailurePolicy,
    ) -> Future[bool]:
        return self._executor.submit(
            self.worker.receive, channel_id, result, ticket, block_ids, gateway_id, policy
        )

    def admit_without_kv(self, result: PrefillResult, gateway_id: str) -> Future[None]:
        return self._executor.submit(self.worker.admit_without_kv, result, gateway_id)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
