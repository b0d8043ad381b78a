"""``python -m bench.role_change`` runs end to end on CPU at a small size and writes its JSON: a
worker changed role in place, a new one built and one started in a process of its own, each
role each round, and every decode worker after a change decoded the first one's tokens (the
bench fails otherwise); the same with workers of two ranks, whose followers change with them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("ranks", "rounds"), [(1, 2), (2, 1)], ids=["one-rank", "two-ranks"])
def test_the_role_change_benchmark_runs_and_times_both_ways(
    tmp_path: Path, ranks: int, rounds: int
) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.role_change", "--model-size", "tiny", "--rounds", str(rounds)]
        + ["--num-kv-blocks", "64", "--tensor-parallel-size", str(ranks), "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "role_change.json").read_text())
    assert result["tensor_parallel_size"] == ranks
    for way in ("in_place", "new", "new_process"):
        for role in ("prefill", "decode"):
            times = result["seconds"][way][role]
            assert len(times) == rounds and all(t > 0 for t in times)
