"""``--rebalance`` on a local Ray: a workload that shifts from prompt-heavy to output-heavy
makes prefill workers become decode workers, in one switch, each in its own process (no new
one starts; a tensor-parallel worker's ranks change with it, in theirs), or, where the decode pool's
workers have twice the ranks of the prefill pool's, two prefill workers make way for a new
decode worker of the decode pool's size, in new processes; with no request failed and every
output what the offline engine gives."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from bench.rebalance import switch_times
from engine import LLM, SamplingParams
from router.cluster import Cluster
from router.cluster_config import ClusterConfig
from router.rebalance_policy import RebalanceConfig
from router.worker_slots import WorkerLauncher
from tests.engine.hf_reference import first_divergence_near_ties
from tests.fixtures.local_cluster import local_cluster_config

pytestmark = pytest.mark.timeout(300)
BLOCK = 8  # local_cluster_config's block size
CLIENTS = 4
MAX_NEAR_TIES = 2  # over one run's requests (a few hundred of 48 tokens)


async def _phase(
    cluster: Cluster,
    rng: random.Random,
    prompt_len: int,
    max_tokens: int,
    until: float,
    done: list[tuple[list[int], int, list[int]]],
) -> None:
    """``CLIENTS`` clients, each sending its next prompt as its last one ends, until ``until``
    (monotonic); every request's prompt, max_tokens and tokens go in ``done``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def client() -> None:
        while time.monotonic() < until:
            prompt = [rng.randrange(3, 500) for _ in range(prompt_len)]
            tokens = [e.token_id async for e in cluster.generate(prompt, params)]
            done.append((prompt, max_tokens, tokens))

    await asyncio.gather(*(client() for _ in range(CLIENTS)))


def _serve_until(
    cluster: Cluster,
    rng: random.Random,
    shape: tuple[int, int],
    done: list[tuple[list[int], int, list[int]]],
    reached: Callable[[], bool],
) -> None:
    """Phases of a second of (prompt length, max_tokens) ``shape`` requests until
    ``reached()``, for 120 s at most."""
    deadline = time.monotonic() + 120
    while not reached() and time.monotonic() < deadline:
        asyncio.run(_phase(cluster, rng, *shape, time.monotonic() + 1.0, done))


def _assert_as_offline(
    llama_dir: Path, done: list[tuple[list[int], int, list[int]]], tensor_parallel: bool
) -> None:
    """Every request's tokens are what the offline engine gives its prompt (one batch per
    max_tokens); where workers had two ranks, up to a near-tie at the first divergence (their
    all-reduce sums in another order than one device; hundreds of random prompts meet one now
    and then), and few of those."""
    offline = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=BLOCK)
    near_ties = []
    for max_tokens in sorted({m for _, m, _ in done}):
        runs = [(p, t) for p, m, t in done if m == max_tokens]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in offline.generate([p for p, _ in runs], params)]
        got = [t for _, t in runs]
        if not tensor_parallel:
            assert got == expected
            continue
        prompts = [p for p, _ in runs]
        near_ties += first_divergence_near_ties(llama_dir, prompts, got, expected)
    assert len(near_ties) <= MAX_NEAR_TIES, near_ties


def _rebalance(cooldown_s: float, place_timeout_s: float = 120.0) -> RebalanceConfig:
    """decode's TPOT SLO is out of reach (its pressure is always high): what keeps the prefill
    pool from giving a worker while prompts are long is its own utilization."""
    return RebalanceConfig(
        slo_ttft_s=30.0, slo_tpot_s=0.0005, window_s=1.5, cooldown_s=cooldown_s,
        donor_utilization_low=0.15, drain_timeout_s=20.0, place_timeout_s=place_timeout_s,
    )  # fmt: skip


