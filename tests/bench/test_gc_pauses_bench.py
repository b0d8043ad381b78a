"""bench.gc_pauses's probe: the ``sitecustomize`` it puts before a server's processes logs
each collection of at least the given length, and for the baseline makes ``gc.freeze`` do
nothing; the log is read back by time window and kind of process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.gc_pauses import SITECUSTOMIZE, process_kind, read_pauses

CHILD = """
import gc
gc.freeze()
print(gc.get_freeze_count())
gc.collect(2)
"""


def _run_child(tmp_path: Path, logs: Path, no_freeze: bool) -> int:
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
        "PDSERVE_GC_LOG_DIR": str(logs),
        "PDSERVE_GC_MIN_PAUSE_S": "0",
        "PDSERVE_GC_NO_FREEZE": "1" if no_freeze else "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_each_collection_is_logged_and_the_baseline_freezes_nothing(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    logs = tmp_path / "logs"
    logs.mkdir()
    since = time.time()
    assert _run_child(tmp_path, logs, no_freeze=False) > 0
    assert _run_child(tmp_path, logs, no_freeze=True) == 0
    pauses = read_pauses(logs, since, time.time())
    assert len({p["pid"] for p in pauses}) == 2
    assert {p["generation"] for p in pauses} >= {2}
    assert all(p["kind"] == "ray daemon" and p["seconds"] >= 0 for p in pauses)
    assert read_pauses(logs, since - 100, since - 50) == []


def test_a_process_is_known_by_its_command() -> None:
    assert process_kind("/x/python -m router.cli serve --model m") == "gateway"
    assert process_kind("/work/main/router/cli.py serve --model m") == "gateway"
    assert process_kind("/x/ray/_private/workers/default_worker.py --node-ip") == "worker"
    assert process_kind("/x/ray/dashboard/agent.py") == "ray daemon"
