"""Messages between the router and the workers. Torch-free: the router imports this module.

A request enters a worker as a ``GenerateRequest``; tokens leave as ``TokenEvent``s, batched
into one ``OutputBatch`` per engine step per gateway (never one message per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling.messages import PromptTokenLogprobs, TokenLogprobs
from engine.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str  # assigned by the gateway, unique in the cluster
    prompt_token_ids: list[int]  # tokenized prompt
    params: SamplingParams
    gateway_id: str = "default"  # which gateway's output stream receives the tokens
    cache_salt: str | None = None  # tenant salt for prefix-cache isolation
    # lower runs first under the scheduling policy "priority" (vLLM's); only 0 under "fcfs"
    priority: int = 0
    # Tokens a client already received per sample (sample index -> token ids), when a request
    # is recomputed after the worker that ran it died: generation continues after them.
    resume_token_ids: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str
    sample_index: int  # which of the request's n samples
    position: int  # index of token_id among the sample's output tokens (for de-duplication)
    token_id: int
    logprobs: TokenLogprobs | None  # when the request asked for logprobs
    finish_reason: str | None  # set on the sample's last token: "stop" | "length" | "abort"
    num_cached_tokens: int = 0  # on position 0: prompt tokens served by the prefix cache
    queue_seconds: float = 0.0  # on position 0: arrival at the worker to first scheduled
    # on sample 0's position 0, when the request asked for prompt logprobs: those of every
    # prompt position from 1 (once per request, from the worker that ran the prompt)
    prompt_logprobs: PromptTokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class RequestFailure:
    request_id: str
    message: str  # why the request cannot complete here (shown to the client if final)
    retryable: bool = False  # another worker may still complete it (e.g. a hand-off's peer died)


@dataclass(frozen=True, slots=True)
class OutputBatch:
    worker_id: str  # the worker that produced these events
    events: list[TokenEvent]  # every token its last step produced for this gateway
    failures: list[RequestFailure] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """Totals since the worker started; the router exports them as Prometheus counters."""

    num_generated_tokens: int = 0  # tokens sampled
    num_prefill_tokens: int = 0  # tokens computed for prompts (and recomputes), not decodes
    num_preemptions: int = 0  # sequences preempted for lack of KV blocks (recomputed later)
    num_prefix_cache_queried_tokens: int = 0  # prompt tokens (full blocks) looked up in the cache
    num_prefix_cache_hit_tokens: int = 0  # of those, the tokens found
    num_kv_transfers: int = 0  # KV hand-offs sent (prefill) or received (decode)
    num_kv_transfer_bytes: int = 0  # their payload bytes
    kv_transfer_seconds: float = 0.0  # their wall time
    num_draft_tokens: int = 0  # speculative decoding: draft tokens computed and checked
    num_accepted_draft_tokens: int = 0  # of those, the ones that stood (emitted as output)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a worker reports to the router for routing decisions."""

    worker_id: str
    num_waiting: int  # sequences queued, not yet running
    num_running: int  # sequences in the running batch
    num_queued_prompt_tokens: int  # prompt tokens not yet computed (prefill load)
    kv_usage: float  # fraction of KV blocks in use, 0..1
    counters: WorkerCounters = field(default_factory=WorkerCounters)
