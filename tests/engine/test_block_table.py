"""Block tables: the numpy copy the runner reads always equals the list the block manager
writes, whichever verbs changed it, and the pool's reference counts are the tables'."""

import copy
import pickle
import random
from collections import Counter

import numpy as np
import pytest

from engine.kv_cache.block_manager import RELEASED, BlockManager
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.cache_groups import CacheGroup, CacheGroups
from engine.sampling import SamplingParams
from engine.sequence import Sequence


def _assert_mirrored(table: BlockTable) -> None:
    assert table.array.dtype == np.int64
    assert table.array.tolist() == list(table)


def test_append_past_the_capacity_and_assign_keep_the_array_equal() -> None:
    table = BlockTable([7, 3])
    _assert_mirrored(table)
    for block_id in range(100, 140):  # past the first capacity, twice
        table.append(block_id)
        _assert_mirrored(table)
    table[1] = 55
    table[-1] = 66  # from the end of the list, not of the array's capacity
    _assert_mirrored(table)
    assert table[:2] == [7, 55] and table[-1] == 66
    with pytest.raises(IndexError):
        table[len(table)] = 1
    _assert_mirrored(table)


def test_pickled_and_copied_tables_keep_their_arrays() -> None:
    table = BlockTable(range(20))
    table[3] = 99
    for twin in (pickle.loads(pickle.dumps(table)), copy.copy(table), copy.deepcopy(table)):
        assert type(twin) is BlockTable and twin == table
        _assert_mirrored(twin)
        twin.append(7)  # a copy of its own
        assert len(table) == 20


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: t.extend([1]),
        lambda t: t.insert(0, 1),
        lambda t: t.pop(),
        lambda t: t.remove(7),
        lambda t: t.clear(),
        lambda t: t.sort(),
        lambda t: t.reverse(),
        lambda t: t.__delitem__(0),
        lambda t: t.__iadd__([1]),
        lambda t: t.__imul__(2),
        lambda t: t.__setitem__(slice(0, 1), [1]),
    ],
)
def test_every_other_mutator_is_refused(mutate: object) -> None:
    table = BlockTable([7, 3, 9])
    with pytest.raises(TypeError, match="block table"):
        mutate(table)  # type: ignore[operator]
    assert table == [7, 3, 9]
    _assert_mirrored(table)


MIXED_GROUPS = CacheGroups((CacheGroup(None, (0, 2)), CacheGroup(9, (1, 3))))


@pytest.mark.parametrize("cache_groups", [None, MIXED_GROUPS], ids=["one-group", "mixed"])
def test_the_block_managers_verbs_keep_every_table_mirrored(
    cache_groups: CacheGroups | None,
) -> None:
    """A random walk of prefix hits, decode steps (giving back what leaves a window), n > 1
    forks (copy-on-write), adoption of received blocks and frees, checking after each verb
    every live sequence's arrays, and that the pool's reference counts are exactly the live
    tables' references; with a windowed group, that no table holds more of its blocks than
    its window reaches."""
    rng = random.Random(0)
    manager = BlockManager(256, block_size=4, enable_prefix_caching=True, cache_groups=cache_groups)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    live: list[Sequence] = []
    next_id = 0

    def new_seq(tokens: list[int]) -> Sequence:
        nonlocal next_id
        next_id += 1
        return Sequence(next_id, f"r{next_id}", tokens, SamplingParams(), 10_000)

    def step(seq: Sequence) -> None:
        manager.release_outside_window(seq)
        num_new = seq.num_uncomputed_tokens
        if manager.can_allocate(seq, num_new):
            manager.allocate_slots(seq, num_new)
            seq.num_computed_tokens += num_new
            manager.commit_computed(seq)
            seq.token_ids.append(rng.randrange(50))

    def check_references() -> None:
        references: Counter[int] = Counter()
        for seq in live:
            for group, table in enumerate(seq.block_tables):
                _assert_mirrored(table)
                held = table[seq.num_released_blocks[group] :]
                assert RELEASED not in held
                references.update(held)
        for block_id in range(256):
            assert manager.pool.ref_count(block_id) == references[block_id]

    num_copies = num_windowed_checks = 0
    for _ in range(400):
        action = rng.random()
        if action < 0.25 or not live:
            seq = new_seq(list(rng.choice(prompts)))
            manager.attach_cached_prefix(seq)
            live.append(seq)
        elif action < 0.6:
            step(rng.choice(live))
        elif action < 0.75:
            parent = rng.choice(live)
            child = new_seq(list(parent.token_ids))
            manager.fork(parent, child)
            live.append(child)
            before = [list(table) for table in child.block_tables]
            step(child)  # writes into the shared partial block: copy-on-write
            num_copies += any(
                table[: len(old)] != old for table, old in zip(child.block_tables, before)
            )
        elif action < 0.85:
            donor = rng.choice(live)
            full = donor.num_computed_tokens // manager.block_size
            received = new_seq(donor.token_ids[: full * manager.block_size])
            moved = [block for table in donor.block_tables for block in table[:full]]
            num_moved = manager.num_blocks_to_hand_off(received.num_prompt_tokens)
            if full and RELEASED not in moved and num_moved == len(moved):  # no window to skip
                manager.adopt(received, moved, share=True)
                live.append(received)
        else:
            manager.free(live.pop(rng.randrange(len(live))))
        check_references()
        for seq in live:
            if seq.block_tables and cache_groups is not None:
                window_table = seq.block_tables[1]
                held = len(window_table) - seq.num_released_blocks[1]
                # the window's blocks, the new token's and those a step filled since the release
                assert held <= len(window_table) - max(seq.num_computed_tokens - 9 - 30, 0) // 4
                num_windowed_checks += held < len(window_table)
    assert num_copies > 0  # the walk did assign into tables, not only append
    assert cache_groups is None or num_windowed_checks > 0  # and gave blocks back
    for seq in live:
        manager.free(seq)
    assert manager.num_free_blocks == 256
