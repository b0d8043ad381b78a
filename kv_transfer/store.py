"""A two-party key-value store for process-group rendezvous, over the channel's control socket.

torch's TCPStore server listens on a wildcard address, so the pairwise process groups
rendezvous through this instead. The sender holds the keys (`ServedStore`) and answers the
receiver's `RemoteStore` over the already-authenticated control connection.

Lifecycle: handshake done → sender thread `ServedStore.serve(conn)` while both sides build
their process group (gloo sets/gets each rank's address) → receiver `RemoteStore.finish()`
ends the serve loop → the control connection is closed. JSON messages, values base64.
"""

from __future__ import annotations

import base64
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from kv_transfer.deadline import Deadline
from kv_transfer.errors import ProtocolError
from kv_transfer.wire import FramedConnection, Kind, decode_json


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class ServedStore(dist.Store):
    """The sender's store: a local dict, also served to the receiver by `serve`."""

    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self._deadline = deadline
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._failure: BaseException | None = None

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._data[key] = _as_bytes(value)
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._changed:
            return self._data[key]

    def add(self, key: str, value: int) -> int:
        with self._changed:
            total = int(self._data.get(key, b"0")) + value
            self._data[key] = str(total).encode()
            self._changed.notify_all()
            return total

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(key in self._data for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._deadline.remaining()
        if timeout is not None:
            limit = min(limit, timeout.total_seconds())
        with self._changed:
            ready = self._changed.wait_for(
                lambda: self._failure is not None or all(k in self._data for k in keys), limit
            )
            if self._failure is not None:
                raise ConnectionError(f"the rendezvous failed: {self._failure}")
            if not ready:
                raise TimeoutError(f"store keys {keys} not set in time")

    def fail(self, exc: BaseException) -> None:
        """Wake every waiter with an error: the receiver went away or misbehaved."""
        with self._changed:
            self._failure = exc
            self._changed.notify_all()

    def serve(self, conn: FramedConnection) -> None:
        """Answer the receiver's requests until it says it is done."""
        while True:
            request = decode_json(conn.expect(Kind.STORE_REQUEST, self._deadline))
            if request.get("op") == "done":
                return
            try:
                reply = self._answer(request)
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(f"malformed store request {request!r}: {exc}") from exc
            conn.send_json(Kind.STORE_REPLY, reply, self._deadline)

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op, keys = request.get("op"), request.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or not keys:
            raise ProtocolError(f"malformed store request {request!r}")
        if op == "set":
            self.set(keys[0], base64.b64decode(request["value"]))
            return {}
        if op == "get":
            return {"value": base64.b64encode(self.get(keys[0])).decode()}
        if op == "add":
            return {"value": self.add(keys[0], int(request["value"]))}
        if op == "check":
            return {"value": self.check(keys)}
        if op == "wait":
            self.wait(keys)
            return {}
        raise ProtocolError(f"unknown store operation {op!r}")


class RemoteStore(dist.Store):
    """The receiver's store: every operation is a request to the sender's `ServedStore`."""

    def __init__(self, conn: FramedConnection, deadline: Deadline) -> None:
        super().__init__()
        self._conn = conn
        self._deadline = deadline
        self._lock = threading.Lock()

    def _call(self, op: str, keys: list[str], value: Any = None) -> Any:
        with self._lock:
            request = {"op": op, "keys": keys, "value": value}
            self._conn.send_json(Kind.STORE_REQUEST, request, self._deadline)
            return decode_json(self._conn.expect(Kind.STORE_REPLY, self._deadline)).get("value")

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", [key], base64.b64encode(_as_bytes(value)).decode())

    def get(self, key: str) -> bytes:
        return base64.b64decode(self._call("get", [key]))

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", [key], value))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", keys)

    def finish(self) -> None:
        """Tell the sender the rendezvous is over (its `serve` returns)."""
        with self._lock:
            self._conn.send_json(Kind.STORE_REQUEST, {"op": "done", "keys": []}, self._deadline)
