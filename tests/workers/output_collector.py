"""A test gateway: drains workers' output streams and assembles each request's tokens once."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable

from engine.messages import OutputBatch

NextBatch = Callable[[str, float], OutputBatch | None]


class OutputCollector:
    def __init__(self, sources: list[NextBatch], gateway_id: str = "test-gateway") -> None:
        self.gateway_id = gateway_id
        self.tokens: defaultdict[str, dict[int, dict[int, int]]] = defaultdict(
            lambda: defaultdict(dict)
        )  # request -> sample -> position -> token
        self.finish: dict[tuple[str, int], str] = {}
        self.failures: dict[str, str] = {}
        self.retryable: dict[str, bool] = {}
        self.num_events = 0
        self.num_duplicates = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._drain, args=(source,), daemon=True) for source in sources
        ]
        for thread in self._threads:
            thread.start()

    def _drain(self, source: NextBatch) -> None:
        while not self._stop.is_set():
            batch = source(self.gateway_id, 0.05)
            if batch is None:
                continue
            with self._lock:
                for event in batch.events:
                    self.num_events += 1
                    positions = self.tokens[event.request_id][event.sample_index]
                    if event.position in positions:
                        self.num_duplicates += 1
                    positions[event.position] = event.token_id
                    if event.finish_reason is not None:
                        self.finish[(event.request_id, event.sample_index)] = event.finish_reason
                for failure in batch.failures:
                    self.failures[failure.request_id] = failure.message
                    self.retryable[failure.request_id] = failure.retryable

    def wait_finished(
        self, samples: list[tuple[str, int]], timeout_s: float = 60.0, *, whole: bool = False
    ) -> None:
        """Wait until each sample has failed or finished; ``whole``: finished with every token
        before its last too (a request's first token comes from its prefill worker, on a stream
        of its own, and may be read after the decode worker's last)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(
                    s[0] in self.failures or (s in self.finish and not (whole and self._gap(s)))
                    for s in samples
                ):
                    return
            time.sleep(0.01)
        missing = [s for s in samples if s not in self.finish]
        raise AssertionError(f"not finished within {timeout_s}s: {missing[:5]}")

    def _gap(self, sample: tuple[str, int]) -> bool:
        positions = self.tokens[sample[0]][sample[1]]
        return max(positions, default=-1) + 1 != len(positions)

    def output(self, request_id: str, sample_index: int = 0) -> list[int]:
        with self._lock:
            positions = self.tokens[request_id][sample_index]
            assert sorted(positions) == list(range(len(positions))), "gap in positions"
            return [positions[p] for p in range(len(positions))]

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
