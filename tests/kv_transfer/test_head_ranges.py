"""Channels that move a range of KV heads, between workers of different tensor-parallel sizes.

Every rank pair of `plan_head_moves` gets its own channel; each decode rank's cache must end up
equal, bit for bit, to its heads of a TP-1 reference cache in the received blocks, and untouched
elsewhere.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kv_transfer import KVCacheLayout, KVChannel, LayoutMismatchError, TransferTicket
from kv_transfer.chunking import plan_chunks
from kv_transfer.head_plan import plan_head_moves
from kv_transfer.transports.cuda_ipc import _require_whole_cache
from tests.kv_transfer.helpers import CPU, HOST, open_pair, random_cache, transfer
from tests.kv_transfer.test_head_plan import rank_heads

TRANSPORTS = ["gloo", "shm", "fake"]
TP_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]
NUM_PREFILL_BLOCKS, NUM_DECODE_BLOCKS, NUM_MOVED_BLOCKS = 12, 15, 5
CHUNK_BYTES = 4096  # a moved block of 2 or 4 heads (6 KiB, 12 KiB) splits into plane groups


def model_layout(num_kv_heads: int) -> KVCacheLayout:
    # a plane of one head: 4 tokens * 32 dims * 4 B = 512 B
    return KVCacheLayout(
        "float32", block_size=4, num_layers=3, num_kv_heads=num_kv_heads, head_dim=32
    )


def rank_layout(heads: range) -> KVCacheLayout:
    """The layout of a rank's cache that holds the model's ``heads``."""
    return model_layout(len(heads)).holding(heads)


def test_head_ranges_in_the_layout() -> None:
    rank1 = rank_layout(range(2, 4))  # TP 2, rank 1
    assert (rank1.kv_heads, rank1.moved_heads, rank1.moved_first) == (range(2, 4), range(2, 4), 0)
    whole = model_layout(4).moving(range(2, 4))  # TP 1, sending rank 1's heads
    assert (whole.moved_first, whole.num_moved_heads) == (2, 2)
    assert whole.moved_block_nbytes == whole.block_nbytes // 2 == rank1.block_nbytes
    assert whole.mismatch(rank1, "sender") is None  # TP 1 -> TP 2 rank 1
    assert rank1.mismatch(whole, "receiver") is None
    with pytest.raises(ValueError, match="moved_kv_heads 1-2 must lie within .* holds, 2-3"):
        rank1.moving(range(1, 3))
    with pytest.raises(ValueError, match="kv_heads range\\(0, 3\\) must be 2 consecutive heads"):
        model_layout(2).holding(range(0, 3))
    cache = random_cache(rank1, 3, seed=0)
    assert KVCacheLayout.from_cache(cache, range(2, 4)) == rank1
    assert rank1.moving(range(3, 4)).check_cache(cache, CPU) == 3


def test_layout_json_carries_the_head_ranges_strictly() -> None:
    layout = rank_layout(range(2, 4)).moving(range(3, 4))
    data = layout.to_json()
    assert (data["first_kv_head"], data["moved_kv_heads"]) == (2, [3, 4])
    assert KVCacheLayout.from_json(data) == layout
    assert KVCacheLayout.from_json(model_layout(4).to_json()) == model_layout(4)
    for bad in ("3-4", [3], [3, 4.0], [True, 4]):
        with pytest.raises(ValueError, match="moved_kv_heads"):
            KVCacheLayout.from_json({**data, "moved_kv_heads": bad})
    with pytest.raises(ValueError, match="malformed KV layout"):
        KVCacheLayout.from_json({k: v for k, v in data.items() if k != "first_kv_head"})
    with pytest.raises(ValueError, match="must lie within"):
        KVCacheLayout.from_json({**data, "moved_kv_heads": [1, 3]})


def test_chunk_plan_covers_the_moved_heads_only() -> None:
    layout = model_layout(4).moving(range(1, 3))  # moved plane 1 KiB, moved block 6 KiB
    plan = plan_chunks(layout, num_blocks=5, max_chunk_bytes=CHUNK_BYTES)
    assert sum(c.nbytes for c in plan) == 5 * layout.moved_block_nbytes == 5 * 6 * 1024
    assert all(c.nbytes <= CHUNK_BYTES for c in plan)
    assert len(plan) == 5 * 2  # each block in two plane groups of 4 KiB and 2 KiB


@pytest.mark.parametrize("num_kv_heads", [4, 1], ids=["gqa4", "mqa"])
@pytest.mark.parametrize(("prefill_size", "decode_size"), TP_PAIRS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_rank_pair_moves_its_heads_bitwise(
    transport: str, prefill_size: int, decode_size: int, num_kv_heads: int
) -> None:
    prefill, decode = rank_heads(num_kv_heads, prefill_size), rank_heads(num_kv_heads, decode_size)
    rng = random.Random(prefill_size * 10 + decode_size)
    reference = random_cache(model_layout(num_kv_heads), NUM_PREFILL_BLOCKS, seed=1)
    prefill_caches = [reference[:, :, :, :, heads].contiguous() for heads in prefill]
    decode_caches = [
        random_cache(rank_layout(heads), NUM_DECODE_BLOCKS, seed=10 + rank)
        for rank, heads in enumerate(decode)
    ]
    expected = [cache.clone() for cache in decode_caches]
    src_ids = rng.sample(range(NUM_PREFILL_BLOCKS), NUM_MOVED_BLOCKS)
    dst_ids = rng.sample(range(NUM_DECODE_BLOCKS), NUM_MOVED_BLOCKS)
    for rank, heads in enumerate(decode):
        expected[rank][:, :, dst_ids] = reference[:, :, src_ids][:, :, :, :, heads]
    moves = plan_head_moves(prefill, decode)
    for index, move in enumerate(moves):
        p, d = move.prefill_rank, move.decode_rank
        sender_layout = rank_layout(prefill[p]).moving(move.heads)
        receiver_layout = rank_layout(decode[d]).moving(move.heads)
        assert (sender_layout.moved_first, receiver_layout.moved_first) == (
            move.source_first,
            move.target_first,
        )
        name = f"tp-{transport}-{num_kv_heads}-{prefill_size}{decode_size}-p{p}d{d}"
        sender, receiver = open_pair(
            transport, sender_layout, name, receiver_layout, chunk_bytes=CHUNK_BYTES
        )
        ticket = TransferTicket(0, name, NUM_MOVED_BLOCKS, 30.0, checksum=index % 2 == 0)
        with sender, receiver:
            sent, received = transfer(
                sender, receiver, (prefill_caches[p], src_ids), (decode_caches[d], dst_ids), ticket
            )
        share = reference[:, :, :1].nbytes * len(move.heads) // num_kv_heads
        assert sent.nbytes == received.nbytes == NUM_MOVED_BLOCKS * share
    for rank, cache in enumerate(decode_caches):
        assert torch.equal(cache.view(torch.int32), expected[rank].view(torch.int32)), rank


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_mismatched_head_range_is_refused_naming_the_field(transport: str) -> None:
    sender_layout = model_layout(4).moving(range(2, 4))  # TP 1 sends heads 2-3 ...
    receiver_layout = rank_layout(range(0, 2))  # ... to TP 2 rank 0, which holds 0-1
    listener = KVChannel.listen(transport, sender_layout, HOST, f"heads-mm-{transport}", CPU)
    with listener, ThreadPoolExecutor(1) as pool:
        connecting = pool.submit(KVChannel.connect, listener.rendezvous, receiver_layout, CPU, 10)
        with pytest.raises(LayoutMismatchError) as on_sender:
            listener.accept(10)
        with pytest.raises(LayoutMismatchError) as on_receiver:
            connecting.result()
    assert str(on_sender.value) == (
        "KV layout mismatch on kv_heads: this side moves heads 2-3, the peer expects 0-1"
    )
    assert str(on_receiver.value) == (
        "KV layout mismatch on kv_heads: this side expects heads 0-1, the peer moves 2-3"
    )


def test_two_whole_ranks_of_other_heads_are_refused() -> None:
    # TP 2 rank 1 (heads 2-3) paired with TP 2 rank 0 (heads 0-1), both moving every head
    rank0, rank1 = rank_layout(range(0, 2)), rank_layout(range(2, 4))
    assert rank1.mismatch(rank0, "sender") == (
        "KV layout mismatch on kv_heads: this side moves heads 2-3, the peer expects 0-1"
    )


def test_cuda_ipc_refuses_a_head_range() -> None:
    _require_whole_cache(rank_layout(range(2, 4)))  # a whole rank's cache: fine
    with pytest.raises(ValueError, match="moves whole caches; moved_kv_heads 2-3 of a cache"):
        _require_whole_cache(model_layout(4).moving(range(2, 4)))
