"""KV cache groups: which layers share a block table, and which cache slot each layer holds."""

import pytest

from engine.kv_cache.cache_groups import CacheGroup, CacheGroups, LayerPlace, cache_groups_for


def test_a_model_whose_layers_attend_alike_has_one_group_of_every_layer() -> None:
    assert cache_groups_for(4, None, ()) == CacheGroups((CacheGroup(None, (0, 1, 2, 3)),))
    every_layer_slides = cache_groups_for(3, 16, (0, 1, 2))
    assert every_layer_slides.groups == (CacheGroup(16, (0, 1, 2)),)
    assert every_layer_slides.handshake_name is None
    assert every_layer_slides.place(2) == LayerPlace(group=0, slot=2, layer=2)


def test_sliding_and_full_layers_in_turn_make_two_groups_of_equal_size() -> None:
    """Gemma 2 and gpt-oss: local and global layers alternate."""
    groups = cache_groups_for(6, 128, (0, 2, 4))
    assert groups.groups == (CacheGroup(None, (1, 3, 5)), CacheGroup(128, (0, 2, 4)))
    assert (groups.num_groups, groups.num_slots) == (2, 3)
    assert groups.place(4) == LayerPlace(group=1, slot=2, layer=4)
    assert groups.place(1) == LayerPlace(group=0, slot=0, layer=1)
    assert groups.handshake_name == "full:1,3,5|window 128:0,2,4"


def test_five_local_layers_to_one_global_split_into_groups_of_the_smaller_kind() -> None:
    """Gemma 3's pattern over 12 layers: 10 sliding, 2 full -> groups of 2 layers, no slot
    unused (a block of any group is 2 layers' KV)."""
    sliding = tuple(layer for layer in range(12) if (layer + 1) % 6 != 0)
    groups = cache_groups_for(12, 512, sliding)
    assert groups.num_slots == 2 and groups.num_groups == 6
    assert groups.groups[0] == CacheGroup(None, (5, 11))
    assert [g.layers for g in groups.groups[1:]] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert sorted(layer for g in groups.groups for layer in g.layers) == list(range(12))


def test_an_uneven_split_leaves_the_last_groups_slots_unused() -> None:
    groups = cache_groups_for(5, 8, (0, 1, 2))  # 3 sliding, 2 full: groups of 2
    assert [g.layers for g in groups.groups] == [(3, 4), (0, 1), (2,)]
    assert groups.num_slots == 2
    with pytest.raises(KeyError, match="layer 7 is in no cache group"):
        groups.place(7)
