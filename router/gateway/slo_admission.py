"""Admission by predicted latency (``--admission slo``): a request refused at the door, before
any worker does anything for it, when the cluster as it stands would not serve it within its
SLOs.

For each of its prompts the router forecasts (router/latency_forecast.py) the TTFT and TPOT on
every placement; admission adds to each the path's tail, how much later than forecast the
slowest of recent requests were: their forecast errors' ``--admission-attainment`` quantile
(default 0.95) less the median (a forecast is a median: under a sustained overload, admitting
every request whose median is within the SLO fills the cluster up to where half of them miss
it; with the 0.9 quantile, two workers per pool made 85-92 % of what they admitted). The
request is refused (429, ``Retry-After``) when a prompt's TTFT so predicted on its best
placement exceeds ``--slo-ttft-ms`` by more than the margin (``--admission-margin``, default 0:
the tail already makes the prediction the attainment's), or when no
placement is so predicted within the margin of both ``--slo-ttft-ms`` and ``--slo-tpot-ms``
(its TPOT then: colocated, one worker prefills and decodes it, and must make both). An admitted
prompt is then placed on the best of the placements predicted to make its SLOs (within the
margin where none is): the prompt worker of least TTFT and the decode worker of least TPOT
(colocated: of the workers that make both, the one of least TTFT), not where the routing
policy's own measure of load would have it. Retry-After is the predicted drain time: how long the
queue ahead of the prompt takes to shrink to what the SLO leaves room for (for TPOT: one
request's decode, the time it takes the running batch to change). Under
``--scheduling-policy priority`` the forecast counts only the prompts that come before this one
on a worker, so a request of higher priority (lower number) is admitted, and served ahead of
those already queued, when one of lower priority would be refused.

A slow start (``in_slow_start``): until the latency model has seen ``WARM_AFTER`` requests
finish in the last ``PATH_HORIZON_S``, or the gateway as many since it last had none in flight
(after start-up, or a quiet spell), it knows neither the path's corrections nor how the
workers' steps slow under load (their fits still hold the quiet start-up profile), so at most
one request per worker that prefills, plus one per request finished since the gateway last had
none in flight, is in flight; the rest are refused (``warming_up``, Retry-After 1 s). Without
it, the first second of a burst at start-up was admitted on the quiet profile: two thirds of
those requests missed their TTFT SLO, predicted at a quarter to a half of what they took. Both
count requests finished while the server stayed busy, not only those of the last
``PATH_HORIZON_S``: requests that take longer than that finish too few at a time to make the
model's count, and by it alone such a cluster stayed in its slow start, its cap at a few
requests in flight (one per prompt worker, doubled, where each takes 20 s), for good.

Probes: a request refused on its predicted TTFT or TPOT goes in anyway when nothing is queued
ahead of it and the workers' steps alone make its SLOs (only the path's corrections said it
would miss) and no other probe is in flight (``worth_probing``; counted in
``pdserve:admission_probes_total``). The corrections come from requests finished earlier; when
every request is refused, none finishes to correct them, and admission stayed shut: for 10 s,
in a run where the first requests after start-up had come through stalls of 300 ms.

Fair share between API keys: once the cluster is loaded (a prompt's predicted TTFT above
``fair_share_after`` of its SLO), a key holding more than its fair share of the requests in
flight (in flight over keys with requests in flight, this one counted) is refused first, so the
remaining room goes to the other keys. Without API keys every caller is one key.

What admitted requests made of their SLOs steers the rule: while fewer of them met both than
``--admission-attainment``, the SLOs it judges by are scaled down (``scale``, from
router/gateway/attainment_feedback.py; 1 otherwise), and a refusal says so; an admitted
prompt's placement is chosen by the SLOs themselves (``allowed_workers``).

Without a forecast (the workers have not run enough steps to fit the latency model yet) every
request is admitted: the model has nothing to refuse by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from router.latency_forecast import AllowedWorkers, Forecast
from router.latency_model import PATH_HORIZON_S, WARM_AFTER

AdmissionMode = Literal["none", "slo"]
ADMISSION_MODES: tuple[AdmissionMode, ...] = ("none", "slo")
# why a request was refused: the label of pdserve:admission_refusals_total
REFUSAL_REASONS = ("ttft", "tpot", "warming_up", "fair_share")
# the shortest wait a refusal asks for (the Retry-After header itself is whole seconds, its
# retry-after-ms exact): a predicted drain time of milliseconds would have clients hammer
MIN_RETRY_AFTER_S = 0.1


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    mode: AdmissionMode = "none"
    # a prompt is refused when predicted to miss an SLO by more than this fraction of it (the
    # prediction has its tail at ``attainment`` already: a margin admits requests predicted to
    # miss; 0.1 had two workers per pool at 92 % of those admitted where 0 had 95 %)
    margin: float = 0.0
    # a key over its fair share is refused once a prompt's predicted TTFT passes this fraction
    # of the TTFT SLO
    fair_share_after: float = 0.5
    # the share of admitted requests meant to make their SLOs: the quantile of recent
    # requests' forecast errors admission adds to each prediction (the path's tail)
    attainment: float = 0.95

    def __post_init__(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise ValueError(
                f"--admission must be one of {', '.join(ADMISSION_MODES)}; got {self.mode!r}"
            )
        if not self.margin >= 0:
            raise ValueError(f"--admission-margin must be >= 0, got {self.margin}")
        if not 0 < self.fair_share_after <= 1 + self.margin:
            raise ValueError(
                f"--admission-fair-share-after must be in (0, 1 + margin], "
                f"got {self.fair_share_after}"
            )
        if not 0.5 <= self.attainment < 1:
            raise ValueError(f"--admission-attainment must be in [0.5, 1), got {self.attainment}")


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str  # one of REFUSAL_REASONS
    message: str
    retry_after_s: float  # the predicted wait (at least ``MIN_RETRY_AFTER_S``)


@dataclass(frozen=True, slots=True)
class KeyLoad:
    """The requests in flight through the gateway: the caller's key's, all keys' together, and
    how many keys have any (the caller's included); and how many requests finished since the
    gateway last had none in flight (what a slow start vouches by)."""

    own: int
    total: int
    num_keys: int
    finished_since_idle: int = 0


def judge(
    forecasts: Sequence[Forecast | None],
    max_tokens: int,
    ttft_slo_s: float,
    tpot_slo_s: float,
    policy: AdmissionPolicy,
    keys: KeyLoad,
    scale: float = 1.0,
) -> Refusal | None:
    """The refusal of a request whose prompts have ``forecasts`` (each generating up to
    ``max_tokens``), or None to admit it; ``scale``: the share of the SLOs admission holds
    requests to (the attainment's feedback, attainment_feedback.py; 1: the SLOs)."""
    known = [f for f in forecasts if f is not None]
    if policy.mode != "slo" or not known:
        return None
    held = "" if scale >= 1 else _held_to(scale, policy.attainment)
    ttft_slo_s, tpot_slo_s = ttft_slo_s * scale, tpot_slo_s * scale
    ttft_limit_s, tpot_limit_s = ttft_slo_s * (1 + policy.margin), tpot_slo_s * (1 + policy.margin)
    # each prompt's TTFT on its best placement, with its tail
    quantile = policy.attainment
    ttft_s, worst_ttft = max(
        ((f.ttft_s + f.tails(quantile)[0], f) for f in known), key=lambda pair: pair[0]
    )
    if ttft_s > ttft_limit_s:
        # what has to drain first: the part of the queue the SLO has no room for
        return Refusal(
            "ttft",
            f"predicted time to first token {ttft_s * 1000:.0f} ms exceeds the "
            f"server's SLO of {ttft_slo_s * 1000:.0f} ms (--slo-ttft-ms{held}) by more than its "
            f"margin of {policy.margin:.0%}; retry later",
            _wait(ttft_s - ttft_slo_s),
        )
    # a placement must make both: colocated, one worker must
    missed = [
        f
        for f in known
        if f.workers_within(ttft_limit_s, tpot_limit_s, tail_quantile=quantile) is None
    ]
    if missed:
        tpot_s = max(f.least_tpot_within(ttft_limit_s, tail_quantile=quantile) for f in missed)
        return Refusal(
            "tpot",
            f"predicted time per output token {tpot_s * 1000:.1f} ms exceeds the "
            f"server's SLO of {tpot_slo_s * 1000:.1f} ms (--slo-tpot-ms{held}) by more than its "
            f"margin of {policy.margin:.0%}; retry later",
            _wait(tpot_s * max_tokens),
        )
    # a slow start: the fewer requests it has seen finish since it was idle, the fewer it
    # vouches for
    if in_slow_start(known, keys.finished_since_idle):
        cold = [f for f in known if _cold(f)]
        seen = min(f.num_observed or 0 for f in cold)
        in_flight_cap = min(f.num_prompt_workers for f in cold) + keys.finished_since_idle
        if keys.total + 1 > in_flight_cap:
            return Refusal(
                "warming_up",
                f"the server has seen {seen} requests finish in the last "
                f"{PATH_HORIZON_S:.0f} s, too few to predict latencies under load; until "
                f"{WARM_AFTER} have, it admits one request in flight per prompt worker plus "
                f"one per request finished since it was idle, {in_flight_cap}; retry shortly",
                1.0,
            )
    loaded = worst_ttft.ttft_s > ttft_slo_s * policy.fair_share_after
    fair_share = (keys.total + 1) / max(1, keys.num_keys)
    if loaded and keys.num_keys > 1 and keys.own + 1 > fair_share:
        return Refusal(
            "fair_share",
            f"the server is loaded and this API key has {keys.own} of the {keys.total} "
            f"requests in flight, more than its fair share of {fair_share:.1f} among "
            f"{keys.num_keys} keys; retry later",
            _wait(worst_ttft.queue_s),
        )
    return None


def in_slow_start(forecasts: Sequence[Forecast | None], finished_since_idle: int) -> bool:
    """Whether a request of prompts ``forecasts`` comes in a slow start: a forecast's latency
    model has seen fewer than ``WARM_AFTER`` requests finish in its last ``PATH_HORIZON_S``
    (a model not known: warm), and the gateway fewer than that since it last had none in
    flight (a server busy since then has fits of busy steps and corrections, however long
    each request takes)."""
    return finished_since_idle < WARM_AFTER and any(f is not None and _cold(f) for f in forecasts)


def _cold(forecast: Forecast) -> bool:
    """Made by a latency model that has seen fewer than ``WARM_AFTER`` requests finish in its
    last ``PATH_HORIZON_S`` (not known: warm)."""
    return forecast.num_observed is not None and forecast.num_observed < WARM_AFTER


def _held_to(scale: float, attainment: float) -> str:
    """What a refusal says of SLOs scaled by the attainment's feedback."""
    return (
        f" x {scale:.2f}: fewer of the requests admitted lately met their SLOs than "
        f"--admission-attainment's {attainment:.0%}"
    )


def _wait(seconds: float) -> float:
    """A refusal's wait before a retry: the predicted one, not less than
    ``MIN_RETRY_AFTER_S``."""
    return max(MIN_RETRY_AFTER_S, seconds)


def worth_probing(
    forecasts: Sequence[Forecast | None],
    ttft_slo_s: float,
    tpot_slo_s: float,
    policy: AdmissionPolicy,
) -> bool:
    """Whether a request refused on its predicted latencies may go in as a probe: nothing is
    queued ahead of any of its prompts, and their workers' steps alone make the SLOs (within
    the margin), so only the path's corrections, learned from requests finished earlier, said
    it would miss. Those can be out of date (a start-up's slow first requests), and once every
    request is refused none finishes to correct them: a probe, one at a time, does."""
    known = [f for f in forecasts if f is not None]
    margin = 1 + policy.margin
    return bool(known) and all(
        f.queue_s <= 0
        and f.steps_ttft_s <= ttft_slo_s * margin
        and f.steps_tpot_s <= tpot_slo_s * margin
        for f in known
    )


def allowed_workers(
    forecast: Forecast | None, ttft_slo_s: float, tpot_slo_s: float, policy: AdmissionPolicy
) -> AllowedWorkers | None:
    """Where an admitted prompt is placed: of the placements predicted to make its SLOs (else,
    none does, within the margin), the best: the prompt worker of least TTFT, the decode worker
    of least TPOT (colocated: the worker of least TTFT); None (any) without ``--admission slo``
    or a forecast. Routed among all those within the SLOs, 38 % of a 2P2D run's prompts went to
    another prefill worker than the best, by the routing policy's own measure of load (queued
    tokens, not predicted time); placed on the best, eight cold starts missed 38 TPOT SLOs
    against 52 (docs/benchmarks.md). By the SLOs themselves, not scaled by the attainment's
    feedback as ``judge`` is: scaled, often one decode worker was allowed, and the prompts
    admitted until its next load report all went to it (TPOT misses 5-15 a run against 1-2)."""
    if policy.mode != "slo" or forecast is None:
        return None
    margin = 1 + policy.margin
    quantile = policy.attainment
    within = forecast.workers_within(
        ttft_slo_s, tpot_slo_s, tail_quantile=quantile
    ) or forecast.workers_within(ttft_slo_s * margin, tpot_slo_s * margin, tail_quantile=quantile)
    if within is None:
        return None
    prompt = min(within.prompt_worker_ids, key=lambda w: (forecast.ttft_on(w), w))
    decode = (
        prompt
        if forecast.colocated
        else min(within.decode_worker_ids, key=lambda w: (forecast.tpot_on(w), w))
    )
    return AllowedWorkers(frozenset({prompt}), frozenset({decode}))
