"""The multi-turn comparison's results: one row per configuration and conversation rate, and the
issue's two goals checked on them.

Goals (issue 34), for each configuration under test ("ours"):
- prefill: over the rates both ran, ours computed at most ``1 - 0.30`` of the prefill tokens
  ``prefix_affinity`` computed (the server's own counters; the same workload at each rate);
- goodput: at the lowest rate where ``least_loaded`` met both SLOs on fewer than 90 % of its
  requests, ours had at least 1.5x its goodput. Unchecked when least_loaded never fell below
  90 % in the sweep (sweep higher rates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.serving.metrics import per_turn_ttft
from bench.serving.runner import BenchResult

PREFILL_BASELINE = "prefix_affinity"
GOODPUT_BASELINE = "least_loaded"
MAX_PREFILL_RATIO = 0.70  # "at least 30 % fewer prefill tokens"
ATTAINMENT_FLOOR = 0.90  # where least_loaded "falls below 90 % SLO attainment"
MIN_GOODPUT_RATIO = 1.5  # "goodput at least 1.5x least_loaded's"


@dataclass(frozen=True, slots=True)
class Point:
    """One configuration at one conversation rate."""

    config: str  # e.g. "kv_aware", "vLLM (CPU)"
    rate: float  # conversations per second
    num_requests: int  # turns in the workload
    num_ok: int  # turns that succeeded
    prefill_tokens_computed: float | None  # the server's counter; None: not read
    prefix_hit_rate: float | None  # cached prompt tokens / prompt tokens; None: not read
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    slo_attainment: float  # share of turns that met both SLOs (0..1)
    goodput: float  # turns per second that met both SLOs


@dataclass(frozen=True, slots=True)
class GoalCheck:
    goal: str  # which goal, for whom
    met: bool | None  # None: it could not be checked (the detail says why)
    detail: str  # the numbers behind it


def point(config: str, result: BenchResult) -> Point:
    summary, counters = result.summary, result.server_counters
    return Point(
        config=config,
        rate=result.config.arrivals.request_rate,
        num_requests=summary.num_requests,
        num_ok=summary.num_completed,
        prefill_tokens_computed=counters.prefill_tokens_computed if counters else None,
        prefix_hit_rate=counters.prefix_hit_rate if counters else None,
        ttft_p50_ms=summary.ttft.percentile(50),
        ttft_p99_ms=summary.ttft.percentile(99),
        slo_attainment=summary.num_good / summary.num_requests if summary.num_requests else 0.0,
        goodput=summary.goodput,
    )


def prefill_goal(points: Sequence[Point], ours: str) -> GoalCheck:
    """``ours`` against prefix_affinity: prefill tokens computed, summed over the common rates."""
    goal = f"{ours}: prefill tokens <= {MAX_PREFILL_RATIO:.0%} of {PREFILL_BASELINE}'s"
    mine = {p.rate: p.prefill_tokens_computed for p in points if p.config == ours}
    theirs = {p.rate: p.prefill_tokens_computed for p in points if p.config == PREFILL_BASELINE}
    rates = sorted(r for r in mine if mine[r] is not None and theirs.get(r) is not None)
    if not rates:
        return GoalCheck(goal, None, f"no rate with both servers' counters ({ours}, baseline)")
    ours_total = sum(mine[r] or 0.0 for r in rates)
    theirs_total = sum(theirs[r] or 0.0 for r in rates)
    if theirs_total <= 0:
        return GoalCheck(goal, None, f"{PREFILL_BASELINE} computed no prefill tokens")
    ratio = ours_total / theirs_total
    per_rate = ", ".join(f"{r:g}/s {_ratio(mine[r], theirs[r])}" for r in rates)
    detail = f"{ours_total:.0f} / {theirs_total:.0f} = {ratio:.2f} (per rate: {per_rate})"
    return GoalCheck(goal, ratio <= MAX_PREFILL_RATIO, detail)


def goodput_goal(points: Sequence[Point], ours: str) -> GoalCheck:
    """``ours`` against least_loaded, at the lowest rate where least_loaded's SLO attainment
    fell below 90 %."""
    goal = f"{ours}: goodput >= {MIN_GOODPUT_RATIO:g}x {GOODPUT_BASELINE}'s where it falls below"
    goal += f" {ATTAINMENT_FLOOR:.0%} attainment"
    baseline = sorted((p for p in points if p.config == GOODPUT_BASELINE), key=lambda p: p.rate)
    below = [p for p in baseline if p.slo_attainment < ATTAINMENT_FLOOR]
    if not baseline:
        return GoalCheck(goal, None, f"{GOODPUT_BASELINE} did not run")
    if not below:
        best = min(p.slo_attainment for p in baseline)
        return GoalCheck(
            goal,
            None,
            f"{GOODPUT_BASELINE} stayed at >= {best:.0%} attainment up to "
            f"{baseline[-1].rate:g}/s: sweep higher rates",
        )
    knee = below[0]
    mine = next((p for p in points if p.config == ours and p.rate == knee.rate), None)
    if mine is None:
        return GoalCheck(goal, None, f"{ours} did not run at {knee.rate:g}/s")
    ratio = mine.goodput / knee.goodput if knee.goodput > 0 else float("inf")
    detail = (
        f"at {knee.rate:g}/s ({GOODPUT_BASELINE} {knee.slo_attainment:.0%} attainment): "
        f"{mine.goodput:.2f} vs {knee.goodput:.2f} turns/s = {ratio:.2f}x"
    )
    return GoalCheck(goal, ratio >= MIN_GOODPUT_RATIO, detail)


def goal_checks(points: Sequence[Point], ours: Sequence[str]) -> list[GoalCheck]:
    """Both goals for each configuration in ``ours`` that ran."""
    ran = {p.config for p in points}
    return [
        check
        for config in ours
        if config in ran
        for check in (prefill_goal(points, config), goodput_goal(points, config))
    ]


def points_table(points: Sequence[Point]) -> str:
    header = (
        f"{'config':<22} {'conv/s':>6} {'ok':>9} {'prefill tok':>11} {'hit rate':>8} "
        f"{'TTFT p50':>9} {'p99':>8} {'in SLO':>7} {'goodput':>8}"
    )
    lines = [header, "-" * len(header)]
    for p in points:
        computed = "-" if p.prefill_tokens_computed is None else f"{p.prefill_tokens_computed:.0f}"
        hit = "-" if p.prefix_hit_rate is None else f"{p.prefix_hit_rate:.1%}"
        lines.append(
            f"{p.config:<22} {p.rate:>6g} {f'{p.num_ok}/{p.num_requests}':>9} {computed:>11} "
            f"{hit:>8} {_ms(p.ttft_p50_ms):>9} {_ms(p.ttft_p99_ms):>8} "
            f"{p.slo_attainment:>7.1%} {p.goodput:>8.2f}"
        )
    lines.append(
        "(prefill tok: prompt tokens the server computed; hit rate: prompt tokens its prefix "
        "cache served; TTFT in ms; in SLO: share of turns within both SLOs; goodput: those "
        "turns per second)"
    )
    return "\n".join(lines)


def turns_table(results: Sequence[tuple[str, BenchResult]]) -> str:
    """TTFT p50/p99 (ms) by turn index, one row per configuration and rate."""
    if not results:
        return ""
    num_turns = max(r.config.workload.num_turns for _, r in results)
    header = f"{'config':<22} {'conv/s':>6} " + " ".join(
        f"{f'turn {t} p50/p99':>16}" for t in range(num_turns)
    )
    lines = [header, "-" * len(header)]
    for config, result in results:
        stats = per_turn_ttft(result.records, (50.0, 99.0))
        cells = [
            f"{_ms(s.percentile(50))}/{_ms(s.percentile(99))}" if (s := stats.get(t)) else "-"
            for t in range(num_turns)
        ]
        rate = result.config.arrivals.request_rate
        lines.append(f"{config:<22} {rate:>6g} " + " ".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def goals_text(checks: Sequence[GoalCheck]) -> str:
    marks = {True: "MET", False: "NOT MET", None: "UNCHECKED"}
    return "\n".join(f"[{marks[c.met]}] {c.goal}: {c.detail}" for c in checks)


def _ratio(mine: float | None, theirs: float | None) -> str:
    if mine is None or not theirs:
        return "-"
    return f"{mine / theirs:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
