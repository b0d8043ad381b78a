"""When a worker moves between the pools: only after the receiving pool has been under pressure
and the giving one idle for a whole window, never below one worker a pool, never again within
the cooldown."""

from __future__ import annotations

import pytest

from router.rebalance_policy import (
    Exchange,
    PoolSignals,
    RebalanceConfig,
    RebalancePolicy,
    exchange,
)

CONFIG = RebalanceConfig(slo_ttft_s=1.0, slo_tpot_s=0.05, window_s=10.0, cooldown_s=60.0)


def _signals(
    *,
    prefill: float = 0.2,
    decode: float = 0.2,
    prefill_busy: float = 0.1,
    decode_busy: float = 0.1,
    num_prefill: int = 2,
    num_decode: int = 2,
) -> PoolSignals:
    return PoolSignals(
        {"prefill": num_prefill, "decode": num_decode},
        {"prefill": prefill, "decode": decode},
        {"prefill": prefill_busy, "decode": decode_busy},
    )


def test_a_bottleneck_sustained_for_the_window_moves_one_worker() -> None:
    policy = RebalancePolicy(CONFIG)
    decode_bound = _signals(decode=1.2, decode_busy=0.95)
    assert policy.decide(0.0, decode_bound) is None
    assert policy.decide(9.9, decode_bound) is None
    switch = policy.decide(10.0, decode_bound)
    assert switch is not None and (switch.from_role, switch.to_role) == ("prefill", "decode")
    assert "decode pressure 1.20" in switch.reason


def test_a_break_in_the_window_starts_it_again() -> None:
    policy = RebalancePolicy(CONFIG)
    decode_bound = _signals(decode=1.2)
    assert policy.decide(0.0, decode_bound) is None
    assert policy.decide(6.0, _signals(decode=0.7)) is None  # below the threshold a moment
    assert policy.decide(12.0, decode_bound) is None
    assert policy.decide(21.9, decode_bound) is None
    assert policy.decide(22.0, decode_bound) is not None


def test_no_switch_when_the_giving_pool_is_busy_or_near_its_own_slo() -> None:
    policy = RebalancePolicy(CONFIG)
    for t in range(0, 40, 5):
        assert policy.decide(float(t), _signals(decode=1.5, prefill_busy=0.8)) is None
        assert policy.decide(float(t), _signals(decode=1.5, prefill=0.6)) is None


def test_a_pool_keeps_one_worker() -> None:
    policy = RebalancePolicy(CONFIG)
    for t in range(0, 40, 5):
        assert policy.decide(float(t), _signals(prefill=2.0, num_decode=1)) is None


def test_after_a_switch_none_follows_within_the_cooldown_in_either_direction() -> None:
    policy = RebalancePolicy(CONFIG)
    prefill_bound = _signals(prefill=1.1, prefill_busy=0.9)
    assert policy.decide(0.0, prefill_bound) is None
    switch = policy.decide(10.0, prefill_bound)
    assert switch is not None and (switch.from_role, switch.to_role) == ("decode", "prefill")
    policy.switched(11.0)
    decode_bound = _signals(decode=1.1, decode_busy=0.9)
    for t in range(12, 71):
        assert policy.decide(float(t), decode_bound) is None
    assert policy.decide(71.0, decode_bound) is None  # the window starts after the cooldown
    assert policy.decide(81.0, decode_bound) is not None


def test_bad_settings_name_their_flags() -> None:
    with pytest.raises(
        ValueError, match="--rebalance-window-s and --rebalance-place-timeout-s must be > 0"
    ):
        RebalanceConfig(1.0, 0.05, window_s=0)
    with pytest.raises(ValueError, match="--rebalance-place-timeout-s must be > 0"):
        RebalanceConfig(1.0, 0.05, place_timeout_s=0)
    with pytest.raises(ValueError, match="--slo-ttft-ms and --slo-tpot-ms > 0"):
        RebalanceConfig(0.0, 0.05)
    with pytest.raises(ValueError, match="must be below the switching one"):
        RebalanceConfig(1.0, 0.05, donor_pressure_low=0.9, pressure_high=0.8)


def _switch_at(policy: RebalancePolicy, start: float, signals: PoolSignals) -> float:
    """Hold ``signals`` from ``start`` until the policy switches; when it switched."""
    t = start
    while policy.decide(t, signals) is None:
        t += 1.0
        assert t < start + 10_000, "no switch"
    policy.switched(t)
    return t


