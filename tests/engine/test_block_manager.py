"""Block manager: slots per sequence, prefix-cache attach, copy-on-write forks."""

from engine.kv_cache.block_manager import RELEASED, BlockManager
from engine.kv_cache.cache_groups import CacheGroup, CacheGroups
from engine.sampling import SamplingParams
from engine.sequence import Sequence


def _seq(seq_id: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams(), 1000, cache_salt=salt)


def _compute(manager: BlockManager, seq: Sequence, num_tokens: int) -> None:
    manager.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    manager.commit_computed(seq)


def test_allocate_slots_grows_block_table_by_need() -> None:
    manager = BlockManager(8, block_size=4, enable_prefix_caching=False)
    seq = _seq(0, list(range(10)))
    assert manager.num_blocks_needed(seq, 10) == 3
    _compute(manager, seq, 10)
    assert len(seq.block_tables[0]) == 3
    seq.token_ids.append(10)
    assert manager.num_blocks_needed(seq, 1) == 0  # slot 10 fits in block 2
    _compute(manager, seq, 1)
    seq.token_ids.append(11)
    _compute(manager, seq, 1)
    seq.token_ids.append(12)
    assert manager.num_blocks_needed(seq, 1) == 1
    manager.free(seq)
    assert manager.num_free_blocks == 8


def test_prefix_cache_hit_shares_full_blocks_and_leaves_one_token() -> None:
    manager = BlockManager(16, block_size=4, enable_prefix_caching=True)
    first = _seq(0, list(range(12)))
    _compute(manager, first, 12)
    second = _seq(1, list(range(12)) + [50, 51])
    assert manager.attach_cached_prefix(second) == 12
    assert second.block_tables[0] == first.block_tables[0]
    assert all(manager.pool.ref_count(b) == 2 for b in first.block_tables[0])
    # an identical prompt reuses all but the last block: its last token must be computed
    third = _seq(2, list(range(12)))
    assert manager.attach_cached_prefix(third) == 8


def test_a_half_computed_block_is_not_cached() -> None:
    """A chunk that ends inside a block (chunked prefill) leaves that block out of the cache,
    though the prompt's hashes already name it; the sequence's end (abort, preemption) must not
    hand its unwritten slots to the next request with the prompt."""
    manager = BlockManager(16, block_size=4, enable_prefix_caching=True)
    first = _seq(0, list(range(20)))
    assert manager.attach_cached_prefix(first) == 0  # hashes all five full blocks of the prompt
    _compute(manager, first, 6)  # block 0 full, block 1 holds 2 of its 4 tokens
    manager.free(first)
    assert manager.attach_cached_prefix(_seq(1, list(range(20)))) == 4
    second = _seq(2, list(range(20)))
    assert manager.attach_cached_prefix(second) == 4
    _compute(manager, second, 4)  # blocks 1 full (and 2 half): block 1 is cached from here on
    assert manager.attach_cached_prefix(_seq(3, list(range(20)))) == 8


def test_cached_blocks_outlive_their_sequence_until_evicted() -> None:
    manager = BlockManager(4, block_size=4, enable_prefix_caching=True)
    first = _seq(0, list(range(9)))
    _compute(manager, first, 9)
    manager.free(first)
    again = _seq(1, list(range(9)))
    assert manager.attach_cached_prefix(again) == 8
    manager.free(again)
    # fill the whole pool with other tokens: cached blocks get evicted
    other = _seq(2, list(range(100, 116)))
    _compute(manager, other, 16)
    manager.free(other)
    late = _seq(3, list(range(9)))
    assert manager.attach_cached_prefix(late) == 0


def test_salt_isolates_tenants() -> None:
    manager = BlockManager(16, block_size=4, enable_prefix_caching=True)
    _compute(manager, first := _seq(0, list(range(12)), salt="a"), 12)
    assert first.num_computed_tokens == 12
    assert manager.attach_cached_prefix(_seq(1, list(range(13)), salt="b")) == 0
    assert manager.attach_cached_prefix(_seq(2, list(range(13)), salt="a")) == 12


def test_fork_shares_blocks_and_copies_partial_block_on_write() -> None:
    manager = BlockManager(8, block_size=4, enable_prefix_caching=False)
    parent = _seq(0, list(range(6)))
    _compute(manager, parent, 6)
    child = _seq(1, list(range(6)))
    manager.fork(parent, child)
    assert child.block_tables[0] == parent.block_tables[0]
    full_block, partial_block = parent.block_tables[0]
    parent.token_ids.append(7)
    child.token_ids.append(8)
    # the parent writes into the shared partial block first: it gets a private copy
    assert manager.num_blocks_needed(parent, 1) == 1
    copies = manager.allocate_slots(parent, 1)
    assert copies == [(partial_block, parent.block_tables[0][1])]
    assert parent.block_tables[0][0] == full_block
    # the child is now the only owner of the original partial block: no copy
    assert manager.allocate_slots(child, 1) == []
    assert child.block_tables[0] == [full_block, partial_block]
    assert manager.pool.ref_count(full_block) == 2
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 8


