"""The cuda_ipc transport's protocol and its CUDA IPC handle, on a CPU build.

The protocol tests run both endpoints in this process over a real control connection, with the
one thing a CPU build cannot do, mapping another process's GPU memory, replaced by handing the
receiver the sender's cache tensor itself (`share_cache` / `map_cache`); the copy is the real
Triton kernel in its interpreter. The handle tests stub torch's CUDA entry points to see what
``map_cache`` asks of them. test_gpu.py runs the real thing between two processes.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from kv_transfer import KVCacheLayout, TransferError, TransferTicket
from kv_transfer.chunking import BlockIds
from kv_transfer.deadline import Deadline
from kv_transfer.errors import ProtocolError
from kv_transfer.transports import cuda_ipc
from kv_transfer.transports.base import Move
from kv_transfer.transports.copy_stream import CopyStream
from kv_transfer.transports.cuda_ipc import CudaIpcEndpoint, map_cache
from kv_transfer.wire import FramedConnection, Kind, accept, bind_listener, connect, decode_json
from tests.kv_transfer.helpers import CPU, HOST, random_cache, small_layout

LAYOUT = small_layout("bfloat16")
CHUNK_BYTES = 2 * LAYOUT.block_nbytes  # the checksum reads two blocks at a time


@pytest.fixture
def shared_caches(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The caches the sender shared, in order; the receiver 'maps' one by taking it."""
    shared: list[torch.Tensor] = []

    def share(kv_cache: torch.Tensor) -> dict[str, Any]:
        shared.append(kv_cache)
        return {"index": len(shared) - 1}

    def open_shared(handle: dict[str, Any], layout: KVCacheLayout, device: Any) -> torch.Tensor:
        return shared[handle["index"]]

    monkeypatch.setattr(cuda_ipc, "share_cache", share)
    monkeypatch.setattr(cuda_ipc, "map_cache", open_shared)
    return shared


@contextlib.contextmanager
def connections() -> Iterator[tuple[FramedConnection, FramedConnection]]:
    server = bind_listener(HOST)
    try:
        deadline = Deadline.after(10)
        receiving = connect(HOST, server.getsockname()[1], deadline)
        sending = accept(server, deadline)
        try:
            yield sending, receiving
        finally:
            sending.close()
            receiving.close()
    finally:
        server.close()


@contextlib.contextmanager
def endpoints() -> Iterator[tuple[CudaIpcEndpoint, CudaIpcEndpoint]]:
    with connections() as (sending, receiving):
        sender = CudaIpcEndpoint(LAYOUT, sending, CPU, CHUNK_BYTES)
        receiver = CudaIpcEndpoint(LAYOUT, receiving, CPU, CHUNK_BYTES)
        try:
            yield sender, receiver
        finally:
            sender.close()
            receiver.close()


def _move(cache: torch.Tensor, ids: list[int], ticket: TransferTicket) -> Move:
    block_ids = BlockIds.build(ids, cache.shape[2], CPU)
    return Move(cache, block_ids, ticket, Deadline.after(ticket.timeout_s))


def _transfer(
    sender: CudaIpcEndpoint,
    receiver: CudaIpcEndpoint,
    src: tuple[torch.Tensor, list[int]],
    dst: tuple[torch.Tensor, list[int]],
    ticket: TransferTicket,
) -> None:
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(receiver.recv, _move(*dst, ticket))
        try:
            sender.send(_move(*src, ticket))
        finally:
            received.result()


def _expected(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]):
    expected = dst.clone()
    expected[:, :, dst_ids] = src[:, :, src_ids]
    return expected.view(torch.int16)


