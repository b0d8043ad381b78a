"""When a worker should move between the prefill and decode pools (``--rebalance``): the rule,
pure (fed the pools' signals and the time), with its settings. router/rebalancer.py reads the
signals and carries the switches out; its docstring tells the whole story.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class RebalanceConfig:
    slo_ttft_s: float
    slo_tpot_s: float
    window_s: float = 10.0  # a pool must be the bottleneck this long before a switch
    cooldown_s: float = 60.0  # after a switch, none for this long
    pressure_high: float = 0.8  # the receiving pool's predicted latency over its SLO
    donor_pressure_low: float = 0.5  # the giving pool's, at most
    donor_utilization_low: float = 0.5  # the giving pool's busy share of the window, at most
    drain_timeout_s: float = 30.0  # then what the leaving worker still holds is resumed elsewhere

    def __post_init__(self) -> None:
        if min(self.slo_ttft_s, self.slo_tpot_s) <= 0:
            raise ValueError("--rebalance needs --slo-ttft-ms and --slo-tpot-ms > 0")
        if self.window_s <= 0 or self.cooldown_s < 0 or self.drain_timeout_s < 0:
            raise ValueError(
                "--rebalance-window-s must be > 0, --rebalance-cooldown-s and "
                "--rebalance-drain-timeout-s >= 0"
            )
        if not 0 <= self.donor_pressure_low < self.pressure_high:
            raise ValueError(
                f"the donor pool's pressure bound ({self.donor_pressure_low}) must be below the "
                f"switching one ({self.pressure_high})"
            )


@dataclass(frozen=True, slots=True)
class PoolSignals:
    num_workers: Mapping[str, int]  # in rotation and not draining, by role
    pressure: Mapping[str, float]  # predicted latency over its SLO, by role
    utilization: Mapping[str, float]  # busy share of the last interval, by role


@dataclass(frozen=True, slots=True)
class Switch:
    from_role: str
    to_role: str
    reason: str


class RebalancePolicy:
    """When to switch (pure: fed signals and the time, no cluster)."""

    def __init__(self, config: RebalanceConfig) -> None:
        self.config = config
        self._last_switch_at = float("-inf")
        self._since: dict[tuple[str, str], float] = {}  # direction -> when it started to hold

    def decide(self, now: float, signals: PoolSignals) -> Switch | None:
        config = self.config
        if now - self._last_switch_at < config.cooldown_s:
            self._since.clear()
            return None
        for donor, receiver in (("prefill", "decode"), ("decode", "prefill")):
            holds = (
                signals.pressure[receiver] >= config.pressure_high
                and signals.pressure[donor] <= config.donor_pressure_low
                and signals.utilization[donor] <= config.donor_utilization_low
                and signals.num_workers[donor] > 1
            )
            if not holds:
                self._since.pop((donor, receiver), None)
                continue
            since = self._since.setdefault((donor, receiver), now)
            if now - since >= config.window_s:
                return Switch(
                    donor,
                    receiver,
                    f"{receiver} pressure {signals.pressure[receiver]:.2f} (>= "
                    f"{config.pressure_high}) while {donor} pressure "
                    f"{signals.pressure[donor]:.2f} and utilization "
                    f"{signals.utilization[donor]:.2f}, for {now - since:.0f} s",
                )
        return None

    def switched(self, now: float) -> None:
        self._last_switch_at = now
        self._since.clear()
