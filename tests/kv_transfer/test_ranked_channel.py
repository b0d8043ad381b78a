"""A channel of rank pairs (kv_transfer/ranked_channel.py) over real rank ports in one process:
each decode rank's cache gets exactly its heads of a TP-1 reference in the received blocks, a
failed pair fails the transfer on both ends and breaks the whole channel, and a pair that names
a rank or heads the decode side does not hold is refused naming the field."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kv_transfer import TransferError, TransferTicket
from kv_transfer.head_plan import plan_head_moves
from kv_transfer.rank_calls import ClosePair
from kv_transfer.rank_port import LocalRankPeer, RankKVPort
from kv_transfer.ranked_channel import RankedChannel, RankedListener
from tests.kv_transfer.helpers import HOST, random_cache
from tests.kv_transfer.test_head_plan import rank_heads
from tests.kv_transfer.test_head_ranges import model_layout

NUM_BLOCKS, TIMEOUT_S = 6, 10.0
SOURCE_BLOCKS, TARGET_BLOCKS = [1, 4, 5], [3, 0, 2]


class Worker:
    """A worker's ranks: each a cache of its heads and a port on it."""

    def __init__(self, name: str, heads: list[range], reference: torch.Tensor | None) -> None:
        self.heads = heads
        self.caches = [
            torch.zeros_like(reference[:, :, :, :, h.start : h.stop])
            if reference is not None
            else torch.zeros(model_layout(len(h)).cache_shape(NUM_BLOCKS))
            for h in heads
        ]
        self.ports = [
            RankKVPort(cache, h, HOST) for cache, h in zip(self.caches, heads, strict=True)
        ]
        self.peers = [LocalRankPeer(port, f"{name}-{r}") for r, port in enumerate(self.ports)]

    def shutdown(self) -> None:
        for peer in self.peers:
            peer.shutdown()


@pytest.fixture
def threads() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as pool:
        yield pool


def _open(
    prefill: Worker, decode: Worker, transport: str, threads: ThreadPoolExecutor
) -> tuple[RankedChannel, RankedChannel]:
    moves = plan_head_moves(prefill.heads, decode.heads)
    listener = RankedListener(transport, "p->d/0", moves, prefill.peers, TIMEOUT_S)
    joined = threads.submit(
        RankedChannel.connect, listener.rendezvous, listener.pairs, decode.peers, TIMEOUT_S
    )
    sender = listener.accept(TIMEOUT_S)
    listener.close()  # accepted: the pairs stay open
    return sender, joined.result(TIMEOUT_S)


def _ticket(transfer_id: int, timeout_s: float = TIMEOUT_S) -> TransferTicket:
    return TransferTicket(transfer_id, f"r{transfer_id}", len(SOURCE_BLOCKS), timeout_s)


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("transport", ["gloo", "shm"])
@pytest.mark.parametrize(
    ("num_kv_heads", "prefill_size", "decode_size"),
    [
        (2, 1, 2),
        (2, 2, 1),
        (2, 2, 2),
        (4, 2, 4),
        (1, 1, 2),
    ],
)
def test_each_decode_rank_gets_exactly_its_heads(
    transport: str,
    num_kv_heads: int,
    prefill_size: int,
    decode_size: int,
    threads: ThreadPoolExecutor,
) -> None:
    reference = random_cache(model_layout(num_kv_heads), NUM_BLOCKS, seed=7)
    prefill = Worker("p", rank_heads(num_kv_heads, prefill_size), None)
    for cache, heads in zip(prefill.caches, prefill.heads, strict=True):
        cache.copy_(reference[:, :, :, :, heads.start : heads.stop])
    decode = Worker("d", rank_heads(num_kv_heads, decode_size), reference)
    try:
        sender, receiver = _open(prefill, decode, transport, threads)
        assert (
            sender.num_pairs
            == receiver.num_pairs
            == len(plan_head_moves(prefill.heads, decode.heads))
        )
        received = threads.submit(receiver.recv_blocks, None, TARGET_BLOCKS, _ticket(0))
        sent = sender.send_blocks(None, SOURCE_BLOCKS, _ticket(0))
        stats = received.result(TIMEOUT_S)
        # each decode rank was sent its own heads and no others
        head_bytes = len(SOURCE_BLOCKS) * model_layout(1).block_nbytes
        assert stats.nbytes == sent.nbytes == head_bytes * sum(len(h) for h in decode.heads)
        for cache, heads in zip(decode.caches, decode.heads, strict=True):
            mine = reference[:, :, :, :, heads.start : heads.stop]
            assert torch.equal(cache[:, :, TARGET_BLOCKS], mine[:, :, SOURCE_BLOCKS])
            untouched = [b for b in range(NUM_BLOCKS) if b not in TARGET_BLOCKS]
            assert not cache[:, :, untouched].any()
        sender.close()
        receiver.close()
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_failed_pair_fails_the_transfer_on_both_ends_and_breaks_the_channel(
    threads: ThreadPoolExecutor,
) -> None:
    reference = random_cache(model_layout(2), NUM_BLOCKS, seed=3)
    prefill = Worker("p", rank_heads(2, 1), reference)
    decode = Worker("d", rank_heads(2, 2), reference)
    try:
        sender, receiver = _open(prefill, decode, "gloo", threads)
        # decode rank 1's end of its pair goes away (its rank died, say)
        pair_ids = [pair_id for _, pair_id in receiver._links]
        decode.peers[1].send(ClosePair(pair_ids[1])).result(TIMEOUT_S)
        received = threads.submit(receiver.recv_blocks, None, TARGET_BLOCKS, _ticket(0, 2.0))
        with pytest.raises(TransferError, match="rank pair"):
            sender.send_blocks(None, SOURCE_BLOCKS, _ticket(0, 2.0))
        with pytest.raises(TransferError, match="rank pair"):
            received.result(TIMEOUT_S)
        assert sender.broken and receiver.broken
        # every pair of both ends is closed: nothing stays open on any rank
        ports = [*prefill.ports, *decode.ports]
        assert _wait_until(lambda: all(port.num_open == 0 for port in ports), TIMEOUT_S)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_pair_the_decode_side_cannot_hold_is_refused_naming_the_field(
    threads: ThreadPoolExecutor,
) -> None:
    reference = random_cache(model_layout(2), NUM_BLOCKS, seed=5)
    prefill = Worker("p", rank_heads(2, 1), reference)
    decode = Worker("d", rank_heads(2, 2), reference)
    one_rank = Worker("d1", rank_heads(2, 1), reference)
    try:
        moves = plan_head_moves(prefill.heads, decode.heads)
        listener = RankedListener("gloo", "p->d/1", moves, prefill.peers, TIMEOUT_S)
        # a decode worker of one rank is told of a pair for its rank 1
        with pytest.raises(ValueError, match="decode_rank 1 .* tensor_parallel_size 1"):
            RankedChannel.connect(listener.rendezvous, listener.pairs, one_rank.peers, TIMEOUT_S)
        # decode ranks that hold other heads than the pairs move: each handshake names kv_heads
        swapped = [decode.peers[1], decode.peers[0]]
        with pytest.raises(TransferError, match="kv_heads"):
            RankedChannel.connect(listener.rendezvous, listener.pairs, swapped, TIMEOUT_S)
        listener.close()
    finally:
        prefill.shutdown()
        decode.shutdown()
        one_rank.shutdown()
