"""Physical KV blocks: a free list, reference counts, and the prefix cache.

A block is in exactly one of three states:
  free       -- on the free list, holds nothing useful;
  in use     -- ref_count > 0, in some sequences' block tables;
  cached     -- ref_count == 0 but its content is registered under a prefix hash; it sits in an
                LRU list and is reused on a hash hit, or evicted (oldest first) when the free
                list is empty.

A hash is registered per KV cache group (engine/kv_cache/cache_groups.py): the same tokens'
blocks of two groups hold different layers' KV. Each hash registered and each one forgotten is
told to the pool's ``KVEventRecorder``, where it has one (tier "device": a worker's pool, whose
events the router's index follows). With a host tier (engine/kv_cache/host_tier.py), a cached
block the pool evicts is told to it, which keeps the block's content (a swap-out the step being
built performs before anything of it writes the block).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.kv_events import KVEventRecorder
from engine.kv_cache.prefix_hash import BlockHash

_CacheKey = tuple[int, BlockHash]  # (cache group, prefix hash)


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool,
        events: KVEventRecorder | None = None,  # told of hashes registered and forgotten
        host: HostTier | None = None,  # told of each cached block evicted (None: no host tier)
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: dict[int, _CacheKey] = {}
        self._block_of_hash: dict[_CacheKey, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.num_cache_queries = 0  # full blocks looked up
        self.num_cache_hits = 0  # full blocks found
        self.events = events  # None: no one follows this pool's events
        self.host = host

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self) -> int:
        """Take one block (ref_count 1), evicting the least recently used cached block if needed
        (into the host tier, where there is one)."""
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            group, block_hash = self._forget_hash(block_id)
            if self.host is not None:
                self.host.evicted(block_id, block_hash, group)
        else:
            raise RuntimeError("out of KV blocks: check num_free_blocks before allocating")
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            self._evictable.pop(block_id, None)
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes cached (if hashed) or free."""
        count = self._ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"double free of KV block {block_id}")
        self._ref_counts[block_id] = count - 1
        if count > 1:
            return
        if block_id in self._hash_of_block:
            self._evictable[block_id] = None
        else:
            self._free.append(block_id)

    def cached_hashes(self) -> dict[int, frozenset[BlockHash]]:
        """The prefix hashes this pool caches, by cache group (what its KV events told)."""
        held: dict[int, set[BlockHash]] = {}
        for group, block_hash in self._block_of_hash:
            held.setdefault(group, set()).add(block_hash)
        return {group: frozenset(hashes) for group, hashes in held.items()}

    def cached_block(self, block_hash: BlockHash, group: int = 0) -> int | None:
        """The block caching this prefix hash of cache group ``group``, or None."""
        return self._block_of_hash.get((group, block_hash))

    def count_lookups(self, num_queried: int, num_hit: int) -> None:
        """A prefix lookup asked for ``num_queried`` full blocks and found ``num_hit``."""
        self.num_cache_queries += num_queried
        self.num_cache_hits += num_hit

    def register(self, block_id: int, block_hash: BlockHash, group: int = 0) -> None:
        """Record that ``block_id`` now holds group ``group``'s full block named by
        ``block_hash``."""
        key = (group, block_hash)
        if not self.enable_prefix_caching or block_id in self._hash_of_block:
            return
        if key in self._block_of_hash:
            return  # an identical block is already cached; keep the first one
        self._hash_of_block[block_id] = key
        self._block_of_hash[key] = block_id
        if self.events is not None:
            self.events.stored("device", group, block_hash)

    def _forget_hash(self, block_id: int) -> _CacheKey:
        key = self._hash_of_block.pop(block_id)
        del self._block_of_hash[key]
        if self.events is not None:
            self.events.removed("device", *key)
        return key
