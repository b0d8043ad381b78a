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
    # pools of different sizes: a worker of the other pool's size not placed by Ray in this
    # long is given up, and one of the old role starts instead
    place_timeout_s: float = 120.0
    # a switch helped when, at the end of its cooldown, the receiving pool's pressure (as its
    # step timings predict it) is at most (1 - this) of what it was; after k in a row that did
    # not, the next switch that way waits 2 ** k more cooldowns (k at most max_backoff); one
    # that helped clears k
    min_relief: float = 0.1
    max_backoff: int = 3
    # how many moves (one worker for one, or one exchange between pools of different sizes) a
    # switch makes: the fewest that bring the receiving pool's projected pressure to
    # ``settle_pressure``, as many as leave the giving pool's projected pressure and
    # utilization at most that; one at least, ``max_moves`` at most (None: no bound)
    settle_pressure: float = 0.7
    max_moves: int | None = None

    def __post_init__(self) -> None:
        if min(self.slo_ttft_s, self.slo_tpot_s) <= 0:
            raise ValueError("--rebalance needs --slo-ttft-ms and --slo-tpot-ms > 0")
        if (
            self.window_s <= 0
            or min(self.cooldown_s, self.drain_timeout_s) < 0
            or self.place_timeout_s <= 0
        ):
            raise ValueError(
                "--rebalance-window-s and --rebalance-place-timeout-s must be > 0, "
                "--rebalance-cooldown-s and --rebalance-drain-timeout-s >= 0"
            )
        if not 0 <= self.min_relief < 1 or self.max_backoff < 0:
            raise ValueError("min_relief must be in [0, 1) and max_backoff >= 0")
        if not 0 < self.settle_pressure <= self.pressure_high:
            raise ValueError(
                f"settle_pressure must be in (0, {self.pressure_high}] (the switching "
                f"pressure), got {self.settle_pressure}"
            )
        if self.max_moves is not None and self.max_moves < 1:
            raise ValueError(f"--rebalance-max-moves must be >= 1, got {self.max_moves}")
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
    # the pressure as the workers' step timings alone predict it, by role: what a switch is
    # judged on (the path's correction, learned from finished requests, still holds those
    # served before the switch at its cooldown's end); None: ``pressure``
    step_pressure: Mapping[str, float] | None = None

    def judged(self, role: str) -> float:
        """The pressure a switch into ``role``'s pool is judged on."""
        return (self.pressure if self.step_pressure is None else self.step_pressure)[role]


@dataclass(frozen=True, slots=True)
class Exchange:
    """How many workers a switch takes from the giving pool, and how many of the receiving
    pool's size it starts on their ranks' room: one for one where the pools' workers have as
    many ranks; else as many givers as one receiver needs, and as many receivers as they make
    room for."""

    given: int
    started: int

    def times(self, moves: int) -> Exchange:
        """``moves`` of this exchange at once."""
        return Exchange(self.given * moves, self.started * moves)


