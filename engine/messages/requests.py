"""A request into a worker and its tokens out, between the router's gateway and a worker.

A request enters a worker as a ``GenerateRequest`` (an actor call from the router); tokens
leave as ``TokenEvent``s, batched into one ``OutputBatch`` per engine step per gateway (never
one message per token), on the worker's output stream to that gateway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages.first_token import FirstTokenTrace
from engine.messages.kv_events import KVEventsReply
from engine.sampling.messages import PromptTokenLogprobs, TokenLogprobs
from engine.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str  # assigned by the gateway, unique in the cluster
    prompt_token_ids: list[int]  # tokenized prompt
    params: SamplingParams  # how to sample, and when to stop
    gateway_id: str = "default"  # which gateway's output stream receives the tokens
    cache_salt: str | None = None  # tenant salt for prefix-cache isolation
    # lower runs first under the scheduling policy "priority" (vLLM's); only 0 under "fcfs"
    priority: int = 0
    # Tokens a client already received per sample (sample index -> token ids), when a request
    # is recomputed after the worker that ran it died: generation continues after them.
    resume_token_ids: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str  # the request the token belongs to
    sample_index: int  # which of the request's n samples
    position: int  # index of token_id among the sample's output tokens (for de-duplication)
    token_id: int  # the sampled token
    logprobs: TokenLogprobs | None  # when the request asked for logprobs
    finish_reason: str | None  # set on the sample's last token: "stop" | "length" | "abort"
    num_cached_tokens: int = 0  # on position 0: prompt tokens served by the prefix cache
    queue_seconds: float = 0.0  # on position 0: arrival at the worker to first scheduled
    # on sample 0's position 0, when the request asked for prompt logprobs: those of every
    # prompt position from 1 (once per request, from the worker that ran the prompt)
    prompt_logprobs: PromptTokenLogprobs | None = None
    # on sample 0's position 0, from a worker's EngineLoop: the times the token passed each hop
    # so far (the router and gateway add theirs); None on every other event
    first_token_trace: FirstTokenTrace | None = None


@dataclass(frozen=True, slots=True)
class RequestFailure:
    request_id: str  # the request that ends here without its tokens
    message: str  # why the request cannot complete here (shown to the client if final)
    retryable: bool = False  # another worker may still complete it (e.g. a hand-off's peer died)


@dataclass(frozen=True, slots=True)
class OutputBatch:
    worker_id: str  # the worker that produced these events
    events: list[TokenEvent]  # every token its last step produced for this gateway
    failures: list[RequestFailure] = field(default_factory=list)  # requests that failed here
    # wall clock (time.time()) when the worker's output stream took the batch off its queue to
    # send it; None until then
    streamed_at: float | None = None
    # the worker's KV events since the ones its last batch to this gateway carried (None: it
    # records none, or none came since); the router's index applies them at once, so a
    # conversation's next turn finds the blocks its reply just filled (the load poll's copy of
    # them, up to a report interval later, is applied once only)
    kv_events: KVEventsReply | None = None
