"""A worker's KV events: recorded as its block pool changes, kept in a bounded log for the router.

``KVEventRecorder`` notes each block a tier stores or removes (the block pool and the host tier
call it as they change) and hands them over, merged into runs, once per step. ``KVEventLog``
numbers those batches, keeps the latest ``max_batches`` of them and a mirror of what the tiers
hold, and answers a router's ``KVCursor`` with the batches after it or with a snapshot (see
engine/messages/kv_events.py); the worker's output stream also carries, with each batch of
tokens, the event batches since its last one (``after``). The recorder is the engine's (called under its loop's lock); the
log has its own lock, so the router's call never waits for a step.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque

from engine.kv_cache.prefix_hash import BlockHash
from engine.messages.kv_events import (
    KVBlocksEvent,
    KVCacheSnapshot,
    KVCursor,
    KVEventBatch,
    KVEventKind,
    KVEventsReply,
    KVTier,
)

_Key = tuple[KVTier, int]  # (tier, cache group)


class KVEventRecorder:
    """Blocks stored and removed since the last ``take``, in order. Not thread-safe: its owner
    (the engine) calls it under one lock."""

    def __init__(self) -> None:
        self._events: list[tuple[KVEventKind, KVTier, int, BlockHash]] = []

    def stored(self, tier: KVTier, group: int, block_hash: BlockHash) -> None:
        self._events.append(("stored", tier, group, block_hash))

    def removed(self, tier: KVTier, group: int, block_hash: BlockHash) -> None:
        self._events.append(("removed", tier, group, block_hash))

    def take(self) -> tuple[KVBlocksEvent, ...]:
        """The events since the last call, consecutive ones of one kind, tier and group merged
        into one event."""
        events: list[KVBlocksEvent] = []
        run: list[BlockHash] = []
        head: tuple[KVEventKind, KVTier, int] | None = None
        for kind, tier, group, block_hash in self._events:
            if (kind, tier, group) != head:
                if head is not None:
                    events.append(KVBlocksEvent(*head, tuple(run)))
                head, run = (kind, tier, group), []
            run.append(block_hash)
        if head is not None:
            events.append(KVBlocksEvent(*head, tuple(run)))
        self._events.clear()
        return tuple(events)


class KVEventLog:
    """A worker's numbered event batches (the latest ``max_batches``) and what its tiers hold."""

    def __init__(self, max_batches: int = 4096) -> None:
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        self.log_id = uuid.uuid4().hex  # a new log per worker process
        self._lock = threading.Lock()
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        self._number = 0  # the latest batch's number
        self._held: dict[_Key, set[BlockHash]] = {}  # what the tiers hold after that batch

    def append(self, events: tuple[KVBlocksEvent, ...]) -> None:
        """Add one step's events as the next batch (nothing for a step with none)."""
        if not events:
            return
        with self._lock:
            self._number += 1
            self._batches.append(KVEventBatch(self._number, events))
            for event in events:
                held = self._held.setdefault((event.tier, event.group), set())
                if event.kind == "stored":
                    held.update(event.block_hashes)
                else:
                    held.difference_update(event.block_hashes)

    def since(self, cursor: KVCursor) -> KVEventsReply:
        """The batches after ``cursor``; a snapshot instead when the cursor is of another log,
        or ahead of this one, or behind the oldest batch kept."""
        with self._lock:
            oldest = self._batches[0].number if self._batches else self._number + 1
            if cursor.log_id == self.log_id and oldest - 1 <= cursor.number <= self._number:
                batches = self._batches_after_locked(cursor.number)
                return KVEventsReply(self.log_id, self._number, None, batches)
            return KVEventsReply(self.log_id, self._number, self._snapshot_locked(), ())

    def after(self, number: int) -> KVEventsReply:
        """The batches kept after batch ``number`` (never a snapshot: those kept may start
        later than ``number + 1``, which the asker then cannot apply)."""
        with self._lock:
            return KVEventsReply(
                self.log_id, self._number, None, self._batches_after_locked(number)
            )

    def _batches_after_locked(self, number: int) -> tuple[KVEventBatch, ...]:
        """The kept batches numbered above ``number``, read from the newest end (the output
        stream asks every step for the one or two just added)."""
        newest = itertools.islice(reversed(self._batches), max(0, self._number - number))
        return tuple(reversed(list(newest)))

    @property
    def number(self) -> int:
        """The latest batch's number."""
        with self._lock:
            return self._number

    def holdings(self) -> dict[tuple[KVTier, int], frozenset[BlockHash]]:
        """What the log says each tier and group holds now (non-empty ones)."""
        with self._lock:
            return {key: frozenset(held) for key, held in self._held.items() if held}

    def _snapshot_locked(self) -> KVCacheSnapshot:
        blocks = tuple(
            KVBlocksEvent("stored", tier, group, tuple(sorted(held)))
            for (tier, group), held in sorted(self._held.items())
            if held
        )
        return KVCacheSnapshot(self._number, blocks)