def test_fork_at_block_boundary_needs_no_copy() -> None:
    manager = BlockManager(8, block_size=4, enable_prefix_caching=False)
    parent = _seq(0, list(range(8)))
    _compute(manager, parent, 8)
    child = _seq(1, list(range(8)))
    manager.fork(parent, child)
    child.token_ids.append(1)
    assert manager.allocate_slots(child, 1) == []
    assert child.block_tables[0][:2] == parent.block_tables[0]
    assert len(child.block_tables[0]) == 3


def test_a_step_registers_only_the_blocks_it_filled() -> None:
    """A decode step costs what it filled, not the sequence's length: blocks committed by an
    earlier step are not offered to the prefix cache again (at batch 256 x 1k tokens that was
    16k dictionary probes a step)."""
    manager = BlockManager(64, block_size=4, enable_prefix_caching=True)
    registered: list[int] = []
    register = manager.pool.register
    manager.pool.register = lambda block_id, block_hash, group=0: (  # type: ignore[method-assign]
        registered.append(block_id),
        register(block_id, block_hash, group),
    )[-1]
    seq = _seq(0, list(range(40)))
    _compute(manager, seq, 40)
    assert registered == seq.block_tables[0]  # the prompt's ten full blocks, once each
    registered.clear()
    for token in range(40, 48):
        seq.token_ids.append(token)
        _compute(manager, seq, 1)
    assert registered == seq.block_tables[0][10:12]  # the two blocks the decode steps filled

    # a preempted sequence starts again: its new blocks are committed again
    manager.free(seq)
    registered.clear()
    manager.attach_cached_prefix(seq)
    _compute(manager, seq, seq.num_uncomputed_tokens)
    assert registered == seq.block_tables[0]


def test_a_fork_commits_from_where_its_parent_stood() -> None:
    manager = BlockManager(64, block_size=4, enable_prefix_caching=True)
    parent = _seq(0, list(range(10)))
    _compute(manager, parent, 10)
    child = _seq(1, list(range(10)))
    manager.fork(parent, child)
    assert child.num_committed_blocks == 2
    for token in (10, 11):
        child.token_ids.append(token)
        _compute(manager, child, 1)
    assert child.num_committed_blocks == 3
    # the block the child filled serves a prompt that shares its tokens
    assert manager.attach_cached_prefix(_seq(2, list(range(12)) + [99])) == 12


def test_reserve_takes_fresh_blocks_for_the_tokens_or_none_when_they_do_not_fit() -> None:
    manager = BlockManager(4, block_size=4, enable_prefix_caching=False)
    reserved = manager.reserve(9)  # 3 blocks
    assert reserved is not None and len(set(reserved)) == 3
    assert manager.num_free_blocks == 1
    assert manager.reserve(5) is None  # 2 blocks: they do not fit, and none is taken
    assert manager.num_free_blocks == 1
    manager.release(reserved)
    assert manager.num_free_blocks == 4


def test_reserved_blocks_a_sequence_adopts_are_freed_with_it() -> None:
    manager = BlockManager(8, block_size=4, enable_prefix_caching=True)
    seq = _seq(0, list(range(8)))
    reserved = manager.reserve(seq.num_prompt_tokens)
    assert reserved is not None
    manager.adopt(seq, reserved, share=False)
    manager.free(seq)
    assert manager.num_free_blocks == 8


# ---- models whose layers mix sliding and full attention: a block table per cache group ----
# one full layer, one with a window of 6 tokens: its token at position p sees p - 5 .. p
MIXED = CacheGroups((CacheGroup(None, (0,)), CacheGroup(6, (1,))))


def test_each_group_takes_its_own_blocks_and_a_window_gives_back_what_it_left() -> None:
    manager = BlockManager(32, block_size=4, enable_prefix_caching=False, cache_groups=MIXED)
    seq = _seq(0, list(range(20)))
    assert manager.num_blocks_needed(seq, 20) == 10  # five blocks in each group
    _compute(manager, seq, 20)
    full, windowed = seq.block_tables
    assert len(full) == len(windowed) == 5 and not set(full) & set(windowed)
    manager.release_outside_window(seq)  # the next token (20) sees 15..20: blocks 3 and 4
    assert windowed[:3] == [RELEASED] * 3 and seq.num_released_blocks == [0, 3]
    assert RELEASED not in full
    assert manager.num_free_blocks == 32 - 7
    manager.free(seq)
    assert manager.num_free_blocks == 32


