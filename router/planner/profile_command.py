"""``pdserve profile``: a hardware profile of the machine at hand, for ``pdserve plan``.

It loads the model on one device of this machine (the engine a worker runs, on a CPU with the
threads a worker of ``--worker-num-cpus`` computes on), runs the start-up latency profile's
synthetic requests through its engine loop (each step timed as the loop's turn, as a served
worker's) a few times with larger decode batches (engine/latency_profile.py), and fits the
router's step-time model to those steps (router/latency_model.py): that fit is the profile's
``measured`` step time for this model. From it and the model's sizes come the effective FLOP/s
(a prompt token's FLOPs over its fitted seconds) and memory bandwidth (a KV token's bytes over
its fitted read time); a hand-off's link is measured as a copy of a 256 MiB buffer on the device
(on a CPU, the shared-memory transport is such a copy). The gateway's and router's own time per
request is not measured here: the profile keeps the default (``path_overhead_s``), which
``--path-overhead-ms`` sets.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from router.cpu_binding import threads_per_worker
from router.latency_model import fit_step_cost
from router.planner.hardware import DEFAULT_PATH_OVERHEAD_S, Hardware
from router.planner.model_costs import ModelCosts

_COPY_BYTES = 256 << 20
_ROUNDS = 3
_BATCH_SIZES = (1, 4, 16, 64)

if TYPE_CHECKING:
    import torch


def add_profile_args(profile: argparse.ArgumentParser) -> None:
    profile.add_argument("--model", required=True, help="Hugging Face model directory")
    profile.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    profile.add_argument("--dtype", default="float32", help="as pdserve serve's --dtype")
    profile.add_argument(
        "--worker-num-cpus",
        type=float,
        default=1.0,
        help="as pdserve serve's: a CPU worker computes on this many threads (0: one)",
    )
    profile.add_argument("--max-num-batched-tokens", type=int, default=512)
    profile.add_argument("--num-kv-blocks", type=int, default=2048)
    profile.add_argument("--block-size", type=int, default=16)
    profile.add_argument(
        "--path-overhead-ms", type=float, default=None, help="per request's first token"
    )
    profile.add_argument("--name", default=None, help="the profile's name (default: the host's)")
    profile.add_argument("--out", type=Path, default=Path("pdserve-hardware.json"))


def run_profile(args: argparse.Namespace) -> int:
    import torch

    from engine.engine_config import CacheConfig, LoadConfig
    from engine.engine_loop import EngineLoop
    from engine.kv_cache.budget import KVBudget
    from engine.latency_profile import run_latency_profile_in_loop
    from engine.llm_engine import LLMEngine
    from engine.scheduler import SchedulerConfig

    if args.device == "cpu":  # the threads a served worker has (router/cpu_binding.py)
        torch.set_num_threads(threads_per_worker(args.worker_num_cpus))
    engine = LLMEngine(
        LoadConfig(args.model, dtype=args.dtype, device=args.device),
        CacheConfig(block_size=args.block_size, budget=KVBudget(num_blocks=args.num_kv_blocks)),
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens),
    )
    loop = EngineLoop(engine, "profile")  # as a worker serves: steps timed as loop turns
    loop.start()
    try:
        run_latency_profile_in_loop(loop, seed=-1)  # warm-up: its steps are not kept
        engine.step_timings.take()
        for seed in range(_ROUNDS):
            run_latency_profile_in_loop(loop, seed=seed, batch_sizes=_BATCH_SIZES)
        timings = engine.step_timings.take()
    finally:
        loop.stop()
    cost = fit_step_cost(timings)
    element = torch.empty((), dtype=engine.kv_cache.dtype).element_size()
    model = ModelCosts.of(engine.model_config, Path(args.model).name, _dtype_name(element))
    copy_bytes_per_s = _copy_bandwidth(engine.device)
    flops = model.flops_per_token / cost.per_prefill_token_s if cost.per_prefill_token_s else 0.0
    memory = (
        model.kv_bytes_per_token / cost.per_context_token_s if cost.per_context_token_s else 0.0
    )
    hardware = Hardware(
        name=args.name or f"{os.uname().nodename} ({args.device})",
        flops_per_s=flops or copy_bytes_per_s,  # (a fit without a per-token cost: a floor)
        memory_bytes_per_s=memory or copy_bytes_per_s,
        device_memory_bytes=_device_memory(engine.device),
        link_bytes_per_s=copy_bytes_per_s,
        step_overhead_s=cost.overhead_s,
        path_overhead_s=DEFAULT_PATH_OVERHEAD_S
        if args.path_overhead_ms is None
        else args.path_overhead_ms / 1000,
        measured_model=model.name,
        measured=cost,
    )
    engine.close()
    hardware.save(args.out)
    print(
        f"{len(timings)} steps of {model.name} fitted: {cost.overhead_s * 1000:.2f} ms a step + "
        f"{cost.per_prefill_token_s * 1e6:.1f} us a prompt token + "
        f"{cost.per_decode_token_s * 1e6:.1f} us a decode row + "
        f"{cost.per_context_token_s * 1e9:.2f} ns a KV token read; copies at "
        f"{copy_bytes_per_s / 1e9:.1f} GB/s"
    )
    print(f"wrote {args.out}")
    return 0


def _dtype_name(element_bytes: int) -> str:
    return {4: "float32", 2: "bfloat16", 1: "int8"}[element_bytes]


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of one copy of a 256 MiB buffer (read and write each count once: the
    bytes a hand-off moves)."""
    import torch

    source = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return _COPY_BYTES / best


def _device_memory(device: torch.device) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
