"""Framed messages over a TCP control connection, with a deadline on every call.

Lifecycle: `bind_listener(host)` (never a wildcard address) → `accept` / `connect` →
`send` / `recv` framed messages → `close`. A frame is a fixed header (magic, kind, length)
and a payload of at most `MAX_PAYLOAD` bytes: JSON for structured messages, struct-packed for
per-chunk signals. Nothing is ever pickled.

Errors: `TimeoutError` when the deadline passes, `ConnectionError` when the peer is gone,
`ProtocolError` for a malformed frame or an unexpected message kind.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import json
import socket
import struct
import threading
from typing import Any

from kv_transfer.deadline import Deadline
from kv_transfer.errors import ProtocolError

MAX_PAYLOAD = 1 << 20
_HEADER = struct.Struct("!2sBxI")  # magic, kind, pad, payload length
_MAGIC = b"KV"


class Kind(enum.IntEnum):
    """Message kinds; values are on the wire."""

    HELLO = 1  # receiver → sender: JSON identity + layout
    WELCOME = 2  # sender → receiver: JSON layout + transport data
    REFUSED = 3  # sender → receiver: JSON reason (+ layout on a mismatch)
    ATTACHED = 4  # receiver → sender: transport resources mapped
    STORE_REQUEST = 10  # receiver → sender: JSON store operation (process-group rendezvous)
    STORE_REPLY = 11  # sender → receiver: JSON result
    BEGIN = 20  # sender → receiver: JSON ticket of the transfer that starts
    READY = 21  # sender → receiver: chunk staged in a slot
    FREE = 22  # receiver → sender: chunk consumed, slot free again
    END = 23  # sender → receiver: JSON trailer (checksum)
    DONE = 24  # receiver → sender: JSON outcome


def resolve_bind_address(host: str) -> tuple[socket.AddressFamily, str]:
    """The (family, address) to bind for `host`; refuse wildcard addresses."""
    if host in ("", "*"):
        raise ValueError("refusing to listen on a wildcard address; pass the node's cluster IP")
    infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    address = str(sockaddr[0])
    if ipaddress.ip_address(address.split("%")[0]).is_unspecified:
        raise ValueError(f"refusing to listen on wildcard address {host!r}; pass a cluster IP")
    return family, address


def bind_listener(host: str) -> socket.socket:
    """A listening TCP socket on `host` with an ephemeral port."""
    family, address = resolve_bind_address(host)
    server = socket.socket(family, socket.SOCK_STREAM)
    try:
        server.bind((address, 0))
        server.listen(4)
    except OSError:
        server.close()
        raise
    return server


def accept(server: socket.socket, deadline: Deadline) -> FramedConnection:
    server.settimeout(deadline.check("waiting for the receiver to connect"))
    sock, _ = server.accept()
    return FramedConnection(sock)


def connect(host: str, port: int, deadline: Deadline) -> FramedConnection:
    timeout = deadline.check(f"connecting to {host}:{port}")
    return FramedConnection(socket.create_connection((host, port), timeout=timeout))


class FramedConnection:
    """One control connection. `send` and `recv` may run in different threads."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._send_lock = threading.Lock()
        self._closed = False

    def send(self, kind: Kind, payload: bytes, deadline: Deadline) -> None:
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"control payload of {len(payload)} bytes is over {MAX_PAYLOAD}")
        frame = _HEADER.pack(_MAGIC, kind, len(payload)) + payload
        with self._send_lock:
            self._sock.settimeout(deadline.check(f"sending {kind.name}"))
            self._sock.sendall(frame)

    def recv(self, deadline: Deadline) -> tuple[Kind, bytes]:
        magic, kind, length = _HEADER.unpack(self._recv_exact(_HEADER.size, deadline))
        if magic != _MAGIC or length > MAX_PAYLOAD or kind not in Kind._value2member_map_:
            raise ProtocolError(f"malformed control frame (magic {magic!r}, kind {kind})")
        return Kind(kind), self._recv_exact(length, deadline)

    def expect(self, kind: Kind, deadline: Deadline) -> bytes:
        got, payload = self.recv(deadline)
        if got != kind:
            raise ProtocolError(f"expected {kind.name} from the peer, got {got.name}")
        return payload

    def send_json(self, kind: Kind, data: dict[str, Any], deadline: Deadline) -> None:
        self.send(kind, json.dumps(data).encode(), deadline)

    def _recv_exact(self, size: int, deadline: Deadline) -> bytes:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            self._sock.settimeout(deadline.check("waiting for the peer"))
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the peer closed the control connection")
            got += n
        return bytes(buf)

    def local_host(self) -> str:
        """This end's IP address on the connection (the interface that reaches the peer)."""
        return str(self._sock.getsockname()[0])

    def shutdown(self) -> None:
        """Unblock any thread inside send/recv; safe from any thread, idempotent."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.shutdown()
            self._sock.close()


def decode_json(payload: bytes) -> dict[str, Any]:
    """Parse a JSON object from the peer; `ProtocolError` on anything else."""
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"malformed JSON from the peer: {exc}") from exc
    if not isinstance(data, dict):
        raise ProtocolError(f"expected a JSON object from the peer, got {type(data).__name__}")
    return data