def test_a_switch_that_relieved_its_pool_leaves_the_next_one_free() -> None:
    policy = RebalancePolicy(CONFIG)
    at = _switch_at(policy, 0.0, _signals(decode=1.5, num_prefill=3))
    assert at == 10.0
    relieved = _signals(decode=1.2, num_prefill=2)  # lower, still over: another is wanted
    assert policy.decide(at + 60.0, relieved) is None
    (verdict,) = policy.take_verdicts()
    assert verdict.helped and verdict.pressure_before == 1.5 and verdict.pressure_after == 1.2
    assert "relieved the decode pool (step pressure 1.50 -> 1.20)" in verdict.describe()
    assert _switch_at(policy, at + 61.0, relieved) == at + 70.0  # cooldown, then the window


def test_a_switch_that_did_not_relieve_its_pool_backs_off_that_direction_only() -> None:
    policy = RebalancePolicy(CONFIG)
    stuck = _signals(decode=1.5, num_prefill=3)
    at = _switch_at(policy, 0.0, stuck)
    assert policy.decide(at + 60.0, stuck) is None  # judged: not relieved
    (verdict,) = policy.take_verdicts()
    assert not verdict.helped and verdict.next_allowed_at == at + 60.0 + 2 * 60.0
    assert "did not relieve" in verdict.describe()
    # the same way again only after 2 more cooldowns (and a window)
    second = _switch_at(policy, at + 61.0, stuck)
    assert second == verdict.next_allowed_at + 10.0
    # still no relief: 4 cooldowns next, then at most 8
    waits = []
    for _ in range(3):
        assert policy.decide(second + 60.0, stuck) is None
        (verdict,) = policy.take_verdicts()
        waits.append(verdict.next_allowed_at - (second + 60.0))
        second = _switch_at(policy, second + 61.0, stuck)
    assert waits == [4 * 60.0, 8 * 60.0, 8 * 60.0]


def test_a_switch_is_judged_on_the_pressure_its_step_timings_predict() -> None:
    """The path's correction, learned from finished requests, lags a switch: at the end of the
    cooldown it still holds requests served before it. The verdict reads the steps' pressure."""
    policy = RebalancePolicy(CONFIG)

    def signals(pressure: float, step_pressure: float, num_prefill: int) -> PoolSignals:
        return PoolSignals(
            {"prefill": num_prefill, "decode": 2},
            {"prefill": 0.2, "decode": pressure},
            {"prefill": 0.1, "decode": 0.9},
            {"prefill": 0.1, "decode": step_pressure},
        )

    at = _switch_at(policy, 0.0, signals(1.5, 1.2, 3))
    # the steps see the new worker's relief at once; the path's correction has not caught up
    policy.decide(at + 60.0, signals(1.5, 0.7, 2))
    (verdict,) = policy.take_verdicts()
    assert verdict.helped and (verdict.pressure_before, verdict.pressure_after) == (1.2, 0.7)
    # and one the steps show no relief from backs off, whatever the path's correction does
    at = _switch_at(policy, at + 61.0, signals(1.5, 1.2, 2))
    policy.decide(at + 60.0, signals(0.9, 1.2, 1))
    assert not policy.take_verdicts()[0].helped


def test_a_backed_off_direction_leaves_the_other_free() -> None:
    policy = RebalancePolicy(CONFIG)
    at = _switch_at(policy, 0.0, _signals(decode=1.5, num_prefill=3))
    prefill_bound = _signals(prefill=1.5, prefill_busy=0.9, decode=1.5, num_prefill=2)
    assert policy.decide(at + 60.0, prefill_bound) is None
    assert not policy.take_verdicts()[0].helped
    # decode's pressure is not low enough to give a worker; once it is, prefill gets one
    eased = _signals(prefill=1.5, prefill_busy=0.9, decode=0.3, num_prefill=2, num_decode=3)
    for t in range(61, 71):
        assert policy.decide(at + t, eased) is None
    switch = policy.decide(at + 71.0, eased)
    assert switch is not None and (switch.from_role, switch.to_role) == ("decode", "prefill")


def test_a_relieving_switch_clears_the_back_off() -> None:
    policy = RebalancePolicy(CONFIG)
    stuck = _signals(decode=1.5, num_prefill=4)
    at = _switch_at(policy, 0.0, stuck)
    policy.decide(at + 60.0, stuck)
    assert not policy.take_verdicts()[0].helped
    at = _switch_at(policy, at + 61.0, stuck)  # after the back-off
    policy.decide(at + 60.0, _signals(decode=0.9, num_prefill=3))
    assert policy.take_verdicts()[0].helped
    assert _switch_at(policy, at + 61.0, stuck) == at + 70.0


def test_bad_relief_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_relief"):
        RebalanceConfig(1.0, 0.05, min_relief=1.0)
    with pytest.raises(ValueError, match="max_backoff"):
        RebalanceConfig(1.0, 0.05, max_backoff=-1)


