"""A prompt's predicted latencies on the cluster as it stands: TTFT and TPOT of its best
placement, from the workers' loads and the latency model's fits (router/latency_model.py).

On a worker that prefills it (a prefill worker, or a colocated one), the prompt waits for the
prompt tokens queued ahead of it, then computes its own; both in steps of the worker's token
budget, each step costing the worker's fitted step time:

    steps   = ceil((queued ahead + own uncached tokens) / tokens a step has room for)
    seconds = sum over those steps of the fitted step time

The queue ahead is the worker's queued prompt tokens (its report plus what was routed since);
under priority scheduling only the share of them whose requests come first (priority lower or
equal) counts, since the worker serves those before this one. Queued tokens attend, on average,
to half their prompt's length; the prompt's own attend to its cached prefix and themselves. A
colocated worker's steps also carry its running sequences' decode rows, which take room and
time in every step.

The first token leaves the prefill worker as soon as it is sampled (the hand-off comes after
it), so TTFT is the queue and the prefill. The hand-off is predicted as the decode worker's
current wait for blocks (router/latency_model.py) and its bytes on the transport fitted most,
and reported beside them; it delays the second token only.

TPOT is a decode step of the decode worker's running batch with this request in it; on a
colocated worker, plus its share of the prompt chunks queued there, spread over the request's
tokens; on a decode worker whose hand-offs wait for blocks (its KV cache full), plus that wait
spread over the request's tokens after the first. Both then get the model's path corrections:
what finished requests' clients saw beyond their steps (the gateway's and router's hops, the
stream); TPOT also how much longer a request's first gap is than its later ones (the
hand-off, as clients see it), spread over its ``max_tokens`` - 1 gaps: it weighs more in a
short output. A prediction needs the fits of the roles it uses: None until the workers have reported
enough steps (``pdserve serve --latency-profile`` runs a few at start-up).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from engine.messages import WorkerLoad
from router.latency_model import LatencyModel, RecentPath, StepCost, StepShape


@dataclass(frozen=True, slots=True)
class PromptToPlace:
    """What the forecast knows of a request."""

    num_prompt_tokens: int
    max_tokens: int  # its output tokens, at most
    priority: int = 0
    # prompt tokens each worker's prefix cache holds (kv_aware's index); absent: none
    cached_tokens: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AllowedWorkers:
    """The workers a request may be placed on: those predicted to serve it within limits."""

    prompt_worker_ids: frozenset[str]  # that prefill it (colocated: the same as decode's)
    decode_worker_ids: frozenset[str]


@dataclass(frozen=True, slots=True)
class Forecast:
    """A prompt's predicted latencies on its best placement, and on every candidate."""

    ttft_s: float  # queue + prefill on the prefill worker of least TTFT, + the path's
    queue_s: float  # of which the wait for the prompts ahead of it
    prefill_worker_id: str
    tpot_s: float  # decode step on the decode worker of least TPOT, + the path's
    decode_worker_id: str
    # the prompt's KV moving to it: the wait for its blocks, then the transfer (0 colocated)
    handoff_s: float
    # the path corrections (what the steps do not see), added to the steps' TTFT and TPOT
    # (but never taking away more than half of them)
    ttft_path_s: float = 0.0
    tpot_path_s: float = 0.0
    # each candidate's as the workers' steps predict it: TTFT by the worker that would
    # prefill the prompt, TPOT by the one that would decode it (colocated: the same workers)
    steps_ttft_by_worker: Mapping[str, float] = field(default_factory=dict)
    steps_tpot_by_worker: Mapping[str, float] = field(default_factory=dict)
    colocated: bool = False
    # what recently finished requests saw beyond their steps (the corrections above are from
    # it): admission adds its tails, so it admits what makes the SLOs in most cases, not in
    # half of them (None: not known)
    path: RecentPath | None = None
    # the weight of the request's first inter-token gap in its TPOT: 1 / (max_tokens - 1)
    first_gap_share: float = 0.0

    def ttft_on(self, worker_id: str) -> float:
        """The prompt's TTFT if the worker prefills it, the path's correction included."""
        return _corrected(self._steps_ttfts()[worker_id], self.ttft_path_s)

    def tpot_on(self, worker_id: str) -> float:
        """Its TPOT if the worker decodes it, the path's correction included."""
        return _corrected(self._steps_tpots()[worker_id], self.tpot_path_s)

    def tails(self, quantile: float | None) -> tuple[float, float]:
        """How much later than this forecast the slowest ``quantile`` of recent requests were,
        for TTFT and TPOT (``RecentPath.tails``); TPOT's is the later gaps' tail plus the
        first gap's, at its share of this request's gaps (a short output's TPOT carries much
        of a slow hand-off). None, or no path known: 0."""
        if quantile is None or self.path is None:
            return 0.0, 0.0
        ttft_tail, tpot_tail = self.path.tails(quantile)
        return ttft_tail, tpot_tail + self.first_gap_share * self.path.first_gap_tail(quantile)

    @property
    def num_observed(self) -> int | None:
        """Finished requests the path corrections and tails are from (None: not known)."""
        return None if self.path is None else self.path.num_requests

    def workers_within(
        self, ttft_s: float, tpot_s: float, *, tail_quantile: float | None = None
    ) -> AllowedWorkers | None:
        """The placements predicted to meet both limits (``tail_quantile``: in that share of
        cases, the tails added): the prompt workers within ``ttft_s`` and the decode workers
        within ``tpot_s`` (colocated: the workers within both); None where there is none."""
        ttft_tail, tpot_tail = self.tails(tail_quantile)
        prompt = frozenset(w for w in self._steps_ttfts() if self.ttft_on(w) + ttft_tail <= ttft_s)
        decode = frozenset(w for w in self._steps_tpots() if self.tpot_on(w) + tpot_tail <= tpot_s)
        if self.colocated:
            prompt = decode = prompt & decode
        if not prompt or not decode:
            return None
        return AllowedWorkers(prompt, decode)

    def least_tpot_within(self, ttft_s: float, *, tail_quantile: float | None = None) -> float:
        """The least TPOT predicted on a placement (colocated: a worker) whose TTFT is within
        ``ttft_s`` (any, where none is); ``tail_quantile``: both with their tails."""
        ttft_tail, tpot_tail = self.tails(tail_quantile)
        decode = list(self._steps_tpots())
        if self.colocated:
            decode = [w for w in decode if self.ttft_on(w) + ttft_tail <= ttft_s] or decode
        return min(self.tpot_on(w) for w in decode) + tpot_tail

    def placed_on(self, prompt_worker_id: str, decode_worker_id: str | None) -> Forecast:
        """The forecast of the placement the prompt got: its workers' predictions where they
        were candidates (a prompt prefilled on its decode worker, say, keeps the best's)."""
        forecast = self
        if prompt_worker_id in self.steps_ttft_by_worker:
            ttft_s = self.ttft_on(prompt_worker_id)
            forecast = replace(forecast, ttft_s=ttft_s, prefill_worker_id=prompt_worker_id)
        if decode_worker_id is not None and decode_worker_id in self.steps_tpot_by_worker:
            tpot_s = self.tpot_on(decode_worker_id)
            forecast = replace(forecast, tpot_s=tpot_s, decode_worker_id=decode_worker_id)
        return forecast

    @property
    def num_prompt_workers(self) -> int:
        """The workers that could prefill the prompt (the candidates)."""
        return len(self._steps_ttfts())

    def _steps_ttfts(self) -> Mapping[str, float]:
        return self.steps_ttft_by_worker or {self.prefill_worker_id: self.steps_ttft_s}

    def _steps_tpots(self) -> Mapping[str, float]:
        return self.steps_tpot_by_worker or {self.decode_worker_id: self.steps_tpot_s}

    @property
    def steps_ttft_s(self) -> float:
        """TTFT on the best placement as the workers' steps alone predict it."""
        if self.steps_ttft_by_worker:
            return self.steps_ttft_by_worker[self.prefill_worker_id]
        return self.ttft_s - self.ttft_path_s

    @property
    def steps_tpot_s(self) -> float:
        if self.steps_tpot_by_worker:
            return self.steps_tpot_by_worker[self.decode_worker_id]
        return self.tpot_s - self.tpot_path_s


