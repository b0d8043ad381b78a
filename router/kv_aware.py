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
blocks). So a decode worker holding a prefix of the prompt offers two more ways
(``choose_reuse``): it prefills the rest itself, with no hand-off, at the same cost with its own
queue and each token it computes weighed by ``local_prefill_weight`` (its running batch waits
meanwhile); or a prefill worker copies the prefix's blocks it lacks from it, each token copied
weighed by ``move_weight``, computes the rest at its own cost, and hands back to it only the
blocks it does not hold. When one of them is cheaper than every prefill worker computing from
its own cache, the prompt goes that way (a local prefill, reason "cached"; or a fetch); else to
the cheapest prefill worker, and its decode worker is least_loaded's: lowest KV usage, then
fewest sequences (also for a request resumed after a worker's loss). Where decode workers
prefill every prompt (colocated) they are chosen by the same cost as prefill workers.

Every decision is logged at debug level with its inputs (each candidate's hits per tier, queue
and cost), and its hit tokens per tier are counted (``PrefixHitStats``, exported as the
``pdserve:routed_prefix_hit_tokens`` histogram).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from engine.kv_cache.prefix_hash import BlockHash, servable_block_hashes
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
    # a prompt token whose KV a prefill worker copies from a decode worker's cache costs this
    # fraction of computing it (measured: 0.0005-0.054 on the CPU machine, docs/benchmarks.md)
    move_weight: float = 0.05
    # a decode worker whose KV usage has reached this fraction is sent no more prompts for its
    # cached prefix (a local prefill or a fetch would grow its conversations there until it
    # preempts); they go the pooled way, to least_loaded's decode worker
    holder_kv_limit: float = 0.9

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
        if not 0 <= self.move_weight <= 1:
            raise ValueError(f"--kv-aware-move-weight must be in [0, 1], got {self.move_weight}")
        if not 0 < self.holder_kv_limit <= 1:
            raise ValueError(
                f"--kv-aware-holder-kv-limit must be in (0, 1], got {self.holder_kv_limit}"
            )


@dataclass(slots=True)
class PrefixHitStats:
    """Prompts routed by ``kv_aware`` and the cached tokens found on their chosen worker."""

    num_routed: int = 0
    device_hit_tokens: int = 0  # summed over routed prompts
    host_hit_tokens: int = 0
    num_fetches: int = 0  # prompts whose prefill worker copies a prefix from a decode worker
    fetched_tokens: int = 0  # the prompt tokens those copy (planned), summed
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

    def count_fetch(self, tokens: int) -> None:
        self.num_fetches += 1
        self.fetched_tokens += tokens

    def snapshot(self) -> PrefixHitStats:
        return replace(self, bucket_counts=list(self.bucket_counts))


@dataclass(frozen=True, slots=True)
class Reuse:
    """``choose_reuse``'s answer: a prompt goes to the decode worker caching its prefix."""

    decode_worker_id: str  # caches a prefix of the prompt, and decodes the reply
    # None: the decode worker prefills the rest itself; else this prefill worker does
    prefill_worker_id: str | None
    # the prefill worker first copies the prompt's first this many blocks from the decode
    # worker's cache (0 for a local prefill)
    fetch_blocks: int


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
        fetch: bool = True,  # prefill workers may copy prefixes from decode workers' caches
    ) -> None:
        self.block_size = block_size
        self.index = index
        self.weights = weights or KVAwareWeights()
        self.colocated = colocated
        self.fetch = fetch
        # the routing info last hashed, and its hashes: ``choose_reuse`` then ``choose_prefill``
        # ask for the same prompt's (the router decides one request at a time)
        self._last_hashed: tuple[RoutingInfo, list[BlockHash]] | None = None
        # and, when ``choose_reuse`` sent it the pooled way, the prefill workers' costs it
        # weighed, with the loads they came from: the ``choose_prefill`` after it takes them
        self._last_pooled: (
            tuple[RoutingInfo, Sequence[WorkerLoad], tuple[_Candidate, list[_Candidate]]] | None
        ) = None
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
        # the prefill pool's costs ``choose_reuse`` computed for this request and these loads
        # just before, when it found nothing cheaper (taken once)
        weighed, self._last_pooled = self._last_pooled, None
        if weighed is not None and weighed[0] is request and weighed[1] is loads:
            chosen, candidates = weighed[2]
        else:
            hashes = self.prompt_hashes(request)
            chosen, candidates = self._cheapest(
                request, hashes, loads, compute_weight=1.0, decode=pool == "decode"
            )
        self._count(request, chosen, candidates)
        return chosen.worker_id

    def choose_reuse(
        self,
        request: RoutingInfo,
        prefill_loads: Sequence[WorkerLoad],
        decode_loads: Sequence[WorkerLoad],
    ) -> Reuse | None:
        """Where a prompt whose prefix a decode worker caches goes, when that is cheaper than
        any prefill worker computing it from its own cache: the decode worker prefills the rest
        itself (a local prefill), or a prefill worker copies the prefix from it, computes the
        rest and hands it back (only the rest moves back). None: neither is cheaper, the prefill
        pool takes the prompt as usual (then counted by ``choose_prefill``)."""
        hashes = self.prompt_hashes(request)
        hits = self.index.prefix_hits([w.worker_id for w in decode_loads], hashes)
        limit = self.weights.holder_kv_limit
        holding = [
            w for w in decode_loads if hits[w.worker_id].num_blocks > 0 and w.kv_usage < limit
        ]
        if not holding or not prefill_loads:
            return None
        weight = self.weights.local_prefill_weight
        local, locals_ = self._cheapest(
            request, hashes, holding, compute_weight=weight, decode=True, hits=hits
        )
        pooled, pooled_all = self._cheapest(request, hashes, prefill_loads, compute_weight=1.0)
        fetch = self._cheapest_fetch(request, holding, hits, pooled_all) if self.fetch else None
        if min(local.cost, math.inf if fetch is None else fetch[2]) >= pooled.cost:
            self._last_pooled = (request, prefill_loads, (pooled, pooled_all))  # for choose_prefill
            return None
        if fetch is None or local.cost <= fetch[2]:
            self._count(request, local, locals_)
            return Reuse(local.worker_id, None, 0)
        holder, prefill, cost = fetch
        num_blocks = hits[holder].num_device_blocks
        held = num_blocks * self.block_size
        fetched = replace(prefill, device_tokens=held, cost=cost)
        self._count(request, fetched, [*locals_, *pooled_all], fetching_from=holder)
        self.stats.count_fetch(held - prefill.device_tokens)
        return Reuse(holder, prefill.worker_id, num_blocks)

    def _cheapest_fetch(
        self,
        request: RoutingInfo,
        holding: Sequence[WorkerLoad],
        hits: dict[str, PrefixHits],
        prefill_candidates: list[_Candidate],
    ) -> tuple[str, _Candidate, float] | None:
        """The cheapest (decode worker, prefill worker, cost) where the prefill worker copies
        the prefix the decode worker caches beyond its own device hits and computes the rest;
        None when no decode worker holds more than a prefill worker."""
        num_prompt_tokens = len(request.prompt_token_ids)
        best: tuple[str, _Candidate, float] | None = None
        for load in holding:  # (what a decode worker's host tier holds is not lent)
            held = hits[load.worker_id].num_device_blocks * self.block_size
            for prefill in prefill_candidates:
                moved = held - prefill.device_tokens
                if moved <= 0:
                    continue
                cost = (
                    num_prompt_tokens
                    - held
                    + self.weights.move_weight * moved
                    + self.weights.queue_weight * prefill.queued_tokens
                )
                if best is None or cost < best[2]:
                    best = (load.worker_id, prefill, cost)
        return best

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
        self,
        request: RoutingInfo,
        chosen: _Candidate,
        candidates: list[_Candidate],
        *,
        fetching_from: str | None = None,
    ) -> None:
        """Count a decision's hits and log its inputs (debug)."""
        self.stats.count(chosen.device_tokens, chosen.host_tokens)
        if logger.isEnabledFor(logging.DEBUG):
            fetch = "" if fetching_from is None else f" fetching from {fetching_from}"
            logger.debug(
                "kv_aware %s (%d prompt tokens) -> %s%s (cost %.0f); %s",
                request.request_id,
                len(request.prompt_token_ids),
                chosen.worker_id,
                fetch,
                chosen.cost,
                "; ".join(c.describe() for c in candidates),
            )

    def prompt_hashes(self, request: RoutingInfo) -> list[BlockHash]:
        """The prefix hashes of the prompt's full blocks that a cache can serve (the engine
        always computes the last prompt token, so a prompt of whole blocks leaves its last
        block out)."""
        last = self._last_hashed
        if last is not None and last[0] is request:  # (asked again for the same decision)
            return last[1]
        hashes = servable_block_hashes(
            request.prompt_token_ids, self.block_size, request.cache_salt
        )
        self._last_hashed = (request, hashes)
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
