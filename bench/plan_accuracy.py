"""How well ``pdserve plan`` predicts a real cluster (issue 35's "Measure": the planner's
prediction error per layout and rate, in a table).

    .venv/bin/python -m bench.plan_accuracy [--layouts colocated2,1p1d] [--loads 0.5,1.0,1.5]
        [--model-size tiny|small|medium] [--workload chat-like|shared-prefix|multi-turn]

Steps: ``pdserve profile`` measures this machine on the model (a tiny random Llama without
``--model``); then, for each layout, ``pdserve serve`` runs it, a closed loop measures its
capacity, and Poisson traffic runs at each ``--loads`` fraction of that capacity. The planner
simulates the same layout serving the same requests (their lengths and send times, as sent) on
the profile, and the two are compared: goodput (the offered rate times the share of requests
within both SLOs), SLO attainment, TTFT and TPOT percentiles. Quantities of this machine
beyond the profile are measured on the served clusters, each once: the gateway's own time per
request (the planner's ``path_overhead_s``: the TTFT of requests sent one at a time to the
first layout, minus what the simulation gives them); and the CPU time of the host's work
besides the engines' steps, which the workers share the cores with, from the machine's busy
time during a capacity run and the workers' counters of their processes' and their steps' CPU
time (``pdserve:worker_process_cpu_seconds``, ``pdserve:worker_step_thread_cpu_seconds``): on
the colocated layout, per batch of a step's outputs and per sampled token (solved from the
capacity run and the one of a request at a time, whose batches hold a token each), the time
outside the workers' processes (the gateway, the router, Ray's daemons, the load generator:
``host_seconds_per_batch``, ``host_seconds_per_token``), which runs on two threads, the
gateway's and the load generator's (``host_front_door_threads``), and the workers' processes'
time beyond their steps (their outputs: ``host_worker_seconds_per_batch``,
``host_worker_seconds_per_token``); on a disaggregated one, the prefill workers' processes'
time beyond their steps and outputs per KV hand-off (``host_seconds_per_handoff``), and how much
more CPU time the workers' steps took on this busy host than the profile (measured on a quiet
one) gives the same steps: a prefill worker's, all computing prompt tokens
(``host_prompt_step_cpu_factor``), and a decode worker's, none
(``host_decode_step_cpu_factor``). Colocated layouts run first; every point is predicted once
all the capacity runs have measured. Each point is also simulated with every worker on cores
of its own (``alone``), and on a machine 10 % slower and faster than profiled (``±10% speed``: how far
the prediction moves with this machine's speed, which varies from run to run by more than
that). ``--resimulate DIR`` predicts a finished run's points again with the planner as it is
now, measuring nothing.

``--workload shared-prefix``: the points' requests start with one of ``--num-prefixes``
system prompts of ``--prefix-len`` tokens (the machine is still measured on chat-like ones,
the capacity on these); the simulation gives the requests of one system prompt the same first
tokens, and a third table sets kv_aware's reuse of the decode workers' caches, served (the
router's ``pdserve:local_prefills_total`` and ``pdserve:routed_prefix_fetches_total``) beside
simulated: prompts prefilled on their decode worker, and prefixes fetched from one.
``--workload multi-turn``: conversations of ``--num-turns`` behind one system prompt of
``--prefix-len`` tokens, each turn the conversation so far (bench/serving/conversations.py),
started at a turn's share of each point's rate; replayed as sent, each turn's prompt holding
its earlier turn's prompt and reply.

Where each point's first tokens spent their time, served and predicted, is a second table
(bench/ttft_phases.py: wait, prompt, after; served from ``--first-token-trace``, which the
bench turns on). And each capacity run's ``HostCPU`` (printed, and in the JSON) sets the
workers' steps as served (their CPU and wall time, their number) beside the profile's time for
the same steps (``profiled_steps_s``) and the planner's simulation of the run.

Writes a JSON with every number and prints the table with each goodput's error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.plan_host_cpu import HostCPU, busy_cpu_seconds, host_cpu, measure_host
from bench.plan_replay import Prompts, replay, replay_conversations, replay_prompts
from bench.results_json import write_json
from bench.serving.arrivals import ArrivalSpec
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO, RequestRecord
from bench.serving.runner import BenchConfig, BenchResult, load_codec, run_benchmark
from bench.serving.server_metrics import ServerCounters
from bench.serving.servers import RunningServer, cores_per_worker, pdserve_server
from bench.serving.tiny_model import MODEL_SIZES, add_model_args, build_tiny_llama
from bench.serving.workloads import WorkloadSpec, build_requests
from bench.ttft_phases import (
    Phases,
    percentiles_ms,
    phases_header,
    phases_row,
    served_phases,
    simulated_phases,
    traces_since,
)
from router.planner.hardware import Hardware
from router.planner.model_costs import ModelCosts
from router.planner.plan import Layout, Planner, Slo
from router.planner.simulator import SimulatedRequest

SERVED_NAME = "pdserve-demo"
MODEL_POSITIONS = 2048
STEP_BUDGET = 512  # pdserve serve's on CPU
LAYOUTS = {"colocated2": Layout(0, 1, 2, 1), "1p1d": Layout(1, 1, 1, 1)}
# the sensitivity shown beside each prediction: step and host times this much longer, and
# shorter (this machine's capacity varies more than that from one run to the next)
SPEED_BAND = 0.1
LOCAL_PREFILLS = "pdserve:local_prefills_total"
FETCHES = "pdserve:routed_prefix_fetches_total"
FRONT_DOOR_THREADS = 2  # streaming tokens on this host: the gateway's and the load generator's


@dataclass(frozen=True, slots=True)
class Comparison:
    layout: str
    rate: float
    measured_goodput: float
    predicted_goodput: float
    alone_goodput: float  # predicted with each worker on cores of its own
    # predicted on a machine SPEED_BAND slower, and as much faster, than profiled
    band_goodput: tuple[float, float]
    measured_attainment: float
    predicted_attainment: float
    measured_ttft_ms: dict[str, float]
    predicted_ttft_ms: dict[str, float]
    measured_tpot_ms: dict[str, float]
    predicted_tpot_ms: dict[str, float]
    # where the first token's time went (bench/ttft_phases.py); measured: none without traces
    measured_ttft_phases_ms: Phases = field(default_factory=dict)
    predicted_ttft_phases_ms: Phases = field(default_factory=dict)
    # kv_aware's reuse of decode workers' caches: (local prefills, fetches), served (None:
    # not counted) and simulated
    measured_reuse: tuple[float, float] | None = None
    predicted_reuse: tuple[int, int] = (0, 0)

    @property
    def goodput_error(self) -> float | None:
        """(predicted - measured) / measured; None when nothing met the SLOs."""
        if not self.measured_goodput:
            return None
        return (self.predicted_goodput - self.measured_goodput) / self.measured_goodput


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.plan_accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(parser, "tiny")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    parser.add_argument("--loads", default="0.5,1.0,1.5", help="fractions of the capacity")
    parser.add_argument("--num-prompts", type=int, default=200, help="per rate")
    parser.add_argument("--prompt-len", type=int, default=256, help="median")
    parser.add_argument("--output-len", type=int, default=64, help="median")
    parser.add_argument("--sigma", type=float, default=0.5, help="of ln(length)")
    parser.add_argument(
        "--workload",
        choices=("chat-like", "shared-prefix", "multi-turn"),
        default="chat-like",
        help="the points' requests: log-normal lengths, system prompts shared, or "
        "conversations (then the machine is still measured on chat-like ones)",
    )
    parser.add_argument("--num-turns", type=int, default=4, help="multi-turn's, a conversation")
    parser.add_argument("--prefix-len", type=int, default=192, help="shared-prefix's")
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix's")
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="per worker")
    parser.add_argument("--cores-per-worker", type=int, default=None, help="default: split")
    parser.add_argument("--slo-ttft-ms", type=float, default=300.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=60.0)
    parser.add_argument("--port", type=int, default=8480)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/plan_accuracy"))
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--resimulate",
        type=Path,
        default=None,
        metavar="DIR",
        help="predict the points of a finished run in DIR again (its profile, model and "
        "requests) with the planner as it is now; nothing is served",
    )
    return parser


def resimulate(directory: Path) -> int:
    """The saved run's points, predicted again."""
    saved = json.loads((directory / "plan_accuracy.json").read_text())
    if "runs" not in saved:
        raise SystemExit(
            f"--resimulate: {directory} holds no requests (a run before they were saved)"
        )
    slo = Slo(saved["slo"]["ttft_s"], saved["slo"]["tpot_s"])
    planner = _planner(
        directory / "model", Hardware.from_json(saved["hardware"]), saved["num_kv_blocks"]
    )
    comparisons = []
    for run in saved["runs"]:
        records = tuple(
            RequestRecord(i, r["prompt_len"], r["output_len"], r["success"],
                          send_time_s=r["send_time_s"], ttft_s=r["ttft_s"],
                          e2e_s=r["e2e_s"], output_tokens=r["output_tokens"],
                          conversation_id=r.get("conversation_id"),
                          turn_index=r.get("turn_index"))
            for i, r in enumerate(run["records"])
        )  # fmt: skip
        prompts = (
            replay_conversations(records, run.get("prefix_len", 0))
            if run.get("workload") == "multi-turn"
            else replay_prompts(
                records, [r.get("prefix_id") for r in run["records"]], run.get("prefix_len", 0)
            )
        )
        reuse = run.get("reuse")
        comparisons.append(
            _compared(
                planner, run["layout"], run["rate"], records, slo, prompts=prompts,
                measured_reuse=None if reuse is None else (reuse[0], reuse[1]),
            )
        )  # fmt: skip
    print(table(comparisons))
    return 0


