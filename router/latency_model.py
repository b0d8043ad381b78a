"""The latency model: how long a worker's engine steps and a KV hand-off take, fitted online.

Workers report the timing of every engine step they ran (``engine.messages.StepTiming``: prompt
tokens computed and the context they attend to, decode rows and the KV they read, seconds) and
the prefill workers each hand-off they sent (bytes, seconds, transport) with their loads. From
a window of each worker's latest steps the model fits

    step seconds = overhead + a * prompt tokens + b * attention pairs
                 + c * decode rows + d * decode context tokens

by least squares with every coefficient kept >= 0 (a coefficient the data would make negative
is dropped and the rest fitted again), each feature scaled to its own size first and a little
ridge added, so that a window where two features move together (every prompt step full, say)
still fits. A worker with too few steps of its own borrows its role's fit over every worker of
that role. Hand-offs fit ``seconds = latency + bytes / bandwidth`` per transport the same way.

A hand-off first waits for the decode worker's blocks, which a decode worker whose KV cache is
full does not have until sequences finish: each hand-off reports that wait once it ended, and
each prefill worker's load report the waits of its hand-offs still waiting. A decode worker's
current wait is the mean over the hand-offs to it reported in the last ``WAIT_HORIZON_S``, or
the longest still waiting where that is longer (none: 0), so a cache that fills shows at the
next report, not only once its first waiting hand-off ends. It is a queue, not a cost, so it is
observed rather than fitted.

What the workers' steps cannot see (the gateway's parsing, the router's hops, the output stream
to the client) is learned from finished requests (``recent_path``): what their clients observed
minus what the steps predicted, for TTFT and TPOT apart. The forecast adds the median
(``RecentPath.corrections``; for TPOT, of the gaps after a request's first: the first gap,
across a disaggregated request's hand-off, is longer, by ``first_gap_excess_s``, which the
forecast spreads over the request's tokens). How much more the slowest of them saw is the
path's tail (``RecentPath.tails``, at the quantile admission asks for: the forecast is a
median, and admitting every request predicted within its SLO admits, under a sustained
overload, requests that miss it in half the cases). Only requests finished in the last
``PATH_HORIZON_S`` count: a burst's first requests, slow while the workers' fits still had the
quiet start-up profile, must not make admission refuse everything, and so see no request finish
that would correct them, for good.

Each reported step is also counted by its time over what its worker's fit, as the forecasts
last used it, predicted (``step_ratios``: the model's error step by step, a histogram per role
at /metrics). Fits are redone lazily, when asked for after new timings came. Thread-safe: the
load monitor and the front doors feed it, the front doors ask it.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from engine.messages import BlockWait, StepTiming, TransferTiming

STEP_WINDOW = 512  # a worker's latest steps the fit is over
TRANSFER_WINDOW = 256  # a transport's latest hand-offs
MIN_STEPS = 8  # fewer of a worker's own: its role's fit stands in
MIN_TRANSFERS = 2
PATH_WINDOW = 64  # finished requests whose residuals the path corrections are the median of
PATH_HORIZON_S = 10.0  # of which those observed this recently count
MIN_TAIL_RESIDUALS = 10  # fewer: no tail (``RecentPath.tails``)
# finished requests (in the horizon) before admission trusts the forecast under load
WARM_AFTER = MIN_TAIL_RESIDUALS
WAIT_WINDOW = 32  # a decode worker's latest hand-offs' waits for its blocks
WAIT_HORIZON_S = 10.0  # of which those reported this recently count
_RIDGE = 1e-6  # relative to the (scaled) features' own size
# bounds of the buckets of an observed-over-predicted histogram: a reported step's
# (``StepRatios``), a finished request's (the gateway's latency_prediction_ratio)
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes (a ``StepTiming`` without its seconds)."""

    num_prefill_tokens: int = 0
    prefill_attention_tokens: int = 0
    num_decode_tokens: int = 0
    decode_context_tokens: int = 0
    # ``pdserve plan``'s roofline, not features (a worker reports and fits its steps by rows):
    # the KV tokens those rows' sequences read, each sequence's once (its drafts are checked
    # against it with its token, like a prompt chunk), a sliding layer's window at most
    # (None: ``decode_context_tokens``); the (query, key) pairs the step attends, averaged over
    # the layers, a sliding layer's within its window (None: the two counts above summed)
    decode_kv_tokens: float | None = None
    attention_pairs: float | None = None

    def features(self) -> tuple[float, ...]:
        return (
            1.0,
            float(self.num_prefill_tokens),
            float(self.prefill_attention_tokens),
            float(self.num_decode_tokens),
            float(self.decode_context_tokens),
        )


