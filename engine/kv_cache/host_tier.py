"""The host-memory tier of the KV cache: which prefix blocks its slots hold, and the copies a step
owes between it and the device.

A slot of the tier holds one KV block (every layer and plane of this rank's cache) in host
memory (engine/kv_cache/host_copies.py holds the bytes; this module is pure Python). The tier
keeps the blocks the device cache evicts, least recently used first out:

  device evicts a cached block (BlockPool.allocate) -> ``evicted``: its content is copied to a
      slot (a swap-out), unless the tier holds that block already
  a prefix lookup finds a block only here (BlockManager.attach_cached_prefix) -> ``pin`` its
      slot, then ``swap_in`` into a fresh device block registered under its hash
  the scheduler builds a step -> ``take_swaps``: the step's swap-outs and swap-ins, which the
      runner performs in that order before its copy-on-write copies and its forward

Rules that keep a step's copies right whatever order its allocations came in:
- a slot a swap-in of this step reads is pinned until the step's swaps are taken: no swap-out of
  the step may write it;
- a device block whose swap-in is pending and that the device evicts again in the same step is
  not copied out (its block is in the tier already): its swap-in is dropped, the block goes to
  its new owner;
- a slot given to another block in the same step drops the swap-out that wrote it.
A block brought back stays in the tier (its slot is refreshed), so its next eviction costs no
copy. Each hash the tier stores and forgets is told to the ``KVEventRecorder`` with tier "host".
"""

from __future__ import annotations

from collections import OrderedDict, deque

from engine.kv_cache.kv_events import KVEventRecorder
from engine.kv_cache.prefix_hash import BlockHash

_CacheKey = tuple[int, BlockHash]  # (cache group, prefix hash)


class HostTier:
    def __init__(self, num_slots: int, events: KVEventRecorder | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self.events = events  # None: no one follows this tier's events
        self._free: deque[int] = deque(range(num_slots))
        self._slot_of: OrderedDict[_CacheKey, int] = OrderedDict()  # least recently used first
        self._key_of: dict[int, _CacheKey] = {}
        # the step being built: host slot -> device block copied into it (swap-outs), device
        # block -> host slot copied into it (swap-ins), and the slots those swap-ins read
        self._swap_outs: dict[int, int] = {}
        self._swap_ins: dict[int, int] = {}
        self._pinned: set[int] = set()
        self.num_hit_blocks = 0  # prefix positions served from this tier

    @property
    def num_cached_blocks(self) -> int:
        return len(self._slot_of)

    def slot_of(self, block_hash: BlockHash, group: int = 0) -> int | None:
        """The slot holding group ``group``'s block named by ``block_hash``, or None."""
        return self._slot_of.get((group, block_hash))

    def cached_hashes(self) -> dict[int, frozenset[BlockHash]]:
        """The prefix hashes this tier holds, by cache group (what its KV events told)."""
        held: dict[int, set[BlockHash]] = {}
        for group, block_hash in self._slot_of:
            held.setdefault(group, set()).add(block_hash)
        return {group: frozenset(hashes) for group, hashes in held.items()}

    def evicted(self, block_id: int, block_hash: BlockHash, group: int = 0) -> None:
        """The device evicted ``block_id``, which held group ``group``'s block ``block_hash``:
        keep its content here (a swap-out). A full tier makes room by forgetting its least
        recently used unpinned block; with every slot pinned the block is not kept."""
        key = (group, block_hash)
        slot = self._swap_ins.pop(block_id, None)
        if slot is not None:  # its content had yet to come from here: it is here already
            assert self._key_of.get(slot) == key
        if key in self._slot_of:
            self._slot_of.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self._swap_outs[slot] = block_id
        if self.events is not None:
            self.events.stored("host", group, block_hash)

    def pin(self, block_hash: BlockHash, group: int = 0) -> int:
        """The slot of a block this step brings back, kept from reuse until the step's swaps
        are taken (and made the most recently used)."""
        key = (group, block_hash)
        slot = self._slot_of[key]
        self._slot_of.move_to_end(key)
        self._pinned.add(slot)
        return slot

    def swap_in(self, slot: int, block_id: int) -> None:
        """Copy the block in ``slot`` (pinned) into device block ``block_id`` before the step's
        forward."""
        assert slot in self._pinned, "pin a slot before a swap-in reads it"
        self._swap_ins[block_id] = slot

    def count_hits(self, num_blocks: int) -> None:
        self.num_hit_blocks += num_blocks

    def take_swaps(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """The copies the step being built owes, in the order they run: swap-outs (device
        block, host slot), then swap-ins (host slot, device block); their slots are unpinned."""
        swap_outs = tuple((block_id, slot) for slot, block_id in self._swap_outs.items())
        swap_ins = tuple((slot, block_id) for block_id, slot in self._swap_ins.items())
        self._swap_outs.clear()
        self._swap_ins.clear()
        self._pinned.clear()
        return swap_outs, swap_ins

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used unpinned one (its block forgotten)."""
        if self._free:
            return self._free.popleft()
        for key, slot in self._slot_of.items():
            if slot not in self._pinned:
                self._forget(key)
                return slot
        return None

    def _forget(self, key: _CacheKey) -> None:
        slot = self._slot_of.pop(key)
        del self._key_of[slot]
        self._swap_outs.pop(slot, None)  # a copy into it this step is for no one now
        if self.events is not None:
            self.events.removed("host", *key)