def test_pools_of_different_sizes_exchange_workers_by_their_ranks() -> None:
    """TP 1 to TP 2 takes two workers for one; TP 4 to TP 2 starts two for one; as many
    ranks one for one. A pool gives workers only if it keeps one."""
    assert exchange(1, 2) == Exchange(2, 1) and exchange(4, 2) == Exchange(1, 2)
    assert exchange(2, 2) == Exchange(1, 1) and exchange(2, 4) == Exchange(2, 1)
    assert exchange(2, 3) == Exchange(2, 1)  # 4 ranks of room hold one worker of 3
    with pytest.raises(ValueError, match="at least one rank"):
        exchange(0, 2)
    policy = RebalancePolicy(CONFIG, {("prefill", "decode"): exchange(1, 2)})
    two = _signals(decode=1.1, decode_busy=0.9)  # 2 prefill workers: giving 2 leaves none
    assert all(policy.decide(float(t), two) is None for t in range(0, 30))
    three = _signals(decode=1.1, decode_busy=0.9, num_prefill=3)
    switch = next(s for t in range(30, 60) if (s := policy.decide(float(t), three)) is not None)
    assert (switch.from_role, switch.to_role, switch.exchange) == (
        "prefill",
        "decode",
        Exchange(2, 1),
    )


def _first_switch(policy: RebalancePolicy, signals: PoolSignals) -> Exchange:
    """The exchange of the switch ``signals`` held for the window bring about."""
    switch = next(s for t in range(0, 30) if (s := policy.decide(float(t), signals)) is not None)
    return switch.exchange


def test_a_large_shift_moves_as_many_workers_as_settle_the_pool_in_one_switch() -> None:
    """The receiving pool's pressure spread over its workers and those moved: 2.0 on one
    decode worker wants two more to come to 0.7 (2.0 / 3); the idle prefill pool of five keeps
    three, at 0.2 * 5 / 3 of pressure. A shift one more worker settles takes one."""
    policy = RebalancePolicy(CONFIG)
    shift = _signals(decode=2.0, decode_busy=1.0, num_prefill=5, num_decode=1)
    switch = next(s for t in range(0, 30) if (s := policy.decide(float(t), shift)) is not None)
    assert switch.exchange == Exchange(2, 2) and "2 moves at once" in switch.reason
    slight = _signals(decode=1.2, decode_busy=1.0, num_prefill=5, num_decode=1)
    assert _first_switch(RebalancePolicy(CONFIG), slight) == Exchange(1, 1)
    # pools of different sizes: each move is one exchange (two workers of one rank for one
    # of two); seven prefill workers keep three
    two_for_one = RebalancePolicy(CONFIG, {("prefill", "decode"): exchange(1, 2)})
    wide = _signals(decode=2.0, decode_busy=1.0, num_prefill=7, num_decode=1)
    assert _first_switch(two_for_one, wide) == Exchange(4, 2)


def test_moves_stop_where_the_giving_pool_would_be_strained_or_emptied() -> None:
    """Three prefill workers, a third busy: moving two would leave one at 0.3 * 3 = 0.9 of
    its capacity (above 0.7): one moves, however far the decode pool is from settling; at
    0.2 busy two move (0.6), never the third (the pool keeps one); ``max_moves`` bounds them."""
    far = {"decode": 3.0, "decode_busy": 1.0, "num_prefill": 3, "num_decode": 1}
    assert _first_switch(RebalancePolicy(CONFIG), _signals(**far, prefill_busy=0.3)) == Exchange(
        1, 1
    )
    assert _first_switch(RebalancePolicy(CONFIG), _signals(**far, prefill_busy=0.2)) == Exchange(
        2, 2
    )
    # the giving pool's pressure counts as its utilization does
    near = _signals(**far, prefill=0.3, prefill_busy=0.1)
    assert _first_switch(RebalancePolicy(CONFIG), near) == Exchange(1, 1)
    bounded = RebalanceConfig(1.0, 0.05, window_s=10.0, max_moves=1)
    idle = _signals(decode=3.0, decode_busy=1.0, num_prefill=8, num_decode=1)
    assert _first_switch(RebalancePolicy(bounded), idle) == Exchange(1, 1)
    assert _first_switch(RebalancePolicy(CONFIG), idle) == Exchange(4, 4)  # 3.0 / 5 <= 0.7
    with pytest.raises(ValueError, match="--rebalance-max-moves must be >= 1, got 0"):
        RebalanceConfig(1.0, 0.05, max_moves=0)
    with pytest.raises(ValueError, match=r"settle_pressure must be in \(0, 0.8\]"):
        RebalanceConfig(1.0, 0.05, settle_pressure=0.9)
