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


def vllm_rows(
    runs: dict[str, list[dict[str, Any]]],  # by drafts' name ("none" first): per batch, a run
    batches: list[list[list[int]]],
    baselines: list[list[list[int]]],  # pdserve's tokens without drafts, per batch
    output_len: int,
) -> list[dict[str, Any]]:
    """vLLM's row of each of ``runs`` at each batch size: tokens/s, speed-up over its own run
    without drafts, tokens compared with pdserve's baseline; each printed as a table's line
    (``bench.speculative.drafting_rows``' columns)."""
    rows = []
    for index, prompts in enumerate(batches):
        num_output = len(prompts) * output_len
        base_rate = num_output / runs["none"][index]["median_seconds"]
        for name, per_batch in runs.items():
            run = per_batch[index]
            rate = num_output / run["median_seconds"]
            rows.append({
                "engine": "vllm", "batch_size": len(prompts), "drafts": name,
                "median_seconds": run["median_seconds"], "output_tokens_per_s": rate,
                "speed_up": rate / base_rate,
                "num_outputs_differing_from_pdserve": sum(
                    a != b for a, b in zip(run["tokens"], baselines[index], strict=True)
                ),
            })  # fmt: skip
            label = f"vllm {name}"
            print(f"{len(prompts):>5} {label:>14} {rate:>9.0f} {rate / base_rate:>7.2f}x")
    return rows