@dataclass(frozen=True, slots=True)
class StepBudgets:
    """Tokens one step computes at most: a prefill worker's, and a decode (or colocated)
    worker's."""

    prefill: int
    decode: int


class LatencyForecaster:
    def __init__(
        self,
        model: LatencyModel,
        budgets: StepBudgets,
        block_size: int,
        *,
        colocated: bool,
        by_priority: bool,
    ) -> None:
        """``colocated``: decode workers prefill every prompt; ``by_priority``: workers serve
        requests by priority (``--scheduling-policy priority``), else in order of arrival."""
        self.model = model
        self.budgets = budgets
        self.block_size = block_size
        self.colocated = colocated
        self.by_priority = by_priority

    def forecast(
        self,
        prompt: PromptToPlace,
        prefill_loads: Sequence[WorkerLoad],
        decode_loads: Sequence[WorkerLoad],
        queued: Mapping[str, Sequence[tuple[int, int]]],
    ) -> Forecast | None:
        """The prompt's latencies on its best placement among these workers (``prefill_loads``
        unused when colocated); ``queued`` lists, per worker, (priority, prompt tokens) of the
        requests placed there whose first token has not come. None without fits or workers."""
        prefill_role = "decode" if self.colocated else "prefill"
        prompt_workers = decode_loads if self.colocated else prefill_loads
        ttfts: dict[str, tuple[float, float]] = {}  # worker -> (queue + prefill, queue)
        for load in prompt_workers:
            cost = self.model.step_cost(load.worker_id, prefill_role)
            if cost is None:
                return None
            share = self._share_ahead(prompt.priority, queued.get(load.worker_id, ()))
            cached = min(prompt.cached_tokens.get(load.worker_id, 0), prompt.num_prompt_tokens - 1)
            queue_s, total_s = self._prefill_seconds(cost, load, share, prompt, cached)
            ttfts[load.worker_id] = (total_s, queue_s)
        tpots: dict[str, tuple[float, float]] = {}  # worker -> (TPOT, wait for its blocks)
        for load in decode_loads:
            cost = self.model.step_cost(load.worker_id, "decode")
            if cost is None:
                return None
            # a wait for the decode worker's blocks delays the second token: spread over the rest
            wait_s = 0.0 if self.colocated else self.model.reserve_wait(load.worker_id)
            tpot = self._tpot_seconds(cost, load, prompt) + wait_s / max(1, prompt.max_tokens - 1)
            tpots[load.worker_id] = (tpot, wait_s)
        if not ttfts or not tpots:
            return None
        # the best: least TTFT, then least TPOT (colocated: on the worker of least TTFT)
        best_prompt = min(ttfts, key=lambda w: ttfts[w][0])
        best_decode = best_prompt if self.colocated else min(tpots, key=lambda w: tpots[w][0])
        best_ttft = (ttfts[best_prompt][0], ttfts[best_prompt][1], best_prompt)
        best_tpot = (tpots[best_decode][0], best_decode, tpots[best_decode][1])
        handoff_s = best_tpot[2]
        transfer = None if self.colocated else self.model.transfer_cost()
        if transfer is not None:
            num_blocks = -(-prompt.num_prompt_tokens // self.block_size)
            handoff_s += transfer.seconds_for_blocks(num_blocks)
        path = self.model.recent_path()
        ttft_path, tpot_path = path.corrections()
        # the first gap's excess (a hand-off's) spread over the request's gaps
        first_gap_share = 1 / max(1, prompt.max_tokens - 1)
        tpot_path += path.first_gap_excess_s * first_gap_share
        return Forecast(
            ttft_s=_corrected(best_ttft[0], ttft_path),
            queue_s=best_ttft[1],
            prefill_worker_id=best_ttft[2],
            tpot_s=_corrected(best_tpot[0], tpot_path),
            decode_worker_id=best_tpot[1],
            handoff_s=handoff_s,
            ttft_path_s=ttft_path,
            tpot_path_s=tpot_path,
            steps_ttft_by_worker={w: t for w, (t, _) in ttfts.items()},
            steps_tpot_by_worker={w: t for w, (t, _) in tpots.items()},
            colocated=self.colocated,
            path=path,
            first_gap_share=first_gap_share,
        )

    def _share_ahead(self, priority: int, queued: Sequence[tuple[int, int]]) -> float:
        """The fraction of a worker's queued prompt tokens that come before a request of
        ``priority``: all of them in order of arrival."""
        if not self.by_priority or not queued:
            return 1.0
        total = sum(tokens for _, tokens in queued)
        ahead = sum(tokens for p, tokens in queued if p <= priority)
        return ahead / total if total else 1.0

    def _prefill_seconds(
        self,
        cost: StepCost,
        load: WorkerLoad,
        share: float,
        prompt: PromptToPlace,
        cached: int,
    ) -> tuple[float, float]:
        """(queue seconds, queue + own prefill seconds) of the prompt on this worker."""
        budget = self.budgets.decode if self.colocated else self.budgets.prefill
        decode_rows = decode_context = 0
        if self.colocated:  # its running sequences decode in every step
            decode_rows = min(load.num_running, budget - 1)
            decode_context = load.num_context_tokens
        room = max(1, budget - decode_rows)
        ahead = load.num_queued_prompt_tokens * share
        mean_prompt = load.num_queued_prompt_tokens / max(1, load.num_waiting)
        ahead_attention = ahead * mean_prompt / 2
        own = max(1, prompt.num_prompt_tokens - cached)
        own_attention = own * cached + own * (own + 1) / 2

        def seconds(tokens: float, attention: float) -> float:
            steps = math.ceil(tokens / room) if tokens > 0 else 0
            per_step = cost.seconds(StepShape(0, 0, decode_rows, decode_context))
            return (
                steps * per_step
                + cost.per_prefill_token_s * tokens
                + cost.per_attention_pair_s * attention
            )

        queue_s = seconds(ahead, ahead_attention)
        return queue_s, seconds(ahead + own, ahead_attention + own_attention)

    def _tpot_seconds(self, cost: StepCost, load: WorkerLoad, prompt: PromptToPlace) -> float:
        rows = load.num_running + 1
        context = load.num_context_tokens + prompt.num_prompt_tokens
        step = cost.seconds(StepShape(0, 0, rows, context))
        if not self.colocated or load.num_queued_prompt_tokens == 0:
            return step
        # a colocated worker's queued prompts go through in chunks between its decode steps:
        # their compute, spread over the request's tokens (each step holds one chunk at most)
        room = max(1, self.budgets.decode - rows)
        per_step = min(room, load.num_queued_prompt_tokens / max(1, prompt.max_tokens))
        return step + cost.per_prefill_token_s * per_step


def _corrected(steps_s: float, path_s: float) -> float:
    """A latency the steps predict, with the path's correction (which never takes away more
    than half the steps' own time)."""
    return steps_s + max(path_s, -steps_s / 2)
