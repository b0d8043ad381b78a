"""First-token traces as JSON lines, one per prompt (``pdserve serve --first-token-trace PATH``).

``worker_id`` sampled the first token, ``decode_worker_id`` decodes the rest (the router's
placement). A line is appended when the gateway records a prompt's trace (a streamed
response: once the first chunk after its first token is written; a whole response: once it
is complete):

  {"request_id": "cmpl-...-0", "worker_id": "prefill-0", "decode_worker_id": "decode-1",
   "stamps": {"arrived": 1767000000.123, ..., "written": ..., "scheduled": ...,
              "submit_returned": ...},
   "hops": {"parse": 0.0009, ..., "write": 0.0001},
   "forecast": {"ttft_s": 0.041, "queue_s": 0.012, "prefill_worker_id": "prefill-0",
                "tpot_s": 0.0031, "decode_worker_id": "decode-1"}}

``stamps`` are wall-clock seconds (``time.time()``), in path order then the side stamps, null
where none was taken; ``hops`` are seconds, those whose two stamps were taken, in path order
(``engine.messages.first_token`` names them both); ``forecast`` is the prompt's latencies as
predicted at admission and the placement they were predicted on (router/latency_forecast.py;
absent without one). Each line is written whole and flushed as it is written, so the file
can be followed while the server runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.messages.first_token import FirstTokenTrace
from router.latency_forecast import Forecast


class FirstTokenLog:
    def __init__(self, path: str | Path) -> None:
        """Appends to ``path`` (created if missing)."""
        self.path = Path(path)
        self._file = self.path.open("a", buffering=1, encoding="utf-8")  # line-buffered

    def write(
        self, request_id: str, trace: FirstTokenTrace, forecast: Forecast | None = None
    ) -> None:
        """Append one prompt's trace and its forecast (nothing once closed)."""
        if self._file.closed:
            return
        line: dict[str, object] = {
            "request_id": request_id,
            "worker_id": trace.worker_id,
            "decode_worker_id": trace.decode_worker_id,
            "stamps": trace.stamps(),
            "hops": trace.hops(),
        }
        if forecast is not None:
            line["forecast"] = {
                "ttft_s": forecast.ttft_s,
                "queue_s": forecast.queue_s,
                "prefill_worker_id": forecast.prefill_worker_id,
                "tpot_s": forecast.tpot_s,
                "decode_worker_id": forecast.decode_worker_id,
            }
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
