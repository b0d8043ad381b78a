"""Pairwise torch process-group transport: `gloo` (CPU tensors) and `nccl` (GPU), one code path.

Lifecycle: `listen` (control socket bound to host) → receiver `connect` → handshake →
rendezvous of a 2-rank group (sender rank 0) through `ServedStore` / `RemoteStore` over the
control connection; gloo's own data socket is bound to the same cluster address → warm-up
exchange (creates NCCL's pair communicator while the store is still served) → control
connection closed → transfers → `close` aborts the group.

One transfer of n chunks uses tags base+1 … base+n+3 (`_Tags`; both ends derive them from the
transfer count and their own ticket). NCCL ignores tags and pairs each end's sends with the
other's receives in issue order, on one stream per peer, so both ends issue the same sequence:
  sender   HEADER int64[5] → chunk 0, 1, … (two staging slots: the gather of k+1 overlaps the
           wire of k) → TRAILER int64[2] (transfer id, crc32) → ACK receive, waited on
  receiver HEADER receive → checks it against its ticket → chunk 0 and 1 receives (never
           before: a message larger than its posted buffer aborts gloo) → scatters each chunk,
           reposting its slot for chunk k+2 → TRAILER receive → checks the checksum → ACK
           int64[2] (transfer id, status)
The group's own timeout (`GROUP_TIMEOUT`) is far longer than any transfer: every wait carries
the transfer's deadline, and NCCL's watchdog kills the process when an operation outlives the
group's timeout. Errors the watchdog sees (a dead peer, a comm aborted by a timed-out wait) are
left to the waits (`NCCL_ERROR_HANDLING_ENV`): by default it would kill the process for them too.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kv_transfer.checksum import StreamingCrc32
from kv_transfer.chunking import (
    Chunk,
    chunk_view,
    gather_chunk,
    heads_view,
    plan_chunks,
    scatter_chunk,
)
from kv_transfer.deadline import Deadline
from kv_transfer.errors import ProtocolError, TransferError
from kv_transfer.layout import KVCacheLayout
from kv_transfer.messages import TransferStats, TransferTicket
from kv_transfer.transports.base import Endpoint, Move, PhaseTimer
from kv_transfer.transports.copy_stream import CopyStream

_MAGIC = 0x4B565846  # "KVXF"
_TAG_SPACE = 1 << 30
_STATUS_OK, _STATUS_BAD_CHECKSUM = 0, 1
GROUP_TIMEOUT = timedelta(hours=2)  # past any transfer's deadline; see the module docstring
# By default (3) NCCL's watchdog takes the whole process down on any error it sees: a peer that
# died, or the comm that a timed-out wait aborted, under the channel's other in-flight operations.
# 0 leaves the error to the wait that carries the deadline, so only the channel fails.
NCCL_ERROR_HANDLING_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
_MIN_WAIT = timedelta(milliseconds=1)  # a wait of 0 ms is a wait without a timeout


def make_group(
    backend: str, store: dist.Store, rank: int, host: str, device: torch.device, deadline: Deadline
) -> Any:
    """A 2-rank process group without a global world; gloo's listener is bound to `host`.
    gloo connects while it is built, within `deadline`; NCCL builds its communicator at the
    first operation (the warm-up, which waits with the deadline)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = deadline.timedelta("building the process group")
        try:
            gloo_device = dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=False)
        except TypeError:  # torch without lazy gloo init
            gloo_device = dist.ProcessGroupGloo.create_device(hostname=host)
        options._devices = [gloo_device]
        return dist.ProcessGroupGloo(store, rank, 2, options)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not torch.cuda.is_available():
        raise RuntimeError("the nccl transport needs CUDA and a torch build with NCCL")
    if device.type != "cuda":
        raise ValueError(f"the nccl transport moves CUDA caches, not {device}")
    options = nccl.Options()
    options._timeout = GROUP_TIMEOUT
    os.environ.setdefault(*NCCL_ERROR_HANDLING_ENV)  # read by each group as it is built
    return nccl(store, rank, 2, options)


