"""The ``kv_aware`` routing policy: prompts go where their KV already is, weighed against queues.

For each candidate prefill worker the router's KV index (router/kv_index.py, built from the
workers' own KV events) gives the longest prefix of the prompt the worker holds, on device and
on device-or-host. The worker's cost for the prompt, in prompt tokens' worth of work:

    cost = tokens to compute                       (prompt - cached, at least one token)
         + host_hit_weight * tokens hit in host    (their copy back to the device)
         + queue_weight * queued prompt tokens     (the worker's backlog, load report + routed)

and the cheapest worker wins (ties: fewer queued tokens, fewer waiting, then worker id; with no
hits anywhere that is least_loaded's choice). A prompt's hashes carry its tenant's salt, so one
tenant's cached blocks never attract another's prompts.

Decode workers publish their caches too, and after a conversation's turn the decode worker that
generated the reply holds the whole conversation so far (the prompt it received and the reply's
blocks). So a decode worker holding a prefix of the prompt is a candidate as well: it would
prefill the rest itself, with no hand-off, at the same cost with its own queue and each token it
computes weighed by ``local_prefill_weight`` (its running batch waits meanwhile). When one of
them is cheaper than every prefill worker, the prompt goes there (a local prefill, reason
"cached"); else to the cheapest prefill worker, and its decode worker is least_loaded's:
lowest KV usage, then fewest sequences (also for a request resumed after a worker's loss). Where
decode workers prefill every prompt (colocated) they are chosen by the same cost as prefill
workers.

Every decision is logged at debug level with its inputs (each candidate's hits per tier, queue
and cost), and its hit tokens per tier are counted (``PrefixHitStats``, exported as the
``pdserve:routed_prefix_hit_tokens`` histogram).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv_cache.prefix_hash import BlockHash, extend_block_hashes
from engine.messages import WorkerLoad
from router.kv_index import KVIndex, PrefixHits
from router.policies import LeastLoaded, NoWorkerError, RoutingInfo, decode_order

logger = logging.getLogger("router.kv_aware")
# upper bounds of the hit-token histogram's buckets (a prompt's hit tokens per routed request)
HIT_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


@dataclass(frozen=True, slots=True)
class KVAwareWeights:
    """How ``kv_aware`` weighs a prefill worker's hits against its queue (``--kv-aware-*``)."""

    # one queued prompt token delays this prompt as much as this many tokens of its own compute
    # (below 1: a token computed where the prefix is not also delays every prompt queued after
    # it; 0.25 served the multi-turn chat benchmark best, docs/benchmarks.md)
    queue_weight: float = 0.25
    # a token found in a worker's host tier costs this fraction of computing it (its copy back)
    host_hit_weight: float = 0.1
    # a prompt token a decode worker computes (its running batch waits) costs this many tokens
    # computed on a prefill worker
    local_prefill_weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.queue_weight >= 0:
            raise ValueError(f"--kv-aware-queue-weight must be >= 0, got {self.queue_weight}")
        if not 0 <= self.host_hit_weight <= 1:
            raise ValueError(
                f"--kv-aware-host-hit-weight must be in [0, 1], got {self.host_hit_weight}"
            )
        if not self.local_prefill_weight >= 0:
            raise ValueError(
                f"--kv-aware-local-prefill-weight must be >= 0, got {self.local_prefill_weight}"
            )


@dataclass(slots=True)
class PrefixHitStats:
    """Prompts routed by ``kv_aware`` and the cached tokens found on their chosen worker."""

    num_routed: int = 0
    device_hit_tokens: int = 0  # summed over routed prompts
    host_hit_tokens: int = 0
    # per bucket of HIT_TOKEN_BUCKETS (and one over the last): prompts whose hit tokens (device
    # and host) were at most the bucket's bound and above the one before
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(HIT_TOKEN_BUCKETS) + 1))

    def count(self, device_tokens: int, host_tokens: int) -> None:
        self.num_routed += 1
        self.device_hit_tokens += device_tokens
        self.host_hit_tokens += host_tokens
        total = device_tokens + host_tokens
        bucket = next(
            (i for i, bound in enumerate(HIT_TOKEN_BUCKETS) if total <= bound),
            len(HIT_TOKEN_BUCKETS),
        )
        self.bucket_counts[bucket] += 1

    def snapshot(self) -> PrefixHitStats:
        return PrefixHitStats(
            self.num_routed, self.device_hit_tokens, self.host_hit_tokens, list(self.bucket_counts)
        )


@dataclass(frozen=True, slots=True)
class _Candidate:
    worker_id: str
    device_tokens: int  # prompt tokens its KV cache holds
    host_tokens: int  # tokens after those that its host tier holds
    queued_tokens: int
    num_waiting: int
    cost: float

    def describe(self) -> str:
        return (
            f"{self.worker_id}: hit device {self.device_tokens} host {self.host_tokens}, "
            f"queued {self.queued_tokens}, cost {self.cost:.0f}"
        )


