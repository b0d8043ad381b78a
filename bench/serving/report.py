"""Writing results: JSON (settings, aggregates, per-request records), PNG plots, a text table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.results_json import jsonable
from bench.results_json import write_json as write_json  # re-exported for existing callers
from bench.serving.metrics import per_turn_ttft
from bench.serving.runner import BenchResult, SweepResult
from bench.serving.server_metrics import ServerCounters


def result_dict(result: BenchResult) -> dict[str, Any]:
    """Settings, aggregates and per-request records; the server's counters when read, and for
    a multi-turn workload the TTFT stats of each turn index and the replies' ids' source."""
    records = [{**asdict(r), "tpot_s": r.tpot_s} for r in result.records]
    config = asdict(result.config)
    if config["endpoint"]["api_key"]:
        config["endpoint"]["api_key"] = "<redacted>"  # results get shared; keys must not be
    body: dict[str, Any] = {
        "started_at": result.started_at,
        "config": config,
        "summary": asdict(result.summary),
    }
    if result.server_counters is not None:
        body["server_counters"] = counters_dict(result.server_counters)
    if result.reply_token_ids is not None:
        body["reply_token_ids"] = result.reply_token_ids
        turns = per_turn_ttft(result.records, result.config.percentiles)
        body["per_turn_ttft"] = {str(turn): asdict(stats) for turn, stats in turns.items()}
    return jsonable({**body, "records": records})


def counters_dict(counters: ServerCounters) -> dict[str, Any]:
    return {**asdict(counters), "prefix_hit_rate": counters.prefix_hit_rate}


def sweep_dict(result: SweepResult) -> dict[str, Any]:
    return jsonable(
        {
            "request_rates": list(result.request_rates),
            "runs": [result_dict(run) for run in result.runs],
        }
    )


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot_latency_cdfs(result: BenchResult, path: str | Path) -> Path:
    """One PNG: the empirical CDFs of TTFT, TPOT and ITL in milliseconds."""
    plt = _pyplot()
    ok = [r for r in result.records if r.success]
    samples = {
        "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
        "TPOT": [t for r in ok if (t := r.tpot_s) is not None],
        "ITL": [gap for r in ok for gap in r.itl_s],
    }
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, (name, values_s) in zip(axes, samples.items()):
        values_ms = sorted(v * 1e3 for v in values_s)
        if values_ms:
            fractions = [(i + 1) / len(values_ms) for i in range(len(values_ms))]
            axis.step(values_ms, fractions, where="post")
        axis.set_xlabel(f"{name} (ms)")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
        axis.set_title(f"{name} CDF ({len(values_ms)} samples)")
    axes[0].set_ylabel("fraction of samples")
    figure.suptitle(_run_title(result))
    return _save(plt, figure, path)


def plot_sweep(result: SweepResult, path: str | Path) -> Path:
    """One PNG: throughput and goodput vs request rate, and p99 TTFT / ITL vs request rate."""
    plt = _pyplot()
    positions = list(range(len(result.runs)))
    labels = [rate_label(rate) for rate in result.request_rates]
    summaries = [run.summary for run in result.runs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    left.plot(positions, [s.request_throughput for s in summaries], "o-", label="throughput")
    left.plot(positions, [s.goodput for s in summaries], "s--", label="goodput (met SLOs)")
    left.set_ylabel("requests / s")
    for name in ("ttft", "itl"):
        values = [_or_nan(getattr(s, name).percentile(99)) for s in summaries]
        right.plot(positions, values, "o-", label=f"p99 {name.upper()}")
    right.set_ylabel("ms")
    for axis in (left, right):
        axis.set_xticks(positions, labels)
        axis.set_xlabel("offered request rate (req/s)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(_run_title(result.runs[0], with_rate=False) if result.runs else "sweep")
    return _save(plt, figure, path)


def summary_table(results: Sequence[BenchResult]) -> str:
    """A fixed-width table, one row per run."""
    header = (
        f"{'rate':>6} {'conc':>5} {'ok':>5} {'fail':>4} {'dur s':>7} {'req/s':>7} "
        f"{'good/s':>7} {'out tok/s':>9} {'TTFT mean':>9} {'p50':>8} {'p99':>8} "
        f"{'TPOT mean':>9} {'p99':>7} {'ITL p50':>7} {'p99':>7} {'e2e p99':>8}"
    )
    lines = [header, "-" * len(header)]
    for run in results:
        s, arrivals = run.summary, run.config.arrivals
        concurrency = "-" if arrivals.max_concurrency is None else str(arrivals.max_concurrency)
        lines.append(
            f"{rate_label(arrivals.request_rate):>6} {concurrency:>5} {s.num_completed:>5} "
            f"{s.num_failed:>4} {s.duration_s:>7.2f} {s.request_throughput:>7.2f} "
            f"{s.goodput:>7.2f} {s.output_token_throughput:>9.1f} "
            f"{_ms(s.ttft.mean_ms):>9} {_ms(s.ttft.percentile(50)):>8} "
            f"{_ms(s.ttft.percentile(99)):>8} {_ms(s.tpot.mean_ms):>9} "
            f"{_ms(s.tpot.percentile(99)):>7} {_ms(s.itl.percentile(50)):>7} "
            f"{_ms(s.itl.percentile(99)):>7} {_ms(s.e2e.percentile(99)):>8}"
        )
    lines.append("(latencies in ms; good/s = goodput under the SLOs given)")
    return "\n".join(lines)


def turn_table(result: BenchResult) -> str:
    """A multi-turn run's TTFT by turn index, and the server's counters if read."""
    header = f"{'turn':>4} {'ok':>5} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'mean prompt':>11}"
    lines = [header, "-" * len(header)]
    prompts: dict[int, list[int]] = {}
    for record in result.records:
        if record.success and record.turn_index is not None:
            prompts.setdefault(record.turn_index, []).append(record.prompt_len)
    for turn, stats in per_turn_ttft(result.records, result.config.percentiles).items():
        lengths = prompts.get(turn, [])
        mean = f"{sum(lengths) / len(lengths):.0f}" if lengths else "-"
        lines.append(
            f"{turn:>4} {stats.count:>5} {_ms(stats.percentile(50)):>9} "
            f"{_ms(stats.percentile(90)):>8} {_ms(stats.percentile(99)):>8} {mean:>11}"
        )
    lines.append(f"(replies' token ids from the {result.reply_token_ids}; latencies in ms)")
    counters = result.server_counters
    if counters is not None:
        rate = counters.prefix_hit_rate
        lines.append(
            f"server ({counters.server}): prompt tokens {_count(counters.prompt_tokens)}, "
            f"prefill tokens computed {_count(counters.prefill_tokens_computed)}, prefix hit "
            "rate " + ("-" if rate is None else f"{rate:.1%}")
        )
    return "\n".join(lines)


def _run_title(result: BenchResult, with_rate: bool = True) -> str:
    config = result.config
    title = f"{config.endpoint.model} {config.endpoint.endpoint} {config.workload.kind}"
    if with_rate:
        title += f", rate {rate_label(config.arrivals.request_rate)} req/s"
    workload = config.workload
    if workload.kind == "multi-turn":
        return title + f", {workload.num_conversations} conversations x {workload.num_turns} turns"
    return title + f", {config.num_prompts} requests"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, figure: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
