"""When a worker moves between the pools: only after the receiving pool has been under pressure
and the giving one idle for a whole window, never below one worker a pool, never again within
the cooldown."""

from __future__ import annotations

import pytest

from router.rebalance_policy import PoolSignals, RebalanceConfig, RebalancePolicy

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
    with pytest.raises(ValueError, match="--rebalance-window-s must be > 0"):
        RebalanceConfig(1.0, 0.05, window_s=0)
    with pytest.raises(ValueError, match="--slo-ttft-ms and --slo-tpot-ms > 0"):
        RebalanceConfig(0.0, 0.05)
    with pytest.raises(ValueError, match="must be below the switching one"):
        RebalanceConfig(1.0, 0.05, donor_pressure_low=0.9, pressure_high=0.8)
