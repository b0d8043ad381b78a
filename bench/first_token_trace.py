"""Where a first token's time goes: ``pdserve serve``'s first-token trace under Poisson load.

    .venv/bin/python -m bench.first_token_trace [--rates 4,8,16] [--num-prompts 100]
        [--model DIR] [--serve-args "--prefill 0"] [--out bench/results/first_token_trace.json]

Starts ``pdserve serve`` with its defaults (the layout it picks on this machine), the model in
float32 and ``--first-token-trace`` (plus ``--serve-args``), and drives it at each request rate
with Poisson arrivals: prompts of 256 +- 64 tokens asking for 64 +- 16 tokens each (uniform,
ignore_eos), streamed through the completions API. Prints, per rate, each hop's p50, p99 and
mean in milliseconds from the server's trace (docs/request_path.md names the hops), the sum of
the hops' means, and the client's own TTFT beside the server's (arrival to first chunk
written), then the prefill workers' KV transfers meanwhile (off the first token's path: a
hand-off begins once the token is on its way); writes every trace line and the client's records
as JSON.

Without ``--model`` the model is ``bench/serving/tiny_model.py``'s, built into a temporary
directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.serving.arrivals import ArrivalSpec
from bench.serving.client import EndpointConfig
from bench.serving.report import result_dict, write_json
from bench.serving.runner import BenchConfig, BenchResult, load_codec, run_benchmark_async
from bench.serving.servers import RunningServer, ServerSpec, pdserve_serve
from bench.serving.tiny_model import build_tiny_llama
from bench.serving.workloads import WorkloadSpec
from engine.messages.first_token import HOPS

_RATE_SEED_STRIDE = 7_919  # each rate its own prompts (no prefix-cache hits across rates)
_REPORT_LAG_S = 1.0  # the router polls the workers' loads every 0.5 s


@dataclass(frozen=True, slots=True)
class RateResult:
    rate: float  # offered requests per second
    client: BenchResult  # the client's run (its TTFT per request)
    traces: list[dict[str, Any]]  # the server's trace lines of the timed requests
    # (transfers, seconds) the prefill workers reported while the rate ran (its warm-up and,
    # as reports come every half second, a little before and after it)
    kv_transfers: tuple[float, float]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rates = [float(rate) for rate in args.rates.split(",")]
    with tempfile.TemporaryDirectory(prefix="first-token-trace-") as scratch:
        model_dir = args.model or str(build_tiny_llama(Path(scratch) / "model"))
        trace_path = Path(scratch) / "first_token_trace.jsonl"
        spec = _server(args, model_dir, trace_path)
        with RunningServer(spec, Path(scratch) / "serve.log"):
            results = asyncio.run(_run_rates(args, model_dir, rates, trace_path))
    for result in results:
        print(rate_table(result))
    if args.out:
        print(f"wrote {write_json(args.out, _json(args, results))}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="4,8,16", help="request rates (req/s), comma-separated")
    parser.add_argument("--num-prompts", type=int, default=100, help="timed requests per rate")
    parser.add_argument("--model", default=None, help="model directory (default: a tiny Llama)")
    parser.add_argument("--served-model-name", default="trace-model")
    parser.add_argument("--serve-args", default="", help="more `pdserve serve` flags, one string")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--input-spread", type=int, default=64, help="prompts: len +- this")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output-spread", type=int, default=16, help="outputs: len +- this")
    parser.add_argument("--num-warmups", type=int, default=2, help="untimed requests per rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path for the traces and records")
    return parser


def _server(args: argparse.Namespace, model_dir: str, trace_path: Path) -> ServerSpec:
    extra = ("--first-token-trace", str(trace_path), *shlex.split(args.serve_args))
    return pdserve_serve("pdserve", args.port, model_dir, args.served_model_name, extra)


async def _run_rates(
    args: argparse.Namespace, model_dir: str, rates: list[float], trace_path: Path
) -> list[RateResult]:
    """Each rate in turn; a rate's traces are the lines the server wrote during its run whose
    request arrived once its timed requests began (its warm-up requests came before)."""
    codec = load_codec(model_dir)
    base = BenchConfig(
        endpoint=EndpointConfig(f"http://127.0.0.1:{args.port}/v1", args.served_model_name),
        tokenizer_dir=model_dir,
        workload=WorkloadSpec(
            kind="uniform",
            input_range=(args.input_len - args.input_spread, args.input_len + args.input_spread),
            output_range=(
                args.output_len - args.output_spread,
                args.output_len + args.output_spread,
            ),
        ),
        num_prompts=args.num_prompts,
        num_warmups=args.num_warmups,
        progress=False,
    )
    results = []
    read_from = 0
    for index, rate in enumerate(rates):
        config = replace(
            base,
            arrivals=ArrivalSpec(request_rate=rate),
            seed=args.seed + index * _RATE_SEED_STRIDE,
        )
        transfers_before = _kv_transfers(args.port)
        client = await run_benchmark_async(config, codec)
        await asyncio.sleep(_REPORT_LAG_S)  # the workers' last load reports of the run
        transfers_after = _kv_transfers(args.port)
        lines, read_from = new_lines(trace_path, read_from)
        began = datetime.fromisoformat(client.started_at).timestamp()
        traces = [t for t in lines if (t["stamps"]["arrived"] or 0.0) >= began]
        kv = (
            transfers_after[0] - transfers_before[0],
            transfers_after[1] - transfers_before[1],
        )
        results.append(RateResult(rate, client, traces, kv))
    return results


def _kv_transfers(port: int) -> tuple[float, float]:
    """(KV transfers, their seconds) the prefill workers have sent so far, from /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    totals = {"count": 0.0, "sum": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name != "pdserve:kv_transfer_seconds":
            continue
        for sample in family.samples:
            kind = sample.name.rsplit("_", 1)[-1]
            if sample.labels.get("role") == "prefill" and kind in totals:
                totals[kind] += sample.value
    return totals["count"], totals["sum"]


def new_lines(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The JSON lines of ``path`` from byte ``offset`` on, and the offset after them."""
    with path.open("rb") as file:
        file.seek(offset)
        data = file.read()
    end = data.rfind(b"\n") + 1  # a line being written is read next time
    lines = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return lines, offset + end


def stats_ms(values_s: list[float]) -> dict[str, float]:
    """p50, p99 and mean of ``values_s``, in milliseconds (NaN when empty)."""
    if not values_s:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan"), "count": 0}
    values = np.asarray(values_s) * 1e3
    return {
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
        "mean": float(values.mean()),
        "count": len(values_s),
    }


def hop_stats(traces: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each hop's statistics over the traces that have it, in path order."""
    return {hop: stats_ms([t["hops"][hop] for t in traces if hop in t["hops"]]) for hop in HOPS}


def server_ttft_s(trace: dict[str, Any]) -> float | None:
    """Arrival at the front door to the first chunk written, on the server's clock."""
    stamps = trace["stamps"]
    if stamps["arrived"] is None or stamps["written"] is None:
        return None
    return float(stamps["written"] - stamps["arrived"])


def rate_table(result: RateResult) -> str:
    hops = hop_stats(result.traces)
    server = stats_ms([t for t in map(server_ttft_s, result.traces) if t is not None])
    client = stats_ms([r.ttft_s for r in result.client.records if r.success and r.ttft_s])
    lines = [
        f"rate {result.rate:g} req/s: {len(result.client.records)} requests, "
        f"{len(result.traces)} traced",
        f"  {'hop':<22}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'of TTFT':>9}",
    ]
    for hop, stats in hops.items():
        share = stats["mean"] / server["mean"] if server["mean"] > 0 else float("nan")
        lines.append(_row(hop, stats) + f"{share:>9.0%}")
    total = sum(s["mean"] for s in hops.values() if s["count"])
    lines.append(f"  {'sum of hop means':<22}{'':>10}{'':>10}{total:>10.2f}")
    lines.append(_row("server TTFT", server))
    lines.append(_row("client TTFT", client))
    num_transfers, seconds = result.kv_transfers
    mean_ms = seconds / num_transfers * 1e3 if num_transfers else float("nan")
    lines.append(
        f"  KV transfers meanwhile (off the path): {num_transfers:g}, mean {mean_ms:.2f} ms"
    )
    return "\n".join(lines)


def _row(name: str, stats: dict[str, float]) -> str:
    return f"  {name:<22}{stats['p50']:>10.2f}{stats['p99']:>10.2f}{stats['mean']:>10.2f}"


def _json(args: argparse.Namespace, results: list[RateResult]) -> dict[str, Any]:
    return {
        "settings": vars(args),
        "rates": [
            {
                "rate": result.rate,
                "hops_ms": hop_stats(result.traces),
                "server_ttft_ms": stats_ms(
                    [t for t in map(server_ttft_s, result.traces) if t is not None]
                ),
                "client_ttft_ms": stats_ms(
                    [r.ttft_s for r in result.client.records if r.success and r.ttft_s]
                ),
                "kv_transfers": {
                    "count": result.kv_transfers[0],
                    "seconds": result.kv_transfers[1],
                },
                "traces": result.traces,
                "client": result_dict(result.client),
            }
            for result in results
        ],
    }


if __name__ == "__main__":
    raise SystemExit(main())
