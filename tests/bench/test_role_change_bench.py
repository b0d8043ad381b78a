"""``python -m bench.role_change`` runs end to end on CPU at a small size and writes its JSON: a
worker changed role in place, a new one built and one started in a process of its own, each
role each round, and every decode worker
after a change decoded the first one's tokens (the bench fails otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_role_change_benchmark_runs_and_times_both_ways(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.role_change", "--model-size", "tiny", "--rounds", "2"]
        + ["--num-kv-blocks", "64", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "role_change.json").read_text())
    for way in ("in_place", "new", "new_process"):
        for role in ("prefill", "decode"):
            times = result["seconds"][way][role]
            assert len(times) == 2 and all(t > 0 for t in times)
