"""The planner's simulation of decode workers' caches as the cluster uses them: a hand-off
shares the prefix the decode worker holds (only the rest moves), and kv_aware sends a prompt
whose prefix a decode worker holds to be prefilled there (a local prefill) or has a prefill
worker copy that prefix first (a fetch), as router/placements.py asks ``choose_reuse``; the
router's view of the loads; conversations; the router's conditional local prefills."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.latency_model import StepShape
from router.local_prefill import LocalPrefillRule
from router.planner.hardware import PRESETS
from router.planner.model_costs import ModelCosts
from router.planner.plan import Layout, Planner, Slo, fitting
from router.planner.simulator import (
    SAMPLED_TOKEN,
    ClusterShape,
    Simulation,
    WorkerShape,
    WorkloadRequest,
)
from router.planner.workload import PlanWorkload
from tests.router.test_planner import LLAMA_3_8B

CONVERSATION = tuple(range(1000, 1160))  # a first turn: 10 blocks of 16
REPLY = (SAMPLED_TOKEN,) * 40  # the first turn's reply, as the next turn holds it


def _linear(seconds_per_step: float, per_token: float) -> WorkerShape:
    def step(shape: StepShape) -> float:
        return seconds_per_step + per_token * (shape.num_prefill_tokens + shape.num_decode_tokens)

    return WorkerShape(1, step, num_kv_blocks=1000, max_num_batched_tokens=256)


def _cluster(moved: list[int], **fields: object) -> ClusterShape:
    """1P1D, 10 ms a step + 0.1 ms a token, a hand-off or fetch 1 ms a block (noted in
    ``moved``)."""

    def transfer(num_blocks: int) -> float:
        moved.append(num_blocks)
        return 0.001 * num_blocks

    return ClusterShape(
        _linear(0.010, 1e-4), prefill=_linear(0.010, 1e-4), transfer_seconds=transfer, **fields
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["least_loaded", "kv_aware"])
def test_a_hand_off_moves_only_what_the_decode_workers_cache_lacks(policy: str) -> None:
    """Two prompts of 100 tokens (7 blocks) sharing their first 64 (4 blocks): the second's
    hand-off shares those 4 in the decode worker's cache and moves 3; its prefill worker
    computes only its last 36 tokens (13.6 ms)."""
    moved: list[int] = []
    prompts = [
        WorkloadRequest(0.0, tuple(range(64)) + tuple(range(100, 136)), 2),
        WorkloadRequest(0.2, tuple(range(64)) + tuple(range(200, 236)), 2),
    ]
    first, second = Simulation(_cluster(moved, router_policy=policy), prompts).run()
    assert moved == [7, 3]
    assert second.ttft_s == pytest.approx(0.0136)
    # the decode step waits for the 3 blocks (3 ms) only
    assert second.last_token_s == pytest.approx(0.2 + 0.0136 + 0.003 + 0.0101)
    assert first.done and second.done


def test_kv_aware_prefills_a_conversations_next_turn_on_the_decode_worker_holding_it() -> None:
    """The first turn (160 tokens, 40 out) is prefilled by the prefill worker and decoded by
    the decode worker, whose cache then holds it and its reply (12 full blocks). The next turn
    (the first, its reply and 20 new tokens: 220) costs the decode worker 28 tokens to compute
    and the prefill worker, holding the first turn only, 60: kv_aware prefills it on the decode
    worker (12.8 ms, no hand-off); least_loaded sends it to the prefill worker (16 ms) and
    hands 2 blocks back."""
    next_turn = CONVERSATION + REPLY + tuple(range(2000, 2020))
    prompts = [WorkloadRequest(0.0, CONVERSATION, 40), WorkloadRequest(1.0, next_turn, 2)]
    moved: list[int] = []
    simulation = Simulation(_cluster(moved), prompts)
    _, turn = simulation.run()
    assert (simulation.num_local_prefills, simulation.num_fetches) == (1, 0)
    assert moved == [10]
    assert turn.ttft_s == pytest.approx(0.0128)
    moved.clear()
    pooled = Simulation(_cluster(moved, router_policy="least_loaded"), prompts)
    _, turn = pooled.run()
    assert (pooled.num_local_prefills, moved) == (0, [10, 2])
    assert turn.ttft_s == pytest.approx(0.016)


def test_kv_aware_has_a_prefill_worker_fetch_the_prefix_when_the_decode_worker_is_busy() -> None:
    """Another next turn of 600 new tokens, prefilled on the decode worker (256 tokens a step),
    leaves most of it queued there when the 20-token turn arrives: the prefill worker copies
    the reply's 2 blocks from the decode worker (2 ms), computes the 28 tokens left (12.8 ms)
    and hands 2 blocks back. Without fetches (a pool of TP > 1) it computes 60 (16 ms)."""
    busy_turn = CONVERSATION + REPLY + tuple(range(3000, 3600))
    short_turn = CONVERSATION + REPLY + tuple(range(2000, 2020))
    prompts = [
        WorkloadRequest(0.0, CONVERSATION, 40),
        WorkloadRequest(1.0, busy_turn, 2),
        WorkloadRequest(1.001, short_turn, 2),
    ]
    moved: list[int] = []
    simulation = Simulation(_cluster(moved), prompts)
    _, busy, short = simulation.run()
    assert (simulation.num_local_prefills, simulation.num_fetches) == (1, 1)
    assert simulation.num_fetched_blocks == 2
    assert moved == [10, 2, 2]  # the first turn's hand-off, the fetch, the hand-off back
    assert short.ttft_s == pytest.approx(0.002 + 0.0128)
    assert busy.done and short.done
    moved.clear()
    no_fetch = Simulation(_cluster(moved, prefix_fetch=False), prompts)
    _, _, short = no_fetch.run()
    assert (no_fetch.num_local_prefills, no_fetch.num_fetches, moved) == (1, 0, [10, 2])
    assert short.ttft_s == pytest.approx(0.016)


def test_the_planner_fetches_only_between_workers_of_one_rank(tmp_path: Path) -> None:
    """As the router: kv_aware's fetch needs a prefill and a decode worker of TP 1."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    planner = Planner(ModelCosts.load(tmp_path), PRESETS["h100"])
    assert planner.cluster(Layout(1, 1, 1, 1)).prefix_fetch
    assert not planner.cluster(Layout(1, 2, 1, 1)).prefix_fetch
    assert not planner.cluster(Layout(1, 1, 1, 2)).prefix_fetch


