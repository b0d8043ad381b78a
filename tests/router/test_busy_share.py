"""The rebalancer's utilization: a pool's busy share over the whole window, not over one
tick, whose difference swings with the bursts its workers' reports arrive in."""

from __future__ import annotations

import pytest

from router.busy_share import BusyShare


def test_bursty_reports_give_the_share_over_the_window() -> None:
    """A worker busy 0.2 s of each second, reported once a second, ticks every 0.25 s: one
    tick's difference would read 0.8 (the report's) or 0 (the others); the window's, 0.2."""
    busy = BusyShare(window_s=2.0)
    total = 0.0
    shares = []
    for tick in range(40):
        now = tick * 0.25
        if tick % 4 == 0:
            total += 0.2
        busy.update(now, {"w": total})
        shares.append(busy.share(["w"]))
    assert shares[0] is None  # one sample: no interval yet
    assert all(s == pytest.approx(0.2, abs=0.05) for s in shares[8:]), shares[8:]


def test_a_new_worker_counts_from_its_first_sample_and_a_pool_of_none_is_idle() -> None:
    busy = BusyShare(window_s=1.0)
    busy.update(0.0, {"a": 5.0})
    busy.update(0.5, {"a": 5.5, "b": 100.0})  # b: a worker with a past, just joined
    busy.update(1.0, {"a": 6.0, "b": 100.25})
    assert busy.share(["a"]) == pytest.approx(1.0)
    assert busy.share(["b"]) == pytest.approx(0.5)  # 0.25 s of its 0.5 s, not its 100 s
    assert busy.share(["a", "b"]) == pytest.approx((1.0 + 0.25) / (1.0 + 0.5))
    assert busy.share([]) == 0.0
    busy.update(2.5, {"a": 6.0, "b": 100.25})  # the window (1 s) holds the last tick alone
    assert busy.share(["a", "b"]) == 0.0
