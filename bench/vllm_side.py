"""vLLM's runs of the same requests, in its own venv's process (bench/vllm_draft_worker.py; its
CPU build's recipe: ../shared/ENVIRONMENT.md), for the benchmarks that set vLLM beside pdserve."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

_RESULT = "VLLM_RESULT "  # the line bench/vllm_draft_worker.py prints its timings on


def run_vllm_job(vllm_python: str, threads: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    """vLLM's greedy runs of ``job`` (bench/vllm_draft_worker.py's JOB), pinned to ``threads``
    cores (``VLLM_CPU_OMP_THREADS_BIND``): per batch, the median seconds and the tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        cores = "0" if threads == 1 else f"0-{threads - 1}"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cores}
        done = subprocess.run(
            [vllm_python, str(Path(__file__).with_name("vllm_draft_worker.py")), str(path)],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"vLLM's run failed: {done.stderr[-3000:]}")
        (line,) = [x for x in done.stdout.splitlines() if x.startswith(_RESULT)]
        return list(json.loads(line[len(_RESULT) :]))
