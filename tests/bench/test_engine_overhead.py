"""``python -m bench.engine_overhead`` runs end to end on CPU at small sizes and writes its
JSON, so the GPU session that runs it with ``--device cuda`` does not find a crash first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_overhead_benchmark_runs_and_splits_each_step(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.engine_overhead", "--batch-sizes", "1,3"]
        + ["--context-len", "40", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"prefix_cache_on", "prefix_cache_off"}
    for rows in result["results"].values():
        assert [row["batch_size"] for row in rows] == [1, 3]
        for row in rows:
            assert 0 < row["model_ms"] < row["step_ms"]
            assert abs(row["host_ms"] - (row["step_ms"] - row["model_ms"])) < 1e-9
