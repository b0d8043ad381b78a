"""A one-line progress bar on stderr, redrawn in place with a carriage return."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 30  # characters in the bar
_MIN_REDRAW_S = 0.1  # redraw at most this often (the last request always redraws)


class Progress:
    def __init__(
        self, total: int, label: str = "", enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self._total = total
        self._label = label
        self._enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._num_ok = 0
        self._num_failed = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def advance(self, success: bool) -> None:
        if success:
            self._num_ok += 1
        else:
            self._num_failed += 1
        now = time.perf_counter()
        if self._done or now - self._last_draw >= _MIN_REDRAW_S:
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        if self._enabled:
            if not self._done:  # the last request has drawn the full bar already
                self._draw(time.perf_counter())
            self._stream.write("\n")
            self._stream.flush()

    @property
    def _done(self) -> bool:
        return self._num_ok + self._num_failed >= self._total

    def _draw(self, now: float) -> None:
        if not self._enabled:
            return
        num_done = self._num_ok + self._num_failed
        filled = _WIDTH * num_done // max(self._total, 1)
        bar = "#" * filled + "." * (_WIDTH - filled)
        line = (
            f"\r{self._label}[{bar}] {num_done}/{self._total} "
            f"ok {self._num_ok} failed {self._num_failed} {now - self._start:6.1f}s"
        )
        self._stream.write(line)
        self._stream.flush()