def test_the_router_weighs_the_loads_it_was_last_told_plus_what_it_routed_since() -> None:
    """Ten prompts sharing a 64-token system prompt, one every 50 ms, each decoding 40 tokens.
    Routed on the loads as they are, the prefill worker has nothing queued when the next
    arrives: each prompt goes to it (16 tokens computed, 11.6 ms). The router's view (reports
    every 0.5 s, router/load_ledger.py) still counts the prompts routed there since the last
    report, while they run: so it prefills some on the decode worker, which holds the system
    prompt, behind its running decode step (as served: 93-99 of 200 such prompts)."""
    prompts = [
        WorkloadRequest(0.05 * i, tuple(range(64)) + tuple(range(1000 + 20 * i, 1016 + 20 * i)), 40)
        for i in range(10)
    ]
    exact = Simulation(_cluster([], report_interval_s=0.0), prompts)
    runs = exact.run()
    assert exact.num_local_prefills == 0
    assert [run.ttft_s for run in runs[1:]] == pytest.approx([0.0116] * 9)
    polled = Simulation(_cluster([]), prompts)
    runs = polled.run()
    assert polled.num_local_prefills == 4
    assert all(run.done for run in runs)
    assert max(run.ttft_s or 0 for run in runs[1:]) > 0.0116  # behind a decode step


