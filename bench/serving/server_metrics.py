"""A server's own counters from its Prometheus ``/metrics`` page: prompt tokens, prompt tokens
computed, prefix-cache lookups and hits, and their change over a run, for pdserve or vLLM.

pdserve (names ``pdserve:``): prompt tokens are the gateway's ``prompt_tokens_total`` (of
finished prompts); computed are ``worker_prefill_tokens_total`` summed over the workers (prompt
tokens the workers ran through the model, recomputes included); hits and queries are
``prefix_cache_hits_total`` and ``prefix_cache_queries_total`` summed over the workers (tokens of
full blocks; pdserve counts as queried the blocks a lookup reached: up to its first miss, and
that one). vLLM: prompt tokens are ``vllm:prompt_tokens_total``; computed is
``vllm:prompt_tokens_by_source_total{source="local_compute"}`` where it is exported, else the
prompt tokens less ``vllm:prompt_tokens_cached_total``, else less ``vllm:prefix_cache_hits_total``;
hits and queries are ``vllm:prefix_cache_hits_total`` and ``vllm:prefix_cache_queries_total``.

The prefix hit rate reported is hits over prompt tokens, the share of prompt tokens the cache
served, measured the same way for both servers. pdserve's worker counters reach ``/metrics``
with the router's load polls (every 0.5 s), so ``settled_counters`` reads until two reads a
second apart agree.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

ServerKind = Literal["pdserve", "vllm"]
_SETTLE_PAUSE_S = 1.0  # between two reads that must agree (pdserve's load polls: 0.5 s)
_MAX_SETTLE_READS = 15

Samples = Mapping[tuple[str, frozenset[tuple[str, str]]], float]  # (name, labels) -> value


@dataclass(frozen=True, slots=True)
class ServerCounters:
    """Counter totals of one server (or their change between two readings); None where the
    page lacked the counter (a pdserve page before any worker reported, an older vLLM)."""

    server: ServerKind
    prompt_tokens: float | None  # prompt tokens of the requests served
    prefill_tokens_computed: float | None  # of those (and of recomputes), the ones computed
    prefix_cache_queries: float | None  # tokens looked up in the prefix cache (its measure)
    prefix_cache_hits: float | None  # tokens the prefix cache served
    totals: dict[str, float] = field(default_factory=dict)  # every *_total, summed over labels
    # pdserve: every *_total of the workers, summed over those of each role: (name, role)
    role_totals: dict[tuple[str, str], float] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float | None:
        """The share of prompt tokens the prefix cache served; None without both counters or
        without prompt tokens."""
        if self.prefix_cache_hits is None or not self.prompt_tokens:
            return None
        return self.prefix_cache_hits / self.prompt_tokens

    def since(self, before: ServerCounters) -> ServerCounters:
        """The change from ``before`` (an earlier reading of the same server) to this one."""
        return ServerCounters(
            self.server,
            _minus(self.prompt_tokens, before.prompt_tokens),
            _minus(self.prefill_tokens_computed, before.prefill_tokens_computed),
            _minus(self.prefix_cache_queries, before.prefix_cache_queries),
            _minus(self.prefix_cache_hits, before.prefix_cache_hits),
            {k: v - before.totals.get(k, 0.0) for k, v in self.totals.items()},
            {k: v - before.role_totals.get(k, 0.0) for k, v in self.role_totals.items()},
        )

    def key_values(self) -> tuple[float | None, ...]:
        return (
            self.prompt_tokens,
            self.prefill_tokens_computed,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
        )


def _minus(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def parse_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text page, keyed by name and labels."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            samples[key] = float(sample.value)
    return samples


def _total(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels``; None when it has none."""
    wanted = set(labels.items())
    values = [v for (n, ls), v in samples.items() if n == name and wanted <= ls]
    return math.fsum(values) if values else None


def counters_from_text(text: str) -> ServerCounters | None:
    """The counters of a pdserve or vLLM ``/metrics`` page; None for a page of neither."""
    samples = parse_samples(text)
    names = {name for name, _ in samples}
    totals = {n: _total(samples, n) or 0.0 for n in sorted(names) if n.endswith("_total")}
    if any(n.startswith("pdserve:") for n in names):
        return ServerCounters(
            "pdserve",
            _total(samples, "pdserve:prompt_tokens_total"),
            _total(samples, "pdserve:worker_prefill_tokens_total"),
            _total(samples, "pdserve:prefix_cache_queries_total"),
            _total(samples, "pdserve:prefix_cache_hits_total"),
            totals,
            _role_totals(samples),
        )
    if any(n.startswith("vllm:") for n in names):
        prompt = _total(samples, "vllm:prompt_tokens_total")
        hits = _total(samples, "vllm:prefix_cache_hits_total")
        queries = _total(samples, "vllm:prefix_cache_queries_total")
        computed = _vllm_computed(samples, prompt, hits)
        return ServerCounters("vllm", prompt, computed, queries, hits, totals)
    return None


def _role_totals(samples: Samples) -> dict[tuple[str, str], float]:
    """Each ``*_total`` sample labelled with a worker role, summed over that role's workers."""
    found: dict[tuple[str, str], float] = {}
    for (name, labels), value in samples.items():
        role = dict(labels).get("role")
        if role is not None and name.endswith("_total"):
            found[name, role] = found.get((name, role), 0.0) + value
    return found


def _vllm_computed(
    samples: Samples, prompt_tokens: float | None, hits: float | None
) -> float | None:
    local = _total(samples, "vllm:prompt_tokens_by_source_total", source="local_compute")
    if local is not None:
        return local
    cached = _total(samples, "vllm:prompt_tokens_cached_total")
    return _minus(prompt_tokens, cached if cached is not None else hits)


def metrics_url(base_url: str) -> str:
    """The ``/metrics`` URL of the server whose OpenAI base URL (``.../v1``) is ``base_url``."""
    root = base_url.rstrip("/")
    root = root.removesuffix("/v1")
    return f"{root}/metrics"


async def read_counters(
    client: httpx.AsyncClient, url: str, headers: Mapping[str, str]
) -> ServerCounters | None:
    """The server's counters now; None when the page cannot be read or is neither server's."""
    try:
        response = await client.get(url, headers=dict(headers))
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return counters_from_text(response.text)
    except ValueError:  # not a Prometheus page
        return None


async def settled_counters(
    client: httpx.AsyncClient,
    url: str,
    headers: Mapping[str, str],
    pause_s: float = _SETTLE_PAUSE_S,
    max_reads: int = _MAX_SETTLE_READS,
) -> ServerCounters | None:
    """The server's counters once two reads ``pause_s`` apart agree (or the last of
    ``max_reads``); None when the page cannot be read."""
    last = await read_counters(client, url, headers)
    for _ in range(max_reads - 1):
        if last is None:
            return None
        await asyncio.sleep(pause_s)
        now = await read_counters(client, url, headers)
        if now is not None and now.key_values() == last.key_values():
            return now
        last = now
    return last