def shape_of(timing: StepTiming) -> StepShape:
    return StepShape(
        timing.num_prefill_tokens,
        timing.prefill_attention_tokens,
        timing.num_decode_tokens,
        timing.decode_context_tokens,
    )


@dataclass(frozen=True, slots=True)
class StepCost:
    """A fitted step time: seconds per unit of each feature of ``StepShape``."""

    overhead_s: float
    per_prefill_token_s: float
    per_attention_pair_s: float
    per_decode_token_s: float
    per_context_token_s: float
    num_samples: int  # steps it was fitted on

    def seconds(self, shape: StepShape) -> float:
        return (
            self.overhead_s
            + self.per_prefill_token_s * shape.num_prefill_tokens
            + self.per_attention_pair_s * shape.prefill_attention_tokens
            + self.per_decode_token_s * shape.num_decode_tokens
            + self.per_context_token_s * shape.decode_context_tokens
        )

    def scaled(self, factor: float) -> StepCost:
        """Every step ``factor`` times as long (a machine that much slower)."""
        return StepCost(
            self.overhead_s * factor,
            self.per_prefill_token_s * factor,
            self.per_attention_pair_s * factor,
            self.per_decode_token_s * factor,
            self.per_context_token_s * factor,
            self.num_samples,
        )


@dataclass(frozen=True, slots=True)
class TransferCost:
    """A fitted hand-off time on one transport."""

    latency_s: float
    per_byte_s: float  # 1 / bandwidth
    bytes_per_block: float  # what a block of the hand-offs moved (all layers, all ranks)
    num_samples: int

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + self.per_byte_s * num_bytes

    def seconds_for_blocks(self, num_blocks: int) -> float:
        return self.seconds(num_blocks * self.bytes_per_block)


@dataclass(slots=True)
class StepRatios:
    """Reported steps' time over what their worker's fit predicted for them when they came
    (the fit the forecasts then used: its error, step by step), as a histogram."""

    # per bucket of PREDICTION_RATIO_BUCKETS (and one over the last): steps whose ratio was at most
    # the bucket's bound and above the one before
    bucket_counts: list[int] = field(
        default_factory=lambda: [0] * (len(PREDICTION_RATIO_BUCKETS) + 1)
    )
    sum_ratio: float = 0.0

    def count(self, ratio: float) -> None:
        self.bucket_counts[bisect.bisect_left(PREDICTION_RATIO_BUCKETS, ratio)] += 1
        self.sum_ratio += ratio


@dataclass(frozen=True, slots=True)
class RecentPath:
    """What recently finished requests' clients saw beyond their workers' steps: each one's
    observed latency minus the one its steps predicted (its residual), for TTFT and TPOT (the
    gaps after its first), and how much longer its first gap was than its later ones (a
    disaggregated request's crosses the hand-off), each sorted."""

    ttft_residuals_s: tuple[float, ...] = ()
    tpot_residuals_s: tuple[float, ...] = ()
    first_gap_excesses_s: tuple[float, ...] = ()

    @property
    def num_requests(self) -> int:
        return len(self.ttft_residuals_s)

    @property
    def first_gap_excess_s(self) -> float:
        """The median first gap's excess over the later gaps (0 before any)."""
        return _median(self.first_gap_excesses_s)

    def first_gap_tail(self, quantile: float) -> float:
        """How much longer than the median excess the slowest first gaps were: the excesses'
        ``quantile`` less their median (0 with under ``MIN_TAIL_RESIDUALS``)."""
        return _tail(self.first_gap_excesses_s, quantile)

    def corrections(self) -> tuple[float, float]:
        """What to add to the steps' TTFT and TPOT for what they cannot see: the residuals'
        medians (0 before any request finished)."""
        return _median(self.ttft_residuals_s), _median(self.tpot_residuals_s)

    def tails(self, quantile: float) -> tuple[float, float]:
        """How much later than the corrections the slowest requests were: the residuals'
        ``quantile`` less their median, for TTFT and TPOT (0 with under
        ``MIN_TAIL_RESIDUALS``)."""
        return _tail(self.ttft_residuals_s, quantile), _tail(self.tpot_residuals_s, quantile)


