"""The control-socket half shared by the socket-based transports (gloo, nccl, shm, cuda_ipc).

Lifecycle: `ControlListener` binds a TCP socket to the node's cluster address (never a
wildcard) and makes a random token → the token travels in the rendezvous → `accept` takes
connections until one passes the handshake (strays are refused and dropped) → the transport's
`establish` builds the endpoint on that connection. The receiver side is `open_control`.
"""

from __future__ import annotations

import abc
import contextlib
import secrets
import socket
from typing import Any

from kv_transfer.deadline import Deadline
from kv_transfer.errors import ProtocolError
from kv_transfer.handshake import HandshakeRejected, check_hello, read_welcome, send_hello
from kv_transfer.layout import KVCacheLayout
from kv_transfer.messages import ChannelRendezvous
from kv_transfer.transports.base import Endpoint, ListenerBackend
from kv_transfer.wire import FramedConnection, accept, bind_listener, connect

HELLO_TIMEOUT_S = 5.0


class ControlListener(ListenerBackend):
    """Listens for the receiver's control connection; subclasses build the endpoint."""

    def __init__(self, transport: str, layout: KVCacheLayout, host: str, channel_id: str) -> None:
        self.layout = layout
        self.host = host
        self._server = bind_listener(host)
        port = int(self._server.getsockname()[1])
        token = secrets.token_hex(16)
        self.rendezvous = ChannelRendezvous(transport, channel_id, host, port, (("token", token),))

    def accept(self, deadline: Deadline) -> Endpoint:
        while True:
            conn = accept(self._server, deadline)
            # a silent stranger may hold the (sequential) accept loop only this long
            hello_deadline = Deadline(min(deadline.at, Deadline.after(HELLO_TIMEOUT_S).at))
            try:
                check_hello(conn, self.rendezvous, self.layout, hello_deadline)
            except (HandshakeRejected, ProtocolError, ConnectionError):
                conn.close()  # not our receiver: keep waiting for it
                continue
            except TimeoutError:
                conn.close()
                if deadline.expired():
                    raise
                continue
            except BaseException:
                conn.close()
                raise
            try:
                return self.establish(conn, deadline)
            except BaseException:
                conn.close()
                raise

    @abc.abstractmethod
    def establish(self, conn: FramedConnection, deadline: Deadline) -> Endpoint:
        """The handshake passed: send WELCOME, set the transport up, return the sender end.
        Owns `conn` from here (closes it, or keeps it inside the endpoint)."""

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes an accept() blocked in another thread
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


def open_control(
    rendezvous: ChannelRendezvous, layout: KVCacheLayout, deadline: Deadline
) -> tuple[FramedConnection, dict[str, Any]]:
    """Connect to the sender and pass the handshake; return the connection and WELCOME data."""
    conn = connect(rendezvous.host, rendezvous.port, deadline)
    try:
        send_hello(conn, rendezvous, layout, deadline)
        return conn, read_welcome(conn, layout, deadline)
    except BaseException:
        conn.close()
        raise