@pytest.mark.parametrize("checksum", [False, True])
def test_blocks_land_in_their_own_ids_and_the_cache_is_shared_once(
    shared_caches: list[torch.Tensor], checksum: bool
) -> None:
    src, dst = random_cache(LAYOUT, 20, seed=1), random_cache(LAYOUT, 30, seed=2)
    moves = [([3, 17, 9, 4, 5], [2, 8, 29, 0, 14]), ([0], [1]), ([19, 18, 1], [3, 4, 5])]
    with endpoints() as (sender, receiver):
        for transfer_id, (src_ids, dst_ids) in enumerate(moves):
            expected = _expected(dst, dst_ids, src, src_ids)
            ticket = TransferTicket(transfer_id, f"r{transfer_id}", len(src_ids), 10.0, checksum)
            _transfer(sender, receiver, (src, src_ids), (dst, dst_ids), ticket)
            assert torch.equal(dst.view(torch.int16), expected)
        assert len(shared_caches) == 1

        other = random_cache(LAYOUT, 12, seed=3)  # another cache (a restarted engine's)
        expected = _expected(dst, [7], other, [11])
        _transfer(sender, receiver, (other, [11]), (dst, [7]), TransferTicket(3, "r3", 1, 10.0))
        assert torch.equal(dst.view(torch.int16), expected)
        assert len(shared_caches) == 2


