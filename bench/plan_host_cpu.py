"""Where a served cluster's CPU went during a run (bench.plan_accuracy), and the planner's
fields for a shared host measured from it: the host's busy time (/proc/stat) and the workers'
own counters (their processes', their steps'), against the profile's time for the same steps."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bench.plan_replay import Prompts, replay
from bench.serving.metrics import RequestRecord
from bench.serving.runner import BenchResult
from router.latency_model import StepShape
from router.planner.hardware import Hardware
from router.planner.plan import Layout, Planner

STEPS_CPU = "pdserve:worker_step_thread_cpu_seconds_total"
PROCESS_CPU = "pdserve:worker_process_cpu_seconds_total"
STEPS_WALL = "pdserve:worker_step_seconds_total"
STEPS = "pdserve:worker_steps_total"


def busy_cpu_seconds() -> float:
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


def host_cpu(
    planner: Planner,
    layout: Layout,
    result: BenchResult,
    busy_s: float,
    prompts: Prompts | None = None,
) -> HostCPU:
    counters = result.server_counters
    if counters is None or not any(name == PROCESS_CPU for name, _ in counters.role_totals):
        raise SystemExit(f"the server's /metrics has no {PROCESS_CPU}: a pdserve before it?")
    simulation = replay(planner, layout, result.records, prompts)
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


def measure_host(
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
