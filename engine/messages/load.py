"""What a worker reports to the router: its load, for routing, and its totals, for metrics.

The router asks each worker for a ``WorkerLoad`` every report interval (an actor call), with
the cursor of the worker's KV events it has followed so far: the report carries the events
after it (engine/messages/kv_events.py). It also carries the timings of the engine steps and KV
transfers the worker ran since its last report, which the router's latency model is fitted
from (router/latency_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages.kv_events import KVEventsReply


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """Totals since the worker started; the router exports them as Prometheus counters."""

    num_generated_tokens: int = 0  # tokens sampled
    num_steps: int = 0  # engine steps that ran the model
    step_seconds: float = 0.0  # their wall time: the worker's busy time
    step_thread_cpu_seconds: float = 0.0  # the engine thread's CPU time in them
    process_cpu_seconds: float = 0.0  # the worker's process's (rank 0's), all its threads
    num_prefill_tokens: int = 0  # tokens computed for prompts (and recomputes), not decodes
    num_preemptions: int = 0  # sequences preempted for lack of KV blocks (recomputed later)
    num_prefix_cache_queried_tokens: int = 0  # prompt tokens (full blocks) looked up in the cache
    num_prefix_cache_hit_tokens: int = 0  # of those, the tokens found
    num_prefix_cache_host_hit_tokens: int = 0  # of the tokens found, those the host tier held
    num_kv_offloaded_bytes: int = 0  # KV bytes copied from the device cache to the host tier
    num_kv_loaded_bytes: int = 0  # KV bytes copied from the host tier back to the device cache
    num_kv_transfers: int = 0  # KV hand-offs sent (prefill) or received (decode)
    num_kv_transfer_bytes: int = 0  # their payload bytes
    kv_transfer_seconds: float = 0.0  # their wall time
    # speculative decoding: the times a decoding sequence asked the proposer for drafts, those
    # it got some (its step checked them), the draft tokens checked, and those that stood
    num_draft_attempts: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0  # (emitted as output)
    # mixture-of-experts models (empty otherwise): tokens each expert took, over all sparse
    # layers, and (layer, its busiest expert's tokens over the mean per expert) per sparse layer
    expert_tokens: tuple[int, ...] = ()
    expert_layer_imbalance: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One engine step that ran the model: what it computed and how long it took."""

    num_prefill_tokens: int  # prompt tokens computed (chunks, recomputes)
    # attention work of those: each prompt chunk's new tokens times the context they attend
    # to (cached prefix, earlier chunks and themselves), summed
    prefill_attention_tokens: int
    num_decode_tokens: int  # tokens of running sequences (one each, plus speculative drafts)
    decode_context_tokens: int  # KV tokens those decode rows read, summed
    seconds: float  # wall time of the step, from scheduling to its tokens applied


@dataclass(frozen=True, slots=True)
class TransferTiming:
    """One KV hand-off this worker made: its transfer, and how long it first waited for the
    decode worker's blocks. 0 blocks: none came free in time, so nothing moved (the decode
    worker computes the prompt again)."""

    num_blocks: int
    num_bytes: int
    seconds: float  # the transfer's
    transport: str  # "gloo", "shm", "nccl", "cuda_ipc", ...
    decode_worker_id: str = ""
    reserve_wait_s: float = 0.0  # from the first ask for blocks to the reservation (or giving up)


@dataclass(frozen=True, slots=True)
class BlockWait:
    """A KV hand-off of this (prefill) worker waiting, as it reports, for a decode worker's
    blocks: the latency model sees a decode worker's cache run short before any hand-off to it
    has ended its wait."""

    decode_worker_id: str
    waited_s: float  # so far: from its first ask for blocks to the report


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a worker reports to the router for routing decisions."""

    worker_id: str
    num_waiting: int  # sequences queued, not yet running
    num_running: int  # sequences in the running batch
    num_queued_prompt_tokens: int  # prompt tokens not yet computed (prefill load)
    kv_usage: float  # fraction of KV blocks in use, 0..1
    counters: WorkerCounters = field(default_factory=WorkerCounters)
    # seconds since the engine loop last finished a turn (a step, or a wait for work): it
    # grows only while a step hangs or the loop cannot run; the report itself never waits
    seconds_since_progress: float = 0.0
    # the prefix cache's KV events after the cursor the router asked with (None: it asked with
    # none, or the worker records none); the router's index takes them out of the report
    kv_events: KVEventsReply | None = None
    # KV tokens of the running sequences (what a decode step of the batch reads)
    num_context_tokens: int = 0
    # the steps and KV transfers this worker ran since its previous report (the latest few,
    # when reports were far apart); for the router's latency model
    step_timings: tuple[StepTiming, ...] = ()
    transfer_timings: tuple[TransferTiming, ...] = ()
    # a prefill worker's hand-offs waiting now for decode workers' blocks
    block_waits: tuple[BlockWait, ...] = ()
