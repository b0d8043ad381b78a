"""A shifting workload (issue 35's "Measure"): fixed pools against ``--rebalance``, in one run.

    .venv/bin/python -m bench.rebalance [--prefill 3 --decode 1] [--phase-s 60]
        [--prompt-heavy 1024,16 --output-heavy 64,256] [--rate-a R --rate-b R] [--rounds N]

Both configurations start with the same pools (by default 3 prefill + 1 decode, right for the
first phase) and serve the same traffic, Poisson arrivals in two phases of ``--phase-s`` each:
  A  prompt-heavy: long prompts, short outputs (``--prompt-heavy PROMPT,OUTPUT`` tokens)
  B  output-heavy: short prompts, long outputs (``--output-heavy``)
then ``fixed`` keeps its pools and ``rebalance`` (``--rebalance`` with a short window and
cooldown, ``--rebalance-window-s``/``--rebalance-cooldown-s``) moves workers as phase B's
decode load builds up. Reports per configuration and phase: requests, completed, SLO attainment
and goodput (requests per s within ``--slo-ttft-ms`` and ``--slo-tpot-ms``), TTFT and TPOT p50,
and the role switches the server counted (each one's drain and join times from its log); the
goal: rebalance's goodput over both phases at least 1.3x fixed's. Rates default to measured ones, of what the fixed pools complete in a
closed loop of each phase's requests: phase A at 0.8 of it (``--load-a``), phase B at 1.5
(``--load-b``): beyond the fixed pools, within what the pools rebalanced can do. With
``--rounds N`` both configurations run N times, in turn first (a machine's drift favours
neither), and each configuration's goodput is over all its rounds. Without ``--model`` both
serve a random Llama of ``--model-size``. Writes one JSON with every record.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.results_json import write_json
from bench.serving.arrivals import ArrivalSpec
from bench.serving.cli import int_pair
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO
from bench.serving.report import result_dict
from bench.serving.runner import BenchConfig, BenchResult, run_benchmark
from bench.serving.servers import (
    RunningServer,
    ServerSpec,
    cores_per_worker,
    pdserve_server,
    rotated,
)
from bench.serving.tiny_model import MODEL_SIZES, add_model_args, build_tiny_llama
from bench.serving.workloads import WorkloadSpec

SERVED_NAME = "pdserve-demo"
MODEL_POSITIONS = 2048
GOAL = 1.3


@dataclass(frozen=True, slots=True)
class PhaseOutcome:
    config: str
    phase: str
    round_index: int
    rate: float
    num_sent: int
    num_completed: int
    num_good: int
    duration_s: float
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None

    @property
    def attainment(self) -> float:
        return self.num_good / self.num_sent if self.num_sent else 0.0

    @property
    def goodput(self) -> float:
        return self.num_good / self.duration_s if self.duration_s > 0 else 0.0


def phase_outcome(config: str, phase: str, round_index: int, result: BenchResult) -> PhaseOutcome:
    summary = result.summary
    return PhaseOutcome(
        config,
        phase,
        round_index,
        result.config.arrivals.request_rate,
        summary.num_requests,
        summary.num_completed,
        summary.num_good,
        summary.duration_s,
        summary.ttft.percentile(50),
        summary.tpot.percentile(50),
    )


def overall_goodput(outcomes: list[PhaseOutcome]) -> float:
    """Requests within both SLOs per second over the phases together."""
    duration = sum(o.duration_s for o in outcomes)
    return sum(o.num_good for o in outcomes) / duration if duration > 0 else 0.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rebalance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(parser, "small")
    parser.add_argument("--prefill", type=int, default=3)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--cores-per-worker", type=int, default=None, help="default: split")
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="per worker")
    parser.add_argument("--prompt-heavy", type=int_pair, default=(1024, 16), metavar="IN,OUT")
    parser.add_argument("--output-heavy", type=int_pair, default=(64, 256), metavar="IN,OUT")
    parser.add_argument("--phase-s", type=float, default=60.0, help="seconds per phase")
    parser.add_argument("--rate-a", type=float, default=None, help="default: measured")
    parser.add_argument("--rate-b", type=float, default=None, help="default: measured")
    parser.add_argument(
        "--load-a", type=float, default=0.8, help="phase A's rate, of the fixed pools' capacity"
    )
    parser.add_argument(
        "--load-b",
        type=float,
        default=1.5,
        help="phase B's rate, of the fixed pools' capacity (beyond it: what rebalancing is for)",
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--rebalance-window-s", type=float, default=5.0)
    parser.add_argument("--rebalance-cooldown-s", type=float, default=15.0)
    parser.add_argument("--pdserve-args", default="", help="more flags for both servers")
    parser.add_argument("--rounds", type=int, default=1, help="runs of both, in turn first")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/rebalance"))
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _server(
    args: argparse.Namespace, model_dir: str, name: str, flags: tuple[str, ...]
) -> ServerSpec:
    cores = cores_per_worker(args.prefill + args.decode, args.cores_per_worker)
    extra = (
        "--max-model-len", str(MODEL_POSITIONS),
        "--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}",
        *flags, *args.pdserve_args.split(),
    )  # fmt: skip
    return pdserve_server(
        name, args.prefill, args.decode, args.port, model_dir, SERVED_NAME,
        args.num_kv_blocks, cores_per_worker=cores, extra_args=extra,
    )  # fmt: skip


def _config(
    args: argparse.Namespace,
    spec: ServerSpec,
    model_dir: str,
    lengths: tuple[int, int],
    arrivals: ArrivalSpec,
    num_prompts: int,
    seed: int,
) -> BenchConfig:
    workload = WorkloadSpec(kind="fixed", input_len=lengths[0], output_len=lengths[1])
    return BenchConfig(
        endpoint=EndpointConfig(spec.base_url, SERVED_NAME, timeout_s=600),
        tokenizer_dir=model_dir,
        workload=workload,
        arrivals=arrivals,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        num_prompts=num_prompts,
        seed=seed,
        num_warmups=1,
        progress=not args.no_progress,
    )


def _capacity(
    args: argparse.Namespace, spec: ServerSpec, model_dir: str, lengths: tuple[int, int]
) -> float:
    closed = ArrivalSpec(max_concurrency=16)
    return run_benchmark(
        _config(args, spec, model_dir, lengths, closed, 64, args.seed + 99)
    ).summary.request_throughput


def _switches(spec: ServerSpec) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{spec.port}/metrics", timeout=10).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("pdserve:role_switches_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels[len("pdserve:role_switches_total") :]] = float(value)
    return counts


_SWITCH_LINE = re.compile(
    r"rebalancing: (\w+) worker (.+?) in rotation in place of (.+?) \((the same process|a new "
    r"process); drained in ([\d.]+) s, joined ([\d.]+) s later\)"
)


def switch_times(log: str) -> list[dict[str, Any]]:
    """The switches a server's log tells of: each new worker (or workers, of an exchange
    between pools of different sizes), the one (or ones) it replaced, whether it is the same
    process, and the seconds it took to drain and then to join."""
    return [
        {
            "worker": m[2],
            "in_place_of": m[3],
            "same_process": m[4] == "the same process",
            "drain_s": float(m[5]),
            "join_s": float(m[6]),
        }
        for m in _SWITCH_LINE.finditer(log)
    ]


def _run_phases(
    args: argparse.Namespace, spec: ServerSpec, model_dir: str, rates: tuple[float, float]
) -> tuple[list[BenchResult], dict[str, float]]:
    results = []
    for index, (lengths, rate) in enumerate(zip((args.prompt_heavy, args.output_heavy), rates)):
        arrivals = ArrivalSpec(request_rate=rate)
        num = max(1, round(rate * args.phase_s))
        results.append(
            run_benchmark(_config(args, spec, model_dir, lengths, arrivals, num, args.seed + index))
        )
    return results, _switches(spec)


def table(outcomes: list[PhaseOutcome]) -> str:
    rows = [
        f"{'config':10} {'phase':6} {'round':>5} {'rate/s':>7} {'sent':>5} {'done':>5} {'good':>5} "
        f"{'attain':>7} {'goodput/s':>9} {'ttft p50':>9} {'tpot p50':>9}"
    ]
    for o in outcomes:
        rows.append(
            f"{o.config:10} {o.phase:6} {o.round_index:5d} {o.rate:7.2f} {o.num_sent:5d} "
            f"{o.num_completed:5d} {o.num_good:5d} {o.attainment:7.1%} {o.goodput:9.2f} "
            f"{_ms(o.ttft_p50_ms):>9} {_ms(o.tpot_p50_ms):>9}"
        )
    return "\n".join(rows)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resize = MODEL_SIZES[args.model_size]
    model_dir = args.model or str(build_tiny_llama(args.out / "model", MODEL_POSITIONS, resize))
    fixed = _server(args, model_dir, "fixed", ())
    rebalance_flags = (
        "--rebalance", "--rebalance-window-s", f"{args.rebalance_window_s:g}",
        "--rebalance-cooldown-s", f"{args.rebalance_cooldown_s:g}",
    )  # fmt: skip
    rebalanced = _server(args, model_dir, "rebalance", rebalance_flags)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    # (config, round) -> the phases' results and the role switches the server counted
    runs: dict[tuple[str, int], tuple[list[BenchResult], dict[str, float]]] = {}
    timings: dict[tuple[str, int], list[dict[str, Any]]] = {}  # and each switch's, from its log
    rates = (args.rate_a, args.rate_b)
    for round_index in range(args.rounds):
        for spec in rotated((fixed, rebalanced), round_index):
            print(f"== {spec.name}: {' '.join(spec.argv)}", file=sys.stderr, flush=True)
            log = args.out / f"{spec.name}-{round_index}.log"
            with RunningServer(spec, log):
                if None in rates:  # measured once, on the fixed pools (or the first to run)
                    rate_a = rates[0] or args.load_a * _capacity(
                        args, spec, model_dir, args.prompt_heavy
                    )
                    rate_b = rates[1] or args.load_b * _capacity(
                        args, spec, model_dir, args.output_heavy
                    )
                    rates = (rate_a, rate_b)
                    print(f"rates: phase A {rate_a:.2f}/s, phase B {rate_b:.2f}/s", file=sys.stderr)
                runs[(spec.name, round_index)] = _run_phases(args, spec, model_dir, rates)
            timings[(spec.name, round_index)] = switch_times(log.read_text(errors="replace"))
    outcomes = [
        phase_outcome(name, phase, round_index, result)
        for (name, round_index), (results, _) in runs.items()
        for phase, result in zip(("A", "B"), results)
    ]
    print(table(outcomes))
    names = (fixed.name, rebalanced.name)
    goodputs = {name: overall_goodput([o for o in outcomes if o.config == name]) for name in names}
    ratio = goodputs["rebalance"] / goodputs["fixed"] if goodputs["fixed"] else float("inf")
    for (name, round_index), (_, switches) in runs.items():
        print(f"{name} round {round_index}: role switches {switches}")
        for t in timings.get((name, round_index), []):
            print(
                f"  {t['in_place_of']} -> {t['worker']}: drained in {t['drain_s']:.1f} s, joined "
                f"{t['join_s']:.1f} s later ({'in place' if t['same_process'] else 'new process'})"
            )
    for name in names:
        print(f"{name}: goodput over both phases and every round {goodputs[name]:.2f}/s")
    met = ratio >= GOAL
    print(f"{'met' if met else 'NOT met'}: rebalance goodput >= {GOAL}x fixed ({ratio:.2f}x)")
    payload: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "servers": {s.name: list(s.argv) for s in (fixed, rebalanced)},
        "rates": {"A": rates[0], "B": rates[1]},
        "outcomes": [
            {**asdict(o), "attainment": o.attainment, "goodput": o.goodput} for o in outcomes
        ],
        "goodput": goodputs,
        "goal": {"ratio": ratio, "met": met},
        "switches": {f"{name}/{r}": switches for (name, r), (_, switches) in runs.items()},
        "switch_times": {f"{name}/{r}": t for (name, r), t in timings.items()},
        "runs": {
            f"{name}/{r}": [result_dict(x) for x in results]
            for (name, r), (results, _) in runs.items()
        },
    }
    print(f"wrote {write_json(args.out / 'rebalance.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
