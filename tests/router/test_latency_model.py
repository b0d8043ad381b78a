"""The latency model: step times and hand-off times fitted from the timings workers report."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from engine.messages import BlockWait, StepTiming, TransferTiming
from router.latency_model import (
    MIN_STEPS,
    MIN_TAIL_RESIDUALS,
    PATH_HORIZON_S,
    PREDICTION_RATIO_BUCKETS,
    WAIT_HORIZON_S,
    LatencyModel,
    RecentPath,
    StepShape,
    fit_nonnegative,
)

# a worker whose steps cost 4 ms + 50 us a prompt token + 2 ns an attention pair + 300 us a
# decode row + 20 ns a KV token read
TRUE = (4e-3, 50e-6, 2e-9, 300e-6, 20e-9)


def _seconds(shape: StepShape) -> float:
    return sum(c * x for c, x in zip(TRUE, shape.features(), strict=True))


def _timings(count: int, seed: int = 0, noise: float = 0.0) -> list[StepTiming]:
    rng = random.Random(seed)
    timings = []
    for _ in range(count):
        prefill = rng.choice([0, 0, rng.randrange(1, 512)])
        start = rng.randrange(0, 1024) if prefill else 0
        attention = prefill * start + prefill * (prefill + 1) // 2
        decode = rng.randrange(0, 32)
        context = decode * rng.randrange(16, 2048)
        shape = StepShape(prefill, attention, decode, context)
        seconds = _seconds(shape) * (1 + rng.uniform(-noise, noise))
        timings.append(StepTiming(prefill, attention, decode, context, seconds))
    return timings


def test_a_worker_fit_recovers_its_step_costs_from_mixed_steps() -> None:
    model = LatencyModel()
    model.observe("w0", "decode", _timings(300))
    cost = model.step_cost("w0", "decode")
    assert cost is not None and cost.num_samples == 300
    fitted = (
        cost.overhead_s,
        cost.per_prefill_token_s,
        cost.per_attention_pair_s,
        cost.per_decode_token_s,
        cost.per_context_token_s,
    )
    assert fitted == pytest.approx(TRUE, rel=1e-3)


def test_with_noise_the_fit_predicts_unseen_steps_within_a_few_percent() -> None:
    model = LatencyModel()
    model.observe("w0", "decode", _timings(400, noise=0.1))
    cost = model.step_cost("w0", "decode")
    assert cost is not None
    for timing in _timings(50, seed=7):
        shape = StepShape(
            timing.num_prefill_tokens,
            timing.prefill_attention_tokens,
            timing.num_decode_tokens,
            timing.decode_context_tokens,
        )
        assert cost.seconds(shape) == pytest.approx(_seconds(shape), rel=0.05)


def test_prompt_steps_of_one_size_still_fit_their_own_time() -> None:
    """Every step a full budget of prompt tokens: overhead and per-token time move together
    (collinear); the ridge splits them, and a step of that size is still predicted right."""
    shape = StepShape(512, 512 * 513 // 2)
    steps = [StepTiming(512, 512 * 513 // 2, 0, 0, _seconds(shape))] * 20
    model = LatencyModel()
    model.observe("p0", "prefill", steps)
    cost = model.step_cost("p0", "prefill")
    assert cost is not None
    assert cost.seconds(shape) == pytest.approx(_seconds(shape), rel=1e-3)
    assert min(cost.overhead_s, cost.per_prefill_token_s, cost.per_attention_pair_s) >= 0


def test_coefficients_stay_non_negative() -> None:
    """Step times that fall as batches grow (noise, a warm cache) would fit a negative cost
    per row: it is dropped, and the rest fitted without it."""
    rows = [(1.0, float(n)) for n in range(1, 20)]
    targets = [0.01 - 0.0001 * n for n in range(1, 20)]
    coefficients = fit_nonnegative(rows, targets)
    assert coefficients[1] == 0.0
    assert coefficients[0] == pytest.approx(sum(targets) / len(targets))


def test_each_reported_step_is_counted_by_its_time_over_the_fit_it_came_to() -> None:
    """Steps before any fit are not counted; steps 1.9 times as slow as the fit predicts (a
    busy host's) land in the bucket up to 2, by role; a worker without a fit of its own is
    measured against its role's."""
    model = LatencyModel()
    model.observe("d0", "decode", _timings(100))
    assert model.step_ratios() == {}  # no fit yet when they came
    assert model.step_cost("d0", "decode") is not None  # (a forecast fits it)
    fast = [replace(t, seconds=0.95 * t.seconds) for t in _timings(5, seed=2)]
    model.observe("d1", "decode", fast)  # d1 against the role's fit
    slow = [replace(t, seconds=1.9 * t.seconds) for t in _timings(10, seed=1)]
    model.observe("d0", "decode", slow)
    ratios = model.step_ratios()["decode"]
    assert ratios.bucket_counts[PREDICTION_RATIO_BUCKETS.index(2.0)] == 10
    assert ratios.bucket_counts[PREDICTION_RATIO_BUCKETS.index(1.0)] == 5
    assert sum(ratios.bucket_counts) == 15
    assert ratios.sum_ratio == pytest.approx(1.9 * 10 + 0.95 * 5, rel=1e-2)


def test_a_worker_with_few_steps_borrows_its_roles_fit_and_forgetting_drops_its_own() -> None:
    model = LatencyModel()
    assert model.step_cost("d0", "decode") is None  # nothing reported yet
    model.observe("d0", "decode", _timings(100))
    model.observe("d1", "decode", _timings(MIN_STEPS - 1, seed=3))
    own = model.step_cost("d0", "decode")
    borrowed = model.step_cost("d1", "decode")
    assert borrowed is not None and borrowed.num_samples == 100 + MIN_STEPS - 1
    assert own is not None and own.num_samples == 100
    assert model.step_cost("p0", "prefill") is None  # no prefill worker reported
    model.forget("d0")
    after = model.step_cost("d0", "decode")
    assert after is not None and after.num_samples == borrowed.num_samples  # its role's


def test_hand_offs_fit_latency_and_bandwidth_per_transport() -> None:
    model = LatencyModel()
    assert model.transfer_cost() is None
    gloo = [
        TransferTiming(blocks, blocks * 4096, 0.002 + blocks * 4096 / 1e9, "gloo")
        for blocks in (1, 4, 16, 64)
    ]
    shm = [TransferTiming(b, b * 4096, 0.0005 + b * 4096 / 5e9, "shm") for b in (2, 8)]
    model.observe("p0", "prefill", [], gloo + shm)
    cost = model.transfer_cost("gloo")
    assert cost is not None
    assert cost.latency_s == pytest.approx(0.002, rel=1e-3)
    assert cost.per_byte_s == pytest.approx(1e-9, rel=1e-3)
    assert cost.bytes_per_block == 4096
    assert cost.seconds_for_blocks(10) == pytest.approx(0.002 + 40960 / 1e9, rel=1e-3)
    assert model.transfer_cost() == cost  # the transport seen most
    shm_cost = model.transfer_cost("shm")
    assert shm_cost is not None and shm_cost.per_byte_s == pytest.approx(1 / 5e9, rel=1e-3)


def test_a_decode_workers_wait_for_blocks_is_the_mean_of_its_recent_hand_offs() -> None:
    clock = [100.0]
    model = LatencyModel(clock=lambda: clock[0])
    assert model.reserve_wait("d0") == 0.0

    def hand_off(decode: str, wait_s: float, blocks: int = 4) -> TransferTiming:
        transport = "shm" if blocks else ""
        return TransferTiming(blocks, blocks * 4096, 1e-3, transport, decode, wait_s)

    model.observe("p0", "prefill", [], [hand_off("d0", 0.2), hand_off("d0", 0.4)])
    model.observe("p1", "prefill", [], [hand_off("d1", 0.0), hand_off("d0", 10.0, blocks=0)])
    assert model.reserve_wait("d0") == pytest.approx((0.2 + 0.4 + 10.0) / 3)
    assert model.reserve_wait("d1") == 0.0
    # a hand-off that moved nothing is no transfer to fit
    cost = model.transfer_cost()
    assert cost is not None and cost.num_samples == 3 and cost.bytes_per_block == 4096
    clock[0] += WAIT_HORIZON_S / 2
    model.observe("p0", "prefill", [], [hand_off("d0", 0.0)])
    clock[0] += WAIT_HORIZON_S / 2 + 0.1  # the first three are now too old
    assert model.reserve_wait("d0") == 0.0
    model.observe("p0", "prefill", [], [hand_off("d0", 3.0)])
    assert model.reserve_wait("d0") == pytest.approx(1.5)
    model.forget("d0")
    assert model.reserve_wait("d0") == 0.0


def test_a_hand_off_still_waiting_for_blocks_counts_before_it_ends() -> None:
    """A decode worker whose cache filled shows at the next report of a prefill worker whose
    hand-off waits for it, not once that wait ends; the wait ended, the report drops it."""
    model = LatencyModel(clock=lambda: 100.0)
    model.observe("p0", "prefill", [], [TransferTiming(4, 4 * 4096, 1e-3, "shm", "d0", 0.5)])
    assert model.reserve_wait("d0") == pytest.approx(0.5)
    model.observe_waiting("p0", [BlockWait("d0", 2.0), BlockWait("d0", 0.3)])
    model.observe_waiting("p1", [BlockWait("d0", 1.2), BlockWait("d1", 0.1)])
    assert model.reserve_wait("d0") == pytest.approx(2.0)  # the longest still waiting
    assert model.reserve_wait("d1") == pytest.approx(0.1)
    model.observe_waiting("p0", [])  # its hand-offs got their blocks
    assert model.reserve_wait("d0") == pytest.approx(1.2)
    model.forget("p1")  # a prefill worker gone: its waits go with it
    assert model.reserve_wait("d0") == pytest.approx(0.5)
    model.observe_waiting("p0", [BlockWait("d1", 3.0)])
    model.forget("d1")  # a decode worker gone: nothing waits for it
    assert model.reserve_wait("d1") == 0.0


def test_the_path_corrections_and_tails_count_only_recent_requests() -> None:
    """A burst's first requests, 600 ms later than their steps said, must not hold the
    corrections once newer ones finish, nor for good when none does (admission refusing all
    on them would see no request finish to correct them)."""
    clock = [100.0]
    model = LatencyModel(clock=lambda: clock[0])
    for _ in range(12):
        model.observe_request(0.600, 0.002)
    assert model.recent_path().corrections() == pytest.approx((0.600, 0.002))
    assert model.recent_path().num_requests == 12
    clock[0] += PATH_HORIZON_S + 0.1
    assert model.recent_path() == RecentPath()
    for i in range(20):
        model.observe_request(0.110 if i % 10 == 9 else 0.010, 0.001)
    path = model.recent_path()
    assert path.corrections() == pytest.approx((0.010, 0.001))
    # the 0.9 quantile of the twenty (10 % of the way from 10 to 110 ms) less their median
    assert path.tails(0.9) == pytest.approx((0.010, 0.0), abs=1e-9)
    # the 0.95 quantile: between the two slow ones
    assert path.tails(0.95) == pytest.approx((0.100, 0.0), abs=1e-9)


def test_a_tail_needs_enough_requests() -> None:
    model = LatencyModel(clock=lambda: 100.0)
    for residual in range(MIN_TAIL_RESIDUALS - 1):
        model.observe_request(residual * 0.1, None)
    assert model.recent_path().tails(0.9) == (0.0, 0.0)
    model.observe_request(5.0, None)
    ttft_tail, tpot_tail = model.recent_path().tails(0.9)
    assert ttft_tail > 0 and tpot_tail == 0.0


def test_the_first_gaps_excess_is_the_median_of_recent_requests() -> None:
    clock = [100.0]
    model = LatencyModel(clock=lambda: clock[0])
    assert model.recent_path().first_gap_excess_s == 0.0
    for excess in (0.030, 0.040, 0.200):
        model.observe_request(0.0, 0.001, excess)
    model.observe_request(0.0, None)  # (one token: no gaps known)
    assert model.recent_path().first_gap_excess_s == pytest.approx(0.040)
    clock[0] += PATH_HORIZON_S + 0.1
    assert model.recent_path().first_gap_excess_s == 0.0
