"""First-token traces as JSON lines, one per prompt (``pdserve serve --first-token-trace PATH``).

A line is appended when the gateway records a prompt's trace (a streamed response: once the
first chunk after its first token is written; a whole response: once it is complete):

  {"request_id": "cmpl-...-0", "worker_id": "prefill-0",
   "stamps": {"arrived": 1767000000.123, ..., "written": ..., "scheduled": ...,
              "submit_returned": ...},
   "hops": {"parse": 0.0009, ..., "write": 0.0001}}

``stamps`` are wall-clock seconds (``time.time()``), in path order then the side stamps, null
where none was taken; ``hops`` are seconds, those whose two stamps were taken, in path order
(``engine.messages.first_token`` names them both). Each line is written whole and flushed as it
is written, so the file can be followed while the server runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.messages.first_token import FirstTokenTrace


class FirstTokenLog:
    def __init__(self, path: str | Path) -> None:
        """Appends to ``path`` (created if missing)."""
        self.path = Path(path)
        self._file = self.path.open("a", buffering=1, encoding="utf-8")  # line-buffered

    def write(self, request_id: str, trace: FirstTokenTrace) -> None:
        """Append one prompt's trace (nothing once closed)."""
        if self._file.closed:
            return
        line = {
            "request_id": request_id,
            "worker_id": trace.worker_id,
            "stamps": trace.stamps(),
            "hops": trace.hops(),
        }
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
