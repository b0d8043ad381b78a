"""Where a first token's time went, served and simulated, in three phases:

  wait    from the request's arrival to the first engine step that computed its prompt (the
          front door's hops, the worker's queue; simulated: the worker's queue)
  prompt  from there to the end of the step that sampled its first token (every chunk of the
          prompt, and the steps between them)
  after   from there to the token at its client (the worker's outputs, the stream, the
          gateway; simulated: the outputs, the streaming, the path's hops)

Served, from ``pdserve serve --first-token-trace``'s lines (their stamps ``arrived``,
``scheduled``, ``step_ended`` and ``written``, on the server's clock); simulated, from the
planner's ``SimulatedRequest``. Used by bench.plan_accuracy, to show which phase a prediction
misses.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.first_token_trace import new_lines
from router.planner.simulator import SimulatedRequest

PHASES = ("wait", "prompt", "after")
Phases = dict[str, dict[str, float]]  # phase -> {"p50": ms, "p90": ms}


def served_phases(traces: Iterable[dict[str, Any]]) -> Phases:
    """The phases' percentiles over the traces that have the stamps (a prompt chunked over
    several steps counts from its first)."""
    return _phases(
        (
            stamps.get("arrived"),
            stamps.get("scheduled") or stamps.get("step_started"),
            stamps.get("step_ended"),
            stamps.get("written"),
        )
        for stamps in (trace["stamps"] for trace in traces)
    )


def simulated_phases(requests: Iterable[SimulatedRequest]) -> Phases:
    return _phases((r.arrival_s, r.scheduled_s, r.prompt_done_s, r.first_token_s) for r in requests)


def _phases(stamps: Iterable[tuple[float | None, ...]]) -> Phases:
    """Each phase's percentiles, from each request's four stamps (arrival, prompt first
    computed, first token sampled, first token at its client); a request missing any is left
    out."""
    samples: dict[str, list[float | None]] = {phase: [] for phase in PHASES}
    for times in stamps:
        if any(t is None for t in times):
            continue
        for phase, start, end in zip(PHASES, times, times[1:], strict=False):
            samples[phase].append(end - start)  # type: ignore[operator]
    phases = {phase: percentiles_ms(values) for phase, values in samples.items()}
    return {phase: cuts for phase, cuts in phases.items() if cuts}


def percentiles_ms(values_s: Iterable[float | None]) -> dict[str, float]:
    """p50 and p90 of the known ``values_s``, in ms; none from fewer than two."""
    known = sorted(v * 1000 for v in values_s if v is not None)
    if len(known) < 2:
        return {}
    cuts = statistics.quantiles(known, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89]}


def traces_since(path: Path, began_s: float) -> list[dict[str, Any]]:
    """The trace lines in ``path`` of the requests that arrived at ``began_s`` or later (none
    when the file is missing)."""
    if not path.exists():
        return []
    lines, _ = new_lines(path, 0)
    return [t for t in lines if (t["stamps"].get("arrived") or 0.0) >= began_s]


def phases_row(measured: Phases, predicted: Phases) -> str:
    """Each phase's p50 and p90, measured / predicted, in ms."""
    cells = []
    for phase in PHASES:
        for cut in ("p50", "p90"):
            if phase in measured and phase in predicted:
                cells.append(f"{measured[phase][cut]:.0f}/{predicted[phase][cut]:.0f}")
            else:
                cells.append("-")
    return " ".join(f"{cell:>10}" for cell in cells)


def phases_header() -> str:
    return " ".join(f"{f'{phase} {cut}':>10}" for phase in PHASES for cut in ("p50", "p90"))
