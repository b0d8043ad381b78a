"""A prefill worker copies a prompt's prefix from the decode worker whose cache holds it, before
prefilling the prompt: it then computes only the rest (a conversation's next turn, whose earlier
turns and replies that decode worker decoded). The router asks for it (``submit``'s
``fetch_blocks``) when its cost model says moving the prefix beats computing it here and beats
the decode worker prefilling the rest itself (router/kv_aware.py).

A fetch, for one request, before it is queued here:
  the prompt's first ``fetch_blocks`` block hashes, as this engine names them; the leading ones
  this cache holds are held for the request, and fresh blocks taken for the rest
  (``LLMEngine.hold_prefix``) -> the decode worker holds the leading run of those it caches
  (``LendPrefix``) -> they come over this worker's lend channel from it (decode worker sends,
  this worker receives; opened with ``OpenLendChannel`` when none is) -> registered in this
  cache under their hashes (``LLMEngine.received_prefix``) and held until the request ends, so
  its prefix lookup finds them. Its hand-off back then moves only the blocks the decode worker
  does not hold (``Reservation.num_shared_blocks``).

Best effort: whatever fails (no blocks free, the decode worker holds none any more, a transfer
error or deadline) leaves the request to compute what did not arrive, never fails it. Only
between workers of one rank each (the channel moves every KV head); otherwise no fetch is made.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Future

import torch

from engine.engine_loop import EngineLoop
from engine.kv_cache.prefix_hash import BlockHash
from engine.messages import (
    DecodePeer,
    GenerateRequest,
    GetLocality,
    LendPrefix,
    OpenLendChannel,
    ReturnLent,
    SendLentBlocks,
)
from kv_transfer import KVCacheLayout, KVChannel, TransferError, TransferTicket
from kv_transfer.policy import TransferConfig
from kv_transfer.totals import TransferTotals
from prefill_worker.pair_transports import PairTransports

logger = logging.getLogger(__name__)


class PrefixFetcher:
    def __init__(
        self,
        worker_id: str,
        loop: EngineLoop,
        kv_cache: torch.Tensor,  # the engine's, which fetched blocks land in
        layout: KVCacheLayout,
        transfer: TransferConfig,
        transports: PairTransports,  # the prefill worker's (the same pick as its hand-offs)
        peers: Callable[[], Mapping[str, DecodePeer]],  # the decode workers known now
        ids: itertools.count[int],  # the worker's transfer ids (one sequence per worker)
        *,
        fetches: bool = True,  # False: never fetch (a worker of several ranks, or its peers)
    ) -> None:
        self.worker_id = worker_id
        self._loop = loop
        self._kv_cache = kv_cache
        self._layout = layout
        self._transfer = transfer
        self._transports = transports
        self._peers = peers
        self._ids = ids
        self.fetches = fetches
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._channels: dict[str, KVChannel] = {}  # by decode worker (each one's lend channel)
        self.totals = TransferTotals()  # prefixes received
        self._num_fetched_blocks = 0  # blocks received, over all fetches
        self._count_lock = threading.Lock()  # (fetches run on several threads)

    def fetch(self, request: GenerateRequest, decode_worker_id: str, num_blocks: int) -> int:
        """Copy what this cache lacks of the prompt's first ``num_blocks`` blocks from
        ``decode_worker_id``'s cache, held here for the request until it ends (which the
        caller makes sure of: it is queued next, or ``LLMEngine.drop_prefix_hold`` is called).
        Returns how many blocks arrived."""
        peer = self._peers().get(decode_worker_id)
        if not self.fetches or num_blocks <= 0 or peer is None:
            return 0
        prompt, salt, request_id = request.prompt_token_ids, request.cache_salt, request.request_id
        hashes = self._loop.call(lambda engine: engine.servable_prompt_hashes(prompt, salt))
        hashes = hashes[:num_blocks]
        plan = (
            self._loop.call(lambda engine: engine.hold_prefix(request_id, hashes))
            if hashes
            else None
        )
        if plan is None:
            return 0
        num_held, fresh = plan
        received = 0
        try:
            if fresh:
                received = self._copy(request_id, decode_worker_id, peer, hashes[num_held:], fresh)
        except Exception as error:  # (best effort: the prompt computes what did not come)
            logger.warning(
                "fetching %s's prefix from %s failed: %s", request_id, decode_worker_id, error
            )
        finally:
            self._loop.call(lambda engine: engine.received_prefix(request_id, hashes, received))
        with self._count_lock:
            self._num_fetched_blocks += received
        return received

    @property
    def num_fetched_blocks(self) -> int:
        """Blocks received, over all fetches."""
        with self._count_lock:
            return self._num_fetched_blocks

    def forget(self, decode_worker_id: str) -> None:
        """Close the lend channel from a decode worker that is gone."""
        with self._locks[decode_worker_id]:
            channel = self._channels.pop(decode_worker_id, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for decode_worker_id in list(self._channels):
            self.forget(decode_worker_id)

    def _copy(
        self,
        request_id: str,
        decode_worker_id: str,
        peer: DecodePeer,
        hashes: list[BlockHash],
        fresh: list[int],
    ) -> int:
        """Have the decode worker lend the leading run of ``hashes`` it caches and send it into
        ``fresh``; how many blocks arrived."""
        timeout_s = self._transfer.timeout_s
        lend_id = f"{self.worker_id}/lend/{next(self._ids)}"
        num_lent = peer.send(LendPrefix(lend_id, tuple(hashes))).result(timeout=timeout_s)
        if num_lent <= 0:
            return 0
        owes_return = True  # until the decode worker is told to send (it gives them back then)
        try:
            # one transfer at a time per lend channel, so both ends take the tickets in order
            with self._locks[decode_worker_id]:
                channel = self._channel(decode_worker_id, peer)
                ticket = TransferTicket(
                    transfer_id=next(self._ids),
                    request_id=request_id,
                    num_blocks=min(num_lent, len(fresh)),
                    timeout_s=timeout_s,
                    checksum=self._transfer.checksum,
                )
                sent = peer.send(SendLentBlocks(lend_id, channel.rendezvous.channel_id, ticket))
                owes_return = False

                def stop_waiting_unless_sent(answer: Future[bool]) -> None:
                    if answer.cancelled() or answer.exception() is not None or not answer.result():
                        channel.close()  # wakes the receive below

                sent.add_done_callback(stop_waiting_unless_sent)
                try:
                    stats = channel.recv_blocks(self._kv_cache, fresh[: ticket.num_blocks], ticket)
                except TransferError:
                    self._drop(decode_worker_id, channel)
                    raise
                if not sent.result(timeout=timeout_s):
                    self._drop(decode_worker_id, channel)
                    return 0
            self.totals.add(stats, channel.rendezvous.transport, ticket.num_blocks)
            return ticket.num_blocks
        finally:
            if owes_return:
                peer.send(ReturnLent(lend_id))

    def _channel(self, decode_worker_id: str, peer: DecodePeer) -> KVChannel:
        """The open lend channel from the decode worker, or a new one (the caller holds its lock)."""
        channel = self._channels.get(decode_worker_id)
        if channel is not None and not channel.broken:
            return channel
        timeout_s = self._transfer.timeout_s
        transport = self._transports.choose(
            decode_worker_id, lambda: peer.send(GetLocality()).result(timeout=timeout_s)
        )
        channel_id = f"{decode_worker_id}->{self.worker_id}/lend/{next(self._ids)}"
        call = OpenLendChannel(self.worker_id, channel_id, transport)
        rendezvous = peer.send(call).result(timeout=timeout_s)
        channel = KVChannel.connect(rendezvous, self._layout, self._kv_cache.device, timeout_s)
        self._channels[decode_worker_id] = channel
        logger.info("lend channel %s open over %s", channel_id, transport)
        return channel

    def _drop(self, decode_worker_id: str, channel: KVChannel) -> None:
        if self._channels.get(decode_worker_id) is channel:
            del self._channels[decode_worker_id]
        channel.close()