def _prefill_heavy(
    llama_dir: Path,
    rebalance: RebalanceConfig,
    prefill_tp: int,
    decode_tp: int,
    num_moves: int = 1,
) -> ClusterConfig:
    """One decode worker and, beside the prefill worker a switch leaves, those its
    ``num_moves`` take: one each where the workers have as many ranks, two each where a decode
    worker has twice a prefill one's (and so needs the room of two)."""
    given = -(-decode_tp // prefill_tp)
    return local_cluster_config(
        llama_dir, num_prefill=1 + given * num_moves, num_decode=1, latency_profile=True,
        rebalance=rebalance, prefill_tp=prefill_tp, decode_tp=decode_tp,
    )  # fmt: skip


def _num_ranks(actor: object) -> int:
    """The ranks of the worker an actor runs (on the actor)."""
    group = actor.worker.engine.group  # type: ignore[attr-defined]
    return 1 if group is None else int(group.size)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "num_moves"),
    [(1, 1, 2), (2, 2, 1), (1, 2, 1)],
    ids=["one-rank-two-moves", "two-ranks", "one-rank-to-two"],
)
def test_a_shift_to_long_outputs_moves_prefill_workers_to_decode_in_one_switch(
    ray_session: None,
    llama_dir: Path,
    caplog: pytest.LogCaptureFixture,
    prefill_tp: int,
    decode_tp: int,
    num_moves: int,
) -> None:
    """Workers of one rank: three prefill workers, idle once outputs lengthen, give two to
    the decode pool, whose TPOT SLO no number of workers makes, in one switch, each in its own
    process (the pool keeps one); of two ranks, two give one; to a decode worker of two ranks,
    two prefill workers of one make room for one, in new processes."""
    caplog.set_level(logging.WARNING, logger="router.rebalancer")
    rebalance = _rebalance(cooldown_s=3.0)
    config = _prefill_heavy(llama_dir, rebalance, prefill_tp, decode_tp, num_moves)
    cluster = Cluster.start(config)
    try:
        processes = {w.actor._actor_id for w in cluster.pool.workers.values()}
        rng = random.Random(0)
        done: list[tuple[list[int], int, list[int]]] = []
        asyncio.run(_phase(cluster, rng, 400, 2, time.monotonic() + 4.0, done))
        assert cluster.role_switches() == {}  # prompt-heavy: the prefill pool is busy
        num_prompt_heavy = len(done)

        switched = [f"decode-{i}" for i in range(1, 1 + num_moves)]
        # (a switch is counted once all its workers joined)
        _serve_until(cluster, rng, (4, 48), done, lambda: bool(cluster.role_switches()))
        assert cluster.role_switches() == {("prefill", "decode"): 1}, "no switch in 120 s"
        # well past the cooldown: nothing more moves (the prefill pool keeps its one worker,
        # and it is not the bottleneck)
        asyncio.run(_phase(cluster, rng, 4, 48, time.monotonic() + 2 * rebalance.cooldown_s, done))
        assert cluster.role_switches() == {("prefill", "decode"): 1}
        roles = sorted(s.role for s in cluster.worker_statuses() if s.alive)
        assert roles == ["decode"] * (1 + num_moves) + ["prefill"]
        serving = {w.actor._actor_id for w in cluster.pool.workers.values() if w.alive}
        # as logged (and read back by bench.rebalance): workers of one size change in their
        # own processes, their weights kept (none started), one line each; else a new worker
        # of the decode pool's size, in new processes, in place of two
        logged = switch_times(caplog.text)
        in_place = prefill_tp == decode_tp
        assert sorted(s["worker"] for s in logged) == switched
        for switch in logged:
            assert switch["same_process"] is in_place
            assert switch["in_place_of"].startswith("prefill-")
            assert len(switch["in_place_of"].split(", ")) == -(-decode_tp // prefill_tp)
        assert (serving == processes) is in_place
        assert len(serving - processes) == (0 if in_place else num_moves)
        # the new decode workers step on groups of the decode pool's ranks
        for worker in cluster.pool.workers.values():
            if worker.worker_id in switched:
                assert ray.get(worker.actor.__ray_call__.remote(_num_ranks)) == decode_tp
    finally:
        cluster.shutdown()

    assert num_prompt_heavy >= CLIENTS and len(done) > num_prompt_heavy
    _assert_as_offline(llama_dir, done, tensor_parallel=max(prefill_tp, decode_tp) > 1)


def test_a_switch_to_a_bigger_worker_ray_cannot_place_restores_the_old_role(
    ray_session: None,
    llama_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill workers of one rank, decode workers of two: when no node has room for the
    new decode worker's two ranks within ``place_timeout_s``, prefill workers start in the
    place of the two that left, the pools keep their sizes, and no request fails."""
    caplog.set_level(logging.WARNING, logger="router.rebalancer")
    # Ray places every group on this machine's Ray; a decode worker's is taken as never placed
    monkeypatch.setattr(
        WorkerLauncher, "placed", lambda self, slot, timeout_s: not slot.startswith("decode")
    )
    rebalance = _rebalance(cooldown_s=30.0, place_timeout_s=1.0)
    cluster = Cluster.start(_prefill_heavy(llama_dir, rebalance, 1, 2))
    try:
        rng = random.Random(1)
        done: list[tuple[list[int], int, list[int]]] = []
        _serve_until(cluster, rng, (4, 48), done, lambda: "took their place" in caplog.text)
        assert "took their place" in caplog.text, "no switch tried in 120 s"
        assert cluster.role_switches() == {}
        roles = sorted(s.role for s in cluster.worker_statuses() if s.alive)
        assert roles == ["decode", "prefill", "prefill", "prefill"]
        asyncio.run(_phase(cluster, rng, 4, 48, time.monotonic() + 1.0, done))  # still served
    finally:
        cluster.shutdown()
    _assert_as_offline(llama_dir, done, tensor_parallel=True)  # decode workers of two ranks


def test_a_decode_worker_of_two_ranks_makes_room_for_two_prefill_workers_of_one(
    ray_session: None, llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Prompt-heavy traffic under an out-of-reach TTFT SLO, decode workers of two ranks
    idle: one of them leaves and two prefill workers of one rank start in its room."""
    caplog.set_level(logging.WARNING, logger="router.rebalancer")
    rebalance = RebalanceConfig(
        slo_ttft_s=0.0005, slo_tpot_s=30.0, window_s=1.5, cooldown_s=30.0,
        donor_utilization_low=0.5, drain_timeout_s=20.0,
    )  # fmt: skip
    config = local_cluster_config(
        llama_dir, num_prefill=1, num_decode=2, latency_profile=True, rebalance=rebalance,
        prefill_tp=1, decode_tp=2,
    )  # fmt: skip
    cluster = Cluster.start(config)
    try:
        rng = random.Random(2)
        done: list[tuple[list[int], int, list[int]]] = []
        _serve_until(cluster, rng, (200, 2), done, lambda: bool(cluster.role_switches()))
        assert cluster.role_switches() == {("decode", "prefill"): 1}, "no switch in 120 s"
        roles = sorted(s.role for s in cluster.worker_statuses() if s.alive)
        assert roles == ["decode", "prefill", "prefill", "prefill"]
        (switch,) = switch_times(caplog.text)
        assert switch["in_place_of"].startswith("decode-") and not switch["same_process"]
        assert len(switch["worker"].split(", ")) == 2
        asyncio.run(_phase(cluster, rng, 200, 2, time.monotonic() + 1.0, done))  # all serve
    finally:
        cluster.shutdown()
    _assert_as_offline(llama_dir, done, tensor_parallel=True)  # decode workers of two ranks