def test_a_prefix_hit_needs_every_full_block_but_only_the_windows_blocks() -> None:
    """The windowed group's blocks before the window of the first token left to compute may
    be gone (evicted) and the prefix still hits; a full group's block gone ends the hit."""
    manager = BlockManager(32, block_size=4, enable_prefix_caching=True, cache_groups=MIXED)
    prompt = list(range(21))
    first = _seq(0, prompt)
    _compute(manager, first, 21)
    full, windowed = (list(table) for table in first.block_tables)
    manager.free(first)
    # evict the windowed group's first three blocks from the cache (their hashes forgotten)
    for block_id in windowed[:3]:
        manager.pool._forget_hash(block_id)
    second = _seq(1, prompt)
    assert manager.attach_cached_prefix(second) == 20  # next token 20 sees blocks 3 and 4
    assert second.block_tables[0] == full[:5]
    assert second.block_tables[1] == [RELEASED] * 3 + windowed[3:5]
    assert second.num_released_blocks == [0, 3]
    manager.free(second)
    manager.pool._forget_hash(full[2])  # a full layer's block 2 gone: the hit stops before it
    third = _seq(2, prompt)
    # 8 tokens: token 8 sees 3..8, blocks 0 and 1 of the windowed group, which are gone too
    assert manager.attach_cached_prefix(third) == 0
    assert third.block_tables == []


def test_a_hand_off_moves_each_groups_blocks_in_turn_and_the_receiver_splits_them() -> None:
    sender = BlockManager(32, block_size=4, enable_prefix_caching=False, cache_groups=MIXED)
    seq = _seq(0, list(range(18)), salt=None)
    _compute(sender, seq, 18)
    full, windowed = (list(table) for table in seq.block_tables)
    # token 18 sees 13..18: blocks 3 and 4 of the windowed group; all five of the full one
    assert sender.blocks_to_hand_off(seq) == full + windowed[3:]
    assert sender.num_blocks_to_hand_off(18) == 7
    receiver = BlockManager(32, block_size=4, enable_prefix_caching=True, cache_groups=MIXED)
    reserved = receiver.reserve(18)
    assert reserved is not None and len(reserved) == 7
    received = _seq(1, list(range(18)))
    receiver.adopt(received, reserved, share=False)
    assert received.block_tables[0] == reserved[:5]
    assert received.block_tables[1] == [RELEASED] * 3 + reserved[5:]
    assert received.num_released_blocks == [0, 3]
    receiver.free(received)
    assert receiver.num_free_blocks == 32


def test_what_a_request_can_hold_counts_a_window_and_a_step_per_windowed_group() -> None:
    manager = BlockManager(32, block_size=4, enable_prefix_caching=False, cache_groups=MIXED)
    assert manager.max_blocks_held(100, step_tokens=None) == 50
    # chunks of 8: the windowed group holds ceil((6 - 1 + 8) / 4) + 1 = 5
    assert manager.max_blocks_held(100, step_tokens=8) == 25 + 5


def test_a_reservation_shares_the_leading_blocks_the_cache_holds() -> None:
    """A hand-off's reservation takes the prompt's leading blocks this cache holds with a
    reference (their KV need not move) and fresh blocks for the rest; cached blocks taken so
    leave the free count, and the reservation's release gives them back to the cache."""
    manager = BlockManager(8, block_size=4, enable_prefix_caching=True)
    first = _seq(0, list(range(13)))
    _compute(manager, first, 13)  # 3 full blocks cached
    manager.free(first)
    hashes = manager.servable_prompt_hashes(list(range(12)) + [70, 71, 72, 73, 74], None)
    assert hashes[:3] == first.block_hashes[:3] and len(hashes) == 4
    shared = manager.share_cached_prefix(hashes)
    assert len(shared) == 3
    assert manager.num_free_blocks == 5
    reserved = manager.reserve(17, shared)  # 5 blocks: 3 shared, 2 fresh
    assert reserved is not None and reserved[:3] == shared and manager.num_free_blocks == 3
    manager.release(reserved)
    assert manager.num_free_blocks == 8
    assert manager.share_cached_prefix(hashes) == shared  # still cached
    # another tenant's hashes name none of them; a reservation that does not fit takes nothing
    assert manager.share_cached_prefix(manager.servable_prompt_hashes(list(range(13)), "b")) == []
    assert manager.reserve(41, shared) is None
    assert manager.num_free_blocks == 5


def test_a_cache_of_windowed_layers_shares_no_prefix() -> None:
    """A sliding-window group's blocks move from the window on: nothing is shared."""
    manager = BlockManager(16, block_size=4, enable_prefix_caching=True, cache_groups=MIXED)
    seq = _seq(0, list(range(13)))
    _compute(manager, seq, 13)
    manager.free(seq)
    assert manager.share_cached_prefix(seq.block_hashes[:3]) == []
