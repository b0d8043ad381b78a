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

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from router.planner.simulator import SimulatedRequest

PHASES = ("wait", "prompt", "after")
Phases = dict[str, dict[str, float]]  # phase -> {"p50": ms, "p90": ms}


def served_phases(traces: Iterable[dict[str, Any]]) -> Phases:
    """The phases' percentiles over the traces that have the stamps (a prompt chunked over
    several steps counts from its first)."""
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for trace in traces:
        stamps = trace["stamps"]
        scheduled = stamps.get("scheduled") or stamps.get("step_started")
        times = (stamps.get("arrived"), scheduled, stamps.get("step_ended"), stamps.get("written"))
        if any(t is None for t in times):
            continue
        for phase, start, end in zip(PHASES, times, times[1:], strict=False):
            samples[phase].append(end - start)
    return _percentiles(samples)


def simulated_phases(requests: Iterable[SimulatedRequest]) -> Phases:
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for request in requests:
        times = (
            request.request.arrival_s,
            request.scheduled_s,
            request.prompt_done_s,
            request.first_token_s,
        )
        if any(t is None for t in times):
            continue
        for phase, start, end in zip(PHASES, times, times[1:], strict=False):
            samples[phase].append(end - start)  # type: ignore[operator]
    return _percentiles(samples)


def _percentiles(samples: dict[str, list[float]]) -> Phases:
    phases: Phases = {}
    for phase, values in samples.items():
        if len(values) < 2:
            continue
        cuts = statistics.quantiles(sorted(v * 1000 for v in values), n=100, method="inclusive")
        phases[phase] = {"p50": cuts[49], "p90": cuts[89]}
    return phases


def traces_since(path: Path, began_s: float) -> list[dict[str, Any]]:
    """The trace lines in ``path`` of the requests that arrived at ``began_s`` or later (none
    when the file is missing)."""
    if not path.exists():
        return []
    lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
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
