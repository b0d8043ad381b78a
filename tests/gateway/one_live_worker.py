"""What a scripted stand-in for the cluster answers besides ``generate``: one live decode
worker, no local prefills, ready, room in the router's queue, no role switches, no latency forecast (its workers
report no step timings); the placements admission holds are listed."""

from __future__ import annotations

from collections.abc import Sequence

from router.cluster import SlotRestarts, WorkerStatus
from router.latency_forecast import Forecast
from router.latency_model import StepRatios


class OneLiveWorker:
    def __init__(self) -> None:
        # the admitted prompts counted towards their placements: (id, forecast, tokens, n)
        self.holds: list[tuple[str, Forecast, int, int]] = []

    def worker_statuses(self) -> list[WorkerStatus]:
        return [WorkerStatus("decode-0", "decode", True, None)]

    def local_prefills(self) -> dict[str, int]:
        return {}

    def worker_restarts(self) -> list[SlotRestarts]:
        return []

    def prefix_hit_stats(self) -> None:
        return None

    def role_switches(self) -> dict[tuple[str, str], int]:
        return {}

    def step_prediction_ratios(self) -> dict[str, StepRatios]:
        return {}

    def is_ready(self) -> bool:
        return True

    def queue_is_full(self) -> bool:
        return False

    def forecast(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Forecast | None:
        return None

    def hold_placement(
        self, request_id: str, forecast: Forecast, num_prompt_tokens: int, num_sequences: int
    ) -> None:
        self.holds.append((request_id, forecast, num_prompt_tokens, num_sequences))

    def observe_latencies(
        self,
        forecast: Forecast,
        ttft_s: float,
        first_gap_s: float | None,
        later_gap_s: float | None,
    ) -> None:
        pass
