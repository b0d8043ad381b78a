"""Per-request measurements and their aggregates: latency percentiles, throughput, goodput.

Times are seconds in records and milliseconds in summaries. Definitions:

- TTFT: request sent -> first chunk with non-empty text.
- ITL: gaps between consecutive chunks with text (pooled over all requests).
- TPOT: (e2e - TTFT) / (output tokens - 1); undefined for one-token outputs.
- e2e: request sent -> stream finished.
- goodput: successful requests per second that met every SLO given (TTFT <= slo_ttft_ms and
  TPOT <= slo_tpot_ms; a one-token output meets the TPOT SLO); with no SLO it equals the
  successful request throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    index: int  # the workload request's index
    prompt_len: int  # prompt tokens the benchmark built (usage's prompt_tokens when sent)
    output_len: int  # tokens asked for (max_tokens)
    success: bool  # the stream ended with [DONE] and no error
    error: str = ""  # why it failed (HTTP status and message, error event, exception)
    send_time_s: float = 0.0  # when it was sent, seconds after the benchmark started
    ttft_s: float | None = None  # sent -> first text chunk; None if no text came
    e2e_s: float = 0.0  # sent -> stream end (or failure)
    itl_s: tuple[float, ...] = ()  # gaps between consecutive text chunks
    output_tokens: int = 0  # usage's completion_tokens, else the tokenizer's count
    output_tokens_source: str = "usage"  # "usage" or "tokenizer"
    conversation_id: int | None = None  # multi-turn: the conversation it is a turn of
    turn_index: int | None = None  # multi-turn: its turn (0 first)
    # prompt tokens the server's prefix cache served (usage's prompt_tokens_details); None:
    # the server did not say
    cached_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_ms: float | None = None  # time to first token bound; None = no bound
    tpot_ms: float | None = None  # time per output token bound; None = no bound

    def met_by(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        if self.ttft_ms is not None and (
            record.ttft_s is None or record.ttft_s * 1e3 > self.ttft_ms
        ):
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


@dataclass(frozen=True, slots=True)
class LatencyStats:
    count: int  # samples the stats are over
    mean_ms: float | None  # None when there are no samples
    percentiles_ms: dict[str, float | None]  # "p50" -> value (linear interpolation)

    def percentile(self, p: float) -> float | None:
        return self.percentiles_ms.get(percentile_key(p))


@dataclass(frozen=True, slots=True)
class Summary:
    num_requests: int  # requests sent
    num_completed: int  # requests that succeeded
    num_failed: int  # requests that failed
    duration_s: float  # first send -> last request finished
    total_input_tokens: int  # prompt tokens of successful requests
    total_output_tokens: int  # output tokens of successful requests
    request_throughput: float  # successful requests per second
    output_token_throughput: float  # output tokens per second
    total_token_throughput: float  # (input + output) tokens per second
    goodput: float  # successful requests per second that met the SLOs
    num_good: int  # requests that met the SLOs
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats


def percentile_key(p: float) -> str:
    return f"p{p:g}"


def latency_stats(
    samples_s: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> LatencyStats:
    """Mean and percentiles of ``samples_s`` (seconds), in milliseconds."""
    if not samples_s:
        return LatencyStats(0, None, {percentile_key(p): None for p in percentiles})
    values_ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    return LatencyStats(
        count=len(values_ms),
        mean_ms=float(values_ms.mean()),
        percentiles_ms={percentile_key(p): float(np.percentile(values_ms, p)) for p in percentiles},
    )


def per_turn_ttft(
    records: Sequence[RequestRecord], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict[int, LatencyStats]:
    """TTFT stats of the successful turns of each turn index (multi-turn records), in order."""
    samples: dict[int, list[float]] = {}
    for record in records:
        if record.turn_index is None:
            continue
        turn = samples.setdefault(record.turn_index, [])
        if record.success and record.ttft_s is not None:
            turn.append(record.ttft_s)
    return {turn: latency_stats(samples[turn], percentiles) for turn in sorted(samples)}


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: SLO = SLO(),
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> Summary:
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    num_good = sum(slo.met_by(r) for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return Summary(
        num_requests=len(records),
        num_completed=len(ok),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) * per_s,
        output_token_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        goodput=num_good * per_s,
        num_good=num_good,
        ttft=latency_stats([r.ttft_s for r in ok if r.ttft_s is not None], percentiles),
        tpot=latency_stats([t for r in ok if (t := r.tpot_s) is not None], percentiles),
        itl=latency_stats([gap for r in ok for gap in r.itl_s], percentiles),
        e2e=latency_stats([r.e2e_s for r in ok], percentiles),
    )
