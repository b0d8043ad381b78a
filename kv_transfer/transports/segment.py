"""Transfers staged through a shared two-slot segment: the protocol of `shm`.

The sender gathers chunk k straight into slot k % 2 of memory both processes map, the receiver
scatters straight out of it: one copy on each side, no socket carries payload. The control
connection carries only small signals, each under the transfer's deadline:

  sender   BEGIN (JSON ticket) → [gather k, READY k] … (before reusing a slot: wait FREE k-2)
           → END (JSON crc) → waits for the last FREEs and DONE
  receiver checks BEGIN (a mismatch answers DONE with the reason) → [wait READY k, scatter k,
           FREE k] … → END → compares the checksum → DONE (JSON ok / reason)

Lifecycle of an endpoint: established by the transport (segment mapped on both sides) →
transfers → `abort` (shuts the control socket: any blocked wait fails at once) → `close`.
"""

from __future__ import annotations

import abc
import struct
import time
from typing import Any

import torch

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
from kv_transfer.wire import FramedConnection, Kind, decode_json

_SIGNAL = struct.Struct("!QI")  # transfer id, chunk index
NUM_SLOTS = 2
_ALIGN = 4096


def slot_size(chunk_bytes: int, layout: KVCacheLayout) -> int:
    """`chunk_bytes` rounded down to whole pages; `ValueError` if under one plane."""
    slot_bytes = chunk_bytes // _ALIGN * _ALIGN
    if slot_bytes < layout.moved_plane_nbytes:
        raise ValueError(
            f"chunk_bytes {chunk_bytes} holds no whole plane ({layout.moved_plane_nbytes} B of "
            f"the moved heads) in {_ALIGN}-byte pages"
        )
    return slot_bytes


def _unpack_signal(payload: bytes) -> tuple[int, int]:
    if len(payload) != _SIGNAL.size:
        raise ProtocolError(f"malformed chunk signal of {len(payload)} bytes")
    transfer_id, index = _SIGNAL.unpack(payload)
    return int(transfer_id), int(index)


class Segment(abc.ABC):
    """Memory mapped by both processes, cut into `NUM_SLOTS` slots of `slot_bytes`."""

    slot_bytes: int

    @abc.abstractmethod
    def slot(self, index: int) -> torch.Tensor:
        """Slot `index` as a uint8 tensor of `slot_bytes`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap. Idempotent."""


