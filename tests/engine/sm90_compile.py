"""Compile every Triton kernel the engine (and kv_transfer's cuda_ipc receiver) launches on a
GPU for Hopper (sm_90), without one.

Run as ``python -m tests.engine.sm90_compile`` with TRITON_INTERPRET unset (the interpreter
replaces ``@triton.jit`` at import time): each kernel wrapper is called with ``meta`` tensors
at real model shapes while its kernel is swapped for a recorder, so the launch arguments are
exactly the wrapper's; each distinct launch is then compiled by Triton for an sm_90 target down
to a cubin (ptxas ships with Triton), and ``cuobjdump`` reads its registers, spills and shared
memory, and its PTX how many tensor-core instructions it has. Prints one JSON object per
launch. Compiling proves the kernels lower for the GPU
(bf16 tensor-core dots included), which the interpreter never checks; it proves nothing about
their numbers, which the interpreter and the ``gpu`` tests check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels import (
    elementwise,
    fp8_block_matmul,
    fused_moe,
    kv_cache_write,
    latent_attention,
    packed_int_matmul,
    paged_decode_attention,
    paged_prefill_attention,
    scaled_matmul,
)
from kv_transfer import block_copy

HOPPER = GPUTarget("cuda", 90, 32)
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")
_TENSOR_CORE_OP = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync)\b")
_TENSOR_CORE_INSTRUCTION = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync)[\w.]*")
# the operand types a tensor-core instruction names (f32 / s32 are its accumulator's)
_TENSOR_CORE_OPERANDS = {"e4m3", "e5m2", "bf16", "f16", "tf32", "s8", "u8"}
_VECTOR_STORE = re.compile(r"\bst\.global(?:\.\w+)*\.v[24]\.")  # 2 or 4 words per thread
_POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int16: "*i16",
    torch.uint8: "*u8",
    torch.int8: "*i8",
    torch.float8_e4m3fn: "*fp8e4nv",
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The shapes one model family's kernels see."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int


SHAPES = (
    ModelShape("llama-3-8b", 32, 8, 128, 4096, 14336),  # GQA 4
    ModelShape("llama-3.2-1b", 32, 8, 64, 2048, 8192),  # head_dim 64
    ModelShape("qwen2-7b", 28, 4, 128, 3584, 18944),  # GQA 7: padded group
    ModelShape("llama-2-7b", 32, 32, 128, 4096, 11008),  # no GQA
)
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Launch:
    kernel: Any  # the JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel: Any, launches: list[Launch]) -> None:
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, args, kwargs))

        return launch


def record_launches(module: ModuleType, call: Callable[[], object]) -> list[Launch]:
    """The kernel launches ``call`` makes through ``module``'s ``@triton.jit`` globals."""
    launches: list[Launch] = []
    kernels = {
        name: value for name, value in vars(module).items() if isinstance(value, triton.JITFunction)
    }
    for name, kernel in kernels.items():
        setattr(module, name, _Recorder(kernel, launches))
    try:
        call()
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
    return launches


def _argument_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


def compile_launch(launch: Launch) -> Any:
    """Compile one recorded launch for sm_90; returns Triton's CompiledKernel."""
    params = launch.kernel.params
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    # what Triton's launcher specialises an argument to when it is a multiple of 16 (an
    # integer) or 16-byte aligned (a tensor's address: every allocation, and the views the
    # wrappers pass): vector loads and stores need to know it
    aligned: dict[tuple[int, ...], list[list[Any]]] = {}
    options = {key: launch.kwargs[key] for key in _LAUNCH_OPTIONS if key in launch.kwargs}
    for index, param in enumerate(params):
        if index < len(launch.args):
            value = launch.args[index]
        elif param.name in launch.kwargs:
            value = launch.kwargs[param.name]
        else:
            value = param.default
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        else:
            signature[param.name] = _argument_type(value)
            if isinstance(value, torch.Tensor) or (
                type(value) is int and value % 16 == 0 and value != 0
            ):
                aligned[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=HOPPER, options=options)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, LOCAL (spilled bytes per thread), SHARED, STACK of the cubin's one function."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [cuobjdump, "--dump-resource-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", report)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{report}")
    registers, stack, shared, local = (int(group) for group in match.groups())
    return {"registers": registers, "stack": stack, "static_shared": shared, "local": local}


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _kv_cache_layer(shape: ModelShape, dtype: torch.dtype) -> torch.Tensor:
    return _meta(2, 4096, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, dtype=dtype)


