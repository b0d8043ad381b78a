"""KVCacheLayout, tickets and chunk plans: pure functions, no transport."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_transfer import KVCacheLayout, LayoutMismatchError, TransferTicket
from kv_transfer.chunking import plan_chunks
from tests.kv_transfer.helpers import random_cache, small_layout

MISMATCHES = [
    ("dtype", "bfloat16"),
    ("block_size", 8),
    ("num_layers", 4),
    ("num_kv_heads", 4),
    ("head_dim", 16),
    # a model whose sliding and full layers keep separate block tables (the slots' meaning)
    ("cache_groups", "full:1|window 24:0|window 24:2"),
]


def test_from_cache_reads_every_field() -> None:
    layout = small_layout("bfloat16")
    cache = random_cache(layout, num_blocks=5, seed=0)
    assert KVCacheLayout.from_cache(cache) == layout
    assert layout.block_nbytes == 3 * 2 * 4 * 2 * 8 * 2


@pytest.mark.parametrize(("field", "value"), MISMATCHES)
def test_check_compatible_names_the_field(field: str, value: object) -> None:
    layout = small_layout()
    peer = dataclasses.replace(layout, **{field: value})
    mine = getattr(layout, field)
    expected = f"KV layout mismatch on {field}: this side has {mine}, the peer has {value}"
    with pytest.raises(LayoutMismatchError) as caught:
        layout.check_compatible(peer)
    assert str(caught.value) == expected
    assert isinstance(caught.value, ValueError)


def test_first_differing_field_is_named() -> None:
    layout = small_layout()
    peer = dataclasses.replace(layout, head_dim=64, num_layers=9)
    with pytest.raises(LayoutMismatchError, match="on num_layers"):
        layout.check_compatible(peer)


def test_json_round_trip_and_strict_parse() -> None:
    layout = small_layout()
    assert KVCacheLayout.from_json(layout.to_json()) == layout
    grouped = dataclasses.replace(layout, cache_groups="full:1|window 24:0|window 24:2")
    assert KVCacheLayout.from_json(grouped.to_json()) == grouped
    with pytest.raises(ValueError):
        KVCacheLayout.from_json({**layout.to_json(), "extra": 1})
    with pytest.raises(ValueError):
        KVCacheLayout.from_json({**layout.to_json(), "dtype": "int4"})


def test_check_cache_refuses_other_shapes() -> None:
    layout = small_layout()
    with pytest.raises(ValueError, match="head_dim"):
        layout.check_cache(torch.zeros(3, 2, 5, 4, 2, 16), torch.device("cpu"))
    with pytest.raises(ValueError, match="dtype"):
        layout.check_cache(torch.zeros(3, 2, 5, 4, 2, 8, dtype=torch.float16), torch.device("cpu"))
    assert layout.check_cache(torch.zeros(3, 2, 5, 4, 2, 8), torch.device("cpu")) == 5


def test_ticket_validation() -> None:
    with pytest.raises(ValueError):
        TransferTicket(0, "r", num_blocks=0, timeout_s=1.0)
    with pytest.raises(ValueError):
        TransferTicket(0, "r", num_blocks=1, timeout_s=0.0)
    with pytest.raises(ValueError):
        TransferTicket(-1, "r", num_blocks=1, timeout_s=1.0)


@pytest.mark.parametrize("max_chunk_bytes", [64, 128, 200, 192 * 3, 768 * 2, 10**6])
def test_chunk_plan_covers_every_plane_of_every_block_once(max_chunk_bytes: int) -> None:
    layout = KVCacheLayout("float32", 1, 3, 1, 16)  # plane 64 B, block 384 B
    plan = plan_chunks(layout, num_blocks=5, max_chunk_bytes=max_chunk_bytes)
    covered = [
        (p, b)
        for c in plan
        for b in range(c.block_start, c.block_stop)
        for p in range(c.plane_start, c.plane_stop)
    ]
    assert sorted(covered) == [(p, b) for p in range(6) for b in range(5)]
    assert all(c.nbytes <= max_chunk_bytes for c in plan)
    assert sum(c.nbytes for c in plan) == 5 * layout.block_nbytes


def test_chunk_smaller_than_a_plane_is_refused() -> None:
    with pytest.raises(ValueError, match="smaller than one plane"):
        plan_chunks(small_layout(), num_blocks=2, max_chunk_bytes=16)


def test_quantized_layouts_carry_their_scales_and_name_a_mismatch() -> None:
    """A quantized cache's blocks read the same at both ends only with the same scales: the
    handshake names the first layer, plane and head whose scale differs, among the moved
    heads only; the scales survive the JSON handshake."""
    layout = small_layout("int8")
    assert layout.block_nbytes == 3 * 2 * 4 * 2 * 8  # a byte an element
    assert KVCacheLayout.from_json(layout.to_json()) == layout
    cache = random_cache(layout, num_blocks=3, seed=0)
    assert KVCacheLayout.from_cache(cache, kv_scales=layout.kv_scales) == layout
    assert layout.check_cache(cache, torch.device("cpu")) == 3
    scales = [list(map(list, planes)) for planes in layout.kv_scales or ()]
    scales[2][1][1] = 4.0  # layer 2's V scale of head 1
    peer = dataclasses.replace(layout, kv_scales=tuple((tuple(k), tuple(v)) for k, v in scales))
    with pytest.raises(
        LayoutMismatchError,
        match="on kv_scales: layer 2 V head 1 has scale 2.0 on this side, 4.0 on the peer",
    ):
        layout.check_compatible(peer)
    # a channel that moves head 0 alone does not care about head 1's scales
    layout.moving(range(0, 1)).check_compatible(peer.moving(range(0, 1)))
    with pytest.raises(LayoutMismatchError, match="on dtype: this side has int8"):
        layout.check_compatible(small_layout("float8_e4m3fn"))
    with pytest.raises(ValueError, match="kv_scales must be given exactly for a quantized"):
        dataclasses.replace(layout, kv_scales=None)
    with pytest.raises(ValueError, match="malformed kv_scales"):
        KVCacheLayout.from_json({**layout.to_json(), "kv_scales": [[[1.0, "x"], [1.0, 1.0]]]})


def test_quantized_latent_layouts_carry_their_one_scale_a_layer() -> None:
    """A latent cache (one plane a layer, one head) has one scale a layer: it survives the
    handshake, a different one is named as the latent's, and a K/V pair of scales is refused
    for it."""
    scales = (((0.5,),), ((0.25,),), ((1.5,),))
    layout = KVCacheLayout("float8_e4m3fn", 4, 3, 1, 40, kv_planes=1, kv_scales=scales)
    assert KVCacheLayout.from_json(layout.to_json()) == layout
    cache = torch.zeros(3, 1, 2, 4, 1, 40, dtype=torch.float8_e4m3fn)
    assert KVCacheLayout.from_cache(cache, kv_scales=layout.kv_scales) == layout
    peer = dataclasses.replace(layout, kv_scales=(((0.5,),), ((0.125,),), ((1.5,),)))
    with pytest.raises(
        LayoutMismatchError,
        match="on kv_scales: layer 1 latent head 0 has scale 0.25 on this side, 0.125 on the peer",
    ):
        layout.check_compatible(peer)
    with pytest.raises(ValueError, match=r"kv_scales must have 1 plane\(s\) per layer"):
        dataclasses.replace(layout, kv_scales=(((0.5,), (0.5,)),) * 3)
