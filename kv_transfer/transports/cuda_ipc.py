"""`cuda_ipc` transport: same-host GPU caches through a CUDA IPC-shared staging buffer.

Lifecycle: listen (control socket on host) → receiver connects, handshake → the sender
allocates a two-slot staging buffer on its GPU and puts the buffer's CUDA IPC handle (torch's
`_share_cuda_`, base64 in JSON, never pickled) in WELCOME → the receiver opens it
(`_new_shared_cuda`) and answers ATTACHED → transfers by the segment protocol, each side
copying on its own stream (`CopyStream`, not the engine's) and synchronising it before
signalling → close drops the mapping (the receiver's) and the buffer (the sender's; torch's
IPC ref counter keeps it until the receiver let go).
NCCL cannot pair two ranks on one GPU; this is the same-GPU path. Needs two processes.
"""

from __future__ import annotations

import base64
import contextlib
from typing import Any

import torch

from kv_transfer.deadline import Deadline
from kv_transfer.errors import ProtocolError
from kv_transfer.handshake import send_welcome, welcome_field
from kv_transfer.layout import KVCacheLayout
from kv_transfer.messages import ChannelRendezvous
from kv_transfer.transports.base import Endpoint
from kv_transfer.transports.control import ControlListener, open_control
from kv_transfer.transports.copy_stream import CopyStream
from kv_transfer.transports.segment import NUM_SLOTS, Segment, SegmentEndpoint, slot_size
from kv_transfer.wire import FramedConnection, Kind


def _require_cuda(device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"the cuda_ipc transport needs a CUDA device, got {device}")


class CudaSegment(Segment):
    def __init__(self, buffer: torch.Tensor, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self._device = buffer.device
        self._buffer: torch.Tensor | None = buffer  # uint8 [NUM_SLOTS * slot_bytes]
        self._slots = list(buffer.split(slot_bytes))
        self._stream = CopyStream(self._device)

    @classmethod
    def create(cls, slot_bytes: int, device: torch.device) -> CudaSegment:
        buffer = torch.zeros(NUM_SLOTS * slot_bytes, dtype=torch.uint8, device=device)
        return cls(buffer, slot_bytes)

    def handle(self) -> dict[str, Any]:
        """The buffer's IPC handle as JSON-able data."""
        assert self._buffer is not None
        fields = self._buffer.untyped_storage()._share_cuda_()
        return {
            "fields": [_encode(value) for value in fields],
            "offset": self._buffer.storage_offset(),
        }

    @classmethod
    def open(cls, handle: dict[str, Any], slot_bytes: int, device: torch.device) -> CudaSegment:
        try:
            fields = [_decode(value) for value in handle["fields"]]
            offset = int(handle["offset"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed CUDA IPC handle: {exc}") from exc
        if len(fields) != 8:  # (device, handle, size, offset, ref counter, its offset, event, sync)
            raise ProtocolError(f"malformed CUDA IPC handle: {len(fields)} fields, not 8")
        torch.cuda._lazy_init()
        index = device.index if device.index is not None else torch.cuda.current_device()
        # fields[0] is the sender's index of the GPU, which the receiver may number otherwise
        # (another CUDA_VISIBLE_DEVICES); _new_shared_cuda maps the buffer on the device it names
        fields[0] = index
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(*fields)
            buffer = torch.empty(0, dtype=torch.uint8, device=device)
            buffer.set_(storage, offset, (NUM_SLOTS * slot_bytes,), (1,))
        return cls(buffer, slot_bytes)

    def slot(self, index: int) -> torch.Tensor:
        return self._slots[index]

    def copies(self) -> contextlib.AbstractContextManager[None]:
        return self._stream.active()

    def sync(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        self._slots = []
        self._buffer = None


def _encode(value: object) -> object:
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    return value


def _decode(value: object) -> object:
    if isinstance(value, dict):
        return base64.b64decode(value["b64"])
    return value


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
        super().__init__("cuda_ipc", layout, host, channel_id)
        self._device = device
        self._slot_bytes = slot_size(chunk_bytes, layout)

    def establish(self, conn: FramedConnection, deadline: Deadline) -> Endpoint:
        segment = CudaSegment.create(self._slot_bytes, self._device)
        try:
            extra = {"handle": segment.handle(), "slot_bytes": self._slot_bytes}
            send_welcome(conn, self.layout, extra, deadline)
            conn.expect(Kind.ATTACHED, deadline)
        except BaseException:
            segment.close()
            raise
        return SegmentEndpoint(self.layout, conn, segment)


def connect_cuda_ipc(
    rendezvous: ChannelRendezvous, layout: KVCacheLayout, device: torch.device, deadline: Deadline
) -> Endpoint:
    _require_cuda(device)
    conn, welcome = open_control(rendezvous, layout, deadline)
    try:
        handle = welcome_field(welcome, "handle", dict)
        segment = CudaSegment.open(handle, welcome_field(welcome, "slot_bytes", int), device)
        conn.send(Kind.ATTACHED, b"", deadline)
    except BaseException:
        conn.close()
        raise
    return SegmentEndpoint(layout, conn, segment)
