"""Timing on one device, and its ceilings: device-to-device copy bandwidth and matmul FLOP/s.

CUDA events time device work on CUDA, wall clocks elsewhere; ``log`` stamps progress with the
seconds since this module was imported (the start of the run).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu.shapes import MIB, Preset

STARTED = time.perf_counter()


def seconds_since_start() -> float:
    return time.perf_counter() - STARTED


def log(message: str) -> None:
    print(f"[{seconds_since_start():6.1f}s] {message}", flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``reps`` calls after ``warmup``: CUDA events on CUDA, else wall."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(reps):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        return samples
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize(device)
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]


def timed_wall(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall seconds of one call, synchronised on both sides (host work included)."""
    synchronize(device)
    started = time.perf_counter()
    value = fn()
    synchronize(device)
    return time.perf_counter() - started, value


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- ceilings ----------------------------------------------------------------------------
def measure_copy(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    src = torch.full((nbytes,), 1, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = statistics.median(time_op(lambda: dst.copy_(src), device, reps))
    return {
        "nbytes": nbytes,
        "seconds": seconds,
        "copied_gb_per_s": nbytes / seconds / 1e9,
        "read_write_gb_per_s": 2 * nbytes / seconds / 1e9,
    }


def measure_matmul(device: torch.device, n: int, dtype: str, reps: int) -> dict[str, Any]:
    torch_dtype = getattr(torch, dtype)
    a = torch.randn(n, n, dtype=torch_dtype, device=device)  # [n, n]
    b = torch.randn(n, n, dtype=torch_dtype, device=device)  # [n, n]
    out = torch.empty(n, n, dtype=torch_dtype, device=device)
    seconds = statistics.median(time_op(lambda: torch.mm(a, b, out=out), device, reps, warmup=3))
    return {"n": n, "dtype": dtype, "seconds": seconds, "flop_per_s": 2 * n**3 / seconds}


def read_bytes_per_s(ceilings: dict[str, Any]) -> float:
    """The streaming rate rooflines divide by: the copy's read+write bytes per second."""
    return float(ceilings["copy"]["read_write_gb_per_s"]) * 1e9


def peak_flop_per_s(ceilings: dict[str, Any]) -> float:
    return float(ceilings["matmul"]["flop_per_s"])


def measure_ceilings(device: torch.device, dtype: str, preset: Preset) -> dict[str, Any]:
    copy = measure_copy(device, preset.copy_bytes, preset.num_reps)
    log(f"copy {preset.copy_bytes / MIB:g} MiB: {copy['read_write_gb_per_s']:.0f} GB/s read+write")
    matmul = measure_matmul(device, preset.matmul_n, dtype, preset.num_reps)
    log(f"matmul {preset.matmul_n}^3 {dtype}: {matmul['flop_per_s'] / 1e12:.1f} TFLOP/s")
    free_memory(device)
    return {"copy": copy, "matmul": matmul}
