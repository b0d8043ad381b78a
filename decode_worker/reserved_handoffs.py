"""Which hand-off holds each request's reserved blocks on a decode worker, and for how long.

Each hand-off from a prefill worker has its own id, which its reserve, pins and cancel carry:
a cancel that overtakes a late reserve (the prefill side's deadline passed) is remembered and
refuses that reserve, and never touches a later hand-off of the same request. A reservation
whose transfer never began within ``ttl_s`` expires: its prefill worker died or gave up
without a word, and the blocks go back (a transfer that still comes is refused, and its request
failed for the router to place again). Not thread-safe: the decode worker calls it under its
engine loop's lock.
"""

from __future__ import annotations

import time

from decode_worker.early_aborts import EarlyAborts


class ReservedHandoffs:
    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._holders: dict[str, tuple[str, float]] = {}  # request -> (hand-off, reserved at)
        self._cancelled = EarlyAborts()  # hand-offs cancelled before their reserve came
        self._expired = EarlyAborts()  # requests whose reservation expired

    def refuses(self, handoff_id: str) -> bool:
        """Whether the hand-off was cancelled before its reserve came (forgotten either way)."""
        return self._cancelled.take(handoff_id)

    def hold(self, request_id: str, handoff_id: str) -> None:
        """The request's blocks are reserved for ``handoff_id`` from now."""
        self._holders[request_id] = (handoff_id, time.monotonic())

    def holds(self, request_id: str, handoff_id: str) -> bool:
        holder = self._holders.get(request_id)
        return holder is not None and holder[0] == handoff_id

    def cancel_early(self, handoff_id: str) -> None:
        """The hand-off's cancel came first: refuse its reserve if it still comes."""
        self._cancelled.add(handoff_id)

    def release(self, request_id: str) -> None:
        """The reservation ended: taken by its receive, cancelled, or dropped with the request."""
        self._holders.pop(request_id, None)

    def expire(self) -> list[str]:
        """Requests whose reservation is older than ``ttl_s``: forgotten here, remembered as
        expired; the caller gives their blocks back."""
        now = time.monotonic()
        expired = [rid for rid, (_, at) in self._holders.items() if now - at > self.ttl_s]
        for request_id in expired:
            del self._holders[request_id]
            self._expired.add(request_id)
        return expired

    def take_expired(self, request_id: str) -> bool:
        """Whether the request's reservation expired (forgotten either way)."""
        return self._expired.take(request_id)
