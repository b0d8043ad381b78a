"""bench.rebalance's and bench.plan_accuracy's pure parts: phases' outcomes and their overall
goodput; a measured run against its simulation, and the goodput error."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.plan_accuracy import compare, table
from bench.plan_accuracy import main as plan_accuracy_main
from bench.plan_host_cpu import HostCPU, measure_host, per_batch_and_token
from bench.plan_replay import replay_conversations, replay_prompts
from bench.rebalance import PhaseOutcome, overall_goodput, phase_outcome
from bench.rebalance import table as phases_table
from bench.serving.arrivals import ArrivalSpec
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO, RequestRecord, summarize
from bench.serving.runner import BenchConfig, BenchResult
from router.latency_model import StepCost
from router.planner.hardware import Hardware
from router.planner.plan import Layout, Slo
from router.planner.simulator import SAMPLED_TOKEN, SimulatedRequest, WorkloadRequest

BOUNDS = SLO(ttft_ms=100, tpot_ms=20)
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
}


def _record(index: int, ttft_s: float) -> RequestRecord:
    return RequestRecord(
        index,
        100,
        10,
        True,
        ttft_s=ttft_s,
        e2e_s=ttft_s + 0.09,
        itl_s=(0.01,) * 9,
        output_tokens=10,
    )


def _result(records: list[RequestRecord], rate: float) -> BenchResult:
    config = BenchConfig(
        EndpointConfig("http://127.0.0.1:1/v1", "m"),
        "unused",
        arrivals=ArrivalSpec(rate),
        slo=BOUNDS,
    )
    return BenchResult(config, summarize(records, 10.0, BOUNDS), tuple(records), "now")


def test_a_phase_counts_good_requests_and_the_phases_add_up() -> None:
    records = [_record(i, 0.05) for i in range(8)] + [_record(8, 0.5), _record(9, 0.5)]
    a = phase_outcome("fixed", "A", 0, _result(records, 1.0))
    assert (a.num_sent, a.num_good, a.attainment, a.goodput) == (10, 8, 0.8, 0.8)
    b = PhaseOutcome("fixed", "B", 0, 1.0, 10, 10, 2, 10.0, 50.0, 10.0)
    assert overall_goodput([a, b]) == 0.5  # 10 good in 20 s
    # a second round's phases add in: 10 + 4 good in 20 + 20 s
    again = [PhaseOutcome("fixed", phase, 1, 1.0, 10, 10, 2, 10.0, None, None) for phase in "AB"]
    assert overall_goodput([a, b, *again]) == 14 / 40
    printed = phases_table([a, b, *again])
    assert "fixed" in printed and " round " in printed


def test_a_simulation_is_compared_with_its_measured_run() -> None:
    records = [_record(i, 0.05 if i < 6 else 0.3) for i in range(10)]
    simulated = []
    for i in range(10):
        run = SimulatedRequest(WorkloadRequest(0.0, (1,) * 100, 10))
        run.first_token_s, run.last_token_s, run.num_tokens = 0.05 if i < 8 else 0.3, 0.14, 10
        if i >= 8:
            run.last_token_s = 0.39
        simulated.append(run)
    alone = simulated[:8]  # with every worker on cores of its own: all 8 within the SLOs
    slower = simulated[2:]  # on a slower machine: 6 of 8
    band = (slower, alone)
    comparison = compare("1p1d", 5.0, tuple(records), simulated, Slo(0.1, 0.02), alone, band)
    assert comparison.measured_goodput == 3.0  # 6 of 10 within the SLOs at 5/s
    assert comparison.predicted_goodput == 4.0  # 8 of 10
    assert comparison.alone_goodput == 5.0
    assert comparison.band_goodput == (3.75, 5.0)
    assert comparison.goodput_error == (4.0 - 3.0) / 3.0
    assert "+33%   5.00     3.8-5.0" in table([comparison])


def test_a_saved_run_is_predicted_again_with_the_planner_as_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--resimulate``: a finished run's requests, as saved, simulated again on its profile
    (a worker of 10 ms a step + 0.1 ms a token, two of them sharing two cores with 1 ms of
    streaming per token): the table compares them with how they were served, and shows the
    prediction on a machine 10 % slower and faster."""
    hardware = Hardware(
        "box", 1e11, 1e10, 8e9, 1e10, measured_model="model",
        measured=StepCost(0.010, 1e-4, 0.0, 1e-4, 0.0, 100),
        host_cores=2, host_seconds_per_token=1e-3,
    )  # fmt: skip
    served = [
        {"send_time_s": 0.1 * i, "prompt_len": 50, "output_len": 10, "output_tokens": 10,
         "success": True, "ttft_s": 0.05, "e2e_s": 0.05 + 9 * (0.01 if i < 8 else 0.05)}
        for i in range(10)
    ]  # fmt: skip
    saved = _saved_run(
        tmp_path, hardware, {"ttft_s": 0.1, "tpot_s": 0.0105, "attainment": 0.9},
        {"layout": "colocated2", "rate": 10.0, "records": served},
    )  # fmt: skip
    assert plan_accuracy_main(["--resimulate", str(tmp_path)]) == 0
    row, phases = [line for line in capsys.readouterr().out.splitlines() if "colocated2" in line]
    assert phases.split()[2:] == ["-"] * 6  # a saved run's first tokens were not traced
    # measured: 8 of 10 within the SLOs; simulated: each alone on a worker, all within
    assert row.split()[1:6] == ["10.00", "8.00", "10.00", "+25%", "10.00"]
    # 10 % slower, each decode step (10.1 ms alone) takes 11.1 ms: over the 10.5 ms TPOT SLO
    assert row.split()[6] == "0.0-10.0"
    del saved["runs"]
    (tmp_path / "plan_accuracy.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="holds no requests"):
        plan_accuracy_main(["--resimulate", str(tmp_path)])


def test_a_disaggregated_capacity_run_measures_each_kind_of_steps_cpu_on_the_busy_host() -> None:
    """The prefill worker's steps (all computing prompts) took 5 s of CPU where the profile
    gives the same steps 4 s, the decode worker's 11 s for 10 s: the planner's busy-host
    factors 1.25 and 1.1; and each hand-off's work: the prefill worker's process's time beyond
    its steps, less its first tokens' outputs, per request."""
    cpu = HostCPU(
        busy_s=30.0, processes_s={"prefill": 7.0, "decode": 13.0},
        steps_s={"prefill": 5.0, "decode": 11.0}, steps_wall_s={"prefill": 8.0, "decode": 15.0},
        simulated_steps_s={}, num_steps={}, profiled_steps_s={"prefill": 4.0, "decode": 10.0},
        num_tokens=1000, num_requests=100,
    )  # fmt: skip
    hardware = Hardware("box", 1e11, 1e10, 8e9, 1e10, host_worker_seconds_per_token=1e-3)
    measured = measure_host(Layout(1, 1, 1, 1), cpu, hardware)
    assert measured == pytest.approx(
        {
            "host_seconds_per_handoff": (2.0 - 100 * 1e-3) / 100,
            "host_prompt_step_cpu_factor": 1.25,
            "host_decode_step_cpu_factor": 1.1,
        }
    )
    # nothing profiled (a profile without a measured fit): no factor
    assert replace(cpu, profiled_steps_s={}).step_cpu_factor("prefill") == 1.0


def test_a_colocated_layout_measures_the_hosts_work_per_batch_and_per_token() -> None:
    """A request at a time, 1000 steps each sampling one token, against the capacity run's
    2000 steps of 10 000 tokens: outside the workers' processes 1.3 s and 5 s (1 ms a batch,
    0.3 ms a token), beyond the workers' steps 0.6 s and 2 s (0.5 ms, 0.1 ms). From the
    capacity run alone, all of it per token; a prefill worker's outputs per batch and per
    token leave its hand-offs."""

    def run(steps: float, tokens: int, front_door_s: float, beyond_s: float) -> HostCPU:
        return HostCPU(
            busy_s=front_door_s + beyond_s + 10.0, processes_s={"decode": beyond_s + 10.0},
            steps_s={"decode": 10.0}, steps_wall_s={}, simulated_steps_s={},
            num_steps={"decode": (steps, 0)}, profiled_steps_s={}, num_tokens=tokens,
            num_requests=10,
        )  # fmt: skip

    few, capacity = run(1000, 1000, 1.3, 0.6), run(2000, 10_000, 5.0, 2.0)
    hardware = Hardware("box", 1e11, 1e10, 8e9, 1e10)
    assert measure_host(Layout(0, 1, 2, 1), capacity, hardware, few) == pytest.approx(
        {
            "host_seconds_per_batch": 1e-3,
            "host_seconds_per_token": 3e-4,
            "host_worker_seconds_per_batch": 5e-4,
            "host_worker_seconds_per_token": 1e-4,
        }
    )
    assert measure_host(Layout(0, 1, 2, 1), capacity, hardware) == pytest.approx(
        {
            "host_seconds_per_batch": 0.0,
            "host_seconds_per_token": 5e-4,
            "host_worker_seconds_per_batch": 0.0,
            "host_worker_seconds_per_token": 2e-4,
        }
    )
    # a fit below 0 for either is that one at 0 and the other fitted alone
    assert per_batch_and_token([(1000, 1000, 1.0), (2000, 10_000, 1.0)]) == pytest.approx(
        (6e-4, 0.0)
    )
    assert per_batch_and_token([(1000, 1000, 1.0), (1000, 10_000, 10.0)]) == pytest.approx(
        (0.0, 1e-3)
    )
    assert per_batch_and_token([]) == (0.0, 0.0)
    disaggregated = replace(
        capacity,
        processes_s={"prefill": 3.0, "decode": 12.0},
        steps_s={"prefill": 2.0, "decode": 10.0},
        num_steps={"prefill": (100, 0), "decode": (2000, 0)},
    )
    measured = measure_host(
        Layout(1, 1, 1, 1),
        disaggregated,
        replace(hardware, host_worker_seconds_per_token=1e-4, host_worker_seconds_per_batch=5e-4),
    )
    # beyond the prefill worker's steps 1 s, less 10 first tokens and 100 batches: 0.949 s
    assert measured["host_seconds_per_handoff"] == pytest.approx((1.0 - 10e-4 - 0.05) / 10)


def test_requests_sharing_a_system_prompt_are_replayed_with_one_prefix() -> None:
    """Replayed prompts keep each record's length; those of one system prompt start with the
    same ``prefix_len`` tokens, others (and requests without one) share nothing."""
    records = tuple(
        RequestRecord(i, length, 4, True) for i, length in enumerate((40, 50, 30, 20, 5))
    )
    prompts = replay_prompts(records, [0, 0, 1, None, 0], 16)
    assert [len(p) for p in prompts] == [40, 50, 30, 20, 5]
    assert prompts[0][:16] == prompts[1][:16] and prompts[0][16:20] != prompts[1][16:20]
    assert prompts[2][:16] != prompts[0][:16]
    assert prompts[3][:16] not in (prompts[0][:16], prompts[2][:16])
    assert prompts[4][:4] == prompts[0][:4]  # shorter than the prefix: its first tokens
    assert len(set(replay_prompts(records))) == 5


def test_a_saved_shared_prefix_run_shows_kv_aware_reusing_the_decode_workers_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--resimulate`` of a 1P1D run whose requests share one system prompt of 96 tokens: the
    simulated router prefills some on the decode worker, which holds the prompt from earlier
    hand-offs, and the table says how many (served: not counted in this saved run)."""
    hardware = Hardware(
        "box", 1e11, 1e10, 8e9, 1e10, measured_model="model",
        measured=StepCost(0.002, 1e-4, 0.0, 1e-4, 0.0, 100),
    )  # fmt: skip
    served = [
        {"send_time_s": 0.002 * i, "prompt_len": 128, "output_len": 8, "output_tokens": 8,
         "success": True, "ttft_s": 0.05, "e2e_s": 0.1, "prefix_id": 0}
        for i in range(40)
    ]  # fmt: skip
    saved = _saved_run(
        tmp_path, hardware, {"ttft_s": 0.5, "tpot_s": 0.05, "attainment": 0.9},
        {"layout": "1p1d", "rate": 500.0, "records": served, "prefix_len": 96},
    )  # fmt: skip
    assert plan_accuracy_main(["--resimulate", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "kv_aware's reuse of decode workers' caches, served/simulated" in printed
    (row,) = [line for line in printed.splitlines()[-1:] if line.startswith("1p1d")]
    local, fetched = row.split()[2:]
    assert local.startswith("-/") and int(local[2:]) > 0  # served: not counted in this run
    assert fetched.startswith("-/")
    del saved["runs"][0]["prefix_len"]  # without its system prompt, nothing to reuse
    (tmp_path / "plan_accuracy.json").write_text(json.dumps(saved))
    assert plan_accuracy_main(["--resimulate", str(tmp_path)]) == 0
    assert "kv_aware's reuse" not in capsys.readouterr().out


def test_a_conversations_turns_are_replayed_holding_their_history() -> None:
    """Two conversations of two turns behind a system prompt of 16 tokens: each first turn
    starts with it, each second turn with its first turn's prompt and reply (the simulation's
    sampled tokens), all at their served lengths."""
    records = tuple(
        RequestRecord(i, length, 8, True, output_tokens=5, conversation_id=c, turn_index=t)
        for i, (length, c, t) in enumerate(((40, 0, 0), (30, 1, 0), (60, 0, 1), (50, 1, 1)))
    )
    first, other, second, other_second = replay_conversations(records, 16)
    assert [len(p) for p in (first, other, second, other_second)] == [40, 30, 60, 50]
    assert first[:16] == other[:16] and first[16:20] != other[16:20]
    assert second[:45] == first + (SAMPLED_TOKEN,) * 5
    assert other_second[:35] == other + (SAMPLED_TOKEN,) * 5


def _saved_run(
    directory: Path, hardware: Hardware, slo: dict[str, float], run: dict[str, Any]
) -> dict[str, Any]:
    """A finished bench.plan_accuracy run in ``directory``, as ``--resimulate`` reads it: the
    tiny model's config, the profile, the SLOs and one point's requests."""
    (directory / "model").mkdir()
    (directory / "model" / "config.json").write_text(json.dumps(TINY_LLAMA))
    saved = {"hardware": hardware.to_json(), "slo": slo, "num_kv_blocks": 1000, "runs": [run]}
    (directory / "plan_accuracy.json").write_text(json.dumps(saved))
    return saved
