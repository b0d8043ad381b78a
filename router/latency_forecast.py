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
stream). A prediction needs the fits of the roles it uses: None until the workers have reported
enough steps (``pdserve serve --latency-profile`` runs a few at start-up).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.messages import WorkerLoad
from router.latency_model import LatencyModel, StepCost, StepShape


@dataclass(frozen=True, slots=True)
class PromptToPlace:
    """What the forecast knows of a request."""

    num_prompt_tokens: int
    max_tokens: int  # its output tokens, at most
    priority: int = 0
    # prompt tokens each worker's prefix cache holds (kv_aware's index); absent: none
    cached_tokens: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Forecast:
    """A prompt's predicted latencies on its best placement."""

    ttft_s: float  # queue + prefill on the prefill worker of least TTFT, + the path's
    queue_s: float  # of which the wait for the prompts ahead of it
    prefill_worker_id: str
    tpot_s: float  # decode step on the decode worker of least TPOT, + the path's
    decode_worker_id: str
    # the prompt's KV moving to it: the wait for its blocks, then the transfer (0 colocated)
    handoff_s: float
    # of ttft_s and tpot_s: the path corrections (what the steps do not see)
    ttft_path_s: float = 0.0
    tpot_path_s: float = 0.0

    @property
    def steps_ttft_s(self) -> float:
        """TTFT as the workers' steps alone predict it."""
        return self.ttft_s - self.ttft_path_s

    @property
    def steps_tpot_s(self) -> float:
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
        best_ttft: tuple[float, float, str] | None = None
        for load in prompt_workers:
            cost = self.model.step_cost(load.worker_id, prefill_role)
            if cost is None:
                return None
            share = self._share_ahead(prompt.priority, queued.get(load.worker_id, ()))
            cached = min(prompt.cached_tokens.get(load.worker_id, 0), prompt.num_prompt_tokens - 1)
            queue_s, total_s = self._prefill_seconds(cost, load, share, prompt, cached)
            if best_ttft is None or total_s < best_ttft[0]:
                best_ttft = (total_s, queue_s, load.worker_id)
        best_tpot: tuple[float, str, float] | None = None
        for load in decode_loads:
            cost = self.model.step_cost(load.worker_id, "decode")
            if cost is None:
                return None
            # a wait for the decode worker's blocks delays the second token: spread over the rest
            wait_s = 0.0 if self.colocated else self.model.reserve_wait(load.worker_id)
            tpot = self._tpot_seconds(cost, load, prompt) + wait_s / max(1, prompt.max_tokens - 1)
            if best_tpot is None or tpot < best_tpot[0]:
                best_tpot = (tpot, load.worker_id, wait_s)
        if best_ttft is None or best_tpot is None:
            return None
        handoff_s = best_tpot[2]
        transfer = None if self.colocated else self.model.transfer_cost()
        if transfer is not None:
            num_blocks = -(-prompt.num_prompt_tokens // self.block_size)
            handoff_s += transfer.seconds_for_blocks(num_blocks)
        # (a correction never takes away more than half the steps' own time)
        ttft_path, tpot_path = self.model.path_corrections()
        ttft_path = max(ttft_path, -best_ttft[0] / 2)
        tpot_path = max(tpot_path, -best_tpot[0] / 2)
        return Forecast(
            ttft_s=best_ttft[0] + ttft_path,
            queue_s=best_ttft[1],
            prefill_worker_id=best_ttft[2],
            tpot_s=best_tpot[0] + tpot_path,
            decode_worker_id=best_tpot[1],
            handoff_s=handoff_s,
            ttft_path_s=ttft_path,
            tpot_path_s=tpot_path,
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
