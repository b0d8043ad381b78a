"""Every Triton kernel of the engine compiles for an H100 (sm_90) at real model shapes, here,
without a GPU: the interpreter the other kernel tests run in never lowers a kernel, so only
this catches a kernel that cannot compile (a dot's operand types, a layout, a shared-memory
budget) before a GPU session does. See tests/engine/sm90_compile.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import triton

import engine.kernels

ROOT = Path(__file__).resolve().parents[2]
H100_SHARED_BYTES = 227 * 1024  # the most shared memory one block may opt into on sm_90
PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"


def _kernel_names() -> set[str]:
    """Names of the ``@triton.jit`` functions under engine/kernels/ and in kv_transfer's block
    copy (helpers that kernels call, like ``_attend_tile``, are compiled inside them)."""
    names = set()
    paths = [*Path(engine.kernels.__file__).parent.glob("*.py"), ROOT / "kv_transfer/block_copy.py"]
    for path in paths:
        lines = path.read_text().splitlines()
        for decorator, definition in zip(lines, lines[1:]):
            if decorator.strip() == "@triton.jit" and definition.startswith("def "):
                names.add(definition.removeprefix("def ").split("(")[0])
    return names


@pytest.fixture(scope="module")
def compiled() -> list[dict[str, Any]]:
    if not PTXAS.exists():
        pytest.skip(f"this Triton has no ptxas at {PTXAS}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default, said aloud to silence its warning
    # the groups of cases side by side (compiling takes a core each; "paged" is the longest)
    commands = [
        [sys.executable, "-m", "tests.engine.sm90_compile", "--group", group]
        for group in ("paged", "latent", "moe", "packed_int", "eight_bit")
    ]
    runs = [
        subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command in commands
    ]
    results = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-4000:]
        results += [json.loads(line) for line in stdout.splitlines()]
    return results


def test_every_launch_compiles_within_the_shared_memory_of_an_h100(
    compiled: list[dict[str, Any]],
) -> None:
    failures = [f"{r['case']} / {r['kernel']}: {r['error']}" for r in compiled if "error" in r]
    assert not failures, "\n".join(failures)
    too_big = [r for r in compiled if r["shared"] + r["static_shared"] > H100_SHARED_BYTES]
    assert not too_big, too_big


def test_every_kernel_is_compiled(compiled: list[dict[str, Any]]) -> None:
    """A new kernel must join sm90_compile.cases(), or this fails."""
    # @triton.jit helpers inlined into kernels
    internal = {"_attend_tile", "_attend_latent_tile", "_rotate_heads", "_tile_rows"}
    internal |= {"to_float8e4nv", "to_int8"}  # the KV write's quantizers
    internal |= {"_round_to"}  # the W8A8 inputs' rounding to x's dtype
    assert {r["kernel"] for r in compiled} == _kernel_names() - internal


def test_bfloat16_attention_runs_on_tensor_cores(compiled: list[dict[str, Any]]) -> None:
    """The attention dots lower to mma / wgmma in bfloat16, not to float32 FMAs (what an
    upcast, or a precision the tensor cores lack, would give)."""
    kernels = {
        "_decode_partition_kernel",
        "_paged_prefill_kernel",
        "_latent_decode_kernel",
        "_latent_prefill_kernel",
    }
    attention = [r for r in compiled if "bfloat16" in r["case"] and r["kernel"] in kernels]
    assert {r["kernel"] for r in attention} == kernels
    assert all(r["tensor_core_instructions"] > 0 for r in attention), attention


def test_quantized_kv_caches_compile(compiled: list[dict[str, Any]]) -> None:
    """A float8 e4m3 cache and an int8 one: the write quantizes into each, and the attention
    kernels read each's elements (converted to bfloat16, exactly) into tensor-core dots."""
    attention = {"_decode_partition_kernel", "_paged_prefill_kernel"}
    for cache in ("fp8_e4m3 cache", "int8 cache"):
        launches = [r for r in compiled if cache in r["case"]]
        assert {r["kernel"] for r in launches} >= attention | {"_write_kv_kernel"}, cache
        dots = [r for r in launches if r["kernel"] in attention]
        assert all(r["tensor_core_instructions"] > 0 for r in dots), dots


def test_bfloat16_expert_matmuls_run_on_tensor_cores(compiled: list[dict[str, Any]]) -> None:
    """The fused experts' grouped matmuls lower to mma / wgmma in bfloat16, for decode's
    16-row tiles and prefill's 64-row ones."""
    kernels = {"_gate_up_kernel", "_down_kernel"}
    experts = [r for r in compiled if "bfloat16" in r["case"] and r["kernel"] in kernels]
    assert {r["kernel"] for r in experts} == kernels
    assert {r["case"].split()[-2] for r in experts} == {"1", "1024"}  # (the token counts)
    assert all(r["tensor_core_instructions"] > 0 for r in experts), experts


def test_bfloat16_packed_int_matmuls_run_on_tensor_cores(compiled: list[dict[str, Any]]) -> None:
    """The packed-integer matmul's dots (its weights dequantized in registers) lower to mma /
    wgmma in bfloat16, for decode's 16-row tiles and prefill's 64-row ones, in every group
    layout (a group per K step, several a step, one per row)."""
    packed = [
        r
        for r in compiled
        if "bfloat16" in r["case"] and r["kernel"] == "_packed_int_matmul_kernel"
    ]
    assert {r["case"].split()[-2] for r in packed} == {"1", "1024"}  # (the token counts)
    assert {r["case"].split()[4] for r in packed} == {"g128", "g32", "channel"}
    assert all(r["tensor_core_instructions"] > 0 for r in packed), packed


def test_the_kv_block_copy_stores_in_vectors(compiled: list[dict[str, Any]]) -> None:
    """The cuda_ipc receiver's copy reaches a device copy's bandwidth only with 16-byte
    accesses (two 8-byte words per thread), which a tile's contiguous, aligned words allow."""
    copies = [r for r in compiled if r["kernel"] == "_copy_blocks_kernel"]
    assert copies and all(r["vector_stores"] > 0 for r in copies), copies


def test_eight_bit_matmuls_run_on_eight_bit_tensor_cores(compiled: list[dict[str, Any]]) -> None:
    """The float8 block matmul and the W8A8 float8 one lower to e4m3 MMAs, the int8 one to s8
    MMAs (not to 16-bit ones over converted operands), for decode's 16-row tiles and prefill's
    64-row ones; the inputs' quantizers compile beside them."""
    for prefix, kernel, operands in (
        ("fp8_block", "_fp8_block_matmul_kernel", ["e4m3"]),
        ("w8a8 float", "_scaled_matmul_kernel", ["e4m3"]),
        ("w8a8 int", "_scaled_matmul_kernel", ["s8"]),
    ):
        launches = [r for r in compiled if r["kernel"] == kernel and r["case"].startswith(prefix)]
        assert {"1", "1024"} <= {r["case"].split()[-2] for r in launches}, prefix  # (tokens)
        assert all(r["tensor_core_operands"] == operands for r in launches), launches
    quantizers = {r["kernel"] for r in compiled if r["case"].startswith(("fp8_block", "w8a8"))}
    assert {"_group_quantize_kernel", "_quantize_rows_kernel"} <= quantizers