def exchange(giver_ranks: int, receiver_ranks: int) -> Exchange:
    """The exchange between workers of ``giver_ranks`` and of ``receiver_ranks`` ranks: TP 1
    to TP 2 gives two workers for one, TP 4 to TP 2 one for two."""
    if min(giver_ranks, receiver_ranks) < 1:
        raise ValueError(f"workers have at least one rank, not {giver_ranks} and {receiver_ranks}")
    given = -(-receiver_ranks // giver_ranks)
    return Exchange(given, given * giver_ranks // receiver_ranks)


ONE_FOR_ONE = Exchange(1, 1)


@dataclass(frozen=True, slots=True)
class Switch:
    from_role: str
    to_role: str
    reason: str
    exchange: Exchange = ONE_FOR_ONE  # all its moves': workers that leave, workers that start


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a switch relieved the pool it fed, judged at the end of its cooldown."""

    from_role: str
    to_role: str
    # the receiving pool's, as its step timings predict it: when the switch was decided, and at
    # the end of its cooldown
    pressure_before: float
    pressure_after: float
    helped: bool
    next_allowed_at: float  # the earliest time of the next switch that way

    def describe(self) -> str:
        outcome = "relieved" if self.helped else "did not relieve"
        return (
            f"the {self.from_role} -> {self.to_role} switch {outcome} the {self.to_role} pool "
            f"(step pressure {self.pressure_before:.2f} -> {self.pressure_after:.2f})"
        )


class RebalancePolicy:
    """When to switch (pure: fed signals and the time, no cluster)."""

    def __init__(
        self, config: RebalanceConfig, exchanges: Mapping[tuple[str, str], Exchange] | None = None
    ) -> None:
        """``exchanges``: by direction (giving role, receiving role), the workers a switch
        takes and starts (default: one for one)."""
        self.config = config
        self._exchanges = dict(exchanges or {})
        self._last_switch_at = float("-inf")
        self._since: dict[tuple[str, str], float] = {}  # direction -> when it started to hold
        # the switch decided (direction, the receiving pool's judged pressure then), until
        # carried out; then the switch carried out, until judged
        self._decided: tuple[tuple[str, str], float] | None = None
        self._on_trial: tuple[tuple[str, str], float] | None = None
        self._backoff: dict[tuple[str, str], int] = {}  # direction -> switches in a row not helping
        self._blocked_until: dict[tuple[str, str], float] = {}
        self._verdicts: list[Verdict] = []  # judged, not yet taken

    def decide(self, now: float, signals: PoolSignals) -> Switch | None:
        config = self.config
        if now - self._last_switch_at < config.cooldown_s:
            self._since.clear()
            return None
        if self._on_trial is not None:
            self._judge(now, signals)
        for donor, receiver in (("prefill", "decode"), ("decode", "prefill")):
            if now < self._blocked_until.get((donor, receiver), float("-inf")):
                self._since.pop((donor, receiver), None)
                continue
            trade = self._exchanges.get((donor, receiver), ONE_FOR_ONE)
            holds = (
                signals.pressure[receiver] >= config.pressure_high
                and signals.pressure[donor] <= config.donor_pressure_low
                and signals.utilization[donor] <= config.donor_utilization_low
                and signals.num_workers[donor] > trade.given  # it keeps one at least
            )
            if not holds:
                self._since.pop((donor, receiver), None)
                continue
            since = self._since.setdefault((donor, receiver), now)
            if now - since >= config.window_s:
                self._decided = ((donor, receiver), signals.judged(receiver))
                moves = self._moves(signals, donor, receiver, trade)
                return Switch(
                    donor,
                    receiver,
                    f"{receiver} pressure {signals.pressure[receiver]:.2f} (>= "
                    f"{config.pressure_high}) while {donor} pressure "
                    f"{signals.pressure[donor]:.2f} and utilization "
                    f"{signals.utilization[donor]:.2f}, for {now - since:.0f} s"
                    + (f"; {moves} moves at once" if moves > 1 else ""),
                    trade.times(moves),
                )
        return None

    def _moves(self, signals: PoolSignals, donor: str, receiver: str, trade: Exchange) -> int:
        """How many of ``trade`` a switch makes: the fewest that bring the receiving pool's
        projected pressure to ``settle_pressure``, as many as keep the giving pool's projected
        pressure and utilization at most that and a worker in it (one at least, ``max_moves``
        at most). A pool's load is taken to spread evenly over its workers: k more workers
        scale its pressure and utilization by n / (n + k). A pressure has parts that more
        workers do not divide (a prompt's own prefill, a decode step's fixed cost), so the
        projection overstates the relief a move brings the receiving pool and the strain it
        puts on the giving one: it errs towards fewer moves, the rest left to the next switch."""
        config = self.config
        num_donors = signals.num_workers[donor]
        num_receivers = max(1, signals.num_workers[receiver])
        receiving_load = signals.pressure[receiver] * num_receivers
        giving_load = max(signals.pressure[donor], signals.utilization[donor]) * num_donors
        moves = 1
        while config.max_moves is None or moves < config.max_moves:
            if receiving_load / (num_receivers + trade.started * moves) <= config.settle_pressure:
                break  # the receiving pool settles with these
            left = num_donors - trade.given * (moves + 1)
            if left < 1 or giving_load / left > config.settle_pressure:
                break  # one more would strain the giving pool (or empty it)
            moves += 1
        return moves

    def switched(self, now: float) -> None:
        """The switch decided last was carried out (or tried) at ``now``."""
        self._last_switch_at = now
        self._since.clear()
        self._on_trial, self._decided = self._decided, None

    def take_verdicts(self) -> list[Verdict]:
        """The verdicts given since the last take, oldest first."""
        verdicts, self._verdicts = self._verdicts, []
        return verdicts

    def _judge(self, now: float, signals: PoolSignals) -> None:
        """The switch on trial, at the end of its cooldown: did it relieve its pool? One that
        did not makes the next that way wait ``cooldown_s * 2 ** k`` more (k: such switches in
        a row, at most ``max_backoff``); one that did clears the count."""
        assert self._on_trial is not None
        direction, before = self._on_trial
        self._on_trial = None
        after = signals.judged(direction[1])
        helped = after <= before * (1 - self.config.min_relief)
        if helped:
            self._backoff.pop(direction, None)
            self._blocked_until.pop(direction, None)
        else:
            misses = min(self._backoff.get(direction, 0) + 1, self.config.max_backoff)
            self._backoff[direction] = misses
            self._blocked_until[direction] = now + self.config.cooldown_s * 2**misses
        allowed = self._blocked_until.get(direction, now)
        self._verdicts.append(Verdict(*direction, before, after, helped, allowed))
