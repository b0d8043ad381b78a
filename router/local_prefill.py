"""Conditional disaggregation: when a prompt skips the prefill pool and runs on its decode worker.

A disaggregated cluster sends every new prompt to the prefill pool unless one of two rules says
its decode worker should prefill it itself, as a colocated worker would (chunked, between its
decode steps, no KV hand-off):
  short prompt     -- at most ``max_local_prompt_tokens`` tokens: the hand-off's fixed cost
                      outweighs what the decode worker's batch loses to a short prefill
  prefill backlog  -- every live prefill worker already has more than
                      ``max_prefill_queue_tokens`` prompt tokens queued, and the decode worker
                      none: the prompt starts sooner there, and the decode worker takes on one
                      such prompt at a time, which bounds what its running batch waits
Both are off by default. A third reason, "cached", is the kv_aware policy's (router/kv_aware.py). Pure Python over the load reports (with the router's charges on top).
The router counts its local prefills by reason (``pdserve:local_prefills_total{reason}``): a
steady "backlog" count means the prefill pool is too small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.messages import WorkerLoad

# "cached": the kv_aware policy found the prompt's prefix in the decode worker's own cache (a
# conversation's earlier turns, replies included) and computing the rest there costs less than
# anywhere in the prefill pool (router/kv_aware.py)
LOCAL_PREFILL_REASONS = ("short", "backlog", "cached")


@dataclass(frozen=True, slots=True)
class LocalPrefillRule:
    max_local_prompt_tokens: int = 0  # 0: no prompt is short enough
    max_prefill_queue_tokens: int | None = None  # None: the prefill pool's backlog is unbounded

    def __post_init__(self) -> None:
        if self.max_local_prompt_tokens < 0:
            raise ValueError(
                f"--max-local-prefill-length must be >= 0, got {self.max_local_prompt_tokens}"
            )
        if self.max_prefill_queue_tokens is not None and self.max_prefill_queue_tokens < 0:
            raise ValueError(
                f"--max-prefill-queue-tokens must be >= 0, got {self.max_prefill_queue_tokens}"
            )

    def reason(
        self,
        num_prompt_tokens: int,
        prefill_loads: Sequence[WorkerLoad],
        decode_load: WorkerLoad | None,
    ) -> str | None:
        """Why the decode worker with ``decode_load`` should prefill this prompt itself ("short"
        or "backlog"), or None: the prefill pool takes it."""
        if num_prompt_tokens <= self.max_local_prompt_tokens:
            return "short"
        if self.max_prefill_queue_tokens is None or not prefill_loads or decode_load is None:
            return None
        least_queued = min(w.num_queued_prompt_tokens for w in prefill_loads)
        decode_is_prefilling = decode_load.num_queued_prompt_tokens > 0
        if least_queued > self.max_prefill_queue_tokens and not decode_is_prefilling:
            return "backlog"
        return None
