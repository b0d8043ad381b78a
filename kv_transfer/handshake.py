"""Channel handshake over the control connection, shared by the socket-based transports.

Lifecycle: receiver `send_hello` (identity, token, layout) → sender `check_hello`
(wrong identity: REFUSED and the connection is dropped; wrong layout: REFUSED with its own
layout and `LayoutMismatchError` on both sides) → sender `send_welcome` (its layout and the
transport's own data, e.g. a shared-memory name) → receiver `read_welcome`. All JSON. Each
layout names the model's KV heads its end holds and the ones the channel moves.
"""

from __future__ import annotations

import hmac
from typing import Any, TypeVar

from kv_transfer.deadline import Deadline
from kv_transfer.errors import LayoutMismatchError, ProtocolError, TransferError
from kv_transfer.layout import KVCacheLayout
from kv_transfer.messages import ChannelRendezvous
from kv_transfer.wire import FramedConnection, Kind, decode_json

MAGIC = "pdserve-kv/2"  # /2: layouts carry head ranges
T = TypeVar("T")


class HandshakeRejected(TransferError):
    """Someone connected who is not the expected receiver; the listener keeps waiting."""


def send_hello(
    conn: FramedConnection, rendezvous: ChannelRendezvous, layout: KVCacheLayout, deadline: Deadline
) -> None:
    hello = {
        "magic": MAGIC,
        "transport": rendezvous.transport,
        "channel_id": rendezvous.channel_id,
        "token": rendezvous.option("token") or "",
        "layout": layout.to_json(),
    }
    conn.send_json(Kind.HELLO, hello, deadline)


def check_hello(
    conn: FramedConnection, expected: ChannelRendezvous, layout: KVCacheLayout, deadline: Deadline
) -> None:
    """Read and check the receiver's HELLO; REFUSED and raise if it does not fit."""
    hello = decode_json(conn.expect(Kind.HELLO, deadline))
    for key in ("magic", "transport", "channel_id", "token"):
        wanted = MAGIC if key == "magic" else _expected_value(expected, key)
        if not isinstance(hello.get(key), str) or not hmac.compare_digest(
            hello[key].encode(), wanted.encode()
        ):
            conn.send_json(Kind.REFUSED, {"reason": f"wrong {key}"}, deadline)
            raise HandshakeRejected(f"refused a connection with the wrong {key}")
    try:
        peer = KVCacheLayout.from_json(hello.get("layout"))
    except (TypeError, ValueError) as exc:
        conn.send_json(Kind.REFUSED, {"reason": f"bad layout: {exc}"}, deadline)
        raise HandshakeRejected(f"refused a malformed layout: {exc}") from exc
    reason = layout.mismatch(peer, "sender")
    if reason is not None:
        conn.send_json(Kind.REFUSED, {"reason": "layout", "layout": layout.to_json()}, deadline)
        raise LayoutMismatchError(reason)


def send_welcome(
    conn: FramedConnection, layout: KVCacheLayout, extra: dict[str, Any], deadline: Deadline
) -> None:
    conn.send_json(Kind.WELCOME, {"layout": layout.to_json(), **extra}, deadline)


def read_welcome(
    conn: FramedConnection, layout: KVCacheLayout, deadline: Deadline
) -> dict[str, Any]:
    """The sender's WELCOME data; `LayoutMismatchError` or `TransferError` if refused."""
    kind, payload = conn.recv(deadline)
    reply = decode_json(payload)
    if kind not in (Kind.WELCOME, Kind.REFUSED):
        raise ProtocolError(f"expected WELCOME or REFUSED, got {kind.name}")
    if "layout" in reply:
        try:
            peer = KVCacheLayout.from_json(reply["layout"])
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"the sender sent a malformed layout: {exc}") from exc
        layout.check_compatible(peer, "receiver")
    if kind == Kind.REFUSED:
        raise TransferError(f"the sender refused the channel: {reply.get('reason')}")
    return reply


def welcome_field(welcome: dict[str, Any], key: str, kind: type[T]) -> T:
    """`welcome[key]`, which must be a `kind`; `ProtocolError` otherwise."""
    value = welcome.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ProtocolError(f"the sender's WELCOME has no valid {key!r}: {value!r}")
    return value


def _expected_value(rendezvous: ChannelRendezvous, key: str) -> str:
    if key == "token":
        return rendezvous.option("token") or ""
    return str(getattr(rendezvous, key))
