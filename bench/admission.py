"""Admission by predicted latency under overload (issue 35's "Measure"): ``--admission slo``
against no admission control, at twice the cluster's capacity, in one run.

    .venv/bin/python -m bench.admission [--prefill 1 --decode 1] [--overload 2]
        [--num-prompts 400] [--slo-ttft-ms MS --slo-tpot-ms MS] [--repeats N]

Steps, each server started and stopped in turn (the same layout, model and flags but one):
  1. ``pdserve serve --admission none``: a few requests one by one (the idle latencies), then a
     closed loop of ``--capacity-concurrency`` clients (the capacity: completed requests per s);
     the SLOs, unless given, are ``--slo-factor`` times the idle TTFT and TPOT (p50);
  2. the same server, Poisson arrivals at ``--overload`` times the capacity: no admission
     control, every request queues;
  3. ``pdserve serve --admission slo`` with those SLOs, the same arrivals and prompts;
     ``--repeats N`` times, each server a cold start (one run's attainment moves by several
     points from run to run on a busy host), the goals then on the runs pooled.
Refused requests (HTTP 429) count as sent, not as completed. Reports per configuration: sent,
refused, completed, met the SLOs; the SLO attainment of the accepted requests (met / accepted)
and of all; goodput (requests per s that met both SLOs); TTFT p50/p99 of the completed ones;
the completed ones past the TTFT SLO, past the TPOT SLO, and those of either sent in the run's
first second (before the latency model has seen requests finish).
Goals: attainment of accepted >= 95 % with admission, and its goodput not below the baseline's.

Without ``--model`` both serve a tiny random Llama (``bench/serving/tiny_model.py``). Writes
one JSON with every run's records.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.results_json import write_json
from bench.serving.arrivals import ArrivalSpec
from bench.serving.cli import int_pair
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO
from bench.serving.report import result_dict
from bench.serving.runner import BenchConfig, BenchmarkError, BenchResult, run_benchmark
from bench.serving.servers import RunningServer, ServerSpec, cores_per_worker, pdserve_server
from bench.serving.tiny_model import build_tiny_llama
from bench.serving.workloads import WorkloadSpec

SERVED_NAME = "pdserve-demo"
MODEL_POSITIONS = 2048
ATTAINMENT_GOAL = 0.95
# a miss by a request sent this soon after the run began is counted apart too: before the
# latency model has seen requests finish (the start-up profile's fits, no path corrections)
EARLY_S = 1.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """One configuration's run at the overload rate."""

    config: str
    request_rate: float
    num_sent: int
    num_refused: int  # HTTP 429
    num_completed: int
    num_good: int  # completed within both SLOs
    duration_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    # completed requests past the TTFT SLO, past the TPOT SLO (one past both counts in each),
    # and those that missed either sent in the run's first EARLY_S
    num_ttft_missed: int = 0
    num_tpot_missed: int = 0
    num_missed_early: int = 0

    @property
    def attainment_of_accepted(self) -> float | None:
        accepted = self.num_sent - self.num_refused
        return self.num_good / accepted if accepted else None

    @property
    def attainment_of_all(self) -> float:
        return self.num_good / self.num_sent if self.num_sent else 0.0

    @property
    def goodput(self) -> float:
        return self.num_good / self.duration_s if self.duration_s > 0 else 0.0


def outcome(config: str, result: BenchResult) -> Outcome:
    records = result.records
    refused = sum(1 for r in records if r.error.startswith("HTTP 429"))
    summary = result.summary
    slo = result.config.slo
    done = [r for r in records if r.success]
    ttft_ms = [None if r.ttft_s is None else r.ttft_s * 1e3 for r in done]
    tpot_ms = [None if r.tpot_s is None else r.tpot_s * 1e3 for r in done]
    return Outcome(
        config,
        result.config.arrivals.request_rate,
        len(records),
        refused,
        summary.num_completed,
        summary.num_good,
        summary.duration_s,
        summary.ttft.percentile(50),
        summary.ttft.percentile(99),
        num_ttft_missed=sum(
            slo.ttft_ms is not None and (t is None or t > slo.ttft_ms) for t in ttft_ms
        ),
        num_tpot_missed=sum(
            slo.tpot_ms is not None and t is not None and t > slo.tpot_ms for t in tpot_ms
        ),
        num_missed_early=sum(r.send_time_s < EARLY_S and not slo.met_by(r) for r in done),
    )


