"""`shm` transport: same-host CPU caches through a POSIX shared-memory segment.

Lifecycle: listen (control socket on host) → receiver connects, handshake → the sender creates
`/dev/shm/pdserve-kv-<pid>-<random>` (mode 0600, two slots, pre-faulted) and names it in
WELCOME → the receiver maps it and answers ATTACHED → the sender unlinks the name at once
(both mappings stay; nothing is left behind if either process dies) → transfers by the
segment protocol → close unmaps.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets

import torch

from kv_transfer.deadline import Deadline
from kv_transfer.errors import ProtocolError
from kv_transfer.handshake import send_welcome, welcome_field
from kv_transfer.layout import KVCacheLayout
from kv_transfer.messages import ChannelRendezvous
from kv_transfer.transports.base import Endpoint
from kv_transfer.transports.control import ControlListener, open_control
from kv_transfer.transports.segment import NUM_SLOTS, Segment, SegmentEndpoint, slot_size
from kv_transfer.wire import FramedConnection, Kind

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"pdserve-kv-[0-9]+-[0-9a-f]{16}")


def require_room(nbytes: int, shm_dir: str = SHM_DIR) -> None:
    """OSError (ENOSPC) unless ``shm_dir`` has ``nbytes`` free. Checked before a segment is
    made: tmpfs hands out pages on first touch, and a page it has not got kills the process
    with SIGBUS instead of failing a call (a container's /dev/shm is often 64 MiB)."""
    stats = os.statvfs(shm_dir)
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise OSError(
            errno.ENOSPC,
            f"{shm_dir} has {free / 2**20:.1f} MiB free and a shm channel needs "
            f"{nbytes / 2**20:.1f} MiB: enlarge it (docker --shm-size) or use --kv-transport gloo",
        )


class HostSegment(Segment):
    """A shared-memory file mapped into this process, viewed as uint8 slots."""

    def __init__(self, name: str, fd: int, nbytes: int) -> None:
        self.name = name
        self.slot_bytes = nbytes // NUM_SLOTS
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=flags)
        self._slots = list(torch.frombuffer(self._map, dtype=torch.uint8).split(self.slot_bytes))

    @classmethod
    def create(cls, slot_bytes: int) -> HostSegment:
        name = f"pdserve-kv-{os.getpid()}-{secrets.token_hex(8)}"
        nbytes = NUM_SLOTS * slot_bytes
        require_room(nbytes)
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            segment = cls(name, fd, nbytes)
        except BaseException:
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        finally:
            os.close(fd)
        for slot in segment._slots:
            slot.fill_(0)  # fault the pages in now, not during the first transfer
        return segment

    @classmethod
    def attach(cls, name: str, nbytes: int) -> HostSegment:
        if not _NAME.fullmatch(name):
            raise ProtocolError(f"the sender named an unexpected segment {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size != nbytes:
                raise ProtocolError(f"segment {name} is not {nbytes} bytes")
            return cls(name, fd, nbytes)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))

    def slot(self, index: int) -> torch.Tensor:
        return self._slots[index]

    def close(self) -> None:
        self._slots = []
        mapping, self._map = self._map, None
        if mapping is not None:
            # BufferError: a view is still alive somewhere; the GC unmaps it later.
            with contextlib.suppress(BufferError):
                mapping.close()


class ShmListener(ControlListener):
    def __init__(self, layout: KVCacheLayout, host: str, channel_id: str, chunk_bytes: int) -> None:
        super().__init__("shm", layout, host, channel_id)
        self._slot_bytes = slot_size(chunk_bytes, layout)

    def establish(self, conn: FramedConnection, deadline: Deadline) -> Endpoint:
        segment = HostSegment.create(self._slot_bytes)
        try:
            extra = {"segment": segment.name, "segment_bytes": NUM_SLOTS * self._slot_bytes}
            send_welcome(conn, self.layout, extra, deadline)
            conn.expect(Kind.ATTACHED, deadline)
        except BaseException:
            segment.close()
            raise
        finally:
            segment.unlink()
        return SegmentEndpoint(self.layout, conn, segment)


def connect_shm(
    rendezvous: ChannelRendezvous, layout: KVCacheLayout, deadline: Deadline
) -> Endpoint:
    conn, welcome = open_control(rendezvous, layout, deadline)
    try:
        name, nbytes = (
            welcome_field(welcome, "segment", str),
            welcome_field(welcome, "segment_bytes", int),
        )
        segment = HostSegment.attach(name, nbytes)
    except BaseException:
        conn.close()
        raise
    try:
        conn.send(Kind.ATTACHED, b"", deadline)
    except BaseException:
        conn.close()
        segment.close()
        raise
    return SegmentEndpoint(layout, conn, segment)