def _planner(model_dir: str | Path, hardware: Hardware, num_kv_blocks: int) -> Planner:
    """The planner of the served clusters' settings."""
    return Planner(
        ModelCosts.load(model_dir, "float32"), hardware, block_size=16,
        max_num_batched_tokens=STEP_BUDGET, num_kv_blocks=num_kv_blocks,
    )  # fmt: skip


def _profile(args: argparse.Namespace, model_dir: str) -> Hardware:
    path = args.out / "profile.json"
    command = [
        sys.executable, "-m", "router.cli", "profile", "--model", model_dir,
        "--max-num-batched-tokens", str(STEP_BUDGET), "--num-kv-blocks", str(args.num_kv_blocks),
        "--worker-num-cpus", str(_cores(args)), "--out", str(path),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return Hardware.load(path)


def _cores(args: argparse.Namespace) -> int:
    """Each worker's Ray CPUs (its threads): all cores but 2, split between the two workers."""
    return cores_per_worker(2, args.cores_per_worker)


@dataclass(frozen=True, slots=True)
class _Point:
    """A rate served: its requests, their first tokens' traces, their prompts as simulated
    and the server's counters over the run."""

    layout: str
    rate: float
    records: tuple[RequestRecord, ...]
    traces: list[dict[str, Any]]
    prompts: Prompts
    reuse: tuple[float, float] | None  # the router's local prefills and fetches


def _points_workload(args: argparse.Namespace) -> WorkloadSpec:
    """The points' requests: ``--workload``'s (multi-turn: ``--num-prompts`` requests in
    conversations of ``--num-turns``, sharing a system prompt of ``--prefix-len``, 16-64 new
    tokens a turn and replies of 16-64)."""
    if args.workload == "multi-turn":
        return WorkloadSpec(
            kind="multi-turn",
            num_conversations=max(1, args.num_prompts // args.num_turns),
            num_turns=args.num_turns,
            system_prompt_len=args.prefix_len,
            user_range=(16, 64),
            reply_range=(16, 64),
        )
    if args.workload != "shared-prefix":
        return _workload(args)
    return WorkloadSpec(
        kind="shared-prefix",
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
    )


def _prefix_ids(
    args: argparse.Namespace,
    model_dir: str,
    workload: WorkloadSpec,
    records: tuple[RequestRecord, ...],
) -> list[int | None] | None:
    """Each served request's system prompt (the workload's requests built again, as the run
    built them: same seed); None for a workload without them."""
    if workload.kind != "shared-prefix":
        return None
    built = build_requests(workload, load_codec(model_dir), args.num_prompts, args.seed)
    return [built[r.index].prefix_id for r in records]


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        kind="chat-like",
        input_len=args.prompt_len,
        output_len=args.output_len,
        input_sigma=args.sigma,
        output_sigma=args.sigma,
        input_range=(1, MODEL_POSITIONS // 2),
        output_range=(2, MODEL_POSITIONS // 4),
    )


def _bench(
    args: argparse.Namespace,
    port: int,
    model_dir: str,
    arrivals: ArrivalSpec,
    n: int,
    seed: int,
    server_counters: bool = False,
    workload: WorkloadSpec | None = None,
) -> BenchResult:
    config = BenchConfig(
        endpoint=EndpointConfig(f"http://127.0.0.1:{port}/v1", SERVED_NAME, timeout_s=600),
        tokenizer_dir=model_dir,
        workload=workload or _workload(args),
        arrivals=arrivals,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        num_prompts=n,
        seed=seed,
        num_warmups=2,
        progress=not args.no_progress,
        server_counters=server_counters,
    )
    return run_benchmark(config)


def _compared(
    planner: Planner,
    name: str,
    rate: float,
    records: tuple[RequestRecord, ...],
    slo: Slo,
    traces: list[dict[str, Any]] | None = None,
    prompts: Prompts | None = None,
    measured_reuse: tuple[float, float] | None = None,
) -> Comparison:
    """One point: its requests as served (their first tokens' traces, the router's local
    prefills and fetches) against the planner's predictions of them."""
    layout = LAYOUTS[name]
    prompts = prompts or replay_prompts(records)

    def simulate(planner: Planner) -> list[SimulatedRequest]:
        return replay(planner, layout, records, prompts).run()

    simulation = replay(planner, layout, records, prompts)
    compared = compare(
        name, rate, records, simulation.run(), slo, simulate(_alone(planner)),
        (simulate(_at_speed(planner, 1 + SPEED_BAND)),
         simulate(_at_speed(planner, 1 - SPEED_BAND))),
        traces,
    )  # fmt: skip
    return replace(
        compared,
        measured_reuse=measured_reuse,
        predicted_reuse=(simulation.num_local_prefills, simulation.num_fetches),
    )


def _served_reuse(counters: ServerCounters | None) -> tuple[float, float] | None:
    """The router's local prefills and prefix fetches over a run; None: not counted."""
    totals = {} if counters is None else counters.totals
    if LOCAL_PREFILLS not in totals:
        return None
    return totals[LOCAL_PREFILLS], totals.get(FETCHES, 0.0)


def _at_speed(planner: Planner, factor: float) -> Planner:
    """The planner with every time of its profile ``factor`` times as long: the same machine,
    slower (or faster) than when it was profiled."""
    hardware = planner.hardware
    measured = hardware.measured
    return replace(
        planner,
        hardware=replace(
            hardware,
            flops_per_s=hardware.flops_per_s / factor,
            memory_bytes_per_s=hardware.memory_bytes_per_s / factor,
            step_overhead_s=hardware.step_overhead_s * factor,
            measured=None if measured is None else measured.scaled(factor),
            host_seconds_per_token=hardware.host_seconds_per_token * factor,
            host_seconds_per_handoff=hardware.host_seconds_per_handoff * factor,
            host_worker_seconds_per_token=hardware.host_worker_seconds_per_token * factor,
            host_worker_seconds_per_batch=hardware.host_worker_seconds_per_batch * factor,
            host_seconds_per_batch=hardware.host_seconds_per_batch * factor,
        ),
    )


def _alone(planner: Planner) -> Planner:
    """The planner with every worker on cores of its own (no shared host)."""
    return replace(planner, hardware=replace(planner.hardware, host_cores=0))


def _sent(
    records: tuple[RequestRecord, ...], prefix_ids: list[int | None] | None = None
) -> list[dict[str, Any]]:
    """Each request's lengths, send time and system prompt (``prefix_id``), and how it was
    served."""
    return [
        {
            "send_time_s": r.send_time_s,
            "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "output_tokens": r.output_tokens,
            "success": r.success,
            "ttft_s": r.ttft_s,
            "e2e_s": r.e2e_s,
            "prefix_id": None if prefix_ids is None else prefix_ids[i],
            "conversation_id": r.conversation_id,
            "turn_index": r.turn_index,
        }
        for i, r in enumerate(records)
    ]


def compare(
    name: str,
    rate: float,
    records: tuple[RequestRecord, ...],
    simulated: list[SimulatedRequest],
    slo: Slo,
    alone: list[SimulatedRequest],
    band: tuple[list[SimulatedRequest], list[SimulatedRequest]],
    traces: list[dict[str, Any]] | None = None,
) -> Comparison:
    """``records``: the requests as served; ``alone``: the same simulated with every worker on
    cores of its own; ``band``: simulated on a machine slower, and faster, than profiled;
    ``traces``: the served requests' first-token traces (bench/ttft_phases.py)."""
    bounds = SLO(slo.ttft_s * 1000, slo.tpot_s * 1000)
    measured = sum(bounds.met_by(r) for r in records) / len(records)

    def goodput(simulated: list[SimulatedRequest]) -> float:
        return sum(slo.met_by(s) for s in simulated) / len(simulated) * rate

    predicted = goodput(simulated) / rate
    return Comparison(
        name,
        rate,
        measured * rate,
        predicted * rate,
        goodput(alone),
        (goodput(band[0]), goodput(band[1])),
        measured,
        predicted,
        percentiles_ms([r.ttft_s for r in records]),
        percentiles_ms([s.ttft_s for s in simulated]),
        percentiles_ms([r.tpot_s for r in records]),
        percentiles_ms([s.tpot_s for s in simulated]),
        served_phases(traces or ()),
        simulated_phases(simulated),
    )


def table(comparisons: list[Comparison]) -> str:
    rows = [
        f"{'layout':11} {'rate/s':>7} {'goodput meas':>12} {'pred':>6} {'error':>7} "
        f"{'alone':>6} {f'±{SPEED_BAND:.0%} speed':>11} "
        f"{'ttft p50 meas/pred':>19} {'ttft p90 meas/pred':>19} {'tpot p50 meas/pred':>19}"
    ]
    for c in comparisons:
        error = c.goodput_error
        rows.append(
            f"{c.layout:11} {c.rate:7.2f} {c.measured_goodput:12.2f} {c.predicted_goodput:6.2f} "
            f"{'-' if error is None else f'{error:+.0%}':>7} {c.alone_goodput:6.2f} "
            f"{f'{c.band_goodput[0]:.1f}-{c.band_goodput[1]:.1f}':>11} "
            f"{_pair(c.measured_ttft_ms, c.predicted_ttft_ms, 'p50'):>19} "
            f"{_pair(c.measured_ttft_ms, c.predicted_ttft_ms, 'p90'):>19} "
            f"{_pair(c.measured_tpot_ms, c.predicted_tpot_ms, 'p50'):>19}"
        )
    rows.append("\nwhere the first token's time went, ms measured/predicted (bench/ttft_phases.py)")
    rows.append(f"{'layout':11} {'rate/s':>7} {phases_header()}")
    for c in comparisons:
        phases = phases_row(c.measured_ttft_phases_ms, c.predicted_ttft_phases_ms)
        rows.append(f"{c.layout:11} {c.rate:7.2f} {phases}")
    if any(c.measured_reuse or any(c.predicted_reuse) for c in comparisons):
        rows.append("\nkv_aware's reuse of decode workers' caches, served/simulated")
        rows.append(f"{'layout':11} {'rate/s':>7} {'local prefills':>15} {'fetches':>9}")
        for c in comparisons:
            served = ("-", "-") if c.measured_reuse is None else (
                f"{c.measured_reuse[0]:.0f}", f"{c.measured_reuse[1]:.0f}"
            )  # fmt: skip
            local, fetched = (f"{n}/{p}" for n, p in zip(served, c.predicted_reuse, strict=True))
            rows.append(f"{c.layout:11} {c.rate:7.2f} {local:>15} {fetched:>9}")
    return "\n".join(rows)


def _pair(measured: dict[str, float], predicted: dict[str, float], key: str) -> str:
    if key not in measured or key not in predicted:
        return "-"
    return f"{measured[key]:.0f}/{predicted[key]:.0f} ms"


def _serve_point(
    args: argparse.Namespace,
    port: int,
    model_dir: str,
    planner: Planner,
    name: str,
    rate: float,
    workload: WorkloadSpec,
) -> tuple[_Point, dict[str, Any]]:
    """Poisson traffic at ``rate`` requests a second (conversations: started at a turn's share
    of it) on the layout ``name`` served at ``port``: the point, and what the JSON keeps of it
    to simulate again."""
    multi_turn = workload.kind == "multi-turn"
    arrivals = rate / workload.num_turns if multi_turn else rate
    busy_before = busy_cpu_seconds()
    result = _bench(
        args, port, model_dir, ArrivalSpec(request_rate=arrivals), args.num_prompts, args.seed,
        True, workload,
    )  # fmt: skip
    busy_s = busy_cpu_seconds() - busy_before
    prefix_ids = _prefix_ids(args, model_dir, workload, result.records)
    prompts = (
        replay_conversations(result.records, args.prefix_len)
        if multi_turn
        else replay_prompts(result.records, prefix_ids, args.prefix_len)
    )
    point_cpu = host_cpu(planner, LAYOUTS[name], result, busy_s, prompts)
    began = datetime.fromisoformat(result.started_at).timestamp()
    traces = traces_since(args.out / f"{name}.first_token.jsonl", began)
    reuse = _served_reuse(result.server_counters)
    point = _Point(name, rate, result.records, traces, prompts, reuse)
    return point, {
        "layout": name,
        "rate": rate,
        "records": _sent(result.records, prefix_ids),
        "workload": workload.kind,
        "prefix_len": args.prefix_len if prefix_ids or multi_turn else 0,
        "reuse": reuse,
        "cpu": asdict(point_cpu),
        "duration_s": result.summary.duration_s,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.resimulate is not None:
        return resimulate(args.resimulate)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    names.sort(key=lambda n: LAYOUTS[n].num_prefill > 0)  # colocated first: see the docstring
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model or str(
        build_tiny_llama(args.out / "model", MODEL_POSITIONS, MODEL_SIZES[args.model_size])
    )
    hardware = replace(_profile(args, model_dir), host_front_door_threads=FRONT_DOOR_THREADS)
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    planner = _planner(model_dir, hardware, args.num_kv_blocks)
    cores = _cores(args)
    points: list[_Point] = []
    points_workload = _points_workload(args)
    runs: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    for index, name in enumerate(names):
        layout = LAYOUTS[name]
        traced = args.out / f"{name}.first_token.jsonl"
        spec = pdserve_server(
            name, layout.num_prefill, layout.num_decode, args.port + index, model_dir,
            SERVED_NAME, args.num_kv_blocks, cores_per_worker=cores,
            extra_args=("--max-model-len", str(MODEL_POSITIONS), "--first-token-trace", str(traced)),
        )  # fmt: skip
        print(f"== {name}: {' '.join(spec.argv)}", file=sys.stderr, flush=True)
        with RunningServer(spec, args.out / f"{name}.log"):
            port = spec.port
            few: HostCPU | None = None  # a request at a time: a token a batch
            if "path_overhead_s" not in extra:  # the front door's own time, measured once
                busy_before = busy_cpu_seconds()
                idle = _bench(args, port, model_dir, ArrivalSpec(max_concurrency=1), 20, 7, True)
                few = host_cpu(planner, layout, idle, busy_cpu_seconds() - busy_before)
                print(f"{name}, a request at a time: {few}", file=sys.stderr, flush=True)
                extra[f"{name}_one_at_a_time_cpu"] = asdict(few)
                simulated = replay(planner, layout, idle.records).run()
                gap = statistics.median(
                    r.ttft_s for r in idle.records if r.ttft_s
                ) - statistics.median(s.ttft_s for s in simulated if s.ttft_s)
                extra["path_overhead_s"] = max(0.0, gap + hardware.path_overhead_s)
                planner = replace(
                    planner,
                    hardware=replace(planner.hardware, path_overhead_s=extra["path_overhead_s"]),
                )
            busy_before = busy_cpu_seconds()
            closed = _bench(args, port, model_dir, ArrivalSpec(max_concurrency=16), 300, 11, True)
            cpu = host_cpu(planner, layout, closed, busy_cpu_seconds() - busy_before)
            print(f"{name}: {cpu}", file=sys.stderr, flush=True)
            extra[f"{name}_cpu"] = asdict(cpu)
            for field, value in measure_host(layout, cpu, planner.hardware, few).items():
                extra[f"{name}_{field}"] = value
                if field not in extra:  # measured once, as the path's time
                    extra[field] = value
                    planner = replace(planner, hardware=replace(planner.hardware, **{field: value}))
            capacity = closed.summary.request_throughput
            if points_workload.kind != "chat-like":  # its own: the prefixes are cached
                capacity = _bench(
                    args, port, model_dir, ArrivalSpec(max_concurrency=16), 300, 11,
                    workload=points_workload,
                ).summary.request_throughput  # fmt: skip
            extra[f"{name}_capacity"] = capacity
            for load in loads:
                point, run = _serve_point(
                    args, port, model_dir, planner, name, load * capacity, points_workload
                )
                points.append(point)
                runs.append(run)
    # every point predicted with what the capacity runs measured, all of it
    comparisons = [
        _compared(planner, p.layout, p.rate, p.records, slo, p.traces, p.prompts, p.reuse)
        for p in points
    ]
    print(table(comparisons))
    errors = [abs(c.goodput_error) for c in comparisons if c.goodput_error is not None]
    if errors:
        print(f"goodput error: mean {statistics.mean(errors):.0%}, worst {max(errors):.0%}")
    payload = {
        "command": " ".join(sys.argv),
        "hardware": planner.hardware.to_json(),
        "slo": asdict(slo),
        "num_kv_blocks": args.num_kv_blocks,
        **extra,
        "comparisons": [{**asdict(c), "goodput_error": c.goodput_error} for c in comparisons],
        "runs": runs,  # each point's requests, as sent and as served: to simulate again
    }
    print(f"wrote {write_json(args.out / 'plan_accuracy.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
