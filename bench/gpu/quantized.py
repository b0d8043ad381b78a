"""The quantized paths' kernels alone at a model's shapes, against the unquantized ones in the
same run.

- GEMMs (``measure_quantized_gemms``): each decoder projection (qkv, o, gate_up, down) at a
  few token counts, one GEMM per path: bf16 ``F.linear`` (the baseline), W4A16 with groups of
  128 and W8A16 per channel (``packed_int_matmul``), FP8 in 128 x 128 blocks
  (``fp8_block_matmul``, the inputs quantized per token group inside), W8A8 int8 and FP8 with
  per-token inputs (``w8a8_matmul``: ``torch._scaled_mm`` where it takes the FP8 matmul, which
  each row reports) and the W8A8 FP8 Triton kernel alone (``allow_torch=False``). Each layer is
  built as the loader builds it (``make_linear`` on meta, cast, ``keep_quantized_dtypes``),
  then filled with random integers / float8 values and scales (a GEMM's speed does not depend
  on them), and the timed call is the kernel function the layer's forward runs on CUDA.
- Decode attention (``measure_quantized_kv_attention``): one layer of ``paged_decode_attention``
  over a float8 e4m3 and an int8 cache (with ``kv_scales``) against the model dtype's cache
  ("auto"), at each decode batch size and the preset's context, the caches built as
  attention_tiling builds its cases.

Every row is beside its floor, the bytes it must move over the run's measured read bandwidth:
for a GEMM its weight bytes (scales and zero points included) plus the activations read and
written in the model dtype; for attention the K and V elements its sequences hold. On CUDA
each case is replayed from one CUDA graph that runs it once on each of several copies of its
weights (or of its sequences' blocks), as many as make the working set ``WORKING_SET_BYTES``,
so the weights stream from HBM as a forward's layers do, not from L2, and launch gaps are not
timed; a row's time is the replay's median over the copies. Off CUDA it runs only under
``TRITON_INTERPRET=1``, one copy, wall clock: a smoke run, not a measurement.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.gpu.attention_tiling import _paged_layer
from bench.gpu.shapes import DTYPE_BYTES, MIB, ModelSpec
from bench.gpu.timing import free_memory, log, time_op
from engine.kernels import fp8_block_matmul, packed_int_matmul, scaled_matmul
from engine.kernels.paged_decode_attention import paged_decode_attention
from engine.kv_cache.kv_quantization import storage_dtype
from engine.quantization.config import (
    Fp8BlockWeights,
    PackedIntWeights,
    W8A8Weights,
    WeightQuantization,
)
from engine.quantization.fp8_linear import Fp8BlockLinear
from engine.quantization.linear import QuantizedLinear, make_linear
from engine.quantization.packed_linear import PackedIntLinear
from engine.quantization.w8a8_linear import W8A8Linear

MAX_GEMM_TOKENS = 1024  # a prefill chunk's rows; past it every path is compute-bound alike
WORKING_SET_BYTES = 512 * MIB  # per timed graph on CUDA: ~10x the L2 of an H100 or H200
MAX_COPIES = 64
Projection = nn.Linear | QuantizedLinear  # a decoder projection as make_linear builds it
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")  # "auto": the model dtype's cache


@dataclass(frozen=True, slots=True)
class GemmPath:
    """One way a projection runs: its layer's quantization and the kernel call its forward makes
    on CUDA."""

    name: str  # the rows' "path"
    quantization: WeightQuantization | None  # None: the model dtype's nn.Linear
    run: Callable[[Any, torch.Tensor], torch.Tensor]  # (layer, x [T, in]) -> [T, out]


def _dense(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight)


def _packed_int(layer: PackedIntLinear, x: torch.Tensor) -> torch.Tensor:
    return packed_int_matmul.packed_int_matmul(
        x,
        layer.weight_packed,
        layer.weight_scale,
        layer.weight_zero_point,
        layer.weights.num_bits,
        layer.bias,
    )


def _fp8_block(layer: Fp8BlockLinear, x: torch.Tensor) -> torch.Tensor:
    block_size = (layer.weights.block_rows, layer.weights.block_cols)
    return fp8_block_matmul.fp8_block_matmul(
        x, layer.weight, layer.weight_scale_inv, block_size, layer.bias
    )


def _w8a8(layer: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    return scaled_matmul.w8a8_matmul(
        x, layer.weight, layer.weight_scale, layer.weights.kind, layer.bias
    )


def _w8a8_triton(layer: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """``_w8a8`` with the Triton matmul even where ``_scaled_mm`` would take it."""
    x_q, x_scale = scaled_matmul.quantize_rows(x, layer.weights.kind)
    return scaled_matmul.scaled_matmul(
        x_q, x_scale, layer.weight, layer.weight_scale, x.dtype, layer.bias, allow_torch=False
    )


GEMM_PATHS = (
    GemmPath("bf16", None, _dense),  # the baseline: the model dtype (float32 on a CPU smoke run)
    GemmPath("w4a16_g128", PackedIntWeights(num_bits=4, group_size=128, symmetric=True), _packed_int),
    GemmPath("w8a16", PackedIntWeights(num_bits=8, group_size=None, symmetric=True), _packed_int),
    GemmPath("fp8_block128", Fp8BlockWeights(block_rows=128, block_cols=128), _fp8_block),
    GemmPath("w8a8_int8", W8A8Weights(kind="int"), _w8a8),
    GemmPath("w8a8_fp8", W8A8Weights(kind="float"), _w8a8),
    GemmPath("w8a8_fp8_triton", W8A8Weights(kind="float"), _w8a8_triton),
)  # fmt: skip


def projections(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each decoder projection's (in_features, out_features), fused as the engine fuses them."""
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {
        "qkv": (spec.hidden_size, q_size + 2 * kv_size),
        "o": (q_size, spec.hidden_size),
        "gate_up": (spec.hidden_size, 2 * spec.intermediate_size),
        "down": (spec.intermediate_size, spec.hidden_size),
    }


