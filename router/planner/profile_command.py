"""``pdserve profile``: a hardware profile of the machine at hand, for ``pdserve plan``.

It loads the model on one device of this machine (the engine a worker runs, on a CPU with the
threads a worker of ``--worker-num-cpus`` computes on; ``--load-format dummy``: random weights
from its config.json, for a machine without the checkpoint), runs the start-up latency profile's
synthetic requests through its engine loop (each step timed as the loop's turn, as a served
worker's) a few times with larger decode batches (engine/latency_profile.py), and fits the
router's step-time model to those steps (router/latency_model.py): that fit is the profile's
``measured`` step time for this model. From it and the model's sizes come the effective FLOP/s
(a prompt token's FLOPs over its fitted seconds) and memory bandwidth (a KV token's bytes over
its fitted read time); the rate a step reads its weights at is measured (a matmul of one row
over a 256 MiB weight, through the engine's projections), and the step overhead is the fit's
less its read of the model's weights (the roofline counts that read apart, for any model); a
hand-off's link is measured as a copy of a 256 MiB buffer on the device (on a CPU, the
shared-memory transport is such a copy). The measuring, which needs torch, is
engine/machine_profile.py's; this module fits and writes. The gateway's and router's own time per
request is not measured here: the profile keeps the default (``path_overhead_s``), which
``--path-overhead-ms`` sets. On a CPU the profile records the host's cores, which the workers
share (``host_cores``), and the threads a worker computes on; the CPU time of the host's other
work (per streamed token, per hand-off) needs a served cluster to measure and is left at 0
(bench.plan_accuracy measures it; a profile's JSON can be given it).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from router.cpu_binding import threads_per_worker
from router.latency_model import fit_step_cost
from router.planner.hardware import DEFAULT_PATH_OVERHEAD_S, Hardware
from router.planner.model_costs import ModelCosts

_ROUNDS = 3
_BATCH_SIZES = (1, 4, 16, 64)
# each decode batch's steps: long enough that its steady steps outweigh its first few, slower
# ones (the start-up profile's 8 made a decode step's fit ~10-20 % above a served worker's)
_DECODE_STEPS = 32


def add_profile_args(profile: argparse.ArgumentParser) -> None:
    profile.add_argument("--model", required=True, help="Hugging Face model directory")
    profile.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    profile.add_argument("--dtype", default="float32", help="as pdserve serve's --dtype")
    profile.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy: random weights from the model's config.json alone (a step's time depends "
        "on the model's shapes, not its weights: a model's profile without its checkpoint)",
    )
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
    from engine.machine_profile import measure_machine  # (it loads torch: not at import)

    threads = threads_per_worker(args.worker_num_cpus)  # a served worker's
    measured = measure_machine(
        args.model,
        device=args.device,
        dtype=args.dtype,
        num_threads=threads,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        rounds=_ROUNDS,
        batch_sizes=_BATCH_SIZES,
        decode_steps=_DECODE_STEPS,
        load_format=args.load_format,
    )
    cost = fit_step_cost(measured.step_timings)
    model = ModelCosts.of(measured.model_config, Path(args.model).name, measured.kv_dtype)
    copy_bytes_per_s = measured.copy_bytes_per_s
    # (a fit without a per-token cost: the copies' rate as a floor)
    flops = (
        model.flops_per_token / cost.per_prefill_token_s
        if cost.per_prefill_token_s
        else copy_bytes_per_s
    )
    memory = (
        model.kv_bytes_per_token / cost.per_context_token_s if cost.per_context_token_s else 0.0
    )
    hardware = Hardware(
        name=args.name or f"{os.uname().nodename} ({args.device})",
        flops_per_s=flops,
        memory_bytes_per_s=memory or copy_bytes_per_s,
        device_memory_bytes=measured.device_memory_bytes,
        link_bytes_per_s=copy_bytes_per_s,
        host_link_bytes_per_s=measured.host_link_bytes_per_s,
        # the engine's 8-bit forward, as many times faster than the profiled matmuls as it
        # measured (none measured: 0, the planner's bf16 rate)
        int8_ops_per_s=flops * measured.eight_bit_speedups.get("int", 0.0),
        fp8_flops_per_s=flops * measured.eight_bit_speedups.get("float", 0.0),
        weight_bytes_per_s=measured.weight_bytes_per_s,
        path_overhead_s=DEFAULT_PATH_OVERHEAD_S
        if args.path_overhead_ms is None
        else args.path_overhead_ms / 1000,
        measured_model=model.name,
        measured=cost,
        # a CPU machine's workers share its cores (a GPU's compute on devices of their own)
        host_cores=(os.cpu_count() or 1) if args.device == "cpu" else 0,
        worker_threads=threads,
    )
    # the fit's step overhead holds the step's read of the model's weights (a decode step reads
    # them whatever its rows): the roofline counts that read apart, at the weights' own rate,
    # so its overhead is what is left (as the presets' is)
    weight_rate = hardware.weight_read_bytes_per_s
    weights_s = model.weight_bytes_read(1) / weight_rate
    overhead_s = max(0.0, cost.overhead_s - weights_s)
    hardware = replace(hardware, step_overhead_s=overhead_s)
    hardware.save(args.out)
    print(
        f"{len(measured.step_timings)} steps of {model.name} fitted: "
        f"{cost.overhead_s * 1000:.2f} ms a step + "
        f"{cost.per_prefill_token_s * 1e6:.1f} us a prompt token + "
        f"{cost.per_decode_token_s * 1e6:.1f} us a decode row + "
        f"{cost.per_context_token_s * 1e9:.2f} ns a KV token read; weights read at "
        f"{weight_rate / 1e9:.1f} GB/s ({weights_s * 1000:.2f} ms of the step's "
        f"{cost.overhead_s * 1000:.2f}: the roofline's overhead {overhead_s * 1000:.2f} ms); "
        f"copies at {copy_bytes_per_s / 1e9:.1f} GB/s"
        + (
            f", to and from host memory at {measured.host_link_bytes_per_s / 1e9:.1f} GB/s"
            if measured.host_link_bytes_per_s
            else ""
        )
    )
    for kind, speedup in measured.eight_bit_speedups.items():
        print(f"{kind} 8-bit forward: {speedup:.2f}x the {args.dtype} matmul's rate")
    for kind, failure in measured.eight_bit_failures.items():
        print(f"{kind} 8-bit forward not measured ({failure}): planned at the {args.dtype} rate")
    print(f"wrote {args.out}")
    return 0
