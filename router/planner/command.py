"""``pdserve plan`` and ``pdserve profile``: their flags and what they run (docs/planner.md).

    pdserve profile --model DIR --out this-machine.json
    pdserve plan --model DIR --hardware h100|this-machine.json --rate 20 \\
        --prompt-len 1024 --output-len 256 --slo-ttft-ms 500 --slo-tpot-ms 50 --out plan/
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from router.local_prefill import LocalPrefillRule
from router.planner.hardware import PRESETS, Hardware, hardware_named
from router.planner.model_costs import KV_CACHE_DTYPE_BYTES, ModelCosts
from router.planner.plan import Layout, LayoutResult, Planner, Slo, rates_around
from router.planner.report import deploy_snippet, results_table, write_plot
from router.planner.simulator import ROUTER_POLICIES
from router.planner.speculation import Speculation
from router.planner.workload import PlanWorkload


def add_plan_args(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--model", required=True, help="model directory (config.json is enough)")
    plan.add_argument(
        "--dtype",
        default="bfloat16",
        help="weights' and KV's element type (a quantized checkpoint's linear layers: its own)",
    )
    plan.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=sorted(KV_CACHE_DTYPE_BYTES),
        help="as pdserve serve's (auto: --dtype)",
    )
    plan.add_argument(
        "--hardware",
        default="h100",
        help=f"a preset ({', '.join(PRESETS)}) or a profile JSON from pdserve profile",
    )
    plan.add_argument("--flops", type=float, default=None, help="override: FLOP/s per device")
    plan.add_argument(
        "--fp8-flops", type=float, default=None, help="override: float8 matmul FLOP/s (0: none)"
    )
    plan.add_argument(
        "--int8-ops", type=float, default=None, help="override: int8 matmul OP/s (0: none)"
    )
    plan.add_argument(
        "--memory-gbs",
        type=float,
        default=None,
        help="override: memory GB/s (a step's reads of its weights and of the KV alike)",
    )
    plan.add_argument("--link-gbs", type=float, default=None, help="override: hand-off GB/s")
    plan.add_argument(
        "--host-link-gbs", type=float, default=None, help="override: device-host copies GB/s"
    )
    plan.add_argument(
        "--device-memory-gib", type=float, default=None, help="override: memory per device"
    )
    work = plan.add_argument_group("workload")
    work.add_argument("--rate", type=float, required=True, help="requests per second to serve")
    work.add_argument("--prompt-len", type=int, default=512, help="median prompt tokens")
    work.add_argument("--output-len", type=int, default=128, help="median output tokens")
    work.add_argument("--length-sigma", type=float, default=0.5, help="std-dev of ln(length)")
    work.add_argument("--prefix-share", type=float, default=0.0, help="share with a system prompt")
    work.add_argument("--prefix-len", type=int, default=0, help="its tokens")
    work.add_argument(
        "--turns", type=int, default=1, help="a conversation's requests (its history re-sent)"
    )
    work.add_argument("--think-s", type=float, default=5.0, help="mean time between turns")
    work.add_argument("--num-requests", type=int, default=400, help="simulated per run")
    work.add_argument("--seed", type=int, default=0)
    slo = plan.add_argument_group("SLOs and the search")
    slo.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    slo.add_argument("--slo-tpot-ms", type=float, default=100.0)
    slo.add_argument(
        "--attainment", type=float, default=0.9, help="share of requests meeting both SLOs"
    )
    slo.add_argument("--max-devices", type=int, default=8, help="devices (GPUs) at most")
    slo.add_argument("--tp-sizes", default="1,2,4,8", help="tensor-parallel sizes to try")
    slo.add_argument("--gpus-per-node", type=int, default=8, help="for the deploy snippet")
    engine = plan.add_argument_group("worker settings (as pdserve serve's)")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--prefill-max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--num-kv-blocks", type=int, default=None, help="per worker")
    engine.add_argument(
        "--max-local-prefill-length",
        type=int,
        default=0,
        help="disaggregated: prompts of at most this many tokens prefilled on their decode worker",
    )
    engine.add_argument(
        "--max-prefill-queue-tokens",
        type=int,
        default=None,
        help="disaggregated: past this many prompt tokens queued on every prefill worker, a "
        "prompt is prefilled on its decode worker (if that one prefills nothing)",
    )
    engine.add_argument(
        "--kv-offload-gb",
        type=float,
        default=0.0,
        help="as pdserve serve's: GiB of host memory per worker rank that keeps the blocks its "
        "KV cache evicts, prefix hits copied back (default: none)",
    )
    engine.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="speculative decoding (serve's --speculative-config): drafts a decoding sequence "
        "proposes a step (default: none)",
    )
    engine.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="with --num-speculative-tokens: no drafts in a step while more sequences than "
        "this are running, as serve's speculative_config.disable_by_batch_size (default: "
        "always drafts)",
    )
    engine.add_argument(
        "--draft-acceptance",
        type=float,
        default=0.5,
        help="with --num-speculative-tokens: the share of draft tokens that stand, as pdserve "
        "reports a served model's (pdserve:spec_decode_num_accepted_tokens over "
        "..._num_draft_tokens) (default: %(default)s)",
    )
    engine.add_argument(
        "--draft-rate",
        type=float,
        default=1.0,
        help="with --num-speculative-tokens: the share of the times a decoding sequence asks "
        "for drafts that it gets some (prompt lookup finds none in the others: the step "
        "computes its token alone), as pdserve reports a served model's "
        "(pdserve:spec_decode_num_drafts over ..._num_draft_attempts) (default: %(default)s)",
    )
    engine.add_argument(
        "--router-policy",
        choices=ROUTER_POLICIES,
        default=ROUTER_POLICIES[0],
        help="the router's, simulated (kv_aware: serve's default)",
    )
    plan.add_argument("--out", type=Path, default=Path("pdserve-plan"), help="output directory")


def run_plan(args: argparse.Namespace) -> int:
    model = ModelCosts.load(args.model, args.dtype, args.kv_cache_dtype)
    hardware = _with_overrides(hardware_named(args.hardware), args)
    workload = PlanWorkload(
        rate=args.rate,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        sigma=args.length_sigma,
        max_len=model.max_model_len,
        prefix_share=args.prefix_share,
        prefix_len=args.prefix_len,
        num_requests=args.num_requests,
        seed=args.seed,
        turns=args.turns,
        think_s=args.think_s,
    )
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000, args.attainment)
    planner = Planner(
        model,
        hardware,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_max_num_batched_tokens=args.prefill_max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        memory_fraction=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        router_policy=args.router_policy,
        local_prefill=LocalPrefillRule(
            args.max_local_prefill_length, args.max_prefill_queue_tokens
        ),
        speculation=speculation(args),
        kv_offload_gb=kv_offload_gb(args),
    )
    tp_sizes = [int(size) for size in args.tp_sizes.split(",") if size.strip()]
    layouts = planner.layouts(args.max_devices, tp_sizes)
    if not layouts:
        raise ValueError(
            f"no layout of at most {args.max_devices} devices holds {model.name}'s "
            f"{model.weight_bytes / 2**30:.1f} GiB of weights with room for KV (--tp-sizes "
            f"{args.tp_sizes}, {hardware.device_memory_bytes / 2**30:.0f} GiB per device)"
        )
    best, results = planner.choose(layouts, workload, slo)
    print(f"{model.name} on {hardware.name}, {args.rate:g} req/s, SLOs TTFT "
          f"{args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms, {args.attainment:.0%} of "
          "requests")  # fmt: skip
    print(model.describe())
    if hardware.host_cores:
        print(shared_host_line(hardware))
    print(results_table(results, slo))
    args.out.mkdir(parents=True, exist_ok=True)
    shown = sorted(results, key=lambda r: -r.goodput)[:4]
    if best is not None and best not in shown:
        shown.insert(0, best)
    rates = rates_around(args.rate)
    sweeps = {r.layout.name: planner.sweep(r.layout, workload, slo, rates) for r in shown}
    plot = write_plot(args.out / "goodput.png", sweeps, args.rate)
    document = {
        "model": asdict(model),
        "hardware": hardware.to_json(),
        "workload": asdict(workload),
        "slo": asdict(slo),
        "router_policy": args.router_policy,
        "chosen": None if best is None else _result_json(best),
        "layouts": [_result_json(r) for r in results],
        "sweeps": {name: [_result_json(r) for r in rs] for name, rs in sweeps.items()},
    }
    (args.out / "plan.json").write_text(json.dumps(document, indent=1) + "\n")
    if best is None:
        print(f"no layout of at most {args.max_devices} devices meets the SLOs at this rate")
        return 1
    flags = " ".join(serve_flags(best.layout, args))
    snippet = deploy_snippet(best.layout, model.name, args.gpus_per_node)
    (args.out / "deploy-values.yaml").write_text(snippet)
    print(f"\nchosen: {best.layout.name} ({best.layout.devices} devices)")
    print(f"pdserve serve --model {args.model} {flags}")
    print(f"wrote {args.out / 'plan.json'}, {args.out / 'deploy-values.yaml'}" + (
        f", {plot}" if plot else " (no plot: matplotlib is not installed)"))  # fmt: skip
    return 0


def serve_flags(layout: Layout, args: argparse.Namespace) -> list[str]:
    """``pdserve serve``'s flags for ``layout`` and the settings the plan simulated that are
    not serve's defaults."""
    flags = layout.serve_flags()
    if args.router_policy != ROUTER_POLICIES[0]:
        flags += ["--router-policy", args.router_policy]
    if args.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    if layout.num_prefill and args.max_local_prefill_length:
        flags += ["--max-local-prefill-length", str(args.max_local_prefill_length)]
    if layout.num_prefill and args.max_prefill_queue_tokens is not None:
        flags += ["--max-prefill-queue-tokens", str(args.max_prefill_queue_tokens)]
    if args.kv_offload_gb:
        flags += ["--kv-offload-gb", f"{args.kv_offload_gb:g}"]
    if args.num_speculative_tokens is not None:
        config: dict[str, object] = {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
        }
        if args.speculative_disable_by_batch_size is not None:
            config["disable_by_batch_size"] = args.speculative_disable_by_batch_size
        flags += ["--speculative-config", shlex.quote(json.dumps(config))]
    return flags