def gemm_token_counts(elementwise_tokens: tuple[int, ...]) -> tuple[int, ...]:
    """The preset's forward token counts, the largest capped at ``MAX_GEMM_TOKENS``."""
    return tuple(dict.fromkeys(min(t, MAX_GEMM_TOKENS) for t in elementwise_tokens))


def num_copies(nbytes: int, device: torch.device) -> int:
    """Copies of ``nbytes`` one timed graph runs over (module docstring); one off CUDA."""
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_COPIES, -(-WORKING_SET_BYTES // max(nbytes, 1))))


def time_per_call(
    calls: Sequence[Callable[[], Any]], device: torch.device, reps: int
) -> tuple[float, bool]:
    """Median seconds of one of ``calls`` (all alike but for their data), and whether they were
    replayed from a CUDA graph (else timed eagerly, together, as a capture that fails falls
    back to). Off CUDA (the interpreter's smoke run) each runs once: the time says nothing."""

    def run_all() -> None:
        for call in calls:
            call()

    if device.type != "cuda":
        return time_op(run_all, device, reps=1, warmup=0)[0] / len(calls), False
    # compiles the Triton kernels and warms cuBLAS outside the capture, on a side stream (as
    # torch.cuda.graph's documentation does)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run_all()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
    except Exception as exc:
        log(f"CUDA graph capture failed ({type(exc).__name__}: {exc}); timing eagerly")
        torch.cuda.synchronize(device)
        return statistics.median(time_op(run_all, device, reps)) / len(calls), False
    seconds = statistics.median(time_op(graph.replay, device, reps))
    del graph
    return seconds / len(calls), True


def build_layer(
    in_features: int,
    out_features: int,
    quantization: WeightQuantization | None,
    device: torch.device,
    dtype: torch.dtype,
) -> Projection:
    """A projection as the loader builds it (engine/model_loader.py ``_build_empty``), filled
    with random values of each tensor's kind."""
    if isinstance(quantization, PackedIntWeights) and quantization.group_size:
        # a tiny model's rows may hold fewer inputs than a group: groups that divide them
        group = math.gcd(quantization.group_size, in_features)
        quantization = replace(quantization, group_size=group)
    with torch.device("meta"):
        layer = make_linear(in_features, out_features, False, quantization)
    layer = layer.to(dtype=dtype)
    if isinstance(layer, (Fp8BlockLinear, W8A8Linear)):
        layer.keep_quantized_dtypes()  # float8 / int8 weights, float32 block scales
    layer = layer.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in layer.named_parameters():
            if tensor.dtype == torch.int32:  # packed words: any bits
                tensor.random_()
            elif tensor.dtype == torch.int8:
                tensor.random_(-127, 128)
            elif tensor.dtype == torch.float8_e4m3fn:
                tensor.copy_(torch.randn(tensor.shape, device=device))
            elif "scale" in name:
                tensor.uniform_(1e-3, 1e-2)
            else:
                tensor.normal_(0.0, 0.02)
    return layer


def weight_bytes(layer: Projection) -> int:
    return sum(t.numel() * t.element_size() for t in layer.parameters())


def _gemm_row(
    projection: str,
    num_tokens: int,
    path: GemmPath,
    layers: list[Projection],
    device: torch.device,
    dtype: str,
    reps: int,
    read_bw: float,
) -> dict[str, Any]:
    """One path's GEMM of ``num_tokens`` rows over ``layers`` (copies of one projection)."""
    layer = layers[0]
    in_features, out_features = layer.in_features, layer.out_features
    torch_dtype = getattr(torch, dtype)
    x = torch.randn(num_tokens, in_features, device=device).to(torch_dtype)  # [T, in]
    quantization = None if isinstance(layer, nn.Linear) else layer.weights
    row: dict[str, Any] = {
        "projection": projection,
        "in_features": in_features,
        "out_features": out_features,
        "tokens": num_tokens,
        "path": path.name,
        "quantization": dtype if quantization is None else quantization.describe(),
        "weight_bytes": weight_bytes(layer),
        "activation_bytes": num_tokens * (in_features + out_features) * DTYPE_BYTES[dtype],
        "copies": len(layers),
    }
    if isinstance(layer, W8A8Linear):  # whether torch._scaled_mm took the matmul
        x_q, _ = scaled_matmul.quantize_rows(x, layer.weights.kind)
        usable = scaled_matmul.torch_scaled_mm_usable(x_q, layer.weight, torch_dtype)
        row["scaled_mm"] = path.run is _w8a8 and usable
    try:
        calls = [partial(path.run, each, x) for each in layers]
        seconds, row["graphed"] = time_per_call(calls, device, reps)
    except Exception as exc:  # one path failing must not lose the others of a one-shot run
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    floor = (row["weight_bytes"] + row["activation_bytes"]) / read_bw
    row.update(
        us=seconds * 1e6,
        floor_us=floor * 1e6,
        fraction_of_floor=floor / seconds,
        tflop_per_s=2 * num_tokens * in_features * out_features / seconds / 1e12,
    )
    return row


def measure_quantized_gemms(
    spec: ModelSpec,
    device: torch.device,
    dtype: str,
    token_counts: tuple[int, ...],
    reps: int,
    read_bw: float,
) -> list[dict[str, Any]]:
    """Each projection x path x token count (module docstring), each row's time against the
    bf16 row's of the same projection and tokens (``ratio_to_bf16``)."""
    rows: list[dict[str, Any]] = []
    torch_dtype = getattr(torch, dtype)
    for projection, (in_features, out_features) in projections(spec).items():
        bf16_us: dict[int, float] = {}  # tokens -> the baseline's time
        for path in GEMM_PATHS:
            layers = [
                build_layer(in_features, out_features, path.quantization, device, torch_dtype)
            ]
            for _ in range(num_copies(weight_bytes(layers[0]), device) - 1):
                layers.append(
                    build_layer(in_features, out_features, path.quantization, device, torch_dtype)
                )
            for num_tokens in token_counts:
                row = _gemm_row(projection, num_tokens, path, layers, device, dtype, reps, read_bw)
                if "us" in row and path.quantization is None:
                    bf16_us[num_tokens] = row["us"]
                if "us" in row and num_tokens in bf16_us:
                    row["ratio_to_bf16"] = row["us"] / bf16_us[num_tokens]
                rows.append(row)
                _log_gemm(spec, row)
            del layers
            free_memory(device)
    return rows


def _log_gemm(spec: ModelSpec, row: dict[str, Any]) -> None:
    case = f"{spec.name}: {row['projection']} x {row['tokens']} {row['path']}"
    if "error" in row:
        log(f"{case} failed: {row['error']}")
        return
    scaled_mm = " (_scaled_mm)" if row.get("scaled_mm") else ""
    log(
        f"{case}{scaled_mm}: {row['us']:.1f} us, {row['fraction_of_floor']:.0%} of floor, "
        f"{row.get('ratio_to_bf16', float('nan')):.2f}x bf16"
    )


def measure_quantized_kv_attention(
    spec: ModelSpec,
    device: torch.device,
    dtype: str,
    batch_sizes: list[int],
    context_len: int,
    reps: int,
    read_bw: float,
) -> list[dict[str, Any]]:
    """One layer's decode attention at each batch size over each cache type (module docstring),
    each row's time against the "auto" cache's at the same batch (``ratio_to_bf16``)."""
    rows: list[dict[str, Any]] = []
    for batch_size in batch_sizes:
        auto_us = None  # the model dtype's cache's time at this batch (the first measured)
        for kv_cache_dtype in KV_CACHE_DTYPES:
            row = _kv_attention_row(
                spec, batch_size, context_len, kv_cache_dtype, device, dtype, reps, read_bw
            )
            if kv_cache_dtype == "auto":
                auto_us = row.get("us")
            if "us" in row and auto_us is not None:
                row["ratio_to_bf16"] = row["us"] / auto_us
            rows.append(row)
            case = f"{spec.name}: decode attention, {kv_cache_dtype} cache, batch {batch_size}"
            if "error" in row:
                log(f"{case} failed: {row['error']}")
            else:
                log(f"{case}: {row['us']:.1f} us, {row['fraction_of_floor']:.0%} of floor")
            free_memory(device)
    return rows


def _kv_attention_row(
    spec: ModelSpec,
    batch_size: int,
    context_len: int,
    kv_cache_dtype: str,
    device: torch.device,
    dtype: str,
    reps: int,
    read_bw: float,
) -> dict[str, Any]:
    """One layer's decode step of ``batch_size`` sequences of ``context_len`` tokens over a
    ``kv_cache_dtype`` cache, as attention_tiling builds its decode cases."""
    torch_dtype = getattr(torch, dtype)
    element = storage_dtype(kv_cache_dtype, torch_dtype)
    kv_bytes = batch_size * context_len * 2 * spec.num_kv_heads * spec.head_dim * element.itemsize
    copies = num_copies(kv_bytes, device)
    row: dict[str, Any] = {
        "batch_size": batch_size,
        "context_len": context_len,
        "kv_cache_dtype": kv_cache_dtype,
        "element_bytes": element.itemsize,
        "kv_bytes": kv_bytes,
        "copies": copies,
    }
    try:
        # one cache holding every copy's sequences; copy c reads its own blocks
        element_name = str(element).removeprefix("torch.")
        cache, tables = _paged_layer(spec, batch_size * copies, context_len, device, element_name)
        tables = tables.view(copies, batch_size, -1)  # [copies, batch, blocks per seq]
        query = torch.randn(batch_size, spec.num_heads, spec.head_dim, device=device)
        query = query.to(torch_dtype)  # [batch, num_heads, head_dim]
        seq_lens = torch.full((batch_size,), context_len, dtype=torch.int32, device=device)
        kv_scales = None
        if kv_cache_dtype != "auto":  # [2, num_kv_heads] float32: each head's K, then V scale
            kv_scales = torch.full((2, spec.num_kv_heads), 0.02, device=device)
        calls = [
            partial(
                paged_decode_attention, query, cache, tables[c], seq_lens, spec.head_dim**-0.5,
                max_seq_len=context_len, kv_scales=kv_scales,
            )
            for c in range(copies)
        ]  # fmt: skip
        seconds, row["graphed"] = time_per_call(calls, device, reps)
    except Exception as exc:  # recorded; the other cache types and batches go on
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    floor = kv_bytes / read_bw
    row.update(
        us=seconds * 1e6,
        floor_us=floor * 1e6,
        fraction_of_floor=floor / seconds,
        gb_per_s=kv_bytes / seconds / 1e9,
    )
    return row