def test_the_cache_is_shared_and_mapped_under_the_channels_stream(
    shared_caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's _share_cuda_ records the event the receiver waits for on the current stream, and
    _new_shared_cuda makes the current stream wait for it: both must be the channel's own (the
    copy runs there; the engine's default stream does not order it, nor should it wait)."""
    active: set[int] = set()  # the threads inside a CopyStream.active block
    seen: list[tuple[str, bool]] = []
    share, open_shared = cuda_ipc.share_cache, cuda_ipc.map_cache

    @contextlib.contextmanager
    def track(stream: CopyStream) -> Iterator[None]:
        active.add(threading.get_ident())
        try:
            yield
        finally:
            active.discard(threading.get_ident())

    def shared(kv_cache: torch.Tensor) -> dict[str, Any]:
        seen.append(("share", threading.get_ident() in active))
        return share(kv_cache)

    def mapped(handle: dict[str, Any], layout: KVCacheLayout, device: Any) -> torch.Tensor:
        seen.append(("map", threading.get_ident() in active))
        return open_shared(handle, layout, device)

    monkeypatch.setattr(CopyStream, "active", track)
    monkeypatch.setattr(cuda_ipc, "share_cache", shared)
    monkeypatch.setattr(cuda_ipc, "map_cache", mapped)
    src, dst = random_cache(LAYOUT, 8, seed=1), random_cache(LAYOUT, 8, seed=2)
    with endpoints() as (sender, receiver):
        _transfer(sender, receiver, (src, [1]), (dst, [2]), TransferTicket(0, "r0", 1, 10.0))
    assert sorted(seen) == [("map", True), ("share", True)]


def test_a_transfer_the_receiver_does_not_expect_is_refused_with_the_reason(
    shared_caches: list[torch.Tensor],
) -> None:
    src, dst = random_cache(LAYOUT, 8, seed=1), random_cache(LAYOUT, 8, seed=2)
    before = dst.clone()
    with endpoints() as (sender, receiver), ThreadPoolExecutor(1) as pool:
        received = pool.submit(receiver.recv, _move(dst, [1, 2], TransferTicket(7, "a", 2, 10.0)))
        with pytest.raises(TransferError, match="receiver expects transfer 7"):
            sender.send(_move(src, [3, 4], TransferTicket(6, "b", 2, 10.0)))
        with pytest.raises(ProtocolError, match="sender started transfer 6"):
            received.result()
    assert torch.equal(dst, before)


def test_a_landed_block_that_differs_from_the_sent_one_fails_the_checksum(
    shared_caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    def torn_copy(src: torch.Tensor, src_ids: Any, dst: torch.Tensor, dst_ids: Any) -> None:
        dst[:, dst_ids] = src[:, src_ids]
        dst[-1, dst_ids[-1], -1] += 1  # the last byte pair of the last block is off

    monkeypatch.setattr(cuda_ipc, "copy_blocks", torn_copy)
    src, dst = random_cache(LAYOUT, 8, seed=1), random_cache(LAYOUT, 8, seed=2)
    ticket = TransferTicket(0, "r0", 3, 10.0, checksum=True)
    with endpoints() as (sender, receiver), ThreadPoolExecutor(1) as pool:
        received = pool.submit(receiver.recv, _move(dst, [0, 1, 2], ticket))
        with pytest.raises(TransferError, match="checksum mismatch"):
            sender.send(_move(src, [5, 6, 7], ticket))
        with pytest.raises(TransferError, match="checksum mismatch"):
            received.result()


def _begin(**fields: Any) -> dict[str, Any]:
    begin = {"transfer_id": 0, "request_id": "r", "num_blocks": 2, "checksum": False}
    return {**begin, "cache": {"index": 0}, "block_ids": [1, 2], **fields}


@pytest.mark.parametrize(
    ("begin", "reason"),
    [
        (_begin(block_ids=[1, 8]), r"not all in \[0, 8\)"),
        (_begin(block_ids=[-1, 2]), r"not all in \[0, 8\)"),
        (_begin(block_ids=[1, "2"]), r"not all in \[0, 8\)"),
        (_begin(block_ids=[1, 2, 3]), "not a list of 2"),
        (_begin(block_ids={"1": 2}), "not a list of 2"),
        (_begin(block_ids=[3, 3]), "repeat"),
        ({k: v for k, v in _begin().items() if k != "cache"}, "carried no CUDA IPC handle"),
    ],
)
def test_a_begin_naming_blocks_the_senders_cache_lacks_is_refused(
    shared_caches: list[torch.Tensor], begin: dict[str, Any], reason: str
) -> None:
    shared_caches.append(random_cache(LAYOUT, 8, seed=1))
    dst = random_cache(LAYOUT, 8, seed=2)
    before = dst.clone()
    with connections() as (sending, receiving), ThreadPoolExecutor(1) as pool:
        receiver = CudaIpcEndpoint(LAYOUT, receiving, CPU, CHUNK_BYTES)
        received = pool.submit(receiver.recv, _move(dst, [0, 1], TransferTicket(0, "r", 2, 10.0)))
        sending.send_json(Kind.BEGIN, begin, Deadline.after(10))
        kind, payload = sending.recv(Deadline.after(10))
        assert kind == Kind.DONE
        with pytest.raises(ProtocolError, match=reason):
            received.result()
        receiver.close()
    outcome = decode_json(payload)
    assert outcome["ok"] is False and re.search(reason, outcome["reason"])
    assert torch.equal(dst, before)


@pytest.mark.parametrize("error", [ProtocolError, RuntimeError, TypeError])
def test_a_cache_the_receiver_cannot_map_is_refused_with_the_reason(
    shared_caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    """Whatever torch raises on a bad handle, the sender hears why at once (DONE), rather than
    when the receiver's channel is torn down."""

    def unmappable(handle: dict[str, Any], layout: KVCacheLayout, device: Any) -> torch.Tensor:
        raise error("no such handle")

    monkeypatch.setattr(cuda_ipc, "map_cache", unmappable)
    src, dst = random_cache(LAYOUT, 8, seed=1), random_cache(LAYOUT, 8, seed=2)
    ticket = TransferTicket(0, "r0", 1, 10.0)
    with endpoints() as (sender, receiver), ThreadPoolExecutor(1) as pool:
        received = pool.submit(receiver.recv, _move(dst, [2], ticket))
        with pytest.raises(TransferError, match="cannot map the sender's cache: no such handle"):
            sender.send(_move(src, [1], ticket))
        with pytest.raises(ProtocolError, match="cannot map"):
            received.result()


def test_a_receiver_waiting_for_a_transfer_is_unblocked_by_abort(
    shared_caches: list[torch.Tensor],
) -> None:
    dst = random_cache(LAYOUT, 8, seed=2)
    with endpoints() as (_, receiver), ThreadPoolExecutor(1) as pool:
        received = pool.submit(receiver.recv, _move(dst, [0], TransferTicket(0, "r", 1, 30.0)))
        receiver.abort()
        with pytest.raises((ConnectionError, OSError)):
            received.result(timeout=60)


# ---- the CUDA IPC handle, with torch's CUDA entry points stubbed --------------------------


class _Mapped(Exception):
    """Raised by the stub once it has the arguments (a CPU build cannot go further)."""


def _handle(sender_index: int, size: int = 1 << 20, num_blocks: int = 4) -> dict[str, Any]:
    fields = [sender_index, b"h" * 64, size, 0, b"/torch_ref", 0, b"e" * 64, True]
    encoded = [{"b64": "aA=="} if isinstance(f, bytes) else f for f in fields]
    return {"fields": encoded, "offset": 0, "num_blocks": num_blocks}


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, int]]:
    """The sender's reference counters the receiver gave back without mapping."""
    calls: list[tuple[bytes, int]] = []

    def release_ipc_counter_cuda(handle: bytes, slot: int) -> None:
        calls.append((handle, slot))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.UntypedStorage, "_release_ipc_counter_cuda", release_ipc_counter_cuda, raising=False
    )
    return calls