def _wait(work: Any, deadline: Deadline, what: str) -> None:
    try:
        # torch rounds the timeout down to whole ms, and 0 ms means none: NCCL would not block
        work.wait(max(deadline.timedelta(what), _MIN_WAIT))
    except RuntimeError as exc:
        if deadline.expired() or "Timed out" in str(exc):
            raise TimeoutError(f"{what}: {exc}") from exc
        raise ConnectionError(f"{what}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class _Tags:
    """Message tags of one transfer of `num_chunks` chunks, after `base`."""

    base: int
    num_chunks: int

    def header(self) -> int:
        return self._wrap(1)

    def chunk(self, index: int) -> int:
        return self._wrap(2 + index)

    def trailer(self) -> int:
        return self._wrap(2 + self.num_chunks)

    def ack(self) -> int:
        return self._wrap(3 + self.num_chunks)

    def _wrap(self, offset: int) -> int:
        return (self.base + offset) % _TAG_SPACE


class GroupEndpoint(Endpoint):
    """Either end of a pairwise group: rank 0 sends, rank 1 receives."""

    def __init__(
        self, layout: KVCacheLayout, group: Any, rank: int, device: torch.device, chunk_bytes: int
    ) -> None:
        super().__init__(layout)
        self._group = group
        self._peer = 1 - rank
        self._device = device
        self._chunk_bytes = chunk_bytes
        self._next_base = 0  # tags used so far
        self._slots: list[torch.Tensor] = []
        self._stream = CopyStream(device)  # transfers run on it: copies, and NCCL's waits

    def warm_up(self, deadline: Deadline) -> None:
        """One round trip, so both ends know the group works (and NCCL builds its comm)."""
        ping = torch.ones(1, dtype=torch.int64, device=self._device)
        if self._peer == 1:
            _wait(self._group.send([ping], 1, 1), deadline, "warm-up send")
            _wait(self._group.recv([ping], 1, 2), deadline, "warm-up receive")
        else:
            _wait(self._group.recv([ping], 0, 1), deadline, "warm-up receive")
            _wait(self._group.send([ping], 0, 2), deadline, "warm-up send")
        self._next_base = 2

    def _tags(self, num_chunks: int) -> _Tags:
        tags = _Tags(self._next_base, num_chunks)
        self._next_base = tags.ack()
        return tags

    def _isend(self, tensor: torch.Tensor, tag: int) -> Any:
        return self._group.send([tensor], self._peer, tag)

    def _irecv(self, tensor: torch.Tensor, tag: int) -> Any:
        return self._group.recv([tensor], self._peer, tag)

    def _small(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self._device)

    def _slot(self, index: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of staging slot `index` (0 or 1), grown as needed."""
        while len(self._slots) <= index:
            self._slots.append(torch.empty(0, dtype=torch.uint8, device=self._device))
        if self._slots[index].numel() < nbytes:
            self._slots[index] = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._slots[index][:nbytes]

    def send(self, move: Move) -> TransferStats:
        with self._stream.active():
            return self._send(move)

    def _send(self, move: Move) -> TransferStats:
        ticket, timer = move.ticket, PhaseTimer()
        plan = plan_chunks(self.layout, ticket.num_blocks, self._chunk_bytes)
        tags = self._tags(len(plan))
        header = self._small(
            [_MAGIC, ticket.transfer_id, ticket.num_blocks, self._chunk_bytes, int(ticket.checksum)]
        )
        header_work = self._isend(header, tags.header())
        crc = self._stream_out(move, plan, tags, timer)
        trailer = self._small([ticket.transfer_id, crc])
        trailer_work = self._isend(trailer, tags.trailer())
        ack = self._small([0, 0])
        ack_work = self._irecv(ack, tags.ack())
        for work, what in ((header_work, "header"), (trailer_work, "trailer")):
            self._timed_wait(work, move.deadline, timer, f"sending the {what}")
        self._timed_wait(ack_work, move.deadline, timer, "waiting for the receiver")
        ack_id, status = (int(v) for v in ack.tolist())
        if ack_id != ticket.transfer_id:
            raise ProtocolError(f"the receiver acknowledged transfer {ack_id}")
        if status == _STATUS_BAD_CHECKSUM:
            raise TransferError("the receiver found a checksum mismatch")
        return timer.stats(ticket, sum(c.nbytes for c in plan), len(plan))

    def _stream_out(self, move: Move, plan: list[Chunk], tags: _Tags, timer: PhaseTimer) -> int:
        """Gather each chunk into a free slot and post its send; return the crc32 (or 0)."""
        planes = heads_view(move.kv_cache, self.layout)
        crc = StreamingCrc32() if move.ticket.checksum else None
        in_flight: list[Any] = [None, None]
        for k, chunk in enumerate(plan):
            if in_flight[k % 2] is not None:
                self._timed_wait(in_flight[k % 2], move.deadline, timer, f"sending chunk {k - 2}")
            slot = self._slot(k % 2, chunk.nbytes)
            start = time.perf_counter()
            gather_chunk(planes, move.block_ids, chunk, chunk_view(slot, chunk, self.layout))
            self._stream.synchronize()
            timer.gather_s += time.perf_counter() - start
            if crc is not None:
                start = time.perf_counter()
                crc.update(slot)
                timer.checksum_s += time.perf_counter() - start
            in_flight[k % 2] = self._isend(slot, tags.chunk(k))
        for work in in_flight:
            if work is not None:
                self._timed_wait(work, move.deadline, timer, "sending the last chunks")
        return crc.value if crc is not None else 0

    def recv(self, move: Move) -> TransferStats:
        with self._stream.active():
            return self._recv(move)

    def _recv(self, move: Move) -> TransferStats:
        ticket, timer = move.ticket, PhaseTimer()
        plan = plan_chunks(self.layout, ticket.num_blocks, self._chunk_bytes)
        tags = self._tags(len(plan))
        header = self._small([0] * 5)
        header_work = self._irecv(header, tags.header())
        self._timed_wait(header_work, move.deadline, timer, "waiting for the header")
        # Chunk receives only once the header matched: gloo aborts the whole process when a
        # message does not fit the buffer posted for its tag.
        self._check_header([int(v) for v in header.tolist()], ticket)
        posted = [self._post_chunk(plan, k, tags) for k in range(min(2, len(plan)))]
        crc = self._stream_in(move, plan, tags, posted, timer)
        self._stream.synchronize()  # the engine reads these blocks on its own stream
        trailer = self._small([0, 0])
        trailer_work = self._irecv(trailer, tags.trailer())
        self._timed_wait(trailer_work, move.deadline, timer, "waiting for the trailer")
        sent_id, sent_crc = (int(v) for v in trailer.tolist())
        if sent_id != ticket.transfer_id:
            raise ProtocolError(f"trailer of transfer {sent_id}, expected {ticket.transfer_id}")
        ok = crc is None or crc == sent_crc
        ack = self._small([ticket.transfer_id, _STATUS_OK if ok else _STATUS_BAD_CHECKSUM])
        self._timed_wait(self._isend(ack, tags.ack()), move.deadline, timer, "acknowledging")
        if not ok:
            raise TransferError(f"checksum mismatch: sender {sent_crc:#x}, received {crc:#x}")
        return timer.stats(ticket, sum(c.nbytes for c in plan), len(plan))

    def _post_chunk(self, plan: list[Chunk], index: int, tags: _Tags) -> Any:
        return self._irecv(self._slot(index % 2, plan[index].nbytes), tags.chunk(index))

    def _check_header(self, header: list[int], ticket: TransferTicket) -> None:
        magic, transfer_id, num_blocks, chunk_bytes, checksum = header
        if magic != _MAGIC:
            raise ProtocolError(f"bad transfer header magic {magic:#x}")
        expected = (ticket.transfer_id, ticket.num_blocks, int(ticket.checksum), self._chunk_bytes)
        if (transfer_id, num_blocks, checksum, chunk_bytes) != expected:
            raise ProtocolError(
                f"the sender started transfer {transfer_id} with {num_blocks} blocks "
                f"(checksum={bool(checksum)}), this side expects transfer {ticket.transfer_id} "
                f"with {ticket.num_blocks} blocks (checksum={ticket.checksum})"
            )

    def _stream_in(
        self, move: Move, plan: list[Chunk], tags: _Tags, posted: list[Any], timer: PhaseTimer
    ) -> int | None:
        """Scatter each received chunk, reposting its slot; return the read-back crc32 or None."""
        planes = heads_view(move.kv_cache, self.layout)
        crc = StreamingCrc32() if move.ticket.checksum else None
        for k, chunk in enumerate(plan):
            self._timed_wait(posted[k % 2], move.deadline, timer, f"receiving chunk {k}")
            slot = self._slot(k % 2, chunk.nbytes)
            start = time.perf_counter()
            scatter_chunk(planes, move.block_ids, chunk, chunk_view(slot, chunk, self.layout))
            timer.scatter_s += time.perf_counter() - start
            if crc is not None:  # read back what landed in the cache
                start = time.perf_counter()
                gather_chunk(planes, move.block_ids, chunk, chunk_view(slot, chunk, self.layout))
                crc.update(slot)
                timer.checksum_s += time.perf_counter() - start
            if k + 2 < len(plan):
                posted[k % 2] = self._post_chunk(plan, k + 2, tags)
        return crc.value if crc is not None else None

    def _timed_wait(self, work: Any, deadline: Deadline, timer: PhaseTimer, what: str) -> None:
        start = time.perf_counter()
        _wait(work, deadline, what)
        timer.wire_s += time.perf_counter() - start

    def abort(self) -> None:
        """gloo cannot interrupt a wait from another thread; the wait's own deadline ends it."""

    def close(self) -> None:
        group, self._group = self._group, None
        self._slots = []
        if group is not None:
            with contextlib.suppress(RuntimeError):
                group.abort()
