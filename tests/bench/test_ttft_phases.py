"""bench/ttft_phases.py: a first token's time split into wait, prompt and after, from the served
trace lines and from the planner's simulated requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.ttft_phases import phases_row, served_phases, simulated_phases, traces_since
from router.planner.simulator import SimulatedRequest, WorkloadRequest


def _trace(arrived: float, scheduled: float | None, ended: float, written: float) -> dict:
    stamps = {"arrived": arrived, "scheduled": scheduled, "step_started": ended - 0.01}
    return {"stamps": {**stamps, "step_ended": ended, "written": written}, "hops": {}}


def test_served_phases_come_from_the_trace_stamps() -> None:
    traces = [
        _trace(0.0, 0.010, 0.030, 0.032),
        _trace(1.0, 1.020, 1.060, 1.064),
        _trace(2.0, 2.030, 2.090, 2.096),
        # a trace without its scheduled stamp counts from the step that sampled its token
        _trace(3.0, None, 3.040, 3.048),
        # one without its written stamp (a whole response) is left out
        {"stamps": {"arrived": 4.0, "scheduled": 4.1, "step_ended": 4.2, "written": None}},
    ]
    phases = served_phases(traces)
    assert phases["wait"]["p50"] == pytest.approx(25.0)  # of 10, 20, 30 and 30 ms
    assert phases["prompt"]["p50"] == pytest.approx(30.0)  # of 20, 40, 60 and 10 ms
    assert phases["after"]["p90"] == pytest.approx(7.4)  # of 2, 4, 6 and 8 ms
    assert phases_row(phases, phases).split()[0] == "25/25"


def test_simulated_phases_come_from_the_simulated_stamps() -> None:
    runs = []
    for i in range(3):
        run = SimulatedRequest(WorkloadRequest(float(i), (1,) * 10, 2))
        run.scheduled_s, run.prompt_done_s, run.first_token_s = i + 0.01 * i, i + 0.1, i + 0.2
        runs.append(run)
    runs.append(SimulatedRequest(WorkloadRequest(9.0, (1,), 2)))  # never scheduled: left out
    phases = simulated_phases(runs)
    assert phases["wait"]["p50"] == pytest.approx(10.0)
    assert phases["prompt"]["p50"] == pytest.approx(90.0)
    assert phases["after"]["p50"] == pytest.approx(100.0)
    assert "wait" not in simulated_phases(runs[:1])  # one sample: no percentiles


def test_a_points_traces_are_those_that_arrived_after_it_began(tmp_path: Path) -> None:
    path = tmp_path / "first_token.jsonl"
    assert traces_since(path, 0.0) == []
    lines = [_trace(1.0, 1.1, 1.2, 1.3), _trace(5.0, 5.1, 5.2, 5.3)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [t["stamps"]["arrived"] for t in traces_since(path, 2.0)] == [5.0]
