"""Moving a request's KV blocks from a prefill worker to a decode worker.

Lifecycle: the prefill side `KVChannel.listen` → hands `listener.rendezvous` to the decode side
(through Ray) → decode `KVChannel.connect` ∥ prefill `listener.accept` (handshake checks the
layouts) → per request `send_blocks` ∥ `recv_blocks` with the same `TransferTicket` → `close`.
Between tensor-parallel workers each rank pair has its own channel, whose layouts name the KV
heads each rank holds and the ones the pair moves (`KVCacheLayout.from_cache(cache, kv_heads)
.moving(move.heads)`, the moves from `kv_transfer.head_plan.plan_head_moves`).
Transports: gloo (CPU), nccl (GPU), shm (same host, CPU), cuda_ipc (same host, GPU), fake
(in-process). Imports torch and numpy only, and only when a torch-backed name is used: the
messages, errors and `kv_transfer.policy` import without torch (the router needs them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_transfer.channel import ChannelListener, KVChannel, make_fake_channel_pair
    from kv_transfer.errors import LayoutMismatchError, TransferError, TransferTimeoutError
    from kv_transfer.layout import KVCacheLayout
    from kv_transfer.messages import (
        SUPPORTED_TRANSPORTS,
        ChannelRendezvous,
        TransferStats,
        TransferTicket,
    )

_HOMES = {
    "ChannelListener": "kv_transfer.channel",
    "KVChannel": "kv_transfer.channel",
    "make_fake_channel_pair": "kv_transfer.channel",
    "LayoutMismatchError": "kv_transfer.errors",
    "TransferError": "kv_transfer.errors",
    "TransferTimeoutError": "kv_transfer.errors",
    "KVCacheLayout": "kv_transfer.layout",
    "SUPPORTED_TRANSPORTS": "kv_transfer.messages",
    "ChannelRendezvous": "kv_transfer.messages",
    "TransferStats": "kv_transfer.messages",
    "TransferTicket": "kv_transfer.messages",
}

__all__ = [
    "SUPPORTED_TRANSPORTS",
    "ChannelListener",
    "ChannelRendezvous",
    "KVCacheLayout",
    "KVChannel",
    "LayoutMismatchError",
    "TransferError",
    "TransferStats",
    "TransferTicket",
    "TransferTimeoutError",
    "make_fake_channel_pair",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562), so torch loads only if needed."""
    if name not in _HOMES:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
