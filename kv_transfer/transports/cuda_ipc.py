"""`cuda_ipc` transport: the receiver copies the blocks straight out of the sender's KV cache.

Lifecycle: listen (control socket on host) → receiver connects, handshake → per transfer:

  sender   BEGIN (JSON: the ticket's ids, its block ids, the CRC32 of its blocks when the
           ticket asks for a checksum, and the first time it sends from a cache that cache's
           CUDA IPC handle) → waits for DONE; its blocks are leased until then
  receiver checks BEGIN (a mismatch answers DONE with the reason) → maps the sender's cache
           (once per channel and cache: torch's ``_new_shared_cuda``, on the receiver's index
           of the GPU) → copies every block pair in one kernel (`block_copy`) on its own
           stream (`CopyStream`) and synchronises it → (checksum: CRC32 of what landed) →
           DONE (JSON ok / reason)

→ close drops the mapping (torch's IPC reference counter keeps the sender's cache allocated
until every receiver let go). Each byte is read once and written once, what a device-to-device
copy of the same bytes costs; a staged design (gather into a shared buffer, scatter out of it)
moves every byte twice. The sender does no GPU work unless the ticket asks for a checksum: its
blocks were written by a prefill step whose output the host has read back, so they are there.
NCCL cannot pair two ranks on one GPU; this is the same-GPU path. Needs two processes.
"""

from __future__ import annotations

import base64
import math
import time
from typing import Any

import torch

from kv_transfer.block_copy import copy_blocks
from kv_transfer.checksum import StreamingCrc32
from kv_transfer.chunking import (
    BlockIds,
    chunk_view,
    gather_chunk,
    heads_view,
    plan_chunks,
    planes_view,
)
from kv_transfer.deadline import Deadline
from kv_transfer.errors import ProtocolError, TransferError
from kv_transfer.handshake import send_welcome, welcome_field
from kv_transfer.layout import KVCacheLayout, describe_heads
from kv_transfer.messages import ChannelRendezvous, TransferStats
from kv_transfer.transports.base import Endpoint, Move, PhaseTimer
from kv_transfer.transports.control import ControlListener, open_control
from kv_transfer.transports.copy_stream import CopyStream
from kv_transfer.wire import FramedConnection, Kind, decode_json

_HANDLE_FIELDS = 8  # torch's _share_cuda_: device, handle, size, offset, ref counter, its
# offset, event, event sync


def _require_cuda(device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"the cuda_ipc transport needs a CUDA device, got {device}")


