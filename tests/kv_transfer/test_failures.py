"""Deadlines, dead peers, refused tickets, corruption and busy channels."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from kv_transfer import KVChannel, TransferError, TransferTicket, TransferTimeoutError
from kv_transfer.chunking import BlockIds
from kv_transfer.transports.process_group import GroupEndpoint
from tests.kv_transfer.helpers import (
    CPU,
    HOST,
    open_pair,
    random_cache,
    small_layout,
    transfer,
    wait_until,
)
from tests.kv_transfer.peer import start_receiver

TRANSPORTS = ["gloo", "shm", "fake"]
SLACK_S = 3.0  # generous: other test suites share the two cores


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_send_times_out_when_the_peer_never_receives(transport: str) -> None:
    layout = small_layout()
    src, dst = random_cache(layout, 8, seed=0), random_cache(layout, 8, seed=1)
    sender, receiver = open_pair(transport, layout, f"deaf-{transport}", chunk_bytes=4096)
    ticket = TransferTicket(0, "req-deaf", 4, timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match=r"transfer 0 \(request 'req-deaf'\)"):
        sender.send_blocks(src, [0, 2, 4, 6], ticket)
    assert time.monotonic() - start < ticket.timeout_s + SLACK_S
    assert sender.broken
    # the receiver never hangs on the dead channel: it fails (or completes) within its deadline
    start = time.monotonic()
    late = TransferTicket(0, "req-deaf", 4, timeout_s=5.0)
    try:
        receiver.recv_blocks(dst, [1, 3, 5, 7], late)
    except TransferError:
        assert receiver.broken
    assert time.monotonic() - start < late.timeout_s + SLACK_S
    receiver.close()
    # a fresh channel under the same id works
    sender, receiver = open_pair(transport, layout, f"deaf-{transport}", chunk_bytes=4096)
    with sender, receiver:
        transfer(sender, receiver, (src, [0, 2]), (dst, [1, 3]), TransferTicket(1, "r", 2, 20.0))
    assert torch.equal(dst[:, :, [1, 3]], src[:, :, [0, 2]])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_recv_times_out_when_nothing_is_sent(transport: str) -> None:
    layout = small_layout()
    sender, receiver = open_pair(transport, layout, f"mute-{transport}")
    with sender, receiver:
        start = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="req-mute"):
            receiver.recv_blocks(
                random_cache(layout, 4, 0), [1], TransferTicket(3, "req-mute", 1, 0.5)
            )
        assert time.monotonic() - start < 0.5 + SLACK_S
        assert receiver.broken


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_killed_receiver_process_fails_the_sender_fast(transport: str) -> None:
    layout = small_layout()
    listener = KVChannel.listen(transport, layout, HOST, f"killed-{transport}", CPU)
    with listener:
        process, results = start_receiver(listener.rendezvous, layout, "idle", [], 8)
        sender = listener.accept(60.0)
    assert results.get(timeout=60)[0] == "connected"
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    ticket = TransferTicket(0, "req-orphan", 2, timeout_s=30.0)
    start = time.monotonic()
    with pytest.raises(TransferError, match="req-orphan"):
        sender.send_blocks(random_cache(layout, 8, 0), [1, 2], ticket)
    assert time.monotonic() - start < 10.0  # the dead peer is noticed, not waited out
    assert sender.broken


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_block_count_must_match_the_ticket(transport: str) -> None:
    layout = small_layout()
    cache = random_cache(layout, 8, 0)
    sender, receiver = open_pair(transport, layout, f"count-{transport}")
    with sender, receiver:
        ticket = TransferTicket(0, "req", 3, 5.0)
        with pytest.raises(ValueError, match="3 blocks"):
            sender.send_blocks(cache, [1, 2], ticket)
        with pytest.raises(ValueError, match="3 blocks"):
            receiver.recv_blocks(cache, [1, 2, 3, 4], ticket)
        with pytest.raises(ValueError, match="repeat"):
            receiver.recv_blocks(cache, [1, 1, 2], ticket)
        with pytest.raises(ValueError, match="out of range"):
            sender.send_blocks(cache, [1, 2, 8], ticket)
        assert not sender.broken and not receiver.broken
        transfer(sender, receiver, (cache, [0, 1, 2]), (cache.clone(), [5, 6, 7]), ticket)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tickets_that_disagree_are_refused(transport: str) -> None:
    layout = small_layout()
    cache = random_cache(layout, 8, 0)
    sender, receiver = open_pair(transport, layout, f"disagree-{transport}")
    with sender, receiver, ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(
            receiver.recv_blocks, cache.clone(), [4, 5], TransferTicket(5, "req-b", 2, 5.0)
        )
        with pytest.raises(TransferError):
            sender.send_blocks(cache, [1, 2, 3], TransferTicket(4, "req-a", 3, 5.0))
        with pytest.raises(TransferError, match="transfer 4.*3 blocks.*transfer 5"):
            receiving.result()
        assert sender.broken and receiver.broken


@pytest.mark.parametrize("receiver_blocks", [2, 3])  # 1 chunk of 3072 B, 2 chunks
@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_tickets_that_disagree_on_the_number_of_chunks_are_refused(
    transport: str, receiver_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender's ticket needs 3 chunks, the receiver's fewer. The receiver runs in its own
    process: gloo kills a process whose posted receive is smaller than the message under its
    tag (a receiver of 1 chunk once posted its 16-byte trailer under the sender's chunk 1 tag).
    The receiver checks the header only once the sender has posted chunk 1 (gloo)."""
    header_gate = multiprocessing.get_context("spawn").Event()
    num_sends = itertools.count(1)
    isend = GroupEndpoint._isend

    def isend_then_open_the_gate(self: GroupEndpoint, tensor: torch.Tensor, tag: int) -> Any:
        work = isend(self, tensor, tag)
        if next(num_sends) == 3:  # header, chunk 0, chunk 1
            header_gate.set()
        return work

    monkeypatch.setattr(GroupEndpoint, "_isend", isend_then_open_the_gate)
    layout = small_layout()  # 1536 B a block: two blocks a 4096-byte chunk
    listener = KVChannel.listen(
        transport, layout, HOST, f"chunks-{transport}-{receiver_blocks}", CPU, chunk_bytes=4096
    )
    receiver_ticket = TransferTicket(5, "req-b", receiver_blocks, 10.0)
    receiver_block_ids = list(range(4, 4 + receiver_blocks))
    with listener:
        process, results = start_receiver(
            listener.rendezvous,
            layout,
            "receive",
            [(receiver_ticket, receiver_block_ids)],
            8,
            header_gate,
        )
        sender = listener.accept(60.0)
    assert results.get(timeout=60)[0] == "connected"
    with sender, pytest.raises(TransferError):  # 3 chunks
        sender.send_blocks(
            random_cache(layout, 8, 0), [0, 1, 2, 3, 5], TransferTicket(4, "a", 5, 2.0)
        )
    process.join(30)
    assert process.exitcode == 0, f"the receiver died (exit code {process.exitcode})"
    outcome, detail = results.get(timeout=10)
    assert outcome == "error"
    expected = rf"TransferError: .*transfer 4.*5 blocks.*transfer 5.*{receiver_blocks} blocks"
    assert re.search(expected, detail)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receiver_after_the_sender_gave_up_fails(transport: str) -> None:
    """The sender timed out and tore its end down: the transfer is over, even if all it sent
    is still in reach (the fake's parcel), so the late receiver must not report success."""
    layout = small_layout()
    src, dst = random_cache(layout, 4, 0), random_cache(layout, 4, 1)
    sender, receiver = open_pair(transport, layout, f"late-{transport}")
    with sender, receiver:
        with pytest.raises(TransferTimeoutError):
            sender.send_blocks(src, [0], TransferTicket(0, "req-late", 1, 0.3))
        with pytest.raises(TransferError):
            receiver.recv_blocks(dst, [2], TransferTicket(0, "req-late", 1, 5.0))
        assert receiver.broken


