"""`RankKVPort`: one rank's ends of its pair channels, on its own shard of the KV cache.

Every rank of a worker has one (rank 0 in the worker's process, a follower in its rank actor's).
Its verbs answer the calls of ``kv_transfer.rank_calls``; rank 0 reaches its own port through
``LocalRankPeer``, which runs each call on a thread as a remote rank would. Thread-safe: calls
on different channels run side by side; a channel keeps its own one-transfer-at-a-time lock.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from kv_transfer.channel import ChannelListener, KVChannel
from kv_transfer.errors import TransferError
from kv_transfer.layout import KVCacheLayout, KVScales
from kv_transfer.messages import ChannelRendezvous, TransferStats
from kv_transfer.rank_calls import (
    AcceptPair,
    ClosePair,
    ConnectPair,
    DiscardPair,
    ListenPair,
    RankCall,
    RecvPair,
    SendPair,
)

T = TypeVar("T")
LOCAL_PEER_THREADS = 16  # rank 0's own calls that may wait at once (accepts, transfers)


class RankKVPort:
    def __init__(
        self,
        kv_cache: torch.Tensor,  # [num_layers, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]
        kv_heads: range,  # the model's KV heads the cache holds (the rank's shard.kv_heads)
        host: str,  # where this rank's listening sockets bind (never a wildcard)
        cache_groups: str | None = None,  # the model's KV cache groups (KVCacheLayout's field)
        kv_scales: KVScales | None = None,  # a quantized cache's scales (KVCacheLayout's field)
    ) -> None:
        self.kv_cache = kv_cache
        self.layout = KVCacheLayout.from_cache(kv_cache, kv_heads, cache_groups, kv_scales)
        self.host = host
        self.device = kv_cache.device
        self._listeners: dict[str, ChannelListener] = {}
        self._channels: dict[str, KVChannel] = {}
        self._lock = threading.Lock()

    def listen(self, call: ListenPair) -> ChannelRendezvous:
        layout = self.layout.moving(call.heads)
        listener = KVChannel.listen(call.transport, layout, self.host, call.channel_id, self.device)
        with self._lock:
            self._listeners[call.channel_id] = listener
        return listener.rendezvous

    def accept(self, call: AcceptPair) -> None:
        with self._lock:
            listener = self._listeners.get(call.channel_id)
        if listener is None:
            raise TransferError(f"no listener for channel {call.channel_id!r} (closed)")
        try:
            channel = listener.accept(call.timeout_s)
        finally:
            listener.close()
            with self._lock:
                self._listeners.pop(call.channel_id, None)
        self._add(call.channel_id, channel)

    def connect(self, call: ConnectPair) -> None:
        layout = self.layout.moving(call.heads)
        channel = KVChannel.connect(call.rendezvous, layout, self.device, call.timeout_s)
        self._add(call.rendezvous.channel_id, channel)

    def send(self, call: SendPair) -> TransferStats:
        return self._channel(call.channel_id).send_blocks(
            self.kv_cache, call.block_ids, call.ticket
        )

    def recv(self, call: RecvPair) -> TransferStats:
        return self._channel(call.channel_id).recv_blocks(
            self.kv_cache, call.block_ids, call.ticket
        )

    def discard(self, call: DiscardPair) -> TransferStats:
        return self._channel(call.channel_id).discard(self.kv_cache, call.ticket)

    def close(self, call: ClosePair) -> None:
        with self._lock:
            listener = self._listeners.pop(call.channel_id, None)
            channel = self._channels.pop(call.channel_id, None)
        if listener is not None:
            listener.close()
        if channel is not None:
            channel.close()

    @property
    def num_open(self) -> int:
        """Channels and listeners open on this rank."""
        with self._lock:
            return len(self._listeners) + len(self._channels)

    def close_all(self) -> None:
        with self._lock:
            listeners, self._listeners = list(self._listeners.values()), {}
            channels, self._channels = list(self._channels.values()), {}
        for listener in listeners:
            listener.close()
        for channel in channels:
            channel.close()

    def _add(self, channel_id: str, channel: KVChannel) -> None:
        with self._lock:
            previous = self._channels.pop(channel_id, None)
            self._channels[channel_id] = channel
        if previous is not None:
            previous.close()

    def _channel(self, channel_id: str) -> KVChannel:
        with self._lock:
            channel = self._channels.get(channel_id)
        if channel is None:
            raise TransferError(f"no open channel {channel_id!r} on this rank")
        return channel


class LocalRankPeer:
    """Rank 0's way to its own port: each call runs on a thread of its own, as a follower's
    call runs on its actor, so rank 0's end of a transfer runs beside its followers' ends."""

    def __init__(self, port: RankKVPort, name: str) -> None:
        self.port = port
        self._threads = ThreadPoolExecutor(LOCAL_PEER_THREADS, thread_name_prefix=name)

    def send(self, call: RankCall[T]) -> Future[T]:
        return self._threads.submit(call.run_on, self.port)

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.port.close_all()
