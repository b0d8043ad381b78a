"""A point in monotonic time that every blocking step of a transfer counts down to."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True, slots=True)
class Deadline:
    at: float  # time.monotonic() value after which the operation has failed

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def check(self, what: str) -> float:
        """Seconds left; raise `TimeoutError` naming `what` when none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"deadline passed while {what}")
        return left

    def timedelta(self, what: str) -> timedelta:
        return timedelta(seconds=self.check(what))
