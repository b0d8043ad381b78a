"""The router's index of the cluster's KV caches: which worker holds which blocks, in which tier.

Built from the workers' own KV events (engine/messages/kv_events.py), never from what the router
sent where: each load poll asks a worker with the cursor of its events applied so far, and the
report brings the batches after it (or a snapshot, for a new router, a new worker, or a cursor
the worker's bounded log no longer reaches). The workers' output batches carry their latest
event batches too (``follow``), so the index learns a step's blocks with the step's tokens,
not up to a report interval later; each batch applies once, whichever brings it first. Applied in order, they make the index equal, block
for block, to what each worker's tiers hold as of the batch applied last. A worker taken out of
rotation is forgotten at once; should it come back, its next report starts it from a snapshot.

Blocks are named by their chained prefix hashes, which include the tenant's cache salt: a
prompt's hashes (computed by the router with the same function and salt) can only match its own
tenant's blocks. Thread-safe: the poll applies reports while routing reads prefix hits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv_cache.prefix_hash import BlockHash
from engine.messages import KVBlocksEvent, KVCursor, KVEventBatch, KVEventsReply
from engine.messages.kv_events import KVTier

logger = logging.getLogger("router.kv_index")
_NO_CURSOR = KVCursor("")  # a worker's first ask: answered with a snapshot


@dataclass(frozen=True, slots=True)
class PrefixHits:
    """How many leading blocks of a prompt a worker holds."""

    num_device_blocks: int  # in its KV cache
    num_blocks: int  # in its KV cache or, continuing from there, its host tier (>= device's)

    @property
    def num_host_blocks(self) -> int:
        return self.num_blocks - self.num_device_blocks


@dataclass(slots=True)
class _WorkerBlocks:
    cursor: KVCursor = _NO_CURSOR
    held: dict[tuple[KVTier, int], set[BlockHash]] = field(default_factory=dict)

    def apply(self, event: KVBlocksEvent) -> None:
        held = self.held.setdefault((event.tier, event.group), set())
        if event.kind == "stored":
            held.update(event.block_hashes)
        else:
            held.difference_update(event.block_hashes)

    def apply_batches(self, batches: Sequence[KVEventBatch], number: int) -> int:
        """Apply, in order, the batches that continue from batch ``number`` (those at or
        before it applied already), up to the first gap; returns the last one applied."""
        for batch in batches:
            if batch.number <= number:
                continue
            if batch.number != number + 1:
                break
            for event in batch.events:
                self.apply(event)
            number = batch.number
        return number


class KVIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, _WorkerBlocks] = {}

    def cursor(self, worker_id: str) -> KVCursor:
        """What to ask ``worker_id`` for its KV events with."""
        with self._lock:
            blocks = self._workers.get(worker_id)
            return _NO_CURSOR if blocks is None else blocks.cursor

    def apply(self, worker_id: str, reply: KVEventsReply) -> None:
        """Take a worker's answer to its cursor: a snapshot replaces all it held; batches apply
        in order, each once. A reply that does not continue from the cursor (a batch missing)
        resets the worker, so that its next ask brings a snapshot."""
        with self._lock:
            blocks = self._workers.setdefault(worker_id, _WorkerBlocks())
            if reply.snapshot is not None:
                blocks.held = {}
                for event in reply.snapshot.blocks:
                    blocks.apply(event)
                number = reply.snapshot.number
            elif reply.log_id == blocks.cursor.log_id:
                number = blocks.cursor.number
            else:
                self._reset_locked(worker_id, f"a reply of log {reply.log_id} without a snapshot")
                return
            # (those at or before the cursor came in the worker's output stream already)
            number = blocks.apply_batches(reply.batches, number)
            if number < reply.number:
                self._reset_locked(worker_id, f"batches {number + 1} .. {reply.number} missing")
                return
            blocks.cursor = KVCursor(reply.log_id, number)

    def follow(self, worker_id: str, reply: KVEventsReply) -> None:
        """Take the event batches a worker's output stream carried: those that continue from
        the worker's cursor, in order; the rest are left to its next load report (a batch
        after a gap, a worker not known yet or of another log: nothing is reset)."""
        with self._lock:
            blocks = self._workers.get(worker_id)
            if blocks is None or blocks.cursor.log_id != reply.log_id:
                return
            number = blocks.apply_batches(reply.batches, blocks.cursor.number)
            blocks.cursor = KVCursor(reply.log_id, number)

    def _reset_locked(self, worker_id: str, why: str) -> None:
        logger.warning(
            "KV index of %s reset (%s); its next report brings a snapshot", worker_id, why
        )
        self._workers[worker_id] = _WorkerBlocks()

    def forget(self, worker_id: str) -> None:
        """Drop a worker out of rotation: its blocks no longer count, and a report of it
        starts again from a snapshot."""
        with self._lock:
            self._workers.pop(worker_id, None)

    def holdings(self, worker_id: str) -> dict[tuple[KVTier, int], frozenset[BlockHash]]:
        """The hashes the index says ``worker_id`` holds, by (tier, cache group), non-empty."""
        with self._lock:
            blocks = self._workers.get(worker_id)
            if blocks is None:
                return {}
            return {key: frozenset(held) for key, held in blocks.held.items() if held}

    def num_blocks(self) -> int:
        """Blocks indexed over every worker, tier and group."""
        with self._lock:
            return sum(len(h) for b in self._workers.values() for h in b.held.values())

    def prefix_hits(
        self, worker_ids: Iterable[str], block_hashes: Sequence[BlockHash], group: int = 0
    ) -> dict[str, PrefixHits]:
        """How many leading blocks named by ``block_hashes`` (a prompt's, in order) each worker
        holds in cache group ``group``: on device, and on device or host."""
        hits = {}
        with self._lock:
            for worker_id in worker_ids:
                blocks = self._workers.get(worker_id)
                if blocks is None:
                    hits[worker_id] = PrefixHits(0, 0)
                    continue
                device = blocks.held.get(("device", group), set())
                host = blocks.held.get(("host", group), set())
                num_device = _leading(block_hashes, 0, device, host, both=False)
                num_any = _leading(block_hashes, num_device, device, host, both=True)
                hits[worker_id] = PrefixHits(num_device, num_any)
        return hits


def _leading(
    block_hashes: Sequence[BlockHash],
    start: int,
    device: set[BlockHash],
    host: set[BlockHash],
    *,
    both: bool,
) -> int:
    """The length of the run of ``block_hashes`` held, from ``start`` on (``start`` blocks are
    known held): on device, or with ``both`` on device or host."""
    count = start
    for block_hash in block_hashes[start:]:
        if block_hash in device or (both and block_hash in host):
            count += 1
        else:
            break
    return count
