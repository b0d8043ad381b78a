"""What a worker tells the router about its prefix cache: KV events, in order, batched per step.

A worker's cached blocks are named by their chained prefix hashes (engine/kv_cache/
prefix_hash.py: a block's hash names its whole prefix and its tenant's salt), per KV cache group
and per tier (``device``: the worker's KV cache; ``host``: its host-memory tier). A block is
*stored* when its hash is registered in a tier and *removed* when that tier forgets it (evicted,
or moved to another tier). The router's index (router/kv_index.py) applies them in order and so
holds, block for block, what each worker holds.

The channel is pull-based and survives a router restart: the router asks with a ``KVCursor``
(the worker's log and the last batch it applied); the worker answers with the batches after it,
or, when the router is new, the worker is new, or the batches were dropped from the worker's
bounded log, with a snapshot of everything it holds and the batches after the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KVTier = Literal["device", "host"]
KV_TIERS: tuple[KVTier, ...] = ("device", "host")
KVEventKind = Literal["stored", "removed"]


@dataclass(frozen=True, slots=True)
class KVBlocksEvent:
    """Blocks of one KV cache group that a tier of the worker stored or removed, in order."""

    kind: KVEventKind  # stored: the tier now holds them; removed: it no longer does
    tier: KVTier  # device: the KV cache; host: the host-memory tier
    group: int  # the KV cache group (engine/kv_cache/cache_groups.py) whose blocks they are
    block_hashes: tuple[bytes, ...]  # the blocks' chained prefix hashes (16 bytes each)


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One step's (or one call's) events of a worker, in the order they happened."""

    number: int  # 1, 2, ...: the batch's place in its worker's log
    events: tuple[KVBlocksEvent, ...]


@dataclass(frozen=True, slots=True)
class KVCacheSnapshot:
    """Everything a worker's tiers hold, as of the end of one batch of its log."""

    number: int  # the last batch the snapshot includes (0: before any batch)
    blocks: tuple[KVBlocksEvent, ...]  # "stored" events, one per tier and group


@dataclass(frozen=True, slots=True)
class KVCursor:
    """How far the asker has followed a worker's log."""

    log_id: str  # the log it followed ("": none yet, so a snapshot is needed)
    number: int = 0  # the last batch it applied


@dataclass(frozen=True, slots=True)
class KVEventsReply:
    """A worker's answer to a ``KVCursor``: what changed since, or a fresh start."""

    log_id: str  # the worker's log (a new one per worker process)
    number: int  # the last batch the reply covers: ask from here next time
    snapshot: KVCacheSnapshot | None  # set when the cursor could not be continued: replace all
    batches: tuple[KVEventBatch, ...]  # in order, after the cursor's batch (or the snapshot's)

    @property
    def cursor(self) -> KVCursor:
        """The cursor to ask with next."""
        return KVCursor(self.log_id, self.number)