@pytest.fixture
def mapped_on(monkeypatch: pytest.MonkeyPatch, released: list[tuple[bytes, int]]) -> list[int]:
    """The device index each ``_new_shared_cuda`` call named."""
    calls: list[int] = []

    def new_shared_cuda(*fields: Any) -> Any:
        calls.append(fields[0])
        raise _Mapped

    @contextlib.contextmanager
    def device(index: Any) -> Iterator[None]:
        yield

    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", new_shared_cuda, raising=False)
    return calls


def test_the_cache_is_mapped_on_the_receivers_index_of_the_gpu(mapped_on: list[int]) -> None:
    """torch maps the memory on the index the handle's first field names, which is the sender's
    numbering of the GPU; another CUDA_VISIBLE_DEVICES numbers it otherwise."""
    with pytest.raises(_Mapped):
        map_cache(_handle(sender_index=1), LAYOUT, torch.device("cuda", 0))
    with pytest.raises(_Mapped):  # "cuda" alone: the current device
        map_cache(_handle(sender_index=1), LAYOUT, torch.device("cuda"))
    assert mapped_on == [0, 2]


def test_a_handle_without_its_eight_fields_is_a_protocol_error(mapped_on: list[int]) -> None:
    handle = _handle(0)
    handle["fields"] = handle["fields"][:3]
    with pytest.raises(ProtocolError, match="3 fields"):
        map_cache(handle, LAYOUT, torch.device("cuda", 0))
    assert mapped_on == []


def test_a_handle_to_less_memory_than_the_cache_it_describes_is_refused(
    mapped_on: list[int], released: list[tuple[bytes, int]]
) -> None:
    needed = 4 * LAYOUT.block_nbytes
    with pytest.raises(ProtocolError, match=f"not the {needed} B of a 4-block cache"):
        map_cache(_handle(0, size=needed - 2), LAYOUT, torch.device("cuda", 0))
    assert released == [(b"h", 0)]  # the sender's counter for this share, given back
    with pytest.raises(_Mapped):
        map_cache(_handle(0, size=needed), LAYOUT, torch.device("cuda", 0))
    assert mapped_on == [0]


def test_a_handle_torch_cannot_map_gives_the_senders_reference_back(
    mapped_on: list[int], released: list[tuple[bytes, int]]
) -> None:
    """Each _share_cuda_ counts one reference that only the storage built from it gives back;
    one never built would keep the sender's memory out of use after the sender frees it."""
    with pytest.raises(_Mapped):  # the stub's failure stands for torch's (cudaIpcOpenMemHandle)
        map_cache(_handle(0), LAYOUT, torch.device("cuda", 0))
    assert released == [(b"h", 0)]
