"""What ``pdserve profile`` measures on the machine at hand (router/planner/profile_command.py
fits and writes it; this module does the measuring, the router never imports torch).

The model is loaded as a worker loads it, on a CPU with the threads a worker has; the start-up
latency profile's requests (engine/latency_profile.py) run through an engine loop, so each
step is timed as a served worker's turn; and a 256 MiB copy on the device stands for a hand-off's
link (on a CPU, the shared-memory transport is such a copy); on a GPU, copies to and from
page-locked host memory stand for the KV host tier's.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.engine_config import CacheConfig, LoadConfig, LoadFormat
from engine.engine_loop import EngineLoop
from engine.kernels.linear import PackedLinear, has_packed_linears
from engine.kv_cache.budget import KVBudget
from engine.latency_profile import run_latency_profile_in_loop
from engine.llm_engine import LLMEngine
from engine.messages import StepTiming
from engine.model_config import ModelConfig
from engine.scheduler import SchedulerConfig
from engine.step_timings import StepTimingLog

_COPY_BYTES = 256 << 20
# a prefill chunk's rows through an 8B model's MLP projection: a matmul that fills a GPU
_GEMM_ROWS, _GEMM_IN, _GEMM_OUT = 4096, 4096, 14336
# every step of the profile's rounds is kept (a worker's log keeps its latest 256 between two
# load reports; the rounds run about a thousand)
_STEPS_KEPT = 1 << 16
_DTYPE_NAMES = {4: "float32", 2: "bfloat16", 1: "int8"}  # by a KV element's bytes


@dataclass(frozen=True, slots=True)
class MachineMeasurement:
    model_config: ModelConfig
    kv_dtype: str  # what one KV element is, by its width: "float32", "bfloat16", "int8"
    step_timings: tuple[StepTiming, ...]
    copy_bytes_per_s: float  # one copy of a large buffer on the device
    device_memory_bytes: float
    # copies between the device and page-locked host memory (the KV host tier's), the slower
    # direction; 0 on a CPU (its host tier is the same memory)
    host_link_bytes_per_s: float = 0.0
    # on a GPU: how many times a prefill's rows go faster through the engine's W8A8 forward
    # than through a matmul in the model's dtype, by kind ("int", "float"); a kind the GPU
    # could not run is absent, with why in ``eight_bit_failures``; {} on a CPU
    eight_bit_speedups: dict[str, float] = field(default_factory=dict)
    eight_bit_failures: dict[str, str] = field(default_factory=dict)
    # a matmul of one row streaming a 256 MiB weight in the model's dtype through the
    # engine's projections (oneDNN's packed layout where the model's linears use it): the
    # rate a decode step reads its weights at
    weight_bytes_per_s: float = 0.0


def measure_machine(
    model_dir: str,
    *,
    device: str,
    dtype: str,
    num_threads: int,
    block_size: int,
    num_kv_blocks: int,
    max_num_batched_tokens: int,
    rounds: int,
    batch_sizes: tuple[int, ...],
    decode_steps: int,
    load_format: LoadFormat = "auto",
) -> MachineMeasurement:
    """Load the model, run the profile ``rounds`` times (after one warm-up round whose steps are
    dropped), and measure the device's copies and memory. ``num_threads``: a CPU's torch
    threads (a served worker's); ``load_format`` "dummy": random weights from the model's
    config.json alone (a step's time depends on the model's shapes, not its weights)."""
    if device == "cpu":
        torch.set_num_threads(num_threads)
    engine = LLMEngine(
        LoadConfig(model_dir, dtype=dtype, device=device, load_format=load_format),
        CacheConfig(block_size=block_size, budget=KVBudget(num_blocks=num_kv_blocks)),
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens),
    )
    engine.step_timings = StepTimingLog(_STEPS_KEPT)
    try:
        loop = EngineLoop(engine, "profile")  # as a worker serves: steps timed as loop turns
        loop.start()
        try:
            run_latency_profile_in_loop(loop, seed=-1)  # warm-up: its steps are not kept
            engine.step_timings.take()
            for seed in range(rounds):
                run_latency_profile_in_loop(
                    loop, seed=seed, batch_sizes=batch_sizes, decode_steps=decode_steps
                )
            timings = engine.step_timings.take()
        finally:
            loop.stop()
        element = torch.empty((), dtype=engine.kv_cache.dtype).element_size()
        return MachineMeasurement(
            engine.model_config,
            _DTYPE_NAMES[element],
            timings,
            _copy_bandwidth(engine.device),
            _device_memory(engine.device),
            _host_link_bandwidth(engine.device),
            *_eight_bit_speedups(engine.device, engine.dtype),
            _weight_stream_bandwidth(engine.device, engine.dtype, has_packed_linears(engine.model)),
        )
    finally:
        engine.close()


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of one copy of a 256 MiB buffer (read and write each count once: the
    bytes a hand-off moves); the best of five."""
    source = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return _COPY_BYTES / _best_of_five(device, functools.partial(target.copy_, source))


def _weight_stream_bandwidth(device: torch.device, dtype: torch.dtype, onednn: bool) -> float:
    """Bytes per second of weights a matmul of one row reads: a 256 MiB weight (beyond any
    cache) in ``dtype``, through oneDNN's packed layout where ``onednn`` (a CPU's projections),
    else torch's; the best of five."""
    width = torch.empty((), dtype=dtype).element_size()
    in_features = 4096
    out_features = _COPY_BYTES // (width * in_features)
    weight = torch.randn(out_features, in_features, device=device).to(dtype)
    x = torch.randn(1, in_features, device=device).to(dtype)
    if onednn:
        packed = PackedLinear(weight, None)
        del weight
        seconds = _best_of_five(device, lambda: packed(x))
    else:
        seconds = _best_of_five(device, lambda: torch.nn.functional.linear(x, weight))
    return out_features * in_features * width / seconds


def _host_link_bandwidth(device: torch.device) -> float:
    """A GPU's bytes per second of copies of a 256 MiB buffer to and from page-locked host
    memory (the best of five each way, the slower way); 0 on a CPU."""
    if device.type != "cuda":
        return 0.0
    on_device = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    on_host = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    slowest = max(
        _best_of_five(device, functools.partial(target.copy_, source, non_blocking=True))
        for target, source in ((on_host, on_device), (on_device, on_host))
    )
    return _COPY_BYTES / slowest


def _eight_bit_speedups(
    device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, float], dict[str, str]]:
    """On a GPU, the engine's W8A8 forward (engine/kernels/scaled_matmul.py: the input
    quantized per token, then the 8-bit GEMM) of a prefill's rows through an 8B model's MLP
    projection, int8 and float8, each against a matmul in ``dtype`` of the same shape: the
    times faster (best of five each), and why a kind could not run (a GPU without float8, a
    kernel that failed). ({}, {}) on a CPU, where 8-bit layers dequantize."""
    if device.type != "cuda":
        return {}, {}
    from engine.kernels import scaled_matmul  # (Triton: on a GPU only)

    x = torch.randn(_GEMM_ROWS, _GEMM_IN, device=device, dtype=dtype)
    weight = torch.randn(_GEMM_OUT, _GEMM_IN, device=device, dtype=dtype)
    plain_s = _best_of_five(device, lambda: x @ weight.T)
    speedups, failures = {}, {}
    scale = torch.ones(_GEMM_OUT, 1, device=device, dtype=torch.float32)
    for kind, element in scaled_matmul.ELEMENT_DTYPES.items():
        quantized = weight.clamp(-100, 100).to(element)
        forward = functools.partial(scaled_matmul.w8a8_matmul, x, quantized, scale, kind)
        try:
            seconds = _best_of_five(device, forward)
        except Exception as error:  # recorded, and the profile goes on without this kind
            first_line = (str(error).splitlines() or [""])[0][:200]
            failures[kind] = f"{type(error).__name__}: {first_line}"
            continue
        speedups[kind] = plain_s / seconds
    return speedups, failures


def _best_of_five(device: torch.device, call: Callable[[], object]) -> float:
    """The least of five timed calls after one untimed (compiled, warmed), on a GPU each from
    an idle device to its end there."""
    call()
    best = float("inf")
    for _ in range(5):
        _synchronize(device)
        started = time.perf_counter()
        call()
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
