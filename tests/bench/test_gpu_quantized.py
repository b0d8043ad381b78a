"""bench.gpu's quantized section (bench/gpu/quantized.py) runs on CPU under Triton's interpreter
with the tiny preset, alone (``--only quantized``), and writes every row the report reads; and
the layers it times hold the engine's own layouts. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import product
from pathlib import Path

import torch

from bench.gpu.quantized import (
    GEMM_PATHS,
    KV_CACHE_DTYPES,
    MAX_COPIES,
    build_layer,
    gemm_token_counts,
    num_copies,
    projections,
    weight_bytes,
)
from bench.gpu.shapes import MIB, MODELS

ROOT = Path(__file__).resolve().parents[2]
GEMM_KEYS = {"us", "floor_us", "fraction_of_floor", "ratio_to_bf16", "tflop_per_s", "graphed"}
KV_KEYS = {"us", "floor_us", "fraction_of_floor", "ratio_to_bf16", "gb_per_s", "graphed"}


def test_the_quantized_section_runs_alone_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "quantized.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the kernels run in the interpreter
    argv = ["--device", "cpu", "--preset", "tiny", "--only", "quantized", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "errors" not in result
    assert result["targets"] == []  # nothing the targets read was run
    model = result["models"]["tiny"]
    assert "errors" not in model, model["errors"]
    assert set(model) == {"spec", "num_params", "quantized_gemm", "quantized_kv_attention"}

    gemm = model["quantized_gemm"]
    assert [r for r in gemm if "error" in r] == []
    cases = {(r["projection"], r["path"], r["tokens"]) for r in gemm}
    paths = [path.name for path in GEMM_PATHS]
    assert cases == set(product(("qkv", "o", "gate_up", "down"), paths, (1, 8)))
    assert len(gemm) == len(cases)
    assert all(set(r) >= GEMM_KEYS for r in gemm)
    assert all(r["ratio_to_bf16"] == 1.0 for r in gemm if r["path"] == "bf16")
    # whether _scaled_mm took the W8A8 matmul: never off a GPU
    assert {r["path"] for r in gemm if "scaled_mm" in r} == {
        "w8a8_int8",
        "w8a8_fp8",
        "w8a8_fp8_triton",
    }
    assert not any(r["scaled_mm"] for r in gemm if "scaled_mm" in r)
    for projection in ("qkv", "o", "gate_up", "down"):
        held = {r["path"]: r["weight_bytes"] for r in gemm if r["projection"] == projection}
        assert held["w4a16_g128"] < held["w8a16"] < held["bf16"]
        assert held["fp8_block128"] < held["bf16"] and held["w8a8_int8"] < held["bf16"]

    attention = model["quantized_kv_attention"]
    assert [r for r in attention if "error" in r] == []
    assert {(r["batch_size"], r["kv_cache_dtype"]) for r in attention} == set(
        product((1, 4, 8), KV_CACHE_DTYPES)
    )
    assert all(set(r) >= KV_KEYS for r in attention)
    for batch_size in (1, 4, 8):
        held = {
            r["kv_cache_dtype"]: r["kv_bytes"] for r in attention if r["batch_size"] == batch_size
        }
        assert held["fp8_e4m3"] == held["int8"] == held["auto"] // 4  # float32 on CPU

    assert "one GEMM per path" in run.stdout
    assert "decode attention over each KV cache type" in run.stdout
    assert "\ntargets" not in run.stdout


def test_the_layers_timed_hold_the_engines_layouts_at_8b_shapes() -> None:
    """Built as the loader builds them (bf16, then the quantized dtypes kept): the weight bytes
    the floors use are the engine's."""
    in_features = out_features = 4096  # Llama-3-8B's o_proj
    assert projections(MODELS["8b"]) == {
        "qkv": (4096, 6144),
        "o": (4096, 4096),
        "gate_up": (4096, 28672),
        "down": (14336, 4096),
    }
    expected = {
        "bf16": 4096 * 4096 * 2,
        "w4a16_g128": 4096 * 4096 // 2 + 4096 * 32 * 2,  # int32 words, a bf16 scale per group
        "w8a16": 4096 * 4096 + 4096 * 2,  # a bf16 scale per row
        "fp8_block128": 4096 * 4096 + 32 * 32 * 4,  # a float32 scale per 128 x 128 block
        "w8a8_int8": 4096 * 4096 + 4096 * 2,
        "w8a8_fp8": 4096 * 4096 + 4096 * 2,
        "w8a8_fp8_triton": 4096 * 4096 + 4096 * 2,
    }
    for path in GEMM_PATHS:
        layer = build_layer(
            in_features, out_features, path.quantization, torch.device("cpu"), torch.bfloat16
        )
        assert weight_bytes(layer) == expected[path.name], path.name
    (fp8_blocks,) = [path.quantization for path in GEMM_PATHS if path.name == "fp8_block128"]
    fp8 = build_layer(4096, 4096, fp8_blocks, torch.device("cpu"), torch.bfloat16)
    assert fp8.weight.dtype == torch.float8_e4m3fn
    assert fp8.weight_scale_inv.dtype == torch.float32


def test_token_counts_and_copies() -> None:
    assert gemm_token_counts((1, 64, 8192)) == (1, 64, 1024)  # the full and quick presets'
    assert gemm_token_counts((1, 8)) == (1, 8)  # tiny's
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert num_copies(4 * MIB, cpu) == 1
    assert num_copies(4 * MIB, cuda) == MAX_COPIES  # small weights: as many as allowed
    assert num_copies(200 * MIB, cuda) == 3  # a working set past 512 MiB
    assert num_copies(2048 * MIB, cuda) == 1