def kv_offload_gb(args: argparse.Namespace) -> float:
    """The host tier's GiB per worker rank (refused, naming the flag, below 0)."""
    if args.kv_offload_gb < 0:
        raise ValueError(f"--kv-offload-gb must be >= 0, got {args.kv_offload_gb:g}")
    return float(args.kv_offload_gb)


def speculation(args: argparse.Namespace) -> Speculation | None:
    """The speculative decoding the plan simulates (None: none)."""
    if args.num_speculative_tokens is None:
        return None
    return Speculation(
        args.num_speculative_tokens,
        args.draft_acceptance,
        args.speculative_disable_by_batch_size,
        args.draft_rate,
    )


def shared_host_line(hardware: Hardware) -> str:
    """What the simulation assumes of a CPU machine's shared cores."""
    measured = (
        hardware.host_seconds_per_token,
        hardware.host_seconds_per_handoff,
        hardware.host_worker_seconds_per_token,
        hardware.host_worker_seconds_per_batch,
        hardware.host_seconds_per_batch,
    )
    other = (
        f"{hardware.host_seconds_per_token * 1000:.2f} ms a streamed token, "
        f"{hardware.host_seconds_per_batch * 1000:.2f} ms a batch of outputs and "
        f"{hardware.host_seconds_per_handoff * 1000:.1f} ms a hand-off, on "
        f"{hardware.host_front_door_threads} thread(s), and "
        f"{hardware.host_worker_seconds_per_token * 1000:.2f} ms a token and "
        f"{hardware.host_worker_seconds_per_batch * 1000:.2f} ms a batch in its worker"
        if any(measured)
        else "none measured (the profile's JSON takes host_seconds_per_token, "
        "host_seconds_per_batch, host_seconds_per_handoff, host_worker_seconds_per_token "
        "and host_worker_seconds_per_batch)"
    )
    factors = (hardware.host_prompt_step_cpu_factor, hardware.host_decode_step_cpu_factor)
    busy = (
        f"; on it a step takes {factors[0]:.2f}x its profiled time with prompt tokens, "
        f"{factors[1]:.2f}x without"
        if factors != (1.0, 1.0)
        else ""
    )
    return (
        f"the workers share this host's {hardware.host_cores} cores "
        f"({hardware.worker_threads} thread(s) a worker rank); its other work: {other}{busy}"
    )


