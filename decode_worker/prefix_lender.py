"""A decode worker lends the prefixes its cache holds: a prefill worker copies them, and computes
only the rest of the prompt (a conversation's next turn, whose earlier turns and replies this
worker decoded).

A lend, by its ``lend_id``:
  held      -- ``LendPrefix``: the leading run of the named blocks this cache holds, each taken
               with a reference so no eviction reuses it while the prefill worker copies it
  sending   -- ``SendLentBlocks``: sent on the prefill worker's lend channel (this worker
               listens and sends, the other way from a hand-off's channels)
It ends sent, returned (``ReturnLent``: the prefill worker failed before the transfer) or
expired (neither within ``ttl_s``: the prefill worker died or gave up without a word). The
blocks are given back at its end, whichever it is.

Lend channels, one per prefill worker (the one it opened last; the one before is closed): the
prefill worker asks this worker to listen (``OpenLendChannel``), joins, and the accept finishes
on a thread of its own, which a send waits for.

Only a worker of one rank lends (its cache holds every KV head); one of several answers 0.
Thread-safe: the blocks are taken and given back through the engine loop's ``call``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from engine.engine_loop import EngineLoop
from engine.messages import LendPrefix, OpenLendChannel, ReturnLent, SendLentBlocks
from kv_transfer import ChannelRendezvous, KVCacheLayout, KVChannel, TransferError
from kv_transfer.totals import TransferTotals

logger = logging.getLogger(__name__)


class PrefixLender:
    def __init__(
        self,
        worker_id: str,
        loop: EngineLoop,
        kv_cache: torch.Tensor,  # the engine's, which lent blocks are sent from
        layout: KVCacheLayout,
        host: str,  # the address lend channels listen on
        timeout_s: float,  # deadline of a channel's accept and of each transfer
        ttl_s: float,  # a lend not sent within this is given back
        *,
        lends: bool = True,  # False: answer every LendPrefix with 0 (several ranks)
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id = worker_id
        self._loop = loop
        self._kv_cache = kv_cache
        self._layout = layout
        self._host = host
        self._timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._lends = lends
        self._clock = clock
        self._lock = threading.Lock()  # guards the two maps below
        self._held: dict[str, float] = {}  # lend id -> when it was lent
        # prefill worker id -> (channel id, the channel once accepted)
        self._channels: dict[str, tuple[str, Future[KVChannel]]] = {}
        self.totals = TransferTotals()  # lent blocks sent

    def lend(self, call: LendPrefix) -> int:
        """held: how many of the leading named blocks this cache holds (0: none, nothing held)."""
        if not self._lends or not call.block_hashes:
            return 0
        lend_id = call.lend_id
        blocks = self._loop.call(lambda engine: engine.lend_blocks(lend_id, call.block_hashes))
        if blocks:
            with self._lock:
                self._held[lend_id] = self._clock()
        return len(blocks)

    def give_back(self, call: ReturnLent) -> None:
        """returned: the blocks are no longer held."""
        self._end(call.lend_id)

    def open_channel(self, call: OpenLendChannel) -> ChannelRendezvous:
        """Listen for the prefill worker's lend channel; it replaces the one before."""
        listener = KVChannel.listen(
            call.transport, self._layout, self._host, call.channel_id, self._kv_cache.device
        )
        accepted: Future[KVChannel] = Future()

        def accept() -> None:
            try:
                accepted.set_result(listener.accept(self._timeout_s))
            except BaseException as error:  # (the send waiting for it reports it)
                accepted.set_exception(error)
            finally:
                listener.close()

        with self._lock:
            before = self._channels.get(call.prefill_worker_id)
            self._channels[call.prefill_worker_id] = (call.channel_id, accepted)
        if before is not None:
            _close_when_accepted(before[1])
        threading.Thread(target=accept, name=f"lend-accept-{call.channel_id}", daemon=True).start()
        return listener.rendezvous

    def send(self, call: SendLentBlocks) -> bool:
        """sending -> sent: the first ``ticket.num_blocks`` blocks of the lend, on its channel;
        False (the blocks given back all the same) when the lend or the channel is gone, or
        the transfer failed (the channel is then closed: the prefill worker opens another). A
        lend being sent no longer expires: its blocks are given back once the send ends."""
        lend_id = call.lend_id
        with self._lock:
            lent = self._held.pop(lend_id, None) is not None
        try:
            channel = self._channel(call.channel_id)
            if channel is None:
                return False
            blocks = self._loop.call(lambda engine: engine.lent_blocks(lend_id))
            if not lent or len(blocks) < call.ticket.num_blocks:  # (expired, or never lent)
                channel.close()  # ends the receive that waits for these bytes
                return False
            try:
                sent = blocks[: call.ticket.num_blocks]
                stats = channel.send_blocks(self._kv_cache, sent, call.ticket)
                self.totals.add(stats, channel.rendezvous.transport, len(sent))
            except TransferError:
                logger.warning("lend %s failed on channel %s", lend_id, call.channel_id)
                channel.close()
                return False
            return True
        finally:
            if lent:
                self._loop.call(lambda engine: engine.return_lent(lend_id))

    def expire(self) -> list[str]:
        """expired: the lends older than ``ttl_s``, their blocks given back."""
        now = self._clock()
        with self._lock:
            old = [lend for lend, at in self._held.items() if now - at > self.ttl_s]
        for lend_id in old:
            self._end(lend_id)
        return old

    def close(self) -> None:
        """Close every lend channel and give back every lend."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            lends = list(self._held)
        for _, accepted in channels:
            _close_when_accepted(accepted)
        for lend_id in lends:
            self._end(lend_id)

    def _channel(self, channel_id: str) -> KVChannel | None:
        with self._lock:
            accepted = next((f for cid, f in self._channels.values() if cid == channel_id), None)
        if accepted is None:
            return None
        try:
            channel = accepted.result(timeout=self._timeout_s)
        except Exception:  # (not accepted: the prefill worker's connect failed, or timed out)
            return None
        return None if channel.broken else channel

    def _end(self, lend_id: str) -> None:
        with self._lock:
            held = self._held.pop(lend_id, None) is not None
        if held:
            self._loop.call(lambda engine: engine.return_lent(lend_id))


def _close_when_accepted(accepted: Future[KVChannel]) -> None:
    """Close a lend channel now, or once its accept ends."""

    def close(done: Future[KVChannel]) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().close()

    accepted.add_done_callback(close)
