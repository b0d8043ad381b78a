"""Block pool: free list, ref counts, LRU eviction of cached blocks; prefix hashes."""

import pytest

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.prefix_hash import extend_block_hashes, hash_block


def test_allocate_until_empty_then_free_returns_blocks() -> None:
    pool = BlockPool(4, enable_prefix_caching=False)
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate()
    pool.free(blocks[0])
    assert pool.num_free_blocks == 1
    assert pool.allocate() == blocks[0]


def test_ref_counts_keep_shared_block_until_last_free() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    block = pool.allocate()
    pool.incref(block)
    assert pool.ref_count(block) == 2
    pool.free(block)
    assert pool.num_free_blocks == 1
    pool.free(block)
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(block)


def test_cached_block_survives_free_and_is_found_by_hash() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    block = pool.allocate()
    pool.register(block, b"h" * 16)
    pool.free(block)
    assert pool.num_free_blocks == 2  # evictable counts as free
    assert pool.cached_block(b"h" * 16) == block
    pool.incref(block)
    assert pool.ref_count(block) == 1
    assert pool.num_free_blocks == 1
    assert pool.cached_block(b"x" * 16) is None


def test_a_hash_is_cached_per_cache_group() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    full, sliding = pool.allocate(), pool.allocate()
    pool.register(full, b"h" * 16, group=0)
    pool.register(sliding, b"h" * 16, group=1)  # the same tokens, another group's layers
    assert (pool.cached_block(b"h" * 16, 0), pool.cached_block(b"h" * 16, 1)) == (full, sliding)
    assert pool.cached_block(b"h" * 16, 2) is None


def test_eviction_takes_free_blocks_first_then_least_recently_freed_cached() -> None:
    pool = BlockPool(3, enable_prefix_caching=True)
    a, b, c = (pool.allocate() for _ in range(3))
    pool.register(a, b"a" * 16)
    pool.register(b, b"b" * 16)
    pool.free(a)  # cached, older
    pool.free(b)  # cached, newer
    pool.free(c)  # not hashed: plain free
    assert pool.allocate() == c
    assert pool.allocate() == a  # LRU cached block is evicted first
    assert pool.cached_block(b"a" * 16) is None
    assert pool.cached_block(b"b" * 16) == b


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"same" * 4)
    pool.register(b, b"same" * 4)
    assert pool.cached_block(b"same" * 4) == a
    pool.free(b)
    assert pool.num_free_blocks == 1


def test_block_hash_depends_on_parent_tokens_and_salt() -> None:
    base = hash_block(None, [1, 2, 3, 4], None)
    assert base == hash_block(None, [1, 2, 3, 4], None)
    assert base != hash_block(None, [1, 2, 3, 5], None)
    assert base != hash_block(b"p" * 16, [1, 2, 3, 4], None)
    assert base != hash_block(None, [1, 2, 3, 4], "tenant-a")
    assert hash_block(None, [1], "tenant-a") != hash_block(None, [1], "tenant-b")


def test_extend_block_hashes_chains_full_blocks_only() -> None:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(10)), block_size=4, cache_salt=None)
    assert len(hashes) == 2
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7], None)
    extend_block_hashes(hashes, list(range(12)), block_size=4, cache_salt=None)
    assert len(hashes) == 3
    other: list[bytes] = []
    extend_block_hashes(other, [99] + list(range(1, 12)), block_size=4, cache_salt=None)
    assert other[2] != hashes[2]  # a different first block changes every later hash
