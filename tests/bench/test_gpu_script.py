"""``python -m bench.gpu`` runs end to end on CPU (tiny preset), so a GPU session's short lease
is not spent finding a crash: every section measured, none recorded under "errors"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_runs_every_section_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the fused kernels' path too
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "errors" not in result
    model = result["models"]["tiny"]
    assert "errors" not in model, model["errors"]
    assert [row["tokens"] for row in model["elementwise"]] == [1, 8]
    assert all(row["fused_ms"] > 0 and row["torch_ms"] > 0 for row in model["elementwise"])
    tilings = model["attention_tilings"]
    assert {row["batch_size"] for row in tilings["decode"]} == {1, 4, 8}
    assert sum(row["default"] for row in tilings["prefill"]) == 2  # one per prompt length
    assert len(tilings["verify"]) == 3 * 4  # each batch size, each way
    assert all(row["us"] > 0 for row in tilings["verify"])
    assert "verify, rows folded (graph)" in run.stdout
    assert [row["batch_size"] for row in model["pdserve"]["decode"]] == [1, 4, 8]
    assert {t["target"] for t in result["targets"]} >= {"batch-1 decode / roofline"}
    assert "one forward's elementwise steps" in run.stdout
    # the quantized kernels last (tests/bench/test_gpu_quantized.py checks their rows)
    assert list(model)[-2:] == ["quantized_gemm", "quantized_kv_attention"]
    assert not any("error" in r for r in model["quantized_gemm"] + model["quantized_kv_attention"])


def test_a_run_cut_short_before_the_tuning_sections_keeps_the_targets_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease's time box may end the run: the targets' sections come first, each saved with
    the verdicts, so the JSON on disk when the tuning sections start already judges them."""
    import bench.gpu.__main__ as gpu_main

    out = tmp_path / "gpu.json"
    on_disk: list[dict] = []

    def cut_short(*args: object) -> None:
        on_disk.append(json.loads(out.read_text()))
        raise SystemExit("time box")

    monkeypatch.setattr(gpu_main, "run_model_tuning", cut_short)
    with pytest.raises(SystemExit, match="time box"):
        gpu_main.main(["--device", "cpu", "--preset", "tiny", "--out", str(out)])
    (result,) = on_disk
    model = result["models"]["tiny"]
    assert "errors" not in model, model["errors"]
    assert [row["batch_size"] for row in model["pdserve"]["decode"]] == [1, 4, 8]
    assert model["transformers"]["generate"]["decode_tokens_per_s"] > 0
    assert [row["tokens"] for row in result["kv_transfer"]["rows"]] == [64, 256]
    judged = {t["target"]: t for t in result["targets"]}
    assert judged["batch-1 decode / roofline"]["value"] > 0
    assert any(t.startswith("batch-8 decode tok/s / transformers") for t in judged)
    assert "elementwise" not in model and "attention_tilings" not in model
    assert "quantized_gemm" not in model