class SegmentEndpoint(Endpoint):
    def __init__(self, layout: KVCacheLayout, conn: FramedConnection, segment: Segment) -> None:
        super().__init__(layout)
        self._conn = conn
        self._segment = segment

    def _plan(self, num_blocks: int) -> list[Chunk]:
        return plan_chunks(self.layout, num_blocks, self._segment.slot_bytes)

    def send(self, move: Move) -> TransferStats:
        ticket, deadline, timer = move.ticket, move.deadline, PhaseTimer()
        plan = self._plan(ticket.num_blocks)
        begin = {
            "transfer_id": ticket.transfer_id,
            "request_id": ticket.request_id,
            "num_blocks": ticket.num_blocks,
            "checksum": ticket.checksum,
        }
        self._conn.send_json(Kind.BEGIN, begin, deadline)
        planes = heads_view(move.kv_cache, self.layout)
        crc = StreamingCrc32() if ticket.checksum else None
        for k, chunk in enumerate(plan):
            if k >= NUM_SLOTS:
                self._await_free(ticket, k - NUM_SLOTS, deadline, timer)
            slot = self._segment.slot(k % NUM_SLOTS)
            start = time.perf_counter()
            gather_chunk(planes, move.block_ids, chunk, chunk_view(slot, chunk, self.layout))
            timer.gather_s += time.perf_counter() - start
            if crc is not None:
                start = time.perf_counter()
                crc.update(slot[: chunk.nbytes])
                timer.checksum_s += time.perf_counter() - start
            self._conn.send(Kind.READY, _SIGNAL.pack(ticket.transfer_id, k), deadline)
        self._conn.send_json(Kind.END, {"crc": crc.value if crc else None}, deadline)
        for k in range(max(0, len(plan) - NUM_SLOTS), len(plan)):
            self._await_free(ticket, k, deadline, timer)
        outcome = decode_json(self._await(Kind.DONE, deadline, timer))
        if not outcome.get("ok"):
            raise TransferError(f"the receiver failed the transfer: {outcome.get('reason')}")
        return timer.stats(ticket, sum(c.nbytes for c in plan), len(plan))

    def _await_free(
        self, ticket: TransferTicket, index: int, deadline: Deadline, timer: PhaseTimer
    ) -> None:
        signal = _unpack_signal(self._await(Kind.FREE, deadline, timer))
        if signal != (ticket.transfer_id, index):
            raise ProtocolError(f"FREE {signal} out of order, wanted {(ticket.transfer_id, index)}")

    def _await(self, kind: Kind, deadline: Deadline, timer: PhaseTimer) -> bytes:
        """The next message's payload; it must be `kind` (a failed DONE ends the transfer)."""
        start = time.perf_counter()
        got, payload = self._conn.recv(deadline)
        timer.wire_s += time.perf_counter() - start
        if got == Kind.DONE and kind != Kind.DONE:
            reason = decode_json(payload).get("reason")
            raise TransferError(f"the receiver refused the transfer: {reason}")
        if got != kind:
            raise ProtocolError(f"expected {kind.name} from the peer, got {got.name}")
        return payload

    def recv(self, move: Move) -> TransferStats:
        ticket, deadline, timer = move.ticket, move.deadline, PhaseTimer()
        self._check_begin(decode_json(self._await(Kind.BEGIN, deadline, timer)), ticket, deadline)
        plan = self._plan(ticket.num_blocks)
        planes = heads_view(move.kv_cache, self.layout)
        crc = StreamingCrc32() if ticket.checksum else None
        for k, chunk in enumerate(plan):
            signal = _unpack_signal(self._await(Kind.READY, deadline, timer))
            if signal != (ticket.transfer_id, k):
                raise ProtocolError(
                    f"READY {signal} out of order, wanted {(ticket.transfer_id, k)}"
                )
            slot = self._segment.slot(k % NUM_SLOTS)
            start = time.perf_counter()
            scatter_chunk(planes, move.block_ids, chunk, chunk_view(slot, chunk, self.layout))
            timer.scatter_s += time.perf_counter() - start
            if crc is not None:  # read back what landed in the cache
                start = time.perf_counter()
                gather_chunk(planes, move.block_ids, chunk, chunk_view(slot, chunk, self.layout))
                crc.update(slot[: chunk.nbytes])
                timer.checksum_s += time.perf_counter() - start
            self._conn.send(Kind.FREE, _SIGNAL.pack(ticket.transfer_id, k), deadline)
        sent_crc = decode_json(self._await(Kind.END, deadline, timer)).get("crc")
        ok = crc is None or crc.value == sent_crc
        reason = (
            None if ok else f"checksum mismatch: sender {sent_crc}, received {crc and crc.value}"
        )
        self._conn.send_json(Kind.DONE, {"ok": ok, "reason": reason}, deadline)
        if not ok:
            raise TransferError(str(reason))
        return timer.stats(ticket, sum(c.nbytes for c in plan), len(plan))

    def _check_begin(
        self, begin: dict[str, Any], ticket: TransferTicket, deadline: Deadline
    ) -> None:
        """Refuse (DONE with the reason) a transfer that is not the one this side expects."""
        theirs = (begin.get("transfer_id"), begin.get("num_blocks"), begin.get("checksum"))
        if theirs == (ticket.transfer_id, ticket.num_blocks, ticket.checksum):
            return
        reason = (
            f"the sender started transfer {theirs[0]} (request {begin.get('request_id')!r}, "
            f"{theirs[1]} blocks, checksum={theirs[2]}), the receiver expects "
            f"{ticket.label} ({ticket.num_blocks} blocks, checksum={ticket.checksum})"
        )
        self._conn.send_json(Kind.DONE, {"ok": False, "reason": reason}, deadline)
        raise ProtocolError(reason)

    def abort(self) -> None:
        self._conn.shutdown()

    def close(self) -> None:
        self._conn.close()
        self._segment.close()