class KVAware:
    def __init__(
        self,
        block_size: int,
        index: KVIndex,
        weights: KVAwareWeights | None = None,
        *,
        colocated: bool = False,  # the decode workers prefill every prompt (no prefill pool)
    ) -> None:
        self.block_size = block_size
        self.index = index
        self.weights = weights or KVAwareWeights()
        self.colocated = colocated
        self.stats = PrefixHitStats()
        self._decode = LeastLoaded()

    def choose_prefill(self, request: RoutingInfo, loads: Sequence[WorkerLoad]) -> str:
        return self._choose(request, loads, "prefill")

    def choose_decode(self, request: RoutingInfo, loads: Sequence[WorkerLoad]) -> str:
        """The decode worker: least_loaded's, where a prefill worker hands the prompt to it;
        colocated, where it prefills the prompt itself, the cheapest by the cost above (ties
        in least_loaded's order)."""
        if not self.colocated:
            return self._decode.choose_decode(request, loads)
        return self._choose(request, loads, "decode")

    def _choose(self, request: RoutingInfo, loads: Sequence[WorkerLoad], pool: str) -> str:
        """The cheapest worker of ``pool`` for the prompt, its decision counted."""
        if not loads:
            raise NoWorkerError(f"no live {pool} worker")
        hashes = self.prompt_hashes(request)
        chosen, candidates = self._cheapest(
            request, hashes, loads, compute_weight=1.0, decode=pool == "decode"
        )
        self._count(request, chosen, candidates)
        return chosen.worker_id

    def choose_cached_decode(
        self,
        request: RoutingInfo,
        prefill_loads: Sequence[WorkerLoad],
        decode_loads: Sequence[WorkerLoad],
    ) -> str | None:
        """A decode worker that holds a prefix of the prompt and would prefill the rest for
        less than any prefill worker; None: the prefill pool takes the prompt (then counted
        by ``choose_prefill``)."""
        hashes = self.prompt_hashes(request)
        hits = self.index.prefix_hits([w.worker_id for w in decode_loads], hashes)
        holding = [w for w in decode_loads if hits[w.worker_id].num_blocks > 0]
        if not holding or not prefill_loads:
            return None
        weight = self.weights.local_prefill_weight
        local, locals_ = self._cheapest(
            request, hashes, holding, compute_weight=weight, decode=True, hits=hits
        )
        pooled, _ = self._cheapest(request, hashes, prefill_loads, compute_weight=1.0)
        if local.cost >= pooled.cost:
            return None
        self._count(request, local, locals_)
        return local.worker_id

    def _cheapest(
        self,
        request: RoutingInfo,
        hashes: list[BlockHash],
        loads: Sequence[WorkerLoad],
        *,
        compute_weight: float,
        decode: bool = False,
        hits: dict[str, PrefixHits] | None = None,
    ) -> tuple[_Candidate, list[_Candidate]]:
        """The cheapest of ``loads`` for the prompt (whose ``hashes`` are given), and every
        candidate; ``decode``: ties go by least_loaded's decode order (KV usage, then
        sequences); ``hits``: the index's answer for them, where the caller has it already."""
        num_prompt_tokens = len(request.prompt_token_ids)
        if hits is None:
            hits = self.index.prefix_hits([w.worker_id for w in loads], hashes)
        candidates = [
            self._candidate(load, hits[load.worker_id], num_prompt_tokens, compute_weight)
            for load in loads
        ]
        if decode:
            order = {w.worker_id: decode_order(w) for w in loads}
            chosen = min(candidates, key=lambda c: (c.cost, order[c.worker_id]))
        else:
            chosen = min(
                candidates, key=lambda c: (c.cost, c.queued_tokens, c.num_waiting, c.worker_id)
            )
        return chosen, candidates

    def _count(
        self, request: RoutingInfo, chosen: _Candidate, candidates: list[_Candidate]
    ) -> None:
        """Count a decision's hits and log its inputs (debug)."""
        self.stats.count(chosen.device_tokens, chosen.host_tokens)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv_aware %s (%d prompt tokens) -> %s; %s",
                request.request_id,
                len(request.prompt_token_ids),
                chosen.worker_id,
                "; ".join(c.describe() for c in candidates),
            )

    def prompt_hashes(self, request: RoutingInfo) -> list[BlockHash]:
        """The prefix hashes of the prompt's full blocks that a cache can serve (the engine
        always computes the last prompt token, so a prompt of whole blocks leaves its last
        block out)."""
        num_usable = (len(request.prompt_token_ids) - 1) // self.block_size
        hashes: list[BlockHash] = []
        extend_block_hashes(
            hashes, request.prompt_token_ids, self.block_size, request.cache_salt, num_usable
        )
        return hashes

    def _candidate(
        self, load: WorkerLoad, hits: PrefixHits, num_prompt_tokens: int, compute_weight: float
    ) -> _Candidate:
        device_tokens = hits.num_device_blocks * self.block_size
        host_tokens = hits.num_host_blocks * self.block_size
        to_compute = num_prompt_tokens - device_tokens - host_tokens
        cost = (
            compute_weight * to_compute
            + self.weights.host_hit_weight * host_tokens
            + self.weights.queue_weight * load.num_queued_prompt_tokens
        )
        return _Candidate(
            load.worker_id,
            device_tokens,
            host_tokens,
            load.num_queued_prompt_tokens,
            load.num_waiting,
            cost,
        )
