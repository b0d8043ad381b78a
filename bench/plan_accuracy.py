"""How well ``pdserve plan`` predicts a real cluster (issue 35's "Measure": the planner's
prediction error per layout and rate, in a table).

    .venv/bin/python -m bench.plan_accuracy [--layouts colocated2,1p1d] [--loads 0.5,1.0,1.5]
        [--model-size tiny|small|medium]

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
import os
import random
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.results_json import write_json
from bench.serving.arrivals import ArrivalSpec
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO, RequestRecord
from bench.serving.runner import BenchConfig, BenchResult, run_benchmark
from bench.serving.servers import RunningServer, cores_per_worker, pdserve_server
from bench.serving.tiny_model import MODEL_SIZES, add_model_args, build_tiny_llama
from bench.serving.workloads import WorkloadSpec
from bench.ttft_phases import (
    Phases,
    percentiles_ms,
    phases_header,
    phases_row,
    served_phases,
    simulated_phases,
    traces_since,
)
from router.latency_model import StepShape
from router.planner.hardware import Hardware
from router.planner.model_costs import ModelCosts
from router.planner.plan import Layout, Planner, Slo
from router.planner.simulator import SimulatedRequest, Simulation, WorkloadRequest

SERVED_NAME = "pdserve-demo"
MODEL_POSITIONS = 2048
STEP_BUDGET = 512  # pdserve serve's on CPU
LAYOUTS = {"colocated2": Layout(0, 1, 2, 1), "1p1d": Layout(1, 1, 1, 1)}
# the sensitivity shown beside each prediction: step and host times this much longer, and
# shorter (this machine's capacity varies more than that from one run to the next)
SPEED_BAND = 0.1
STEPS_CPU = "pdserve:worker_step_thread_cpu_seconds_total"
PROCESS_CPU = "pdserve:worker_process_cpu_seconds_total"
STEPS_WALL = "pdserve:worker_step_seconds_total"
STEPS = "pdserve:worker_steps_total"
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
                          e2e_s=r["e2e_s"], output_tokens=r["output_tokens"])
            for i, r in enumerate(run["records"])
        )  # fmt: skip
        comparisons.append(_compared(planner, run["layout"], run["rate"], records, slo))
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
) -> BenchResult:
    config = BenchConfig(
        endpoint=EndpointConfig(f"http://127.0.0.1:{port}/v1", SERVED_NAME, timeout_s=600),
        tokenizer_dir=model_dir,
        workload=_workload(args),
        arrivals=arrivals,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        num_prompts=n,
        seed=seed,
        num_warmups=2,
        progress=not args.no_progress,
        server_counters=server_counters,
    )
    return run_benchmark(config)


def _simulation(planner: Planner, layout: Layout, records: tuple[RequestRecord, ...]) -> Simulation:
    """The planner's simulation of ``layout`` serving the requests as they were sent."""
    rng = random.Random(0)
    requests = [
        WorkloadRequest(
            r.send_time_s,
            tuple(rng.randrange(3, 4000) for _ in range(r.prompt_len)),
            r.output_len,
        )
        for r in records
    ]
    return Simulation(planner.cluster(layout), requests)


def _simulate(
    planner: Planner, layout: Layout, records: tuple[RequestRecord, ...]
) -> list[SimulatedRequest]:
    return _simulation(planner, layout, records).run()


def _compared(
    planner: Planner,
    name: str,
    rate: float,
    records: tuple[RequestRecord, ...],
    slo: Slo,
    traces: list[dict[str, Any]] | None = None,
) -> Comparison:
    """One point: its requests as served (and their first tokens' traces) against the
    planner's predictions of them."""
    layout = LAYOUTS[name]
    return compare(
        name, rate, records, _simulate(planner, layout, records), slo,
        _simulate(_alone(planner), layout, records),
        (_simulate(_at_speed(planner, 1 + SPEED_BAND), layout, records),
         _simulate(_at_speed(planner, 1 - SPEED_BAND), layout, records)),
        traces,
    )  # fmt: skip


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


def _busy_cpu_seconds() -> float:
    """The machine's CPU time spent busy so far, all cores (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class HostCPU:
    """Where the machine's CPU went during a run (seconds, all cores together), from its
    busy time (/proc/stat) and the workers' counters (their processes', their steps')."""

    busy_s: float
    # the workers' processes by role ("prefill", "decode"), all their threads
    processes_s: dict[str, float]
    steps_s: dict[str, float]  # their engine threads in their steps
    steps_wall_s: dict[str, float]  # those steps' wall time (longer while others ran)
    # the same requests' steps as the planner has them, by role: (alone, as simulated on
    # the shared host)
    simulated_steps_s: dict[str, tuple[float, float]]
    num_steps: dict[str, tuple[float, int]]  # by role: (served, simulated)
    # the profile's time for the steps the workers ran: their number (the counters) and what
    # they computed (the requests' prompts and outputs)
    profiled_steps_s: dict[str, float]
    num_tokens: int
    num_requests: int

    @property
    def front_door_s(self) -> float:
        """Everything outside the workers' processes: the gateway, the router, Ray's
        daemons, the load generator."""
        return max(0.0, self.busy_s - sum(self.processes_s.values()))

    def step_cpu_factor(self, role: str) -> float:
        """The role's steps' CPU time over the profile's time for the same steps (1.0 when
        either is unknown)."""
        served, profiled = self.steps_s.get(role, 0.0), self.profiled_steps_s.get(role, 0.0)
        return served / profiled if served > 0 and profiled > 0 else 1.0

    def num_batches(self, role: str) -> float:
        """The role's workers' steps as served (each sends its outputs as one batch)."""
        return self.num_steps.get(role, (0.0, 0))[0]

    def beyond_steps_s(self, role: str) -> float:
        """The role's workers' processes besides their steps: their outputs made and streamed
        out, hand-offs, calls."""
        return max(0.0, self.processes_s.get(role, 0.0) - self.steps_s.get(role, 0.0))