def test_a_conversations_next_turn_is_sent_after_the_user_read_the_reply() -> None:
    """The next turn (the first turn, its reply and 20 new tokens) is sent 0.5 s after the
    first's last token reached its client (0.4299 s), and its TTFT counts from then; kv_aware
    prefills it on the decode worker holding the conversation (12.8 ms)."""
    first = WorkloadRequest(0.0, CONVERSATION, 40)
    turn = WorkloadRequest(
        0.0, CONVERSATION + REPLY + tuple(range(2000, 2020)), 2, follows=first, think_s=0.5
    )
    simulation = Simulation(_cluster([]), [first, turn])
    ran_first, ran_turn = simulation.run()
    assert ran_first.last_token_s == pytest.approx(0.4299)
    assert ran_turn.arrival_s == pytest.approx(0.9299)
    assert ran_turn.ttft_s == pytest.approx(0.0128)
    assert simulation.num_local_prefills == 1
    with pytest.raises(ValueError, match="follows a request that is not simulated"):
        Simulation(_cluster([]), [turn])


def test_a_workload_of_conversations_resends_each_turns_history(tmp_path: Path) -> None:
    """Three turns a conversation: each next turn's prompt is the one before, its reply (the
    simulation's sampled tokens) and a new message; conversations start at a third of the rate.
    The planner leaves out a turn too long for the model, and the turns after it."""
    workload = PlanWorkload(rate=3.0, prompt_len=50, output_len=10, turns=3, num_requests=30)
    requests = workload.requests()
    assert len(requests) == 30
    for i in range(0, 30, 3):
        first, second, third = requests[i : i + 3]
        assert first.follows is None and second.follows is first and third.follows is second
        reply = (SAMPLED_TOKEN,) * first.output_len
        assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(reply)] == (
            first.prompt_token_ids + reply
        )
        assert second.think_s >= 0 and third.arrival_s == first.arrival_s
    starts = [r.arrival_s for r in requests if r.follows is None]
    assert len(starts) == 10 and 10 / starts[-1] == pytest.approx(1.0, rel=0.6)
    sizes = [len(r.prompt_token_ids) + r.output_len for r in requests]
    limit = sorted(sizes[1::3])[5]  # about half the second turns fit
    kept = fitting(requests, limit)
    assert all(requests[i] in kept for i in range(0, 30, 3))  # every first turn
    for i in range(1, 30, 3):
        fits = sizes[i] <= limit
        assert (requests[i] in kept) is fits
        assert (requests[i + 1] in kept) is (fits and sizes[i + 1] <= limit)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    planner = Planner(ModelCosts.load(tmp_path), PRESETS["h100"])
    result = planner.simulate(Layout(1, 1, 1, 1), workload, Slo(1.0, 0.1))
    assert result.attainment == 1.0 and result.local_prefill_share > 0
    with pytest.raises(ValueError, match="--turns must be >= 1"):
        PlanWorkload(rate=1.0, turns=0)


def test_the_routers_conditional_local_prefills_are_simulated_as_it_applies_them() -> None:
    """Three prompts of 200 tokens at once and a 20-token one at 0.3 s, least_loaded. With a
    short-prompt rule of 32 tokens, the short one is prefilled on the decode worker (no
    hand-off). With a backlog rule of 100 queued tokens, the second prompt (the first's 200
    queued ahead of it, as the router sees them) goes to the decode worker, the third to the
    prefill worker again (the decode worker is prefilling one already)."""
    prompts = [WorkloadRequest(0.0, tuple(range(i * 300, i * 300 + 200)), 4) for i in range(3)]
    prompts.append(WorkloadRequest(0.3, tuple(range(5000, 5020)), 4))

    def run(rule: LocalPrefillRule) -> tuple[Simulation, list[int], list[float | None]]:
        moved: list[int] = []
        cluster = _cluster(moved, router_policy="least_loaded", local_prefill=rule)
        simulation = Simulation(cluster, prompts)
        return simulation, moved, [r.ttft_s for r in simulation.run()]

    simulation, moved, ttfts = run(LocalPrefillRule())
    assert (simulation.num_local_prefills, moved) == (0, [13, 13, 13, 2])
    simulation, moved, ttfts = run(LocalPrefillRule(max_local_prompt_tokens=32))
    assert (simulation.num_local_prefills, moved) == (1, [13, 13, 13])
    assert ttfts[3] == pytest.approx(0.012)
    simulation, moved, ttfts = run(LocalPrefillRule(max_prefill_queue_tokens=100))
    assert (simulation.num_local_prefills, moved) == (1, [13, 13, 2])
    assert ttfts[:3] == pytest.approx([0.030, 0.030, 0.060])


