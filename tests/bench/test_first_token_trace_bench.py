"""bench.first_token_trace reads the server's trace lines: a rate's new lines only, each hop's
statistics over the traces that have it, and the server's TTFT from arrival to first write."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.first_token_trace import hop_stats, new_lines, server_ttft_s
from engine.messages.first_token import HOPS


def _line(request_id: str, arrived: float, hops: dict[str, float], written: float | None) -> str:
    stamps = {"arrived": arrived, "written": written}
    return json.dumps({"request_id": request_id, "stamps": stamps, "hops": hops}) + "\n"


def test_each_rate_reads_the_lines_written_since_the_last(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(_line("a", 1.0, {}, 2.0) + _line("b", 3.0, {}, 4.0))
    first, offset = new_lines(path, 0)
    with path.open("a") as file:
        file.write(_line("c", 5.0, {}, None) + '{"request_id": "half')  # a line being written
    second, _ = new_lines(path, offset)
    assert [t["request_id"] for t in first] == ["a", "b"]
    assert [t["request_id"] for t in second] == ["c"]


def test_hop_statistics_are_in_milliseconds_over_the_traces_that_have_the_hop() -> None:
    traces = [
        {"hops": {"parse": 0.001, "write": 0.010}},
        {"hops": {"parse": 0.003}},  # a whole response: no write
    ]
    stats = hop_stats(traces)
    assert list(stats) == list(HOPS)
    assert stats["parse"]["mean"] == 2.0 and stats["parse"]["count"] == 2
    assert stats["write"]["p50"] == 10.0 and stats["write"]["count"] == 1
    assert math.isnan(stats["route"]["mean"]) and stats["route"]["count"] == 0


def test_the_servers_ttft_runs_from_arrival_to_the_first_write() -> None:
    assert server_ttft_s({"stamps": {"arrived": 1.0, "written": 1.25}}) == 0.25
    assert server_ttft_s({"stamps": {"arrived": 1.0, "written": None}}) is None
