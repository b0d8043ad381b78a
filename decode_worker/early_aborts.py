"""Aborts that reach a decode worker before the request they name."""

from __future__ import annotations

from collections import OrderedDict


class EarlyAborts:
    """Ids of requests aborted before they arrived here; their hand-off is dropped on arrival.

    The router sends a client's abort to both of a request's workers at once. Right after the
    first token the prefill worker's hand-off is often still on its way here, and the abort
    overtakes it. Aborts of requests that never come (finished already, or ended on the prefill
    side) are forgotten oldest first beyond ``capacity``: request ids are unique, a hand-off
    trails its abort by at most seconds, and that many aborts do not land in that time.
    ``ReservedHandoffs`` uses the same shape for hand-offs whose cancel overtook their reserve,
    and for reservations that expired before their transfer came.
    Not thread-safe: the decode worker calls it under its engine loop's lock.
    """

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """Whether the request was aborted early; it is forgotten either way."""
        if request_id not in self._ids:
            return False
        del self._ids[request_id]
        return True

    def __len__(self) -> int:
        return len(self._ids)