def fit_nonnegative(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Least-squares coefficients of ``rows`` (each a feature vector) for ``targets``, each kept
    >= 0: columns are scaled to unit root-mean-square (a column of zeros gets 0), a ridge of
    ``_RIDGE`` times the row count steadies collinear columns, and while a coefficient comes out
    negative the most negative one is fixed at 0 and the rest fitted again."""
    num_features = len(rows[0]) if rows else 0
    scales = []
    for j in range(num_features):
        rms = math.sqrt(sum(row[j] * row[j] for row in rows) / len(rows))
        scales.append(rms)
    active = [j for j in range(num_features) if scales[j] > 0]
    coefficients = [0.0] * num_features
    while active:
        solved = _ridge_solve(rows, targets, active, scales)
        worst = min(range(len(active)), key=lambda i: solved[i])
        if solved[worst] >= 0:
            for i, j in enumerate(active):
                coefficients[j] = solved[i] / scales[j]
            break
        del active[worst]
    return coefficients


def _ridge_solve(
    rows: Sequence[Sequence[float]],
    targets: Sequence[float],
    columns: list[int],
    scales: list[float],
) -> list[float]:
    """Coefficients (of the scaled ``columns``) minimising squared error plus the ridge."""
    n = len(columns)
    gram = [[0.0] * n for _ in range(n)]
    moment = [0.0] * n
    for row, target in zip(rows, targets, strict=True):
        x = [row[j] / scales[j] for j in columns]
        for a in range(n):
            moment[a] += x[a] * target
            for b in range(a, n):
                gram[a][b] += x[a] * x[b]
    ridge = _RIDGE * len(rows)
    for a in range(n):
        gram[a][a] += ridge
        for b in range(a):
            gram[a][b] = gram[b][a]
    return _solve(gram, moment)


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """``matrix`` x = ``vector`` by Gaussian elimination with partial pivoting (the matrix is
    symmetric positive definite here, a few columns wide)."""
    n = len(vector)
    m = [row[:] + [vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0:
            continue
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            if factor:
                for c in range(col, n + 1):
                    m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        if m[r][r] == 0:
            continue
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class _StepWindow:
    def __init__(self) -> None:
        self.timings: deque[StepTiming] = deque(maxlen=STEP_WINDOW)
        self.fitted: StepCost | None = None
        self.stale = False

    def cost(self) -> StepCost | None:
        if self.stale:
            self.stale = False
            self.fitted = fit_step_cost(self.timings) if len(self.timings) >= MIN_STEPS else None
        return self.fitted


class LatencyModel:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, _StepWindow] = {}
        self._roles: dict[str, _StepWindow] = defaultdict(_StepWindow)
        self._transfers: dict[str, deque[TransferTiming]] = {}
        self._transfer_fits: dict[str, TransferCost | None] = {}
        self._busy_s: dict[str, float] = defaultdict(float)  # each worker's steps' seconds
        self._step_ratios: dict[str, StepRatios] = defaultdict(StepRatios)  # by role
        # observed minus predicted, of finished requests: TTFT's, TPOT's
        # finished requests' (time observed, residual)
        self._ttft_residuals: deque[tuple[float, float]] = deque(maxlen=PATH_WINDOW)
        self._tpot_residuals: deque[tuple[float, float]] = deque(maxlen=PATH_WINDOW)
        self._first_gap_excesses: deque[tuple[float, float]] = deque(maxlen=PATH_WINDOW)
        # per decode worker: (reported at, seconds) of the hand-offs' waits for its blocks
        self._waits: dict[str, deque[tuple[float, float]]] = {}
        # per prefill worker, as its latest report had them: its hand-offs waiting now, the
        # longest wait so far per decode worker
        self._waiting: dict[str, dict[str, float]] = {}

    def observe(
        self,
        worker_id: str,
        role: str,
        steps: Iterable[StepTiming],
        transfers: Iterable[TransferTiming] = (),
    ) -> None:
        """Take a report's timings from ``worker_id`` of ``role``."""
        steps, transfers = list(steps), list(transfers)
        if not steps and not transfers:
            return
        with self._lock:
            if steps:
                own = self._workers.setdefault(worker_id, _StepWindow())
                fit = own.fitted  # (the fit the forecasts use; none yet: its role's)
                if fit is None and role in self._roles:
                    fit = self._roles[role].cost()
                self._count_step_ratios(role, steps, fit)
                pooled = self._roles[role]
                own.timings.extend(steps)
                pooled.timings.extend(steps)
                self._busy_s[worker_id] += sum(t.seconds for t in steps)
                own.stale = pooled.stale = True
            now = self._clock()
            for timing in transfers:
                if timing.decode_worker_id:
                    waits = self._waits.setdefault(
                        timing.decode_worker_id, deque(maxlen=WAIT_WINDOW)
                    )
                    waits.append((now, timing.reserve_wait_s))
                if not timing.num_blocks:  # given up waiting: nothing moved
                    continue
                window = self._transfers.setdefault(timing.transport, deque(maxlen=TRANSFER_WINDOW))
                window.append(timing)
                self._transfer_fits.pop(timing.transport, None)

    def _count_step_ratios(
        self, role: str, steps: Sequence[StepTiming], fit: StepCost | None
    ) -> None:
        """Each step's time over what ``fit`` (its worker's latest, else its role's; None:
        none yet, nothing counted) predicted for it."""
        if fit is None:
            return
        ratios = self._step_ratios[role]
        for timing in steps:
            predicted = fit.seconds(shape_of(timing))
            if predicted > 0:
                ratios.count(timing.seconds / predicted)

    def step_ratios(self) -> dict[str, StepRatios]:
        """The reported steps' time over their fits' predictions so far, by role."""
        with self._lock:
            return {
                role: StepRatios(list(r.bucket_counts), r.sum_ratio)
                for role, r in self._step_ratios.items()
            }

    def observe_waiting(self, prefill_worker_id: str, block_waits: Iterable[BlockWait]) -> None:
        """A prefill worker's report of its hand-offs waiting now for decode workers' blocks
        (none: its earlier ones ended)."""
        longest: dict[str, float] = {}
        for wait in block_waits:
            longest[wait.decode_worker_id] = max(
                longest.get(wait.decode_worker_id, 0.0), wait.waited_s
            )
        with self._lock:
            if longest:
                self._waiting[prefill_worker_id] = longest
            else:
                self._waiting.pop(prefill_worker_id, None)

    def observe_request(
        self,
        ttft_residual_s: float,
        tpot_residual_s: float | None,
        first_gap_excess_s: float | None = None,
    ) -> None:
        """A finished request's observed latencies minus those its workers' steps predicted:
        its TTFT's, and its inter-token gaps' after the first (None: under three tokens); and
        how much longer its first gap was than those (None: not known)."""
        with self._lock:
            now = self._clock()
            self._ttft_residuals.append((now, ttft_residual_s))
            if tpot_residual_s is not None:
                self._tpot_residuals.append((now, tpot_residual_s))
            if first_gap_excess_s is not None:
                self._first_gap_excesses.append((now, first_gap_excess_s))

    def recent_path(self) -> RecentPath:
        """What the requests finished in the last ``PATH_HORIZON_S`` saw beyond their steps."""
        with self._lock:
            since = self._clock() - PATH_HORIZON_S
            return RecentPath(
                tuple(sorted(r for at, r in self._ttft_residuals if at >= since)),
                tuple(sorted(r for at, r in self._tpot_residuals if at >= since)),
                tuple(sorted(e for at, e in self._first_gap_excesses if at >= since)),
            )

    def busy_seconds(self) -> dict[str, float]:
        """Each worker's steps' seconds so far (its busy time), by worker id."""
        with self._lock:
            return dict(self._busy_s)

    def reserve_wait(self, decode_worker_id: str) -> float:
        """How long a hand-off to the decode worker now waits for its blocks: the mean of the
        waits reported in the last ``WAIT_HORIZON_S``, or the longest of those still waiting
        (as the prefill workers last reported them) where that is longer; 0: none."""
        with self._lock:
            waiting = max(
                (by_decode.get(decode_worker_id, 0.0) for by_decode in self._waiting.values()),
                default=0.0,
            )
            waits = self._waits.get(decode_worker_id)
            if not waits:
                return waiting
            since = self._clock() - WAIT_HORIZON_S
            recent = [seconds for at, seconds in waits if at >= since]
            return max(waiting, sum(recent) / len(recent) if recent else 0.0)

    def forget(self, worker_id: str) -> None:
        """A worker left: its own fit goes (its steps stay in its role's window), and the
        waits of hand-offs to it."""
        with self._lock:
            self._workers.pop(worker_id, None)
            self._busy_s.pop(worker_id, None)
            self._waits.pop(worker_id, None)
            self._waiting.pop(worker_id, None)
            for by_decode in self._waiting.values():
                by_decode.pop(worker_id, None)

    def step_cost(self, worker_id: str, role: str) -> StepCost | None:
        """The worker's fitted step time, its role's where it has too few steps of its own;
        None before any worker of the role ran enough steps."""
        with self._lock:
            own = self._workers.get(worker_id)
            cost = None if own is None else own.cost()
            if cost is not None:
                return cost
            return self._roles[role].cost() if role in self._roles else None

    def transfer_cost(self, transport: str | None = None) -> TransferCost | None:
        """The fitted hand-off time on ``transport`` (None: over the transport seen most)."""
        with self._lock:
            if transport is None:
                if not self._transfers:
                    return None
                transport = max(self._transfers, key=lambda t: len(self._transfers[t]))
            window = self._transfers.get(transport)
            if window is None or len(window) < MIN_TRANSFERS:
                return None
            if transport not in self._transfer_fits:
                self._transfer_fits[transport] = _fit_transfers(window)
            return self._transfer_fits[transport]


def fit_step_cost(timings: Iterable[StepTiming]) -> StepCost:
    """The step time fitted to ``timings`` (see the module's docstring)."""
    timings = list(timings)
    rows = [shape_of(t).features() for t in timings]
    c = fit_nonnegative(rows, [t.seconds for t in timings])
    return StepCost(c[0], c[1], c[2], c[3], c[4], len(timings))


def _fit_transfers(timings: Iterable[TransferTiming]) -> TransferCost:
    timings = list(timings)
    c = fit_nonnegative([(1.0, float(t.num_bytes)) for t in timings], [t.seconds for t in timings])
    num_blocks = sum(t.num_blocks for t in timings)
    bytes_per_block = sum(t.num_bytes for t in timings) / num_blocks if num_blocks else 0.0
    return TransferCost(c[0], c[1], bytes_per_block, len(timings))


def _tail(residuals: Sequence[float], quantile: float) -> float:
    """How much later than their median the residuals' ``quantile`` is (0 for too few)."""
    if len(residuals) < MIN_TAIL_RESIDUALS:
        return 0.0
    return _quantile(residuals, quantile) - _median(residuals)


def _quantile(values: Iterable[float], quantile: float) -> float:
    """The ``quantile`` of the values, interpolated between the two nearest (0 for none)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    position = quantile * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def _median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