def pooled(config: str, runs: list[Outcome]) -> Outcome:
    """Several runs of one configuration as one: their requests and durations summed (the
    percentiles are not kept: None)."""
    return Outcome(
        config,
        runs[0].request_rate,
        sum(o.num_sent for o in runs),
        sum(o.num_refused for o in runs),
        sum(o.num_completed for o in runs),
        sum(o.num_good for o in runs),
        sum(o.duration_s for o in runs),
        None,
        None,
        sum(o.num_ttft_missed for o in runs),
        sum(o.num_tpot_missed for o in runs),
        sum(o.num_missed_early for o in runs),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.admission",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="model dir; default: a tiny Llama")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--cores-per-worker", type=int, default=None, help="default: split")
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="per worker")
    parser.add_argument("--input-range", type=int_pair, default=(128, 1024), metavar="MIN,MAX")
    parser.add_argument("--output-range", type=int_pair, default=(16, 64), metavar="MIN,MAX")
    parser.add_argument("--num-prompts", type=int, default=400, help="per overload run")
    parser.add_argument("--overload", type=float, default=2.0, help="times the capacity")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of the admission server, each a cold start; the goals are on them pooled",
    )
    parser.add_argument("--capacity-concurrency", type=int, default=16)
    parser.add_argument("--capacity-prompts", type=int, default=120)
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="default: measured")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="default: measured")
    parser.add_argument("--slo-factor", type=float, default=4.0, help="SLO / idle latency")
    parser.add_argument("--pdserve-args", default="", help="more flags for both servers")
    parser.add_argument("--port", type=int, default=8460)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/admission"))
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _server(args: argparse.Namespace, model_dir: str, flags: tuple[str, ...]) -> ServerSpec:
    cores = cores_per_worker(args.prefill + args.decode, args.cores_per_worker)
    extra = ("--max-model-len", str(MODEL_POSITIONS), *flags, *args.pdserve_args.split())
    name = "admission " + (flags[1] if flags[:1] == ("--admission",) else "none")
    return pdserve_server(
        name, args.prefill, args.decode, args.port, model_dir, SERVED_NAME,
        args.num_kv_blocks, cores_per_worker=cores, extra_args=extra,
    )  # fmt: skip


def _config(
    args: argparse.Namespace, spec: ServerSpec, model_dir: str, arrivals: ArrivalSpec, n: int
) -> BenchConfig:
    workload = WorkloadSpec(
        kind="uniform", input_range=args.input_range, output_range=args.output_range
    )
    return BenchConfig(
        endpoint=EndpointConfig(spec.base_url, SERVED_NAME, timeout_s=args.timeout_s),
        tokenizer_dir=model_dir,
        workload=workload,
        arrivals=arrivals,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        num_prompts=n,
        seed=args.seed,
        num_warmups=2,
        progress=not args.no_progress,
    )


def _measured_slo(idle: BenchResult, factor: float) -> tuple[float, float]:
    ttft, tpot = idle.summary.ttft.percentile(50), idle.summary.tpot.percentile(50)
    if ttft is None or tpot is None:
        raise BenchmarkError("the idle run completed no request: no latency to set SLOs from")
    return factor * ttft, factor * tpot


def table(outcomes: list[Outcome]) -> str:
    head = (
        f"{'config':16} {'rate/s':>7} {'sent':>5} {'429':>5} {'done':>5} {'good':>5} "
        f"{'attain(acc)':>11} {'attain(all)':>11} {'goodput/s':>9} {'ttft p50':>9} {'ttft p99':>9} "
        f"{'missed ttft/tpot/early':>22}"
    )
    rows = [head]
    for o in outcomes:
        acc = o.attainment_of_accepted
        rows.append(
            f"{o.config:16} {o.request_rate:7.2f} {o.num_sent:5d} {o.num_refused:5d} "
            f"{o.num_completed:5d} {o.num_good:5d} "
            f"{'-' if acc is None else f'{acc:.1%}':>11} {o.attainment_of_all:11.1%} "
            f"{o.goodput:9.2f} {_ms(o.ttft_p50_ms):>9} {_ms(o.ttft_p99_ms):>9} "
            f"{f'{o.num_ttft_missed}/{o.num_tpot_missed}/{o.num_missed_early}':>22}"
        )
    return "\n".join(rows)