def _host_cpu(planner: Planner, layout: Layout, result: BenchResult, busy_s: float) -> HostCPU:
    counters = result.server_counters
    if counters is None or not any(name == PROCESS_CPU for name, _ in counters.role_totals):
        raise SystemExit(f"the server's /metrics has no {PROCESS_CPU}: a pdserve before it?")
    simulation = _simulation(planner, layout, result.records)
    simulation.run()
    simulated = simulation.steps_by_role()
    by_role = counters.role_totals

    def of(counter: str) -> dict[str, float]:
        return {role: value for (name, role), value in by_role.items() if name == counter}

    steps = of(STEPS)
    return HostCPU(
        busy_s, of(PROCESS_CPU), of(STEPS_CPU), of(STEPS_WALL),
        {role: (t.alone_s, t.wall_s) for role, t in simulated.items()},
        {role: (steps.get(role, 0.0), t.num_steps) for role, t in simulated.items()},
        _profiled(planner, layout, steps, result.records),
        sum(r.output_tokens for r in result.records), len(result.records),
    )  # fmt: skip


def _profiled(
    planner: Planner,
    layout: Layout,
    num_steps: dict[str, float],
    records: tuple[RequestRecord, ...],
) -> dict[str, float]:
    """The profile's time for the steps each role's workers ran: ``num_steps`` of them, which
    computed every prompt (its attention pairs whatever its chunks: p (p + 1) / 2) and every
    decode row after the first token (each reading the KV before it). The step time being
    linear in what a step computes, the sum is exact (but for the counters, which come with
    the workers' load reports every half second: a few steps either side of the run)."""
    cost = planner.hardware.measured
    if cost is None:
        return {}
    prompts = [r.prompt_len for r in records]
    rows = [(r.prompt_len, max(0, r.output_tokens - 1)) for r in records]
    prompt_tokens, pairs = sum(prompts), sum(p * (p + 1) // 2 for p in prompts)
    decode_rows = sum(n for _, n in rows)
    context = sum(n * p + n * (n + 1) // 2 for p, n in rows)
    shapes = (
        {
            "prefill": StepShape(prompt_tokens, pairs),
            "decode": StepShape(0, 0, decode_rows, context),
        }
        if layout.num_prefill
        else {"decode": StepShape(prompt_tokens, pairs, decode_rows, context)}
    )
    return {
        role: cost.seconds(shape) + cost.overhead_s * (num_steps.get(role, 1.0) - 1)
        for role, shape in shapes.items()
    }


def _measure_host(
    layout: Layout, cpu: HostCPU, hardware: Hardware, few: HostCPU | None = None
) -> dict[str, float]:
    """The host's other work in a run, as the planner's fields. On a colocated layout, per
    batch of a step's outputs and per sampled token, from the capacity run (``cpu``) and one of
    a request at a time (``few``: a token a batch), solved together: the time outside the
    workers' processes (the front door's receipt and streaming), and the workers' processes'
    time beyond their steps (their outputs); without ``few``, all of it per token. On a
    disaggregated one, per KV hand-off: the prefill workers' processes' time beyond their steps
    and their first tokens' outputs (as measured before), its copies and calls, which the
    planner runs in that process; and the steps' CPU time on this busy host over the profile's
    time for them, of a prompt step (the prefill worker's) and of a decode-only one (the
    decode worker's)."""
    if not layout.num_prefill:
        runs = (cpu,) if few is None else (few, cpu)
        per_batch, per_token = per_batch_and_token(
            [(r.num_batches("decode"), r.num_tokens, r.front_door_s) for r in runs]
        )
        worker_per_batch, worker_per_token = per_batch_and_token(
            [(r.num_batches("decode"), r.num_tokens, r.beyond_steps_s("decode")) for r in runs]
        )
        return {
            "host_seconds_per_token": per_token,
            "host_seconds_per_batch": per_batch,
            "host_worker_seconds_per_token": worker_per_token,
            "host_worker_seconds_per_batch": worker_per_batch,
        }
    # a prefill worker outputs each request's first token, then hands its KV off
    outputs_s = (
        cpu.num_requests * hardware.host_worker_seconds_per_token
        + cpu.num_batches("prefill") * hardware.host_worker_seconds_per_batch
    )
    handoffs_s = max(0.0, cpu.beyond_steps_s("prefill") - outputs_s)
    return {
        "host_seconds_per_handoff": handoffs_s / max(1, cpu.num_requests),
        # the prefill workers' steps all compute prompt tokens, the decode workers' none
        "host_prompt_step_cpu_factor": cpu.step_cpu_factor("prefill"),
        "host_decode_step_cpu_factor": cpu.step_cpu_factor("decode"),
    }


def per_batch_and_token(runs: list[tuple[float, int, float]]) -> tuple[float, float]:
    """(seconds a batch, seconds a token), neither below 0, that fit the runs' ``(batches,
    tokens, seconds)`` best (least squares); from one run, or runs of one ratio of tokens to
    batches, all of it per token."""
    bb = sum(b * b for b, _, _ in runs)
    bt = sum(b * t for b, t, _ in runs)
    tt = sum(t * t for _, t, _ in runs)
    by = sum(b * y for b, _, y in runs)
    ty = sum(t * y for _, t, y in runs)
    determinant = bb * tt - bt * bt
    if determinant > 1e-9 * bb * tt:
        per_batch = (by * tt - ty * bt) / determinant
        per_token = (bb * ty - bt * by) / determinant
        if per_batch >= 0 and per_token >= 0:
            return per_batch, per_token
        if per_token < 0 and bb > 0:
            return max(0.0, by / bb), 0.0
    return 0.0, max(0.0, ty / tt) if tt > 0 else 0.0


def _sent(records: tuple[RequestRecord, ...]) -> list[dict[str, Any]]:
    """Each request's lengths and send time, and how it was served."""
    return [
        {
            "send_time_s": r.send_time_s,
            "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "output_tokens": r.output_tokens,
            "success": r.success,
            "ttft_s": r.ttft_s,
            "e2e_s": r.e2e_s,
        }
        for r in records
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
    return "\n".join(rows)


def _pair(measured: dict[str, float], predicted: dict[str, float], key: str) -> str:
    if key not in measured or key not in predicted:
        return "-"
    return f"{measured[key]:.0f}/{predicted[key]:.0f} ms"


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
    # each point: (layout, rate, its requests as served, their first tokens' traces)
    points: list[tuple[str, float, tuple[RequestRecord, ...], list[dict[str, Any]]]] = []
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
                busy_before = _busy_cpu_seconds()
                idle = _bench(args, port, model_dir, ArrivalSpec(max_concurrency=1), 20, 7, True)
                few = _host_cpu(planner, layout, idle, _busy_cpu_seconds() - busy_before)
                print(f"{name}, a request at a time: {few}", file=sys.stderr, flush=True)
                extra[f"{name}_one_at_a_time_cpu"] = asdict(few)
                simulated = _simulate(planner, layout, idle.records)
                gap = statistics.median(
                    r.ttft_s for r in idle.records if r.ttft_s
                ) - statistics.median(s.ttft_s for s in simulated if s.ttft_s)
                extra["path_overhead_s"] = max(0.0, gap + hardware.path_overhead_s)
                planner = replace(
                    planner,
                    hardware=replace(planner.hardware, path_overhead_s=extra["path_overhead_s"]),
                )
            busy_before = _busy_cpu_seconds()
            closed = _bench(args, port, model_dir, ArrivalSpec(max_concurrency=16), 300, 11, True)
            cpu = _host_cpu(planner, layout, closed, _busy_cpu_seconds() - busy_before)
            print(f"{name}: {cpu}", file=sys.stderr, flush=True)
            extra[f"{name}_cpu"] = asdict(cpu)
            for field, value in _measure_host(layout, cpu, planner.hardware, few).items():
                extra[f"{name}_{field}"] = value
                if field not in extra:  # measured once, as the path's time
                    extra[field] = value
                    planner = replace(planner, hardware=replace(planner.hardware, **{field: value}))
            capacity = closed.summary.request_throughput
            extra[f"{name}_capacity"] = capacity
            for load in loads:
                rate = load * capacity
                busy_before = _busy_cpu_seconds()
                result = _bench(
                    args,
                    port,
                    model_dir,
                    ArrivalSpec(request_rate=rate),
                    args.num_prompts,
                    args.seed,
                    True,
                )
                point_cpu = _host_cpu(planner, layout, result, _busy_cpu_seconds() - busy_before)
                began = datetime.fromisoformat(result.started_at).timestamp()
                points.append((name, rate, result.records, traces_since(traced, began)))
                runs.append(
                    {
                        "layout": name,
                        "rate": rate,
                        "records": _sent(result.records),
                        "cpu": asdict(point_cpu),
                        "duration_s": result.summary.duration_s,
                    }
                )
    # every point predicted with what the capacity runs measured, all of it
    comparisons = [
        _compared(planner, name, rate, records, slo, traces)
        for name, rate, records, traces in points
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