def _host_tier_run(num_host_slots: int) -> tuple[list[float], Simulation]:
    """A worker of 8 blocks of 16 tokens (10 ms a step + 1 ms a token, 2 ms a block copied to
    or from the host): a 64-token prompt, then a 112-token one that evicts its blocks, then the
    first prompt again with 16 tokens more."""
    worker = WorkerShape(
        1, _linear(0.010, 1e-3).step_times, num_kv_blocks=8, max_num_batched_tokens=256,
        num_host_slots=num_host_slots, seconds_per_swapped_block=0.002,
    )  # fmt: skip
    first = tuple(range(1000, 1064))
    requests = [
        WorkloadRequest(0.0, first, 2),
        WorkloadRequest(1.0, tuple(range(2000, 2112)), 2),
        WorkloadRequest(2.0, first + tuple(range(3000, 3016)), 2),
    ]
    simulation = Simulation(ClusterShape(worker, router_policy="least_loaded"), requests)
    ttfts = [run.ttft_s for run in simulation.run()]
    assert None not in ttfts
    return [t for t in ttfts if t is not None], simulation


def test_a_host_tier_keeps_evicted_prefixes_and_copies_them_back_for_their_time() -> None:
    """Without a host tier the third prompt computes all 80 tokens (90 ms). With one, the
    second prompt's step first copies out the 3 blocks of the first's it evicts (6 ms more),
    and the third computes 16 tokens after copying the first's 4 blocks back and 4 of the
    second's out to make room: 10 + 16 + 8 x 2 ms."""
    (_, second, third), plain = _host_tier_run(0)
    assert (second, third) == (pytest.approx(0.010 + 0.112), pytest.approx(0.010 + 0.080))
    assert plain.num_blocks_to_host == plain.num_blocks_from_host == 0
    (_, second, third), tiered = _host_tier_run(16)
    assert second == pytest.approx(0.010 + 0.112 + 3 * 0.002)
    assert third == pytest.approx(0.010 + 0.016 + 8 * 0.002)
    assert tiered.num_blocks_from_host == 4


def test_the_plans_host_tier_holds_a_ranks_gib_of_its_share_of_the_blocks(
    tmp_path: Path,
) -> None:
    """Llama-3-8B's block of 16 tokens is 2 MiB (128 KiB a token); a rank of TP 2 holds half
    of it: 4 GiB holds 2048 blocks of a worker of one rank, 4096 of one of two, each copied
    over the H100's host link (51.2 GB/s)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    costs = ModelCosts.load(tmp_path)
    planner = Planner(costs, PRESETS["h100"], kv_offload_gb=4.0)
    one, two = (
        planner.cluster(Layout(0, 1, 1, 1)).decode,
        planner.cluster(Layout(0, 1, 1, 2)).decode,
    )
    assert (one.num_host_slots, two.num_host_slots) == (2048, 4096)
    assert one.seconds_per_swapped_block == pytest.approx(2 * 2**20 / (0.8 * 64e9))
    assert two.seconds_per_swapped_block == pytest.approx(one.seconds_per_swapped_block / 2)
    assert Planner(costs, PRESETS["h100"]).cluster(Layout(0, 1, 1, 1)).decode.num_host_slots == 0