def share_cache(kv_cache: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC handle of ``kv_cache`` (contiguous) as JSON-able data for `map_cache`."""
    fields = kv_cache.untyped_storage()._share_cuda_()
    return {
        "fields": [_encode(value) for value in fields],
        "offset": kv_cache.storage_offset(),  # in elements
        "num_blocks": int(kv_cache.shape[2]),
    }


def map_cache(handle: dict[str, Any], layout: KVCacheLayout, device: torch.device) -> torch.Tensor:
    """The sender's cache, mapped into this process on ``device``; `ProtocolError` for a
    malformed handle or one whose memory cannot hold the cache it describes."""
    try:
        fields = [_decode(value) for value in handle["fields"]]
        offset, num_blocks = int(handle["offset"]), int(handle["num_blocks"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed CUDA IPC handle: {exc}") from exc
    if len(fields) != _HANDLE_FIELDS:
        raise ProtocolError(f"malformed CUDA IPC handle: {len(fields)} fields, not 8")
    shape = layout.cache_shape(num_blocks)
    numel = math.prod(shape)
    needed = (offset + numel) * layout.torch_dtype.itemsize
    if offset < 0 or num_blocks <= 0 or not isinstance(fields[2], int) or fields[2] < needed:
        _release_ref_counter(fields)
        raise ProtocolError(
            f"the sender's CUDA IPC handle maps {fields[2]!r} B, not the {needed} B of a "
            f"{num_blocks}-block cache at element {offset}"
        )
    torch.cuda._lazy_init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    # fields[0] is the sender's index of the GPU, which the receiver may number otherwise
    # (another CUDA_VISIBLE_DEVICES); _new_shared_cuda maps the memory on the device it names
    fields[0] = index
    with torch.cuda.device(index):
        try:
            # waits for the sender's event on the calling thread's current stream: the caller
            # maps under the stream that reads the mapping (CudaIpcEndpoint.recv)
            storage = torch.UntypedStorage._new_shared_cuda(*fields)
        except Exception:  # no storage, so no deleter to give the counter back
            _release_ref_counter(fields)
            raise
        flat = torch.empty(0, dtype=layout.torch_dtype, device=torch.device("cuda", index))
        flat.set_(storage)  # every element of the sender's storage
    return flat[offset : offset + numel].view(shape)


def _release_ref_counter(fields: list[object]) -> None:
    """Give back the reference the sender's ``_share_cuda_`` counted for this mapping, when no
    storage was built from it (a storage's deleter gives it back when the storage is freed).
    torch's own ``rebuild_cuda_tensor`` does the same on its path that builds none: while a
    share's counter is above zero, the sender's allocator keeps the memory out of use even after
    the sender frees it. Best effort, as in torch (a sender that exited has no counter)."""
    handle, slot = fields[4], fields[5]
    if isinstance(handle, bytes) and type(slot) is int and torch.cuda.is_available():
        torch.UntypedStorage._release_ipc_counter_cuda(handle, slot)


def _encode(value: object) -> object:
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    return value


def _decode(value: object) -> object:
    if isinstance(value, dict):
        return base64.b64decode(value["b64"])
    return value


def _require_whole_cache(layout: KVCacheLayout) -> None:
    """The receiver maps the sender's cache in its own layout and copies whole planes: both
    ends must hold, and move, the same heads."""
    if not layout.moves_whole_cache:
        raise ValueError(
            f"the cuda_ipc transport moves whole caches; moved_kv_heads "
            f"{describe_heads(layout.moved_heads)} of a cache holding "
            f"{describe_heads(layout.kv_heads)} needs gloo, nccl or shm"
        )


def _crc_of_blocks(
    kv_cache: torch.Tensor, block_ids: BlockIds, layout: KVCacheLayout, chunk_bytes: int
) -> int:
    """CRC32 of the blocks in transfer order (each chunk gathered into one scratch buffer)."""
    crc = StreamingCrc32()
    planes = heads_view(kv_cache, layout)
    scratch = torch.empty(chunk_bytes, dtype=torch.uint8, device=planes.device)
    for chunk in plan_chunks(layout, len(block_ids.values), chunk_bytes):
        out = chunk_view(scratch, chunk, layout)
        gather_chunk(planes, block_ids, chunk, out)
        crc.update(out)
    return crc.value


class CudaIpcEndpoint(Endpoint):
    """Either end of a cuda_ipc channel: the sender's remembers which cache it shared, the
    receiver's holds the mapping of it."""

    def __init__(
        self, layout: KVCacheLayout, conn: FramedConnection, device: torch.device, chunk_bytes: int
    ) -> None:
        super().__init__(layout)
        self._conn = conn
        self._device = device
        self._chunk_bytes = chunk_bytes  # checksum scratch: the CRC is over chunks this size
        self._stream = CopyStream(device)
        self._shared: tuple[int, int] | None = None  # sender: (address, blocks) it shared
        self._mapped: torch.Tensor | None = None  # receiver: the sender's cache

    def send(self, move: Move) -> TransferStats:
        ticket, deadline, timer = move.ticket, move.deadline, PhaseTimer()
        begin: dict[str, Any] = {
            "transfer_id": ticket.transfer_id,
            "request_id": ticket.request_id,
            "num_blocks": ticket.num_blocks,
            "checksum": ticket.checksum,
            "block_ids": list(move.block_ids.values),
        }
        cache_key = (move.kv_cache.data_ptr(), int(move.kv_cache.shape[2]))
        if self._shared != cache_key:
            # _share_cuda_ records the event the receiver waits for on the current stream (past
            # 1000 live shares it synchronises that stream instead): this channel's, so neither
            # waits for the engine's queued steps; the blocks were ready before (see the top)
            with self._stream.active():
                begin["cache"] = share_cache(move.kv_cache)
            self._shared = cache_key
        if ticket.checksum:
            start = time.perf_counter()
            with self._stream.active():
                begin["crc"] = _crc_of_blocks(
                    move.kv_cache, move.block_ids, self.layout, self._chunk_bytes
                )
            timer.checksum_s += time.perf_counter() - start
        self._conn.send_json(Kind.BEGIN, begin, deadline)
        start = time.perf_counter()
        kind, payload = self._conn.recv(deadline)
        timer.wire_s += time.perf_counter() - start
        if kind != Kind.DONE:
            raise ProtocolError(f"expected DONE from the peer, got {kind.name}")
        outcome = decode_json(payload)
        if not outcome.get("ok"):
            raise TransferError(f"the receiver failed the transfer: {outcome.get('reason')}")
        return timer.stats(ticket, ticket.num_blocks * self.layout.moved_block_nbytes, 1)

    def recv(self, move: Move) -> TransferStats:
        ticket, deadline, timer = move.ticket, move.deadline, PhaseTimer()
        start = time.perf_counter()
        begin = decode_json(self._conn.expect(Kind.BEGIN, deadline))
        timer.wire_s += time.perf_counter() - start
        # Mapping makes the current stream wait for the sender's event, and dropping a mapping
        # (a new cache) synchronises the current stream (torch's _new_shared_cuda and its
        # deleter): the copy's stream, a non-blocking one the default stream does not order
        with self._stream.active():
            src_ids = self._check_begin(begin, move, deadline)
            assert self._mapped is not None
            start = time.perf_counter()
            src = planes_view(self._mapped, self.layout)
            dst = planes_view(move.kv_cache, self.layout)
            copy_blocks(src, src_ids.tensor, dst, move.block_ids.tensor)
            self._stream.synchronize()
            timer.scatter_s += time.perf_counter() - start
            reason = None
            if ticket.checksum:  # read back what landed in the cache
                start = time.perf_counter()
                crc = _crc_of_blocks(move.kv_cache, move.block_ids, self.layout, self._chunk_bytes)
                timer.checksum_s += time.perf_counter() - start
                if crc != begin.get("crc"):
                    reason = f"checksum mismatch: sender {begin.get('crc')}, received {crc}"
        self._conn.send_json(Kind.DONE, {"ok": reason is None, "reason": reason}, deadline)
        if reason is not None:
            raise TransferError(reason)
        return timer.stats(ticket, ticket.num_blocks * self.layout.moved_block_nbytes, 1)

    def _check_begin(self, begin: dict[str, Any], move: Move, deadline: Deadline) -> BlockIds:
        """The sender's block ids, on this device. A BEGIN that is not the transfer this side
        expects, or names blocks its cache lacks, is refused (DONE with the reason)."""
        reason = self._refusal(begin, move)
        if reason is not None:
            self._conn.send_json(Kind.DONE, {"ok": False, "reason": reason}, deadline)
            raise ProtocolError(reason)
        return BlockIds(tuple(begin["block_ids"]), self._device)  # checked by _refusal

    def _refusal(self, begin: dict[str, Any], move: Move) -> str | None:
        """Why this BEGIN cannot be received, or None; maps a cache it carries."""
        ticket = move.ticket
        if "cache" in begin:  # first, so that a refused transfer still leaves the cache mapped
            self._mapped = None
            try:
                self._mapped = map_cache(begin["cache"], self.layout, self._device)
            except (ProtocolError, RuntimeError, TypeError, ValueError) as exc:
                # TypeError, ValueError: torch's own checks of the handle's fields
                return f"cannot map the sender's cache: {exc}"
        theirs = (begin.get("transfer_id"), begin.get("num_blocks"), begin.get("checksum"))
        if theirs != (ticket.transfer_id, ticket.num_blocks, ticket.checksum):
            return (
                f"the sender started transfer {theirs[0]} (request {begin.get('request_id')!r}, "
                f"{theirs[1]} blocks, checksum={theirs[2]}), the receiver expects "
                f"{ticket.label} ({ticket.num_blocks} blocks, checksum={ticket.checksum})"
            )
        if self._mapped is None:
            return "the sender's first BEGIN carried no CUDA IPC handle of its cache"
        block_ids, cache_blocks = begin.get("block_ids"), int(self._mapped.shape[2])
        if not isinstance(block_ids, list) or len(block_ids) != ticket.num_blocks:
            return (
                f"the sender's block_ids are not a list of {ticket.num_blocks}: {block_ids!r:.200}"
            )
        if not all(type(b) is int and 0 <= b < cache_blocks for b in block_ids):
            return f"the sender's block_ids are not all in [0, {cache_blocks}): {block_ids!r:.200}"
        if len(set(block_ids)) != len(block_ids):
            return "the sender's block_ids repeat"
        return None

    def abort(self) -> None:
        self._conn.shutdown()

    def close(self) -> None:
        self._conn.close()
        with self._stream.active():  # the mapping's deleter synchronises the current stream
            self._mapped = None


class CudaIpcListener(ControlListener):
    def __init__(
        self,
        layout: KVCacheLayout,
        host: str,
        channel_id: str,
        device: torch.device,
        chunk_bytes: int,
    ) -> None:
        _require_cuda(device)
        _require_whole_cache(layout)
        super().__init__("cuda_ipc", layout, host, channel_id)
        self._device = device
        self._chunk_bytes = chunk_bytes

    def establish(self, conn: FramedConnection, deadline: Deadline) -> Endpoint:
        send_welcome(conn, self.layout, {"chunk_bytes": self._chunk_bytes}, deadline)
        return CudaIpcEndpoint(self.layout, conn, self._device, self._chunk_bytes)


def connect_cuda_ipc(
    rendezvous: ChannelRendezvous, layout: KVCacheLayout, device: torch.device, deadline: Deadline
) -> Endpoint:
    _require_cuda(device)
    _require_whole_cache(layout)
    conn, welcome = open_control(rendezvous, layout, deadline)
    try:
        chunk_bytes = welcome_field(welcome, "chunk_bytes", int)
    except BaseException:
        conn.close()
        raise
    return CudaIpcEndpoint(layout, conn, device, chunk_bytes)
