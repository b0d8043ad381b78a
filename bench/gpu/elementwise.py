"""The elementwise steps of one forward, the model's torch ops against the fused Triton kernels.

Every layer of a Llama forward runs RMSNorm, rotary on q and k, the residual add + RMSNorm and
SiLU(gate) * up: some ten torch kernels, four Triton ones. For ``T`` tokens at a model's shapes
each path runs once per layer (plus the final norm) inside one CUDA graph, as a decode step's
replay runs them, and the median replay is reported beside the floor: the bytes the fused
kernels must move over the measured read bandwidth. Off CUDA the graphs are skipped and the
Triton path runs only under ``TRITON_INTERPRET=1``; those numbers only show the code runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu.shapes import DTYPE_BYTES, ModelSpec
from bench.gpu.timing import log, time_op
from engine.kernels import elementwise as triton_kernels
from engine.kernels.checks import interpreted
from engine.models.fused_ops import torch_silu_and_mul
from engine.models.rms_norm import torch_rms_norm
from engine.models.rope import apply_rotary

EPS = 1e-5


class _Activations:
    """One layer's inputs to its elementwise steps, for ``num_tokens`` tokens."""

    def __init__(self, spec: ModelSpec, num_tokens: int, device: torch.device, dtype: str):
        torch_dtype = getattr(torch, dtype)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device).to(torch_dtype)

        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.hidden = rand(num_tokens, spec.hidden_size)  # [T, hidden]
        self.attended = rand(num_tokens, spec.hidden_size)  # [T, hidden]: o_proj's output
        self.weight = rand(spec.hidden_size)
        qkv = rand(num_tokens, q_size + 2 * kv_size)  # [T, q + k + v]: the fused projection
        self.query = qkv[:, :q_size].view(num_tokens, spec.num_heads, spec.head_dim)
        self.key = qkv[:, q_size : q_size + kv_size].view(
            num_tokens, spec.num_kv_heads, spec.head_dim
        )
        angles = torch.randn(num_tokens, spec.head_dim // 2, device=device)
        table = torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch_dtype)
        self.cos, self.sin = table[:, None, :].chunk(2, dim=-1)  # as RotaryEmbedding gives them
        self.gate_up = rand(num_tokens, 2 * spec.intermediate_size)  # [T, 2 * intermediate]


def torch_layer(a: _Activations) -> None:
    """The model's torch path for one layer (engine/models/llama.py without fused kernels)."""
    torch_rms_norm(a.hidden, a.weight, EPS)
    apply_rotary(a.query, a.cos, a.sin)
    apply_rotary(a.key, a.cos, a.sin)
    torch_rms_norm(a.hidden + a.attended, a.weight, EPS)
    torch_silu_and_mul(a.gate_up)


def fused_layer(a: _Activations) -> None:
    triton_kernels.rms_norm(a.hidden, a.weight, EPS)
    triton_kernels.rotary_(a.query, a.key, a.cos, a.sin)
    triton_kernels.add_rms_norm(a.hidden, a.attended, a.weight, EPS)
    triton_kernels.silu_and_mul(a.gate_up)


def fused_bytes(spec: ModelSpec, num_tokens: int, dtype: str) -> int:
    """What the fused kernels of one forward read and write: rms_norm x -> out, rotary q and k
    in place, add_rms_norm residual + x -> total and out, SiLU [gate | up] -> out; weights
    and the cos/sin rows besides."""
    hidden = num_tokens * spec.hidden_size
    rotated = num_tokens * (spec.num_heads + spec.num_kv_heads) * spec.head_dim
    per_layer = 2 * hidden + 2 * rotated + 4 * hidden + 3 * num_tokens * spec.intermediate_size
    per_layer += 2 * spec.hidden_size + num_tokens * spec.head_dim
    final_norm = 2 * hidden + spec.hidden_size
    return (spec.num_layers * per_layer + final_norm) * DTYPE_BYTES[dtype]


def _forward(
    layer: Callable[[_Activations], None],
    final_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    spec: ModelSpec,
) -> Callable[[_Activations], None]:
    def run(a: _Activations) -> None:
        for _ in range(spec.num_layers):
            layer(a)
        final_norm(a.hidden, a.weight, EPS)

    return run


def _time_forward(
    run: Callable[[_Activations], None], a: _Activations, device: torch.device, reps: int
) -> float:
    """Median seconds of one forward's elementwise steps; replayed from a CUDA graph on CUDA."""
    if device.type != "cuda":
        return statistics.median(time_op(lambda: run(a), device, reps))
    run(a)  # compiles the Triton kernels outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(a)
    return statistics.median(time_op(graph.replay, device, reps))


def measure_elementwise(
    spec: ModelSpec,
    device: torch.device,
    dtype: str,
    token_counts: tuple[int, ...],
    reps: int,
    read_bw: float,
) -> list[dict[str, Any]]:
    """For each token count: one forward's elementwise steps, torch against fused."""
    rows: list[dict[str, Any]] = []
    for num_tokens in token_counts:
        activations = _Activations(spec, num_tokens, device, dtype)
        torch_s = _time_forward(
            _forward(torch_layer, torch_rms_norm, spec), activations, device, reps
        )
        row: dict[str, Any] = {
            "tokens": num_tokens,
            "torch_ms": torch_s * 1e3,
            "floor_ms": fused_bytes(spec, num_tokens, dtype) / read_bw * 1e3,
        }
        if triton_kernels.usable(activations.hidden) or interpreted():
            fused_s = _time_forward(
                _forward(fused_layer, triton_kernels.rms_norm, spec), activations, device, reps
            )
            row["fused_ms"] = fused_s * 1e3
            row["speedup"] = torch_s / fused_s
        log(
            f"{spec.name}: elementwise steps, {num_tokens} tokens: torch {row['torch_ms']:.3f} ms"
            + (f", fused {row['fused_ms']:.3f} ms" if "fused_ms" in row else "")
            + f" (floor {row['floor_ms']:.3f} ms)"
        )
        rows.append(row)
        del activations
    return rows
