"""The prefill worker: computes prompts' KV and first tokens, hands the KV to decode workers.

Lifecycle of a request here (queue names are the request's states):
  queued       -- submitted by the router with the decode worker chosen for it
  prefilling   -- batched with other prompts under the step's token budget (long prompts are
                  chunked; cached prefix blocks are reused)
  first token  -- sampled and streamed to the request's gateway at once (that is TTFT)
  handing off  -- the prompt's KV waits under a lease while the decode worker reserves blocks
                  and the pairwise channel moves it (gather -> one send -> scatter); the calls
                  to the decode worker are engine.messages.handoff's. When either worker has
                  several tensor-parallel ranks the channel is one per rank pair (each rank's
                  KV heads go to the decode ranks that hold them), driven by rank 0
  released     -- the decode worker confirmed (or gave up): blocks freed, full ones stay cached
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.messages import (
    AdmitWithoutKV,
    BlockWait,
    CancelReservation,
    DecodePeer,
    GenerateRequest,
    GetLocality,
    JoinChannel,
    KVCursor,
    OutputBatch,
    PinChannel,
    PrefillResult,
    ReceiveKV,
    Reservation,
    ReserveBlocks,
    TransferTiming,
    WorkerLoad,
)
from engine.parallel.rank_model import LoadedWeights
from engine.parallel.shard import kv_heads_of_ranks
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from kv_transfer import KVCacheLayout, KVChannel, TransferError, TransferTicket
from kv_transfer.channel import ChannelListener
from kv_transfer.channel_table import ChannelTable, WorkerChannel, close_channels
from kv_transfer.head_plan import plan_head_moves
from kv_transfer.policy import TransferConfig, network_transport
from kv_transfer.rank_calls import RankPeer
from kv_transfer.rank_port import LocalRankPeer, RankKVPort
from kv_transfer.ranked_channel import RankedListener
from kv_transfer.totals import TransferTotals
from prefill_worker.handoff_lanes import HandoffLanes
from prefill_worker.pair_transports import PairTransports
from prefill_worker.prefix_fetch import PrefixFetcher

logger = logging.getLogger(__name__)
_RESERVE_RETRY_S = 0.01


@dataclass(frozen=True, slots=True)
class _Target:
    decode_worker_id: str  # where the request decodes
    gateway_id: str  # where its tokens go


class PrefillWorker:
    def __init__(
        self,
        worker_id: str,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        transfer: TransferConfig,
        decode_peers: Mapping[str, DecodePeer],
        parallel: ParallelConfig | None = None,  # its ranks (this one schedules); None: one
        follower_ranks: Sequence[RankPeer] = (),  # KV ports of its ranks 1 .. N-1, in order
        decode_tensor_parallel_size: int = 1,  # the ranks of each decode worker it hands to
        # the model of the worker this process ran before (one rank): kept, not loaded again
        weights: LoadedWeights | None = None,
        # speculative decoding of the decode workers: a prediction layer's ("mtp") KV is
        # computed here into the blocks handed off (it never drafts here); others: None
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.transfer = transfer
        # no decode graphs: a prefill worker's sequences stop after their first token
        self.engine = LLMEngine(
            replace(load, enforce_eager=True),
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
        # each decode rank's KV heads (every decode worker of a cluster has as many ranks)
        self._decode_heads = kv_heads_of_ranks(
            self.engine.model_config, decode_tensor_parallel_size
        )
        self._transports = PairTransports(transfer.transport, self.engine.device)
        self._peers = dict(decode_peers)
        self._targets: dict[str, _Target] = {}  # request id -> where it goes after prefill
        self._queued: dict[str, PrefillResult] = {}  # prefilled, hand-off not started yet
        self._targets_lock = threading.Lock()
        self._fetching: set[str] = set()  # requests whose prefix is being fetched (targeted)
        self._fetches = ThreadPoolExecutor(
            transfer.max_concurrent_handoffs, thread_name_prefix=f"fetch-{worker_id}"
        )
        self.channels = ChannelTable(transfer.max_channels)  # by decode worker
        self._transfer_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._transfer_ids = itertools.count()
        self._handoffs = HandoffLanes(transfer.max_concurrent_handoffs, f"handoff-{worker_id}")
        # KV hand-offs sent, each one's timing for the router's latency model
        self._transfer_totals = TransferTotals(keep_timings=True)
        # hand-offs waiting now for a decode worker's blocks: hand-off id -> (decode worker,
        # when the wait began, monotonic), for the load report
        self._block_waits: dict[str, tuple[str, float]] = {}
        self._block_waits_lock = threading.Lock()
        self.loop = EngineLoop(self.engine, worker_id, on_handed_off=self._schedule_handoff)
        self.fetcher = PrefixFetcher(
            worker_id,
            self.loop,
            self.engine.kv_cache,
            self.layout,
            transfer,
            self._transports,
            lambda: self._peers,
            self._transfer_ids,
            # one rank each (the lend channel moves every head), one whole-context cache group
            fetches=len(self._kv_heads) == 1
            and len(self._decode_heads) == 1
            and self.engine.block_manager.windows == (None,),
        )
        self.loop.start()

    # ---- requests -----------------------------------------------------------------------
    def submit(
        self, request: GenerateRequest, decode_worker_id: str, fetch_blocks: int = 0
    ) -> None:
        """Queue a prompt; its decode continues on ``decode_worker_id``.

        ``fetch_blocks``: first copy the prompt's leading blocks, up to this many, from
        ``decode_worker_id``'s cache (prefill_worker/prefix_fetch.py), so that only the rest is
        computed here and handed back. The copy runs on a fetch thread and the request is
        queued after it: this call returns at once (a request the engine then refuses fails
        through its gateway's output stream).
        """
        received_at = time.time()  # (its first token's trace: the wait for the locks counts)
        if decode_worker_id not in self._peers:
            raise ValueError(f"unknown decode worker {decode_worker_id!r}")
        if fetch_blocks > 0 and self.fetcher.fetches:
            request_id = request.request_id
            with self._targets_lock:
                if request_id in self._targets:
                    raise ValueError(f"request_id {request_id!r} is already in use")
                self._fetching.add(request_id)  # (kept from the sweep: not in the engine yet)
                self._targets[request_id] = _Target(decode_worker_id, request.gateway_id)
            self._fetches.submit(
                self._fetch_then_queue, request, decode_worker_id, fetch_blocks, received_at
            )
            return
        # The target and its request come in under one hold of the targets lock: a sweep
        # (``_forget_finished_locked``) never sees the one without the other.
        with self._targets_lock:
            self._targets[request.request_id] = _Target(decode_worker_id, request.gateway_id)
            try:
                self.loop.submit(request, prefill_only=True, received_at=received_at)
            except ValueError:
                del self._targets[request.request_id]
                raise

    @property
    def num_fetching(self) -> int:
        """Requests whose prefix is being copied from a decode worker (not queued yet)."""
        with self._targets_lock:
            return len(self._fetching)

    def _fetch_then_queue(
        self, request: GenerateRequest, decode_worker_id: str, fetch_blocks: int, received_at: float
    ) -> None:
        """Copy the prompt's prefix from the decode worker, then queue the prompt (unless it
        was aborted meanwhile: then the blocks held for it are given back)."""
        request_id = request.request_id
        try:
            self.fetcher.fetch(request, decode_worker_id, fetch_blocks)
        except Exception:  # (best effort: the prompt computes what did not come)
            logger.exception("fetching the prefix of %s failed", request_id)
        with self._targets_lock:
            self._fetching.discard(request_id)
            target = self._targets.get(request_id)
            try:
                if target is None:  # aborted while fetching
                    raise ValueError("aborted")
                self.loop.submit(request, prefill_only=True, received_at=received_at)
            except ValueError as refusal:
                self._targets.pop(request_id, None)
                self.loop.call(lambda engine: engine.drop_prefix_hold(request_id))
                if target is not None:
                    self.loop.fail(request_id, str(refusal), target.gateway_id)

    def _forget_finished_locked(self) -> None:
        """Drop the targets of requests that ended here without a hand-off (targets lock held).

        A request whose every sample finished on its first token (max_tokens=1, eos, a stop
        token) never reaches ``_run_handoff``, where targets are dropped: kept, each one leaked
        and ``retarget`` answered True for it. A handed-off request stays in the engine, under
        its lease, until its hand-off has taken the target.
        """
        with self.loop.lock:
            ended = [
                rid
                for rid in self._targets
                if rid not in self._fetching and not self.engine.has_request(rid)
            ]
        for request_id in ended:
            del self._targets[request_id]

    def retarget(self, request_id: str, decode_worker_id: str) -> bool:
        """Send a not-yet-handed-off request to another decode worker; False if too late."""
        if decode_worker_id not in self._peers:
            raise ValueError(f"unknown decode worker {decode_worker_id!r}")
        with self._targets_lock:
            self._forget_finished_locked()
            target = self._targets.get(request_id)
            if target is None:
                return False
            self._targets[request_id] = _Target(decode_worker_id, target.gateway_id)
            queued = request_id in self._queued
        if queued and decode_worker_id != target.decode_worker_id:
            # its hand-off may wait behind the old decode worker's (hung ones among them)
            self._handoffs.submit(decode_worker_id, self._run_handoff, request_id)
        return True

    def add_decode_peers(self, decode_peers: Mapping[str, DecodePeer]) -> None:
        """Learn decode workers that joined the pool after this worker started (replacements of
        dead ones); ids known already keep their peer. The map is replaced, never changed in
        place, so a hand-off reading it meanwhile sees the old one or the new one."""
        self._peers = {**decode_peers, **self._peers}

    def forget_decode_peer(self, decode_worker_id: str) -> None:
        """Drop a decode worker whose process is gone: it is never handed a request again, and
        its channel is closed (an NCCL one holds GPU memory; the cap would close it only once
        it is idle and over). Waits for a transfer to it in progress, which its deadline ends."""
        self._peers = {wid: p for wid, p in self._peers.items() if wid != decode_worker_id}
        self.fetcher.forget(decode_worker_id)
        with self._transfer_locks[decode_worker_id]:
            channel = self.channels.get(decode_worker_id)
            if channel is not None:
                self.channels.remove(decode_worker_id, channel)
                channel.close()

    def abort(self, request_id: str) -> None:
        with self._targets_lock:
            self._targets.pop(request_id, None)
        self.loop.abort(request_id)

    def channel_transports(self) -> dict[str, str]:
        """The transport of each open KV channel, by decode worker id."""
        return {wid: channel.rendezvous.transport for wid, channel in self.channels.items()}

    # ---- outputs and load ---------------------------------------------------------------
    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        """Output batches for one gateway, as steps produce them, until shutdown."""
        return self.loop.stream(gateway_id)

    def next_batch(self, gateway_id: str, timeout_s: float) -> OutputBatch | None:
        return self.loop.next_batch(gateway_id, timeout_s)

    def load(self, kv_cursor: KVCursor | None = None) -> WorkerLoad:
        """This worker's load report; with ``kv_cursor``, its KV events after it."""
        with self._targets_lock:  # the router asks every report interval: a sweep for free
            self._forget_finished_locked()
        sent = tuple(TransferTiming(*timing) for timing in self._transfer_totals.take_timings())
        load = self.loop.load(self._transfer_totals.snapshot(), kv_cursor, sent)
        now = time.monotonic()
        with self._block_waits_lock:
            waits = tuple(BlockWait(d, now - since) for d, since in self._block_waits.values())
        return replace(load, block_waits=waits) if waits else load

    def shutdown(self) -> None:
        self.loop.stop()
        self._handoffs.shutdown()
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()
        close_channels(self.channels.remove_all())
        self._rank0.shutdown()
        self.engine.close()  # its follower ranks stop (none for a worker of one rank)

    # ---- hand-off -----------------------------------------------------------------------
    def _schedule_handoff(self, result: PrefillResult) -> None:
        with self._targets_lock:
            target = self._targets.get(result.request_id)
            self._queued[result.request_id] = result
        lane = "" if target is None else target.decode_worker_id  # aborted: released at once
        self._handoffs.submit(lane, self._run_handoff, result.request_id)

    def _run_handoff(self, request_id: str) -> None:
        with self._targets_lock:
            result = self._queued.pop(request_id, None)
            if result is None:  # run already, from the lane of the decode worker it moved to
                return
            target = self._targets.pop(request_id, None)
        if target is None:  # aborted meanwhile
            self.loop.release(request_id)
            return
        try:
            self._hand_off(result, target)
        except Exception as error:  # the peer is gone, hung or broken: the request fails
            logger.exception("hand-off of %s failed", request_id)
            reason = str(error) or f"{type(error).__name__} (no answer within the deadline)"
            self.loop.fail(
                request_id, f"hand-off failed: {reason}", target.gateway_id, retryable=True
            )
        finally:
            self.loop.release(request_id)

    def _hand_off(self, result: PrefillResult, target: _Target) -> None:
        """Reserve blocks on the decode worker, move the KV into them, wait for the receipt.

        Every wait on the decode worker has a deadline, so a hung one fails its hand-offs
        instead of holding them (and their leases) for ever. Blocks reserved there are given
        back when the hand-off fails before the decode worker was told to receive them.
        """
        decode_worker_id = target.decode_worker_id
        peer = self._peers[decode_worker_id]
        timeout_s = self.transfer.timeout_s
        handoff_id = f"{self.worker_id}/{next(self._transfer_ids)}"
        owes_cancel = True  # blocks may be reserved there, and no receive will take them
        try:
            current = self.channels.get(decode_worker_id)
            asked = None if current is None or current.broken else current.rendezvous.channel_id
            reservation, waited_s = self._reserve(decode_worker_id, peer, result, handoff_id, asked)
            if reservation is None:  # the decode worker stayed full: it recomputes the prompt
                owes_cancel = False
                self._transfer_totals.waited(decode_worker_id, waited_s)
                peer.send(AdmitWithoutKV(result, target.gateway_id)).result(timeout=timeout_s)
                return
            # One transfer at a time per decode worker, so both ends take the tickets in one
            # order; the channel is taken under the same lock, after a failed transfer before
            # it has been replaced.
            with self._transfer_locks[decode_worker_id]:
                channel_id, channel = self._acquire_channel(
                    decode_worker_id, peer, result.request_id, handoff_id, reservation.channel_id
                )
                try:
                    # the prompt's leading blocks the decode worker caches already stay here
                    shared = reservation.num_shared_blocks
                    ticket = TransferTicket(
                        transfer_id=next(self._transfer_ids),
                        request_id=result.request_id,
                        num_blocks=len(result.block_ids) - shared,
                        timeout_s=timeout_s,
                        checksum=self.transfer.checksum,
                    )
                    receive = ReceiveKV(
                        channel_id=channel_id,
                        handoff_id=handoff_id,
                        result=result,
                        ticket=ticket,
                        block_ids=reservation.block_ids[shared:],
                        gateway_id=target.gateway_id,
                        policy=self.transfer.failure_policy,
                    )
                    receipt = peer.send(receive)
                    owes_cancel = False  # the receive gives the blocks back if it fails
                    blocks = result.block_ids[shared:]
                    self._send(decode_worker_id, channel, blocks, ticket, waited_s)
                finally:
                    close_channels(self.channels.release(decode_worker_id))
            receipt.result(timeout=2 * timeout_s)
        finally:
            if owes_cancel:  # (a reserve answered late is refused by this cancel)
                peer.send(CancelReservation(result.request_id, handoff_id))

    def _send(
        self,
        decode_worker_id: str,
        channel: WorkerChannel,
        block_ids: list[int],
        ticket: TransferTicket,
        waited_s: float,
    ) -> None:
        """Send the prompt's KV in ``block_ids`` (after ``waited_s`` for the decode worker's
        blocks); a failed transfer's channel is dropped (rebuilt on next use)."""
        try:
            stats = channel.send_blocks(self.engine.kv_cache, block_ids, ticket)
            transport = channel.rendezvous.transport
            self._transfer_totals.add(stats, transport, len(block_ids), decode_worker_id, waited_s)
        except TransferError:
            logger.warning("KV transfer of %s failed; channel rebuilt on next use", ticket)
            self.channels.remove(decode_worker_id, channel)
            channel.close()

    def _reserve(
        self,
        decode_worker_id: str,
        peer: DecodePeer,
        result: PrefillResult,
        handoff_id: str,
        channel_id: str | None,
    ) -> tuple[Reservation | None, float]:
        """The decode worker's blocks for the prompt (None: none came free within the reserve
        timeout), and the seconds waited for them. While the first ask is refused, the wait
        goes in the load reports (``block_waits``)."""
        reserve = ReserveBlocks(
            result.request_id,
            handoff_id,
            result.num_prompt_tokens,
            channel_id,
            result.prompt_block_hashes,
        )
        started = time.monotonic()
        deadline = started + self.transfer.reserve_timeout_s
        try:
            while True:
                reservation = peer.send(reserve).result(timeout=self.transfer.timeout_s)
                now = time.monotonic()
                if reservation is not None or now >= deadline:
                    return reservation, now - started
                with self._block_waits_lock:
                    self._block_waits.setdefault(handoff_id, (decode_worker_id, started))
                time.sleep(_RESERVE_RETRY_S)
        finally:
            with self._block_waits_lock:
                self._block_waits.pop(handoff_id, None)

    def _acquire_channel(
        self,
        decode_worker_id: str,
        peer: DecodePeer,
        request_id: str,
        handoff_id: str,
        pinned: str | None,
    ) -> tuple[str, WorkerChannel]:
        """The open channel to a decode worker, marked in use, and pinned open on the decode
        side for this hand-off's transfer (the decode side closes idle channels over its cap).

        ``pinned``: the channel the reservation pinned. Another one (it was replaced since, or
        the decode side had closed it) is pinned now, or a new channel is opened, pinned as the
        decode worker joins it. The caller holds the decode worker's transfer lock, so only
        this thread opens a channel to it; the opening (seconds, up to the deadline for a dead
        peer) holds no lock that hand-offs to other decode workers need.
        """
        existing = self.channels.get(decode_worker_id)
        if existing is not None and not existing.broken:
            existing_id = existing.rendezvous.channel_id
            pin = PinChannel(request_id, handoff_id, existing_id)
            pinned_here = existing_id == pinned or peer.send(pin).result(self.transfer.timeout_s)
            if pinned_here and self.channels.use(decode_worker_id, existing):
                return existing_id, existing
        opened_id, opened = self._open_channel(decode_worker_id, peer, request_id, handoff_id)
        close_channels(self.channels.add(decode_worker_id, opened, in_use=True))
        return opened_id, opened

    def _open_channel(
        self, decode_worker_id: str, peer: DecodePeer, request_id: str, handoff_id: str
    ) -> tuple[str, WorkerChannel]:
        """Listen, let the decode worker join (pinning the channel for the hand-off),
        handshake (the layouts must match). With ``--kv-transport auto`` a pair whose local
        transport fails to set up tries the network one."""
        timeout_s = self.transfer.timeout_s
        transport = self._transports.choose(
            decode_worker_id, lambda: peer.send(GetLocality()).result(timeout=timeout_s)
        )
        join = (decode_worker_id, peer, request_id, handoff_id)
        try:
            return self._join_channel(*join, transport)
        except (TransferError, OSError) as error:  # a LayoutMismatchError is neither
            fallback = self._transports.fall_back(decode_worker_id, transport, error)
            if fallback is None:
                raise
            return self._join_channel(*join, fallback)

    def _join_channel(
        self,
        decode_worker_id: str,
        peer: DecodePeer,
        request_id: str,
        handoff_id: str,
        transport: str,
    ) -> tuple[str, WorkerChannel]:
        channel_id = f"{self.worker_id}->{decode_worker_id}/{next(self._transfer_ids)}"
        listener = self._listen(transport, channel_id)
        pairs = listener.pairs if isinstance(listener, RankedListener) else ()

        def stop_waiting_if_failed(joined: Future[bool]) -> None:
            if _failed(joined):
                listener.close()  # wakes the accept below

        try:
            joined = peer.send(JoinChannel(listener.rendezvous, request_id, handoff_id, pairs))
            # A decode worker that cannot join (its side of the transport failed, or it is
            # gone) ends the wait at once, and its error is the one reported: the accept alone
            # waited out the whole deadline and failed with a bare timeout.
            joined.add_done_callback(stop_waiting_if_failed)
            try:
                channel: WorkerChannel = listener.accept(self.transfer.timeout_s)
            except TransferError:
                if _failed(joined):
                    joined.result()  # raises the decode worker's error
                raise
        finally:
            listener.close()
        try:
            # False: the reservation is gone (aborted there); the send goes ahead all the same,
            # and the decode worker's receive drops it, so both ends stay in step
            joined.result(timeout=self.transfer.timeout_s)
        except BaseException:
            channel.close()
            raise
        logger.info("KV channel %s open over %s", channel_id, transport)
        return channel_id, channel

    def _listen(self, transport: str, channel_id: str) -> ChannelListener | RankedListener:
        """Listen for a channel to the decode worker: one between the two rank 0s when each
        worker is one rank, else one per rank pair of the head plan, each listened for on its
        prefill rank (a pair moves a head range, which cuda_ipc cannot: those use the network
        transport)."""
        if len(self._kv_heads) == 1 and len(self._decode_heads) == 1:
            return KVChannel.listen(
                transport, self.layout, self.transfer.host, channel_id, self.engine.device
            )
        if len(self._ranks) != len(self._kv_heads):
            raise ValueError(
                f"prefill worker {self.worker_id} has tensor_parallel_size {len(self._kv_heads)} "
                f"but {len(self._ranks)} rank KV ports: every rank needs one"
            )
        moves = plan_head_moves(self._kv_heads, self._decode_heads)
        if transport == "cuda_ipc":
            transport = network_transport(self.engine.device.type)
        return RankedListener(transport, channel_id, moves, self._ranks, self.transfer.timeout_s)


def _failed(future: Future[bool]) -> bool:
    """Whether ``future`` has ended without a result."""
    return future.done() and (future.cancelled() or future.exception() is not None)