def _with_overrides(hardware: Hardware, args: argparse.Namespace) -> Hardware:
    """The profile with the flags that override its numbers (each refused, naming it, where
    out of range: > 0, the 8-bit rates >= 0)."""
    overrides = (  # flag, its value, the profile's field, its scale, 0 allowed
        ("--flops", args.flops, "flops_per_s", 1.0, False),
        ("--fp8-flops", args.fp8_flops, "fp8_flops_per_s", 1.0, True),
        ("--int8-ops", args.int8_ops, "int8_ops_per_s", 1.0, True),
        ("--memory-gbs", args.memory_gbs, "memory_bytes_per_s", 1e9, False),
        ("--link-gbs", args.link_gbs, "link_bytes_per_s", 1e9, False),
        ("--host-link-gbs", args.host_link_gbs, "host_link_bytes_per_s", 1e9, False),
        ("--device-memory-gib", args.device_memory_gib, "device_memory_bytes", 2**30, False),
    )
    changes = {}
    for flag, value, field, scale, zero_allowed in overrides:
        if value is None:
            continue
        if value < 0 or (value == 0 and not zero_allowed):
            raise ValueError(f"{flag} must be {'>= 0' if zero_allowed else '> 0'}, got {value:g}")
        changes[field] = value * scale
    if args.memory_gbs is not None:  # the weights too (a profile measured their own rate)
        changes["weight_bytes_per_s"] = 0.0
    return replace(hardware, **changes) if changes else hardware


def _result_json(result: LayoutResult) -> dict[str, Any]:
    body = asdict(result)
    body["layout"]["name"] = result.layout.name
    body["layout"]["devices"] = result.layout.devices
    return body
