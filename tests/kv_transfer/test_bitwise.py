"""Blocks arrive bit for bit, in the right place, and nothing else of the cache changes."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kv_transfer import KVCacheLayout, KVChannel, TransferTicket
from tests.kv_transfer.helpers import open_pair, random_cache, small_layout, transfer
from tests.kv_transfer.peer import start_receiver

TRANSPORTS = ["gloo", "shm", "fake"]
DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "int8"]  # the last two: quantized caches


def pick_blocks(rng: random.Random, num_cache_blocks: int, count: int) -> list[int]:
    """`count` distinct, non-contiguous, shuffled block ids."""
    ids = rng.sample(range(0, num_cache_blocks, 2), count)
    rng.shuffle(ids)
    return ids


def check_landed(
    src: torch.Tensor,
    src_ids: list[int],
    dst: torch.Tensor,
    dst_before: torch.Tensor,
    dst_ids: list[int],
) -> None:
    as_bits = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[src.element_size()]
    assert torch.equal(dst[:, :, dst_ids].view(as_bits), src[:, :, src_ids].view(as_bits))
    untouched = [b for b in range(dst.shape[2]) if b not in set(dst_ids)]
    assert torch.equal(
        dst[:, :, untouched].view(as_bits), dst_before[:, :, untouched].view(as_bits)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_blocks_land_bitwise(transport: str, dtype: str) -> None:
    layout, rng = small_layout(dtype), random.Random(1)
    src, dst = random_cache(layout, 40, seed=1), random_cache(layout, 57, seed=2)
    dst_before = dst.clone()
    src_ids, dst_ids = pick_blocks(rng, 40, 9), pick_blocks(rng, 57, 9)
    sender, receiver = open_pair(transport, layout, f"bits-{transport}-{dtype}")
    with sender, receiver:
        ticket = TransferTicket(0, "req-0", 9, timeout_s=20.0)
        sent, received = transfer(sender, receiver, (src, src_ids), (dst, dst_ids), ticket)
    check_landed(src, src_ids, dst, dst_before, dst_ids)
    assert sent.nbytes == received.nbytes == 9 * layout.block_nbytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_transfer_larger_than_the_staging_segment_is_chunked(transport: str, dtype: str) -> None:
    # block = 3 layers * 2 * 4 tokens * 8 heads * 32 dims elements; a slot holds 4 KiB, so
    # blocks split into plane groups (and a second layout below packs several blocks per slot)
    layout = KVCacheLayout(dtype, block_size=4, num_layers=3, num_kv_heads=8, head_dim=32)
    rng = random.Random(3)
    src, dst = random_cache(layout, 30, seed=3), random_cache(layout, 25, seed=4)
    dst_before = dst.clone()
    src_ids, dst_ids = pick_blocks(rng, 30, 12), pick_blocks(rng, 25, 12)
    sender, receiver = open_pair(transport, layout, f"chunks-{transport}-{dtype}", chunk_bytes=4096)
    with sender, receiver:
        ticket = TransferTicket(7, "req-big", 12, timeout_s=30.0, checksum=True)
        sent, received = transfer(sender, receiver, (src, src_ids), (dst, dst_ids), ticket)
    check_landed(src, src_ids, dst, dst_before, dst_ids)
    assert sent.nbytes > 2 * 4096  # more than the whole two-slot segment
    assert sent.num_chunks == received.num_chunks > 2


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_several_whole_blocks_per_chunk(transport: str) -> None:
    layout = small_layout()  # 1536 B per block: 2 whole blocks per 4 KiB slot
    rng = random.Random(5)
    src, dst = random_cache(layout, 64, seed=5), random_cache(layout, 64, seed=6)
    dst_before = dst.clone()
    src_ids, dst_ids = pick_blocks(rng, 64, 23), pick_blocks(rng, 64, 23)
    sender, receiver = open_pair(transport, layout, f"packed-{transport}", chunk_bytes=4096)
    with sender, receiver:
        ticket = TransferTicket(0, "req", 23, timeout_s=30.0, checksum=True)
        sent, _ = transfer(sender, receiver, (src, src_ids), (dst, dst_ids), ticket)
    check_landed(src, src_ids, dst, dst_before, dst_ids)
    assert sent.num_chunks == 12


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_sequential_transfers_with_checksums(transport: str) -> None:
    layout, rng = small_layout("bfloat16"), random.Random(7)
    src, dst = random_cache(layout, 50, seed=7), random_cache(layout, 80, seed=8)
    sender, receiver = open_pair(transport, layout, f"many-{transport}", chunk_bytes=4096)
    with sender, receiver:
        for transfer_id in range(25):
            count = rng.randint(1, 12)
            src_ids, dst_ids = rng.sample(range(50), count), rng.sample(range(80), count)
            dst_before = dst.clone()
            ticket = TransferTicket(
                transfer_id, f"req-{transfer_id}", count, 20.0, checksum=transfer_id % 2 == 0
            )
            transfer(sender, receiver, (src, src_ids), (dst, dst_ids), ticket)
            check_landed(src, src_ids, dst, dst_before, dst_ids)
        assert not sender.broken and not receiver.broken


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_receiver_in_another_process(transport: str) -> None:
    layout, rng = small_layout("bfloat16"), random.Random(11)
    src = random_cache(layout, 40, seed=11)
    jobs = [
        (TransferTicket(i, f"r{i}", 6, 30.0, checksum=True), rng.sample(range(48), 6))
        for i in range(3)
    ]
    src_ids = [rng.sample(range(40), 6) for _ in jobs]
    listener = KVChannel.listen(
        transport, layout, "127.0.0.1", f"proc-{transport}", torch.device("cpu"), chunk_bytes=4096
    )
    with listener:
        process, results = start_receiver(listener.rendezvous, layout, "receive", jobs, 48)
        with listener.accept(60.0) as sender:
            for (ticket, _), ids in zip(jobs, src_ids):
                sender.send_blocks(src, ids, ticket)
    assert results.get(timeout=60)[0] == "connected"
    kind, payload = results.get(timeout=60)
    process.join(30)
    assert kind == "cache", payload
    dst = torch.frombuffer(bytearray(payload.tobytes()), dtype=torch.bfloat16).view(
        3, 2, 48, 4, 2, 8
    )
    expected = random_cache(layout, 48, seed=99)
    for (_, dst_ids), ids in zip(jobs, src_ids):
        expected[:, :, dst_ids] = src[:, :, ids]
    assert torch.equal(dst.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("transport", ["gloo", "shm", "fake"])
def test_a_discarded_transfer_keeps_the_channel_in_step(transport: str) -> None:
    layout = small_layout()
    sender, receiver = open_pair(transport, layout, f"discard-{transport}")
    with sender, receiver:
        src = random_cache(layout, 6, seed=1)
        dst = torch.zeros_like(src)
        unwanted = TransferTicket(transfer_id=1, request_id="gone", num_blocks=3, timeout_s=10)
        with ThreadPoolExecutor(1) as pool:
            dropped = pool.submit(receiver.discard, dst, unwanted)
            sender.send_blocks(src, [0, 1, 2], unwanted)
            dropped.result(timeout=10)
        assert torch.count_nonzero(dst) == 0  # nothing landed in the cache
        wanted = TransferTicket(transfer_id=2, request_id="next", num_blocks=2, timeout_s=10)
        transfer(sender, receiver, (src, [4, 5]), (dst, [1, 3]), wanted)
        assert torch.equal(dst[:, :, [1, 3]], src[:, :, [4, 5]])
