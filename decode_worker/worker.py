"""The decode worker: receives prefilled requests' KV and runs the continuous-batching decode loop.

Lifecycle of a request here (queue names are the request's states):
  reserving    -- a prefill worker asks for blocks for the prompt's KV (refused when full: the
                  prefill worker keeps its lease and asks again, or falls back to recompute)
  transferring -- the KV arrives over the pairwise channel into the reserved blocks
  decoding     -- admitted into the running batch; every step's tokens for all requests of a
                  gateway leave as one OutputBatch (with speculative decoding a step checks a
                  sequence's ngram drafts too, and may emit several tokens of it)
  recomputing  -- the KV never arrived (or the worker was preempted): the prompt runs here
  finished     -- stop token, max tokens, abort; blocks freed
In colocated mode (no prefill pool) requests are submitted here directly and run both phases
with chunked prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from decode_worker.early_aborts import EarlyAborts
from decode_worker.reserved_handoffs import ReservedHandoffs
from engine.engine_config import CacheConfig, LoadConfig
from engine.engine_loop import EngineLoop
from engine.handoff import PrefillResult, Reservation
from engine.llm_engine import LLMEngine
from engine.messages import GenerateRequest, OutputBatch, WorkerLoad
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from kv_transfer import (
    ChannelRendezvous,
    KVCacheLayout,
    KVChannel,
    TransferError,
    TransferTicket,
)
from kv_transfer.channel_table import ChannelTable, close_channels
from kv_transfer.locality import locality_of
from kv_transfer.policy import FailurePolicy, Locality, TransferConfig
from kv_transfer.totals import TransferTotals

logger = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(
        self,
        worker_id: str,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        transfer: TransferConfig,
        speculative: SpeculativeConfig | None = None,  # ngram drafts checked each step; None: off
    ) -> None:
        self.worker_id = worker_id
        self.transfer = transfer
        self.engine = LLMEngine(load, cache, scheduler, speculative)
        self.layout = KVCacheLayout.from_cache(self.engine.kv_cache)
        self._transfer_totals = TransferTotals()  # KV hand-offs received
        self.loop = EngineLoop(self.engine, worker_id)
        self.channels = ChannelTable(transfer.max_channels)  # from prefill workers
        self._receiving: set[str] = set()  # requests whose KV is arriving (under loop.lock)
        self._aborted: set[str] = set()  # of those, the ones aborted meanwhile
        self._early_aborts = EarlyAborts()  # aborted before their hand-off came (loop.lock)
        self._handoffs = ReservedHandoffs(transfer.reservation_ttl_s)  # (loop.lock)
        self.loop.start()

    # ---- requests -----------------------------------------------------------------------
    def submit(self, request: GenerateRequest) -> bool:
        """Colocated mode, or a resume after a failure: run the request here.

        False when the request runs here already (a repeated resume is a no-op). Blocks
        reserved for its KV from a prefill worker are given back: the request now starts from
        its prompt and the tokens already delivered. A request whose KV is arriving here is
        refused (ValueError): each placement has its own id (the router resumes a request
        under a new one), so the same id twice at once is the caller's error.
        """
        with self.loop.lock:
            if request.request_id in self._receiving:
                raise ValueError(
                    f"request_id {request.request_id!r} is already receiving its KV here"
                )
            # The router aborts a request it submits directly only once this call has returned.
            self._early_aborts.take(request.request_id)
            self._drop_reservation(request.request_id)
            return self.loop.submit(request)

    def abort(self, request_id: str) -> None:
        """Drop the request. One whose KV is arriving keeps its blocks until the transfer has
        landed (the channel must stay in step with the sender), then gives them back. One not
        here yet is dropped when its hand-off arrives."""
        with self.loop.lock:
            if request_id in self._receiving:
                self._aborted.add(request_id)
                return
            if not self.engine.has_request(request_id):
                self._early_aborts.add(request_id)
            self._drop_reservation(request_id)
            self.loop.abort(request_id)

    def _drop_reservation(self, request_id: str) -> None:
        """Give back a request's reserved blocks and their channel's pin (loop lock held)."""
        self._handoffs.release(request_id)
        close_channels(self.channels.unpin(request_id))
        self.loop.call(lambda engine: engine.cancel_reservation(request_id))

    def has_request(self, request_id: str) -> bool:
        """Whether this worker runs the request (queued or running; a reservation is not)."""
        return self.loop.call(lambda engine: engine.has_request(request_id))

    # ---- hand-off from a prefill worker -------------------------------------------------
    # Each hand-off has its own id (``handoff_id``): see ``ReservedHandoffs``.
    def reserve(
        self, request_id: str, num_tokens: int, handoff_id: str, channel_id: str | None = None
    ) -> Reservation | None:
        """Blocks for a prompt's KV, or None when they do not fit now (ask again later).

        ``channel_id``: the channel the prefill worker means to send on. While it is open here
        it stays open (the cap does not close it) until the request's receive ends or the
        reservation is cancelled; the answer names it. Otherwise the answer names no channel:
        this side closed it (over the cap), so the prefill worker opens another.
        """
        with self.loop.lock:
            self._expire_reservations()
            if self._handoffs.refuses(handoff_id):
                return None  # the prefill worker gave up on this hand-off already
            block_ids = self.loop.call(lambda engine: engine.reserve_blocks(request_id, num_tokens))
            if block_ids is None:
                return None
            self._handoffs.hold(request_id, handoff_id)
            pinned = channel_id is not None and self.channels.pin(request_id, channel_id)
        return Reservation(block_ids, channel_id if pinned else None)

    def pin_channel(self, request_id: str, handoff_id: str, channel_id: str) -> bool:
        """Keep ``channel_id`` open for the transfer of ``request_id``'s KV; False if it is not
        open here, or the hand-off's reservation is gone. A pin ends with the request's receive,
        or with its reservation's cancel."""
        with self.loop.lock:
            if not self._handoffs.holds(request_id, handoff_id):
                return False
            return self.channels.pin(request_id, channel_id)

    def cancel_reservation(self, request_id: str, handoff_id: str) -> None:
        """Give back the blocks reserved for a hand-off whose KV will not come: it failed before
        the transfer began (no channel, a layout mismatch, a deadline)."""
        with self.loop.lock:
            if not self._handoffs.holds(request_id, handoff_id):
                self._handoffs.cancel_early(handoff_id)  # its reserve may be late: refuse it
                return
            self._drop_reservation(request_id)

    def locality(self) -> Locality:
        """Where this worker's KV cache lives: a prefill worker picks the transport by it."""
        return locality_of(self.engine.device)

    def connect_channel(
        self, rendezvous: ChannelRendezvous, request_id: str, handoff_id: str
    ) -> bool:
        """Join the channel a prefill worker listens on (handshake checks the KV layout), pinned
        at once for the hand-off it opened for; False if that hand-off's reservation is gone
        (the channel is open all the same)."""
        channel = KVChannel.connect(
            rendezvous, self.layout, self.engine.device, self.transfer.timeout_s
        )
        with self.loop.lock:
            pinned = self._handoffs.holds(request_id, handoff_id)
            pin_for = request_id if pinned else None
            close_channels(self.channels.add(rendezvous.channel_id, channel, pin_for=pin_for))
        return pinned

    def receive(
        self,
        channel_id: str,
        result: PrefillResult,
        ticket: TransferTicket,
        block_ids: list[int],
        gateway_id: str,
        policy: FailurePolicy,
    ) -> bool:
        """Receive a request's KV into its reserved blocks and admit it; False if it failed.

        On failure the request follows ``policy``: recompute here, or fail with a clear error.
        """
        request_id = result.request_id
        self.loop.prepare(result.params)  # (outside the loop's lock: steps go on)
        channel = self.channels.take(request_id, channel_id)
        try:
            with self.loop.lock:
                self._handoffs.release(request_id)  # the receive owns the reservation now
                if self._early_aborts.take(request_id):
                    self.engine.cancel_reservation(request_id)
                reserved = self.engine.reserved_blocks(request_id) == block_ids
                if reserved:
                    self._receiving.add(request_id)
                expired = not reserved and self._handoffs.take_expired(request_id)
            if not reserved:  # given back (aborted, resumed here, expired): take the bytes
                self._discard(channel_id, channel, ticket)
                if expired:  # nobody else knows: the router places it again
                    message = "the KV came after the decode worker's reservation for it expired"
                    self.loop.fail(request_id, message, gateway_id, retryable=True)
                return False
            try:
                error = self._recv(channel_id, channel, block_ids, ticket)
            except BaseException:
                with self.loop.lock:
                    self._forget_receive(request_id)
                    self.engine.cancel_reservation(request_id)
                raise
        finally:
            if channel is not None:
                close_channels(self.channels.release(channel_id))
        # Decided under the loop's lock, so an abort lands either before (the copy is dropped
        # here) or after the request is admitted (and aborts it in the engine).
        with self.loop.lock:
            if self._forget_receive(request_id):  # aborted meanwhile
                self.engine.cancel_reservation(request_id)
                return False
            if error is None:
                return self._admit(result, gateway_id, kv_received=True)
            if policy == "recompute":
                self._admit(result, gateway_id, kv_received=False)
            else:
                self.loop.call(lambda engine: engine.cancel_reservation(result.request_id))
                self.loop.fail(result.request_id, f"KV transfer failed: {error}", gateway_id)
            return False

    def _forget_receive(self, request_id: str) -> bool:
        """End a receive's bookkeeping (loop lock held); True if it was aborted meanwhile."""
        self._receiving.discard(request_id)
        aborted = request_id in self._aborted
        self._aborted.discard(request_id)
        return aborted

    def _recv(
        self,
        channel_id: str,
        channel: KVChannel | None,
        block_ids: list[int],
        ticket: TransferTicket,
    ) -> str | None:
        """Receive into the blocks; the error, or None when the KV arrived."""
        if channel is None:
            return f"no open KV channel {channel_id!r}"
        try:
            self._transfer_totals.add(channel.recv_blocks(self.engine.kv_cache, block_ids, ticket))
        except TransferError as failure:
            self._drop_channel(channel_id, channel)
            return str(failure)
        return None

    def _discard(self, channel_id: str, channel: KVChannel | None, ticket: TransferTicket) -> None:
        if channel is None:
            return
        try:
            channel.discard(self.engine.kv_cache, ticket)
        except TransferError:
            self._drop_channel(channel_id, channel)

    def admit_without_kv(self, result: PrefillResult, gateway_id: str) -> None:
        """Take a prefilled request without its KV (no blocks could be reserved): recompute."""
        self.loop.prepare(result.params)
        with self.loop.lock:
            if self._early_aborts.take(result.request_id):
                return
            self._admit(result, gateway_id, kv_received=False)

    def _admit(self, result: PrefillResult, gateway_id: str, *, kv_received: bool) -> bool:
        """Admit a prefilled request (loop lock held); its reserved blocks become its own.

        False, with the request failed for good, when this worker can never run it: its cache
        or ``max_num_seqs`` may be smaller than the prefill side's. Its blocks are given back.
        """
        try:
            self.loop.call(lambda engine: engine.admit_prefilled(result, kv_received=kv_received))
        except ValueError as refusal:
            message = f"decode worker {self.worker_id} cannot run the request: {refusal}"
            self.loop.fail(result.request_id, message, gateway_id)
            return False
        self.loop.track(result.request_id, gateway_id)
        return True

    # ---- outputs and load ---------------------------------------------------------------
    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        """Output batches for one gateway, as steps produce them, until shutdown."""
        return self.loop.stream(gateway_id)

    def next_batch(self, gateway_id: str, timeout_s: float) -> OutputBatch | None:
        return self.loop.next_batch(gateway_id, timeout_s)

    def load(self) -> WorkerLoad:
        with self.loop.lock:  # the router asks every report interval: a sweep for free
            self._expire_reservations()
        return self.loop.load(self._transfer_totals.snapshot())

    def _expire_reservations(self) -> None:
        """Give back reservations whose transfer never began (loop lock held)."""
        for request_id in self._handoffs.expire():
            logger.warning(
                "reservation of %s expired after %.0f s without its KV; blocks given back",
                request_id,
                self._handoffs.ttl_s,
            )
            self._drop_reservation(request_id)

    def shutdown(self) -> None:
        self.loop.stop()
        close_channels(self.channels.remove_all())

    def _drop_channel(self, channel_id: str, channel: KVChannel) -> None:
        self.channels.remove(channel_id, channel)
        channel.close()