def _kv_scales(shape: ModelShape, cache_dtype: torch.dtype | None) -> torch.Tensor | None:
    """A quantized cache's scales (``cache_dtype`` float8_e4m3fn or int8); None for a float
    cache (``cache_dtype`` None: the model's dtype)."""
    if cache_dtype is None:
        return None
    return _meta(2, shape.num_kv_heads, dtype=torch.float32)


def _decode(
    shape: ModelShape,
    dtype: torch.dtype,
    num_seqs: int,
    context: int,
    rows_per_seq: int = 1,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> Callable[[], object]:
    """``rows_per_seq`` > 1: a verify step's rows (a token and its drafts), folded per
    sequence, as a decode graph of a drafting engine runs them. ``sinks``: a sink logit per
    head. ``cache_dtype``: a quantized cache's element type (None: ``dtype``)."""
    max_blocks = -(-context // BLOCK_SIZE)
    num_rows = num_seqs * rows_per_seq
    folded = rows_per_seq > 1
    index = torch.int64 if folded else torch.int32  # (the decode graphs' buffers are int64)
    return lambda: paged_decode_attention.paged_decode_attention(
        _meta(num_rows, shape.num_heads, shape.head_dim, dtype=dtype),
        _kv_cache_layer(shape, cache_dtype or dtype),
        _meta(num_rows, max_blocks, dtype=index),
        _meta(num_rows, dtype=index),
        shape.head_dim**-0.5,
        max_seq_len=context,
        row_starts=_meta(num_rows + 1, dtype=index) if folded else None,
        max_rows_per_seq=rows_per_seq,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        sinks=_meta(shape.num_heads, dtype=torch.float32) if sinks else None,
        kv_scales=_kv_scales(shape, cache_dtype),
    )


def _prefill(
    shape: ModelShape,
    dtype: torch.dtype,
    num_tokens: int,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> Callable[[], object]:
    max_blocks = -(-num_tokens // BLOCK_SIZE)
    return lambda: paged_prefill_attention.paged_prefill_attention(
        _meta(num_tokens, shape.num_heads, shape.head_dim, dtype=dtype),
        _kv_cache_layer(shape, cache_dtype or dtype),
        _meta(2, dtype=torch.int32),
        _meta(1, dtype=torch.int32),
        _meta(1, max_blocks, dtype=torch.int32),
        shape.head_dim**-0.5,
        max_query_len=num_tokens,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        sinks=_meta(shape.num_heads, dtype=torch.float32) if sinks else None,
        kv_scales=_kv_scales(shape, cache_dtype),
    )


def _write(
    shape: ModelShape, dtype: torch.dtype, num_tokens: int, cache_dtype: torch.dtype | None = None
) -> Callable[[], object]:
    return lambda: kv_cache_write.write_kv_cache(
        _kv_cache_layer(shape, cache_dtype or dtype),
        _meta(num_tokens, shape.num_kv_heads, shape.head_dim, dtype=dtype),
        _meta(num_tokens, shape.num_kv_heads, shape.head_dim, dtype=dtype),
        _meta(num_tokens, dtype=torch.int64),
        _kv_scales(shape, cache_dtype),
    )


def _elementwise(shape: ModelShape, dtype: torch.dtype, num_tokens: int) -> Callable[[], object]:
    def call() -> None:
        hidden = _meta(num_tokens, shape.hidden_size, dtype=dtype)
        weight = _meta(shape.hidden_size, dtype=dtype)
        elementwise.rms_norm(hidden, weight, 1e-5)
        elementwise.add_rms_norm(hidden, hidden, weight, 1e-5)
        heads = _meta(num_tokens, shape.num_heads, shape.head_dim, dtype=dtype)
        elementwise.rms_norm(heads, _meta(shape.head_dim, dtype=dtype), 1e-5)  # Qwen3's q norm
        kv_heads = _meta(num_tokens, shape.num_kv_heads, shape.head_dim, dtype=dtype)
        table = _meta(num_tokens, 1, shape.head_dim // 2, dtype=dtype)
        elementwise.rotary_(heads, kv_heads, table, table)
        elementwise.silu_and_mul(_meta(num_tokens, 2 * shape.intermediate_size, dtype=dtype))

    return call


def _block_copy(shape: ModelShape, dtype: torch.dtype, num_blocks: int) -> Callable[[], object]:
    """A cuda_ipc receiver's copy of ``num_blocks`` blocks out of the sender's cache."""
    planes = (2 * 32, 4096, BLOCK_SIZE * shape.num_kv_heads * shape.head_dim)  # 32 layers
    return lambda: block_copy.copy_blocks(
        _meta(*planes, dtype=dtype),
        _meta(num_blocks, dtype=torch.int64),
        _meta(*planes, dtype=dtype),
        _meta(num_blocks, dtype=torch.int64),
    )


QUANTIZED_CACHES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def paged_cases() -> Iterator[tuple[str, ModuleType, Callable[[], object]]]:
    """(label, kernel module, wrapper call) for the launches a GPU engine makes for K/V caches:
    every model shape in bfloat16 (what GPUs serve), and the first in float16 and float32 too;
    the first's sliding-window variants in each, its soft-cap and sink ones in bfloat16; then
    the first's quantized caches (``quantized_cases``)."""
    for index, shape in enumerate(SHAPES):
        dtypes = (torch.bfloat16, torch.float16, torch.float32) if index == 0 else (torch.bfloat16,)
        for dtype in dtypes:
            tag = f"{shape.name} {str(dtype).removeprefix('torch.')}"
            # batch 1 at 1k splits the context; batch 64 at 1k does not
            for num_seqs in (1, 64):
                call = _decode(shape, dtype, num_seqs, 1024)
                yield f"decode {tag} batch {num_seqs}", paged_decode_attention, call
            call = _decode(shape, dtype, 8, 1024, rows_per_seq=5)
            yield f"decode verify {tag} batch 8 x 5 rows", paged_decode_attention, call
            yield f"prefill {tag}", paged_prefill_attention, _prefill(shape, dtype, 1024)
            if index == 0:  # a sliding-window layer's variants (Mistral, Gemma)
                call = _decode(shape, dtype, 8, 1024, sliding_window=256)
                yield f"decode {tag} batch 8, window 256", paged_decode_attention, call
                call = _prefill(shape, dtype, 1024, sliding_window=256)
                yield f"prefill {tag}, window 256", paged_prefill_attention, call
            if index == 0 and dtype == torch.bfloat16:  # Gemma 2's soft-cap; gpt-oss's sinks
                call = _decode(shape, dtype, 1, 1024, logit_softcap=50.0)
                yield f"decode {tag} batch 1, softcap 50", paged_decode_attention, call
                call = _decode(shape, dtype, 1, 1024, sliding_window=128, sinks=True)
                yield f"decode {tag} batch 1, window 128, sinks", paged_decode_attention, call
                call = _prefill(shape, dtype, 1024, logit_softcap=50.0)
                yield f"prefill {tag}, softcap 50", paged_prefill_attention, call
                call = _prefill(shape, dtype, 1024, sliding_window=128, sinks=True)
                yield f"prefill {tag}, window 128, sinks", paged_prefill_attention, call
            yield f"kv write {tag}", kv_cache_write, _write(shape, dtype, 64)
            yield f"elementwise {tag}", elementwise, _elementwise(shape, dtype, 64)
            yield f"kv block copy {tag}", block_copy, _block_copy(shape, dtype, 512)
    yield from quantized_cases(SHAPES[0])


def quantized_cases(shape: ModelShape) -> Iterator[tuple[str, ModuleType, Callable[[], object]]]:
    """A quantized cache's launches (float8 e4m3 and int8 elements) under bfloat16 queries,
    the writes from bfloat16 K/V: a split decode, a verify step's folded rows, a prefill; the
    float8 cache's windowed, soft-capped and sink variants too, and float16 queries over it."""
    for name, cache_dtype in QUANTIZED_CACHES.items():
        dtypes = (torch.bfloat16, torch.float16) if name == "fp8_e4m3" else (torch.bfloat16,)
        for dtype in dtypes:
            tag = f"{shape.name} {str(dtype).removeprefix('torch.')}, {name} cache"
            call = _decode(shape, dtype, 1, 1024, cache_dtype=cache_dtype)
            yield f"decode {tag}, batch 1", paged_decode_attention, call
            call = _prefill(shape, dtype, 1024, cache_dtype=cache_dtype)
            yield f"prefill {tag}", paged_prefill_attention, call
            if dtype != torch.bfloat16:
                continue
            call = _decode(shape, dtype, 8, 1024, rows_per_seq=5, cache_dtype=cache_dtype)
            yield f"decode verify {tag}, batch 8 x 5 rows", paged_decode_attention, call
            yield f"kv write {tag}", kv_cache_write, _write(shape, dtype, 64, cache_dtype)
            if name != "fp8_e4m3":
                continue
            extras: dict[str, Any] = {"sliding_window": 128, "logit_softcap": 50.0, "sinks": True}
            call = _decode(shape, dtype, 1, 1024, cache_dtype=cache_dtype, **extras)
            yield (
                f"decode {tag}, batch 1, window 128, softcap 50, sinks",
                paged_decode_attention,
                call,
            )
            call = _prefill(shape, dtype, 1024, cache_dtype=cache_dtype, **extras)
            yield f"prefill {tag}, window 128, softcap 50, sinks", paged_prefill_attention, call


LATENT_WIDTH, LATENT_VALUE_DIM = 576, 512  # DeepSeek-V3's entries: a latent of 512, rope 64


def _latent_cache(dtype: torch.dtype) -> torch.Tensor:
    return _meta(1, 4096, 16, 1, LATENT_WIDTH, dtype=dtype)


def _latent_decode(dtype: torch.dtype, num_heads: int, num_rows: int) -> Callable[[], object]:
    return lambda: latent_attention.latent_decode_attention(
        _meta(num_rows, num_heads, LATENT_WIDTH, dtype=dtype),
        _latent_cache(dtype),
        _meta(num_rows, 64, dtype=torch.int64),
        _meta(num_rows, dtype=torch.int64),
        0.1,
        LATENT_VALUE_DIM,
        max_seq_len=1024,
    )


def _latent_prefill(dtype: torch.dtype, num_heads: int) -> Callable[[], object]:
    return lambda: latent_attention.latent_prefill_attention(
        _meta(1024, num_heads, LATENT_WIDTH, dtype=dtype),
        _latent_cache(dtype),
        _meta(2, dtype=torch.int32),
        _meta(1, dtype=torch.int32),
        _meta(1, 64, dtype=torch.int64),
        0.1,
        LATENT_VALUE_DIM,
        max_query_len=1024,
    )


def _latent_write(dtype: torch.dtype) -> Callable[[], object]:
    return lambda: latent_attention.write_latent_cache(
        _latent_cache(dtype), _meta(64, LATENT_WIDTH, dtype=dtype), _meta(64, dtype=torch.int64)
    )


def latent_cases() -> Iterator[tuple[str, ModuleType, Callable[[], object]]]:
    """(label, kernel module, wrapper call) for the latent-attention launches: DeepSeek-V3 with all 128 heads on one rank and 16
    (eight ranks) in bfloat16, and the 16 in float16 and float32 too; the index dtypes are the
    Triton backend's."""
    module = latent_attention
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for num_heads in (128, 16) if dtype == torch.bfloat16 else (16,):
            tag = f"deepseek-v3 {num_heads} heads {str(dtype).removeprefix('torch.')}"
            for num_rows in (1, 64):  # batch 1 at 1k splits the context; batch 64 does not
                call = _latent_decode(dtype, num_heads, num_rows)
                yield f"latent decode {tag} batch {num_rows}", module, call
            yield f"latent prefill {tag}", module, _latent_prefill(dtype, num_heads)
        yield f"latent write {str(dtype).removeprefix('torch.')}", module, _latent_write(dtype)


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The shapes one mixture-of-experts model's expert kernels see (one rank's columns)."""

    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # each expert's
    clamped_swiglu: bool  # gpt-oss's experts; else SiLU(gate) * up


MOE_SHAPES = (
    MoeShape("mixtral-8x7b", 8, 2, 4096, 14336, False),
    MoeShape("qwen3-30b-a3b", 128, 8, 2048, 768, False),
    MoeShape("gpt-oss-20b", 32, 4, 2880, 2880, True),
)


def _experts(shape: MoeShape, dtype: torch.dtype, num_tokens: int) -> Callable[[], object]:
    experts, hidden, width = shape.num_experts, shape.hidden_size, shape.intermediate_size
    # gpt-oss's router weighs in the model's dtype, the others' in float32
    weight_dtype = dtype if shape.clamped_swiglu else torch.float32
    routing = (
        _meta(num_tokens, hidden, dtype=dtype),
        _meta(num_tokens, shape.top_k, dtype=weight_dtype),
        _meta(num_tokens, shape.top_k, dtype=torch.int64),
    )
    if shape.clamped_swiglu:
        return lambda: fused_moe.clamped_swiglu_experts(
            *routing,
            _meta(experts, hidden, 2 * width, dtype=dtype),
            _meta(experts, 2 * width, dtype=dtype),
            _meta(experts, width, hidden, dtype=dtype),
            _meta(experts, hidden, dtype=dtype),
            1.702,
            7.0,
        )
    return lambda: fused_moe.silu_experts(
        *routing,
        _meta(experts, 2 * width, hidden, dtype=dtype),
        _meta(experts, hidden, width, dtype=dtype),
    )


def moe_cases() -> Iterator[tuple[str, ModuleType, Callable[[], object]]]:
    """(label, kernel module, wrapper call) for the fused experts' launches: each model in
    bfloat16 and the first in float16 too, a decode step (16-row tiles) and a prefill's 1024
    tokens (64-row tiles)."""
    for index, shape in enumerate(MOE_SHAPES):
        for dtype in (torch.bfloat16, torch.float16) if index == 0 else (torch.bfloat16,):
            tag = f"{shape.name} {str(dtype).removeprefix('torch.')}"
            for num_tokens in (1, 1024):
                call = _experts(shape, dtype, num_tokens)
                yield f"experts {tag} {num_tokens} tokens", fused_moe, call


@dataclass(frozen=True, slots=True)
class PackedIntShape:
    """One projection of a pack-quantized (W4A16 / W8A16) model, as its layer holds it."""

    name: str
    in_features: int
    out_features: int
    num_bits: int
    group_size: int | None  # None: one scale per row
    symmetric: bool
    bias: bool


PACKED_INT_SHAPES = (
    PackedIntShape("llama-3-8b gate_up w4 g128 asym", 4096, 2 * 14336, 4, 128, False, False),
    PackedIntShape("llama-3-8b down w4 g32 sym", 14336, 4096, 4, 32, True, False),
    PackedIntShape("qwen2-7b qkv w8 channel sym", 3584, 3584 + 2 * 512, 8, None, True, True),
)


def _packed_int(shape: PackedIntShape, dtype: torch.dtype, num_tokens: int) -> Callable[[], object]:
    pack = 32 // shape.num_bits
    num_groups = shape.in_features // (shape.group_size or shape.in_features)
    zero = None
    if not shape.symmetric:
        zero = _meta(shape.out_features // pack, num_groups, dtype=torch.int32)
    return lambda: packed_int_matmul.packed_int_matmul(
        _meta(num_tokens, shape.in_features, dtype=dtype),
        _meta(shape.out_features, shape.in_features // pack, dtype=torch.int32),
        _meta(shape.out_features, num_groups, dtype=dtype),
        zero,
        shape.num_bits,
        _meta(shape.out_features, dtype=dtype) if shape.bias else None,
    )


def packed_int_cases() -> Iterator[tuple[str, ModuleType, Callable[[], object]]]:
    """(label, kernel module, wrapper call) for the packed-integer matmul's launches: each
    projection in bfloat16 and float16, a decode step (1 token: 16-row tiles, K steps of 128)
    and a prefill's 1024 tokens (64-row tiles, steps of 64); groups of 128 (one a K step), of 32
    (several a step) and one per row."""
    for shape in PACKED_INT_SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            tag = f"{shape.name} {str(dtype).removeprefix('torch.')}"
            for num_tokens in (1, 1024):
                call = _packed_int(shape, dtype, num_tokens)
                yield f"packed_int {tag} {num_tokens} tokens", packed_int_matmul, call


@dataclass(frozen=True, slots=True)
class EightBitShape:
    """One projection of an 8-bit model (float8 blocks, or W8A8 int8 / float8), as one rank's
    layer holds it."""

    name: str
    in_features: int
    out_features: int
    bias: bool


FP8_BLOCK = (128, 128)  # DeepSeek-V3's and Qwen3's weight_block_size
FP8_BLOCK_SHAPES = (
    EightBitShape("deepseek-v3 gate_up tp8", 7168, 2 * 18432 // 8, False),
    EightBitShape("deepseek-v3 down tp8", 18432 // 8, 7168, False),
    EightBitShape("qwen2-7b qkv", 3584, 3584 + 2 * 512, True),  # a partial last row block
)
W8A8_SHAPES = (
    EightBitShape("llama-3-8b gate_up", 4096, 2 * 14336, False),
    EightBitShape("qwen2-7b qkv", 3584, 3584 + 2 * 512, True),
)


def _fp8_block(shape: EightBitShape, dtype: torch.dtype, num_tokens: int) -> Callable[[], object]:
    rows, cols = FP8_BLOCK
    scale_shape = (-(-shape.out_features // rows), -(-shape.in_features // cols))
    return lambda: fp8_block_matmul.fp8_block_matmul(
        _meta(num_tokens, shape.in_features, dtype=dtype),
        _meta(shape.out_features, shape.in_features, dtype=torch.float8_e4m3fn),
        _meta(*scale_shape, dtype=torch.float32),
        FP8_BLOCK,
        _meta(shape.out_features, dtype=dtype) if shape.bias else None,
    )


def _w8a8(
    shape: EightBitShape, dtype: torch.dtype, num_tokens: int, kind: str, inputs: str = ""
) -> Callable[[], object]:
    """``inputs``: "static" a static input scale, "row-parallel" the rows' largest magnitudes
    given; "": per token."""
    return lambda: scaled_matmul.w8a8_matmul(
        _meta(num_tokens, shape.in_features, dtype=dtype),
        _meta(shape.out_features, shape.in_features, dtype=scaled_matmul.ELEMENT_DTYPES[kind]),
        _meta(shape.out_features, 1, dtype=dtype),
        kind,
        _meta(shape.out_features, dtype=dtype) if shape.bias else None,
        row_largest=_meta(num_tokens, 1, dtype=dtype) if inputs == "row-parallel" else None,
        input_scale=_meta(1, dtype=dtype) if inputs == "static" else None,
    )


def eight_bit_cases() -> Iterator[tuple[str, ModuleType, Callable[[], object]]]:
    """(label, kernel module, wrapper call) for the 8-bit matmuls' launches (each with its
    inputs' quantization): float8 blocks of 128 x 128 and W8A8 int8 and float8, each
    projection in bfloat16 and the first in float16 too, a decode step (1 token: 16-row
    tiles) and a prefill's 1024 tokens (64-row tiles); and W8A8's static and row-parallel
    input scales."""
    for index, shape in enumerate(FP8_BLOCK_SHAPES):
        for dtype in (torch.bfloat16, torch.float16) if index == 0 else (torch.bfloat16,):
            tag = f"{shape.name} {str(dtype).removeprefix('torch.')}"
            for num_tokens in (1, 1024):
                call = _fp8_block(shape, dtype, num_tokens)
                yield f"fp8_block {tag} {num_tokens} tokens", fp8_block_matmul, call
    for kind in scaled_matmul.KINDS:
        for index, shape in enumerate(W8A8_SHAPES):
            for dtype in (torch.bfloat16, torch.float16) if index == 0 else (torch.bfloat16,):
                tag = f"{kind} {shape.name} {str(dtype).removeprefix('torch.')}"
                for num_tokens in (1, 1024):
                    call = _w8a8(shape, dtype, num_tokens, kind)
                    yield f"w8a8 {tag} {num_tokens} tokens", scaled_matmul, call
        for inputs in ("static", "row-parallel"):
            call = _w8a8(W8A8_SHAPES[0], torch.bfloat16, 64, kind, inputs)
            yield f"w8a8 {kind} {inputs} inputs bfloat16 64 tokens", scaled_matmul, call


def tensor_core_operands(ptx: str) -> list[str]:
    """The operand types (e4m3, bf16, s8 ...) of the PTX's tensor-core instructions."""
    operands = set()
    for instruction in _TENSOR_CORE_INSTRUCTION.findall(ptx):
        operands |= _TENSOR_CORE_OPERANDS.intersection(instruction.split("."))
    return sorted(operands)


def _launch_key(launch: Launch) -> tuple[Any, ...]:
    """What Triton compiles a launch by: the kernel, argument types and constexpr values."""
    types = tuple(
        value if not isinstance(value, (torch.Tensor, int, float)) else _argument_type(value)
        for value in launch.args
    )
    return (launch.kernel.fn.__name__, types, tuple(sorted(launch.kwargs.items())))


CASE_GROUPS: dict[str, Callable[[], Iterator[tuple[str, ModuleType, Callable[[], object]]]]] = {
    "paged": paged_cases,
    "latent": latent_cases,
    "moe": moe_cases,
    "packed_int": packed_int_cases,
    "eight_bit": eight_bit_cases,
}


def cases() -> Iterator[tuple[str, ModuleType, Callable[[], object]]]:
    """Every group's launches."""
    for group in CASE_GROUPS.values():
        yield from group()


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description="compile the engine's kernels for sm_90")
    parser.add_argument("--group", choices=sorted(CASE_GROUPS), default=None, help="default: all")
    group = parser.parse_args(argv).group
    seen: set[tuple[Any, ...]] = set()
    for label, module, call in CASE_GROUPS[group]() if group else cases():
        for launch in record_launches(module, call):
            key = _launch_key(launch)
            if key in seen:
                continue
            seen.add(key)
            result: dict[str, Any] = {"case": label, "kernel": launch.kernel.fn.__name__}
            try:
                compiled = compile_launch(launch)
            except Exception as error:  # reported per launch; the test names the failure
                result["error"] = f"{type(error).__name__}: {error}"[:2000]
            else:
                ptx = compiled.asm["ptx"]
                result["tensor_core_instructions"] = len(_TENSOR_CORE_OP.findall(ptx))
                result["tensor_core_operands"] = tensor_core_operands(ptx)
                result["vector_stores"] = len(_VECTOR_STORE.findall(ptx))
                result["shared"] = compiled.metadata.shared
                result["num_warps"] = compiled.metadata.num_warps
                result.update(resource_usage(compiled.asm["cubin"]))
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