def goals(baseline: Outcome, guarded: Outcome) -> list[dict[str, Any]]:
    attained = guarded.attainment_of_accepted
    return [
        {
            "goal": f"SLO attainment of accepted requests >= {ATTAINMENT_GOAL:.0%} with admission",
            "value": attained,
            "met": attained is not None and attained >= ATTAINMENT_GOAL,
        },
        {
            "goal": "goodput with admission >= without",
            "value": guarded.goodput / baseline.goodput if baseline.goodput else math.inf,
            "met": guarded.goodput >= baseline.goodput,
        },
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    model_dir = args.model or str(build_tiny_llama(args.out / "model", MODEL_POSITIONS))
    baseline_spec = _server(args, model_dir, ())
    print(f"== {baseline_spec.name}: {' '.join(baseline_spec.argv)}", file=sys.stderr)
    with RunningServer(baseline_spec, args.out / "admission_none.log"):
        idle = run_benchmark(
            _config(args, baseline_spec, model_dir, ArrivalSpec(max_concurrency=1), 8)
        )
        if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
            ttft_ms, tpot_ms = _measured_slo(idle, args.slo_factor)
            args.slo_ttft_ms = args.slo_ttft_ms or ttft_ms
            args.slo_tpot_ms = args.slo_tpot_ms or tpot_ms
        saturated = run_benchmark(
            _config(
                args, baseline_spec, model_dir,
                ArrivalSpec(max_concurrency=args.capacity_concurrency), args.capacity_prompts,
            )
        )  # fmt: skip
        capacity = saturated.summary.request_throughput
        rate = args.overload * capacity
        print(
            f"capacity {capacity:.2f} req/s; overload rate {rate:.2f} req/s; SLOs TTFT "
            f"{args.slo_ttft_ms:.0f} ms, TPOT {args.slo_tpot_ms:.1f} ms",
            file=sys.stderr,
        )
        arrivals = ArrivalSpec(request_rate=rate)
        baseline = run_benchmark(
            _config(args, baseline_spec, model_dir, arrivals, args.num_prompts)
        )
    slo_flags = (
        "--admission", "slo",
        "--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}",
    )  # fmt: skip
    guarded_spec = _server(args, model_dir, slo_flags)
    print(f"== {guarded_spec.name}: {' '.join(guarded_spec.argv)}", file=sys.stderr)
    guarded_runs: dict[str, BenchResult] = {}
    for run in range(args.repeats):
        name = "admission slo" if args.repeats == 1 else f"admission slo #{run + 1}"
        log = "admission_slo.log" if args.repeats == 1 else f"admission_slo{run + 1}.log"
        with RunningServer(guarded_spec, args.out / log):
            guarded_runs[name] = run_benchmark(
                _config(args, guarded_spec, model_dir, arrivals, args.num_prompts)
            )
    outcomes = [outcome("admission none", baseline)]
    outcomes += [outcome(name, result) for name, result in guarded_runs.items()]
    if args.repeats > 1:
        outcomes.append(pooled("admission slo", outcomes[1:]))
    checks = goals(outcomes[0], outcomes[-1])
    print(table(outcomes))
    for check in checks:
        print(f"{'met' if check['met'] else 'NOT met'}: {check['goal']} ({check['value']})")
    payload = {
        "command": " ".join(sys.argv),
        "servers": {s.name: list(s.argv) for s in (baseline_spec, guarded_spec)},
        "capacity_req_per_s": capacity,
        "overload": args.overload,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "idle": result_dict(idle),
        "outcomes": [
            {
                **asdict(o),
                "attainment_of_accepted": o.attainment_of_accepted,
                "attainment_of_all": o.attainment_of_all,
                "goodput": o.goodput,
            }
            for o in outcomes
        ],
        "goals": checks,
        "runs": {
            "admission none": result_dict(baseline),
            **{name: result_dict(result) for name, result in guarded_runs.items()},
        },
    }
    print(f"wrote {write_json(args.out / 'admission.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
