"""The decode worker: receives prefilled requests' KV and runs the continuous-batching decode loop.

Lifecycle of a request here (queue names are the request's states):
  reserving    -- a prefill worker asks for blocks for the prompt's KV (refused when full: the
                  prefill worker keeps its lease and asks again, or falls back to recompute)
  transferring -- the KV arrives over the pairwise channel into the reserved blocks (one
                  channel per rank pair when either worker has several tensor-parallel ranks:
                  every rank receives its heads, and rank 0 admits once all have)
                  (from the reserve to the admission, the hand-off's state is DecodeHandoffs')
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
import threading
import time
from collections.abc import Iterator, Sequence

from decode_worker.handoffs import DecodeHandoffs
from decode_worker.prefix_lender import PrefixLender
from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.messages import (
    AdmitWithoutKV,
    CancelReservation,
    GenerateRequest,
    JoinChannel,
    KVCursor,
    LendPrefix,
    OpenLendChannel,
    OutputBatch,
    PinChannel,
    PrefillResult,
    ReceiveKV,
    Reservation,
    ReserveBlocks,
    ReturnLent,
    SendLentBlocks,
    WorkerLoad,
)
from engine.parallel.rank_model import LoadedWeights
from engine.parallel.shard import kv_heads_of_ranks
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from kv_transfer import (
    ChannelRendezvous,
    KVCacheLayout,
    KVChannel,
    TransferError,
    TransferTicket,
)
from kv_transfer.channel_table import ChannelTable, WorkerChannel, close_channels
from kv_transfer.locality import locality_of
from kv_transfer.policy import Locality, TransferConfig
from kv_transfer.rank_calls import RankPeer
from kv_transfer.rank_port import LocalRankPeer, RankKVPort
from kv_transfer.ranked_channel import RankedChannel
from kv_transfer.totals import TransferTotals

logger = logging.getLogger(__name__)


class DecodeWorker:
    """A decode worker; its hand-off verbs answer a prefill worker's calls
    (``engine.messages.HandoffReceiver``)."""

    def __init__(
        self,
        worker_id: str,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        transfer: TransferConfig,
        speculative: SpeculativeConfig | None = None,  # drafts checked each step; None: off
        parallel: ParallelConfig | None = None,  # its ranks (this one schedules); None: one
        follower_ranks: Sequence[RankPeer] = (),  # KV ports of its ranks 1 .. N-1, in order
        # the model of the worker this process ran before (one rank): kept, not loaded again
        weights: LoadedWeights | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.transfer = transfer
        self.engine = LLMEngine(
            load,
            cache,
            scheduler,
            speculative,
            parallel,
            record_kv_events=True,  # the router's index follows its prefix cache
            weights=weights,
        )
        cache_groups = self.engine.model_config.cache_groups.handshake_name
        scales = self.engine.kv_cache_scales
        kv_scales = None if scales is None else scales.per_layer
        self.layout = KVCacheLayout.from_cache(
            self.engine.kv_cache, cache_groups=cache_groups, kv_scales=kv_scales
        )
        # each rank's KV heads and port, rank 0 first: the rank pairs' channels use them
        self._kv_heads = kv_heads_of_ranks(self.engine.model_config, self.engine.shard.size)
        port = RankKVPort(
            self.engine.kv_cache, self.engine.shard.kv_heads, transfer.host, cache_groups, kv_scales
        )
        self._rank0 = LocalRankPeer(port, f"kv-rank0-{worker_id}")
        self._ranks: list[RankPeer] = [self._rank0, *follower_ranks]
        self._transfer_totals = TransferTotals()  # KV hand-offs received
        self.loop = EngineLoop(self.engine, worker_id)
        self.channels = ChannelTable(transfer.max_channels)  # from prefill workers
        # every hand-off's state; called under self.loop.lock only (see DecodeHandoffs)
        self.handoffs = DecodeHandoffs(self.loop, self.channels, transfer.reservation_ttl_s)
        # the prefixes its cache holds, copied by prefill workers (one rank: all the heads)
        self.lender = PrefixLender(
            worker_id,
            self.loop,
            self.engine.kv_cache,
            self.layout,
            transfer.host,
            transfer.timeout_s,
            transfer.reservation_ttl_s,
            lends=len(self._kv_heads) == 1,
        )
        self._stopping = threading.Event()
        self._sweeper = threading.Thread(
            target=self._sweep_expired_reservations, name=f"sweep-{worker_id}", daemon=True
        )
        self.loop.start()
        self._sweeper.start()

    # ---- requests -----------------------------------------------------------------------
    def submit(self, request: GenerateRequest) -> bool:
        """Colocated mode, or a resume after a failure: run the request here.

        False when the request runs here already (a repeated resume is a no-op). Blocks
        reserved for its KV from a prefill worker are given back: the request now starts from
        its prompt and the tokens already delivered. A request whose KV is arriving here is
        refused (ValueError): each placement has its own id (the router resumes a request
        under a new one), so the same id twice at once is the caller's error.
        """
        received_at = time.time()  # (its first token's trace: the wait for the lock counts)
        with self.loop.lock:
            self.handoffs.submitted(request.request_id)
            return self.loop.submit(request, received_at=received_at)

    def abort(self, request_id: str) -> None:
        """Drop the request. One whose KV is arriving keeps its blocks until the transfer has
        landed (the channel must stay in step with the sender), then gives them back. One not
        here yet is dropped when its hand-off arrives."""
        with self.loop.lock:
            if not self.handoffs.abort(request_id):
                self.loop.abort(request_id)

    def has_request(self, request_id: str) -> bool:
        """Whether this worker runs the request (queued or running; a reservation is not)."""
        return self.loop.call(lambda engine: engine.has_request(request_id))

    # ---- hand-off from a prefill worker (engine.messages.handoff) -----------------------
    def reserve(self, call: ReserveBlocks) -> Reservation | None:
        """Blocks for a prompt's KV, or None when they do not fit now (ask again later).

        ``call.channel_id``: the channel the prefill worker means to send on. While it is open
        here it stays open (the cap does not close it) until the request's receive ends or the
        reservation is cancelled; the answer names it. Otherwise the answer names no channel:
        this side closed it (over the cap), so the prefill worker opens another.
        """
        with self.loop.lock:
            self._expire_reservations_locked()
            return self.handoffs.reserve(call)

    def pin_channel(self, call: PinChannel) -> bool:
        """Keep a channel open for the transfer of a hand-off's KV; False if it is not open
        here, or the hand-off's reservation is gone. A pin ends with the request's receive, or
        with its reservation's cancel."""
        with self.loop.lock:
            return self.handoffs.pin(call)

    def cancel_reservation(self, call: CancelReservation) -> None:
        """Give back the blocks reserved for a hand-off whose KV will not come: it failed before
        the transfer began (no channel, a layout mismatch, a deadline)."""
        with self.loop.lock:
            self.handoffs.cancel(call)

    def locality(self) -> Locality:
        """Where this worker's KV cache lives: a prefill worker picks the transport by it."""
        return locality_of(self.engine.device)

    def connect_channel(self, call: JoinChannel) -> bool:
        """Join the channel a prefill worker listens on (handshake checks the KV layout), pinned
        at once for the hand-off it opened for; False if that hand-off's reservation is gone
        (the channel is open all the same). A channel of rank pairs is joined on every rank of
        a pair at once, each with the heads it holds."""
        timeout_s = self.transfer.timeout_s
        channel: WorkerChannel
        if call.pairs:
            if len(self._ranks) != len(self._kv_heads):
                raise ValueError(
                    f"decode worker {self.worker_id} has tensor_parallel_size "
                    f"{len(self._kv_heads)} but {len(self._ranks)} rank KV ports"
                )
            channel = RankedChannel.connect(call.rendezvous, call.pairs, self._ranks, timeout_s)
        else:
            channel = KVChannel.connect(call.rendezvous, self.layout, self.engine.device, timeout_s)
        with self.loop.lock:
            return self.handoffs.join(call, channel)

    def receive(self, call: ReceiveKV) -> bool:
        """Receive a request's KV into its reserved blocks and admit it; False if it failed.

        On failure the request follows ``call.policy``: recompute here, or fail with a clear
        error.
        """
        result, gateway_id = call.result, call.gateway_id
        request_id = result.request_id
        self.loop.prepare(result.params)  # (outside the loop's lock: steps go on)
        with self.loop.lock:
            channel, start = self.handoffs.begin_receive(call)
        try:
            if start != "receive":  # given back (aborted, resumed here, expired): take the bytes
                self._discard(call.channel_id, channel, call.ticket)
                if start == "expired":  # nobody else knows: the router places it again
                    message = "the KV came after the decode worker's reservation for it expired"
                    self.loop.fail(request_id, message, gateway_id, retryable=True)
                return False
            try:
                error = self._recv(call.channel_id, channel, call.block_ids, call.ticket)
            except BaseException:
                with self.loop.lock:
                    self.handoffs.end_receive(request_id, keep_blocks=False)
                raise
        finally:
            if channel is not None:
                close_channels(self.channels.release(call.channel_id))
        # Decided under the loop's lock, so an abort lands either before (the copy is dropped
        # here) or after the request is admitted (and aborts it in the engine).
        with self.loop.lock:
            if not self.handoffs.end_receive(request_id, keep_blocks=error is None):
                return False  # aborted meanwhile
            if error is None:
                return self._admit(result, gateway_id, kv_received=True)
            if call.policy == "recompute":
                self._admit(result, gateway_id, kv_received=False)
            else:
                self.loop.fail(request_id, f"KV transfer failed: {error}", gateway_id)
            return False

    def _recv(
        self,
        channel_id: str,
        channel: WorkerChannel | None,
        block_ids: list[int],
        ticket: TransferTicket,
    ) -> str | None:
        """Receive into the blocks; the error, or None when the KV arrived."""
        if channel is None:
            return f"no open KV channel {channel_id!r}"
        try:
            stats = channel.recv_blocks(self.engine.kv_cache, block_ids, ticket)
            self._transfer_totals.add(stats, channel.rendezvous.transport, len(block_ids))
        except TransferError as failure:
            self._drop_channel(channel_id, channel)
            return str(failure)
        return None

    def _discard(
        self, channel_id: str, channel: WorkerChannel | None, ticket: TransferTicket
    ) -> None:
        if channel is None:
            return
        try:
            channel.discard(self.engine.kv_cache, ticket)
        except TransferError:
            self._drop_channel(channel_id, channel)

    def admit_without_kv(self, call: AdmitWithoutKV) -> None:
        """Take a prefilled request without its KV (no blocks could be reserved): recompute."""
        self.loop.prepare(call.result.params)
        with self.loop.lock:
            if self.handoffs.arrive_without_kv(call.result.request_id):
                self._admit(call.result, call.gateway_id, kv_received=False)

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

    # ---- a cached prefix copied to a prefill worker (engine.messages.handoff) -----------
    def lend_prefix(self, call: LendPrefix) -> int:
        """Hold the leading run of the named blocks this cache holds, for a prefill worker to
        copy; how many (0: none)."""
        return self.lender.lend(call)

    def open_lend_channel(self, call: OpenLendChannel) -> ChannelRendezvous:
        """Listen for a prefill worker's channel for lent blocks (this worker sends on it)."""
        return self.lender.open_channel(call)

    def send_lent(self, call: SendLentBlocks) -> bool:
        """Send a lend's blocks to the prefill worker, then stop holding them; False if not."""
        return self.lender.send(call)

    def return_lent(self, call: ReturnLent) -> None:
        """Stop holding a lend's blocks: the prefill worker will not copy them."""
        self.lender.give_back(call)

    # ---- outputs and load ---------------------------------------------------------------
    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        """Output batches for one gateway, as steps produce them, until shutdown."""
        return self.loop.stream(gateway_id)

    def next_batch(self, gateway_id: str, timeout_s: float) -> OutputBatch | None:
        return self.loop.next_batch(gateway_id, timeout_s)

    def load(self, kv_cursor: KVCursor | None = None) -> WorkerLoad:
        """This worker's load report; never waits for the engine (see ``EngineLoop.load``).
        With ``kv_cursor``, its KV events after it."""
        return self.loop.load(self._transfer_totals.snapshot(), kv_cursor)

    def _sweep_expired_reservations(self) -> None:
        """Give back expired reservations a few times per TTL, on a thread of their own (so
        that waiting for the engine's lock holds up no load report), until shutdown."""
        interval_s = min(self.handoffs.ttl_s / 4, 1.0)
        while not self._stopping.wait(interval_s):
            with self.loop.lock:
                self._expire_reservations_locked()
            for lend_id in self.lender.expire():
                logger.warning("lend %s expired without its send; blocks given back", lend_id)

    def _expire_reservations_locked(self) -> None:
        """Give back reservations whose transfer never began."""
        for request_id in self.handoffs.expire():
            logger.warning(
                "reservation of %s expired after %.0f s without its KV; blocks given back",
                request_id,
                self.handoffs.ttl_s,
            )

    def shutdown(self) -> None:
        self._stopping.set()
        self.lender.close()
        self.loop.stop()
        close_channels(self.channels.remove_all())
        self._rank0.shutdown()
        self.engine.close()  # its follower ranks stop (none for a worker of one rank)

    def _drop_channel(self, channel_id: str, channel: WorkerChannel) -> None:
        self.channels.remove(channel_id, channel)
        channel.close()
