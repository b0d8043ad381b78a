"""Routing policies: which prefill worker runs a prompt, which decode worker continues it.

Pure Python over the workers' latest load reports; no Ray, no torch. Policies:
  round_robin     -- each pool in turn
  least_loaded    -- prefill: fewest queued prompt tokens; decode: lowest KV usage, then fewest
                     running sequences
  prefix_affinity -- a prompt sharing a long prefix with recent prompts goes to the prefill
                     worker that ran them (its prefix cache has the blocks), unless that worker
                     is loaded well beyond the least-loaded one; otherwise least_loaded
  kv_aware        -- by what each worker's cache really holds (router/kv_aware.py)
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.kv_cache.prefix_hash import BlockHash, extend_block_hashes
from engine.messages import WorkerLoad

# kv_aware (router/kv_aware.py) routes by the workers' own KV events; router.placements makes
# the policy a cluster is configured with
POLICY_NAMES = ("round_robin", "least_loaded", "prefix_affinity", "kv_aware")


@dataclass(frozen=True, slots=True)
class RoutingInfo:
    request_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str | None = None


class RoutingPolicy(Protocol):
    def choose_prefill(self, request: RoutingInfo, loads: Sequence[WorkerLoad]) -> str: ...

    def choose_decode(self, request: RoutingInfo, loads: Sequence[WorkerLoad]) -> str: ...


def _require(loads: Sequence[WorkerLoad], pool: str) -> None:
    if not loads:
        raise NoWorkerError(f"no live {pool} worker")


class NoWorkerError(RuntimeError):
    """No worker of the needed pool is alive: the request cannot be placed now."""


class RoundRobin:
    def __init__(self) -> None:
        self._prefill = itertools.count()
        self._decode = itertools.count()

    def choose_prefill(self, request: RoutingInfo, loads: Sequence[WorkerLoad]) -> str:
        _require(loads, "prefill")
        return sorted(w.worker_id for w in loads)[next(self._prefill) % len(loads)]

    def choose_decode(self, request: RoutingInfo, loads: Sequence[WorkerLoad]) -> str:
        _require(loads, "decode")
        return sorted(w.worker_id for w in loads)[next(self._decode) % len(loads)]


class LeastLoaded:
    def choose_prefill(self, request: RoutingInfo, loads: Sequence[WorkerLoad]) -> str:
        _require(loads, "prefill")
        return min(loads, key=_prefill_load).worker_id

    def choose_decode(self, request: RoutingInfo, loads: Sequence[WorkerLoad]) -> str:
        _require(loads, "decode")
        return min(loads, key=decode_order).worker_id


def _prefill_load(load: WorkerLoad) -> tuple[int, int, str]:
    return (load.num_queued_prompt_tokens, load.num_waiting, load.worker_id)


def decode_order(load: WorkerLoad) -> tuple[float, int, str]:
    """least_loaded's order of decode workers: KV usage (to 1 %), sequences, worker id."""
    return (round(load.kv_usage, 2), load.num_running + load.num_waiting, load.worker_id)


class PrefixAffinity:
    """Sends prompts to the prefill worker that recently ran their longest shared prefix.

    The router remembers, per prefill worker, the block hashes (the engine's own chained
    prefix hashes, salt included) of prompts it sent there, up to ``max_remembered_blocks``
    (oldest forgotten first). A match of at least ``min_prefix_blocks`` wins if that worker's
    queued prompt tokens exceed the least-loaded worker's by at most ``max_extra_tokens``.
    """

    def __init__(
        self,
        block_size: int,
        min_prefix_blocks: int = 2,
        max_extra_tokens: int = 4096,
        max_remembered_blocks: int = 100_000,
    ) -> None:
        self.block_size = block_size
        self.min_prefix_blocks = min_prefix_blocks
        self.max_extra_tokens = max_extra_tokens
        self.max_remembered_blocks = max_remembered_blocks
        self._owners: OrderedDict[BlockHash, str] = OrderedDict()  # block hash -> worker id
        self._fallback = LeastLoaded()

    def choose_prefill(self, request: RoutingInfo, loads: Sequence[WorkerLoad]) -> str:
        _require(loads, "prefill")
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, request.prompt_token_ids, self.block_size, request.cache_salt)
        chosen = self._affine_worker(hashes, loads) or self._fallback.choose_prefill(request, loads)
        self._remember(hashes, chosen)
        return chosen

    def choose_decode(self, request: RoutingInfo, loads: Sequence[WorkerLoad]) -> str:
        return self._fallback.choose_decode(request, loads)

    def _affine_worker(self, hashes: list[BlockHash], loads: Sequence[WorkerLoad]) -> str | None:
        live = {w.worker_id: w for w in loads}
        matched: dict[str, int] = {}
        for depth, block_hash in enumerate(hashes, start=1):
            owner = self._owners.get(block_hash)
            if owner is None:
                break
            matched[owner] = depth
        candidates = [
            (depth, worker)
            for worker, depth in matched.items()
            if worker in live and depth >= self.min_prefix_blocks
        ]
        if not candidates:
            return None
        least = min(w.num_queued_prompt_tokens for w in loads)
        for _, worker in sorted(candidates, reverse=True):
            if live[worker].num_queued_prompt_tokens - least <= self.max_extra_tokens:
                return worker
        return None

    def _remember(self, hashes: list[BlockHash], worker_id: str) -> None:
        for block_hash in hashes:
            self._owners[block_hash] = worker_id
            self._owners.move_to_end(block_hash)
        while len(self._owners) > self.max_remembered_blocks:
            self._owners.popitem(last=False)