@pytest.mark.parametrize(
    "module",
    [
        "kv_transfer.transports.process_group",
        "kv_transfer.transports.segment",
        "kv_transfer.transports.fake",
    ],
)
def test_checksum_catches_a_bad_scatter(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    transport = {"process_group": "gloo", "segment": "shm", "fake": "fake"}[module.split(".")[-1]]
    real_scatter = __import__(module, fromlist=["scatter_chunk"]).scatter_chunk

    def corrupting_scatter(
        planes: torch.Tensor, block_ids: BlockIds, chunk: object, src: torch.Tensor
    ) -> None:
        real_scatter(planes, block_ids, chunk, src)
        planes[0, block_ids.values[0], 0] += 1.0  # one wrong element

    monkeypatch.setattr(f"{module}.scatter_chunk", corrupting_scatter)
    layout = small_layout()
    src, dst = random_cache(layout, 8, 0), random_cache(layout, 8, 1)
    sender, receiver = open_pair(transport, layout, f"corrupt-{transport}")
    with sender, receiver, ThreadPoolExecutor(1) as pool:
        ticket = TransferTicket(0, "req-crc", 2, 10.0, checksum=True)
        receiving = pool.submit(receiver.recv_blocks, dst, [3, 4], ticket)
        with pytest.raises(TransferError, match="checksum"):
            sender.send_blocks(src, [1, 2], ticket)
        with pytest.raises(TransferError, match="checksum mismatch"):
            receiving.result()


@pytest.mark.parametrize("transport", ["shm", "fake"])
def test_concurrent_sends_are_serialized(transport: str) -> None:
    layout = small_layout()
    src, dst = random_cache(layout, 8, 0), random_cache(layout, 8, 1)
    sender, receiver = open_pair(transport, layout, f"queue-{transport}")
    tickets = [TransferTicket(i, f"req-{i}", 1, 20.0) for i in range(2)]
    with sender, receiver, ThreadPoolExecutor(2) as pool:
        first = pool.submit(sender.send_blocks, src, [1], tickets[0])
        assert wait_until(lambda: sender._lock.locked(), 10.0)
        second = pool.submit(sender.send_blocks, src, [2], tickets[1])
        receiver.recv_blocks(dst, [5], tickets[0])
        receiver.recv_blocks(dst, [6], tickets[1])
        first.result(), second.result()
    assert torch.equal(dst[:, :, [5, 6]], src[:, :, [1, 2]])


@pytest.mark.parametrize("transport", ["shm", "fake"])
def test_waiting_past_the_deadline_for_a_busy_channel_breaks_it(transport: str) -> None:
    layout = small_layout()
    src = random_cache(layout, 8, 0)
    sender, receiver = open_pair(transport, layout, f"busy-{transport}")
    with sender, receiver, ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(sender.send_blocks, src, [1], TransferTicket(0, "req-0", 1, 3.0))
        assert wait_until(lambda: sender._lock.locked(), 10.0)
        with pytest.raises(TransferTimeoutError, match="waiting for another transfer"):
            sender.send_blocks(src, [2], TransferTicket(1, "req-1", 1, 0.3))
        assert sender.broken
        with pytest.raises(TransferError):
            stuck.result(timeout=3.0 + SLACK_S)  # aborted, or at worst timed out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_closed_channel_refuses_transfers(transport: str) -> None:
    layout = small_layout()
    sender, receiver = open_pair(transport, layout, f"closed-{transport}")
    sender.close()
    sender.close()  # idempotent
    with pytest.raises(TransferError, match="broken"):
        sender.send_blocks(random_cache(layout, 4, 0), [1], TransferTicket(0, "r", 1, 1.0))
    receiver.close()
