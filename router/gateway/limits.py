"""Bounds on what one request may ask for. Every value here comes from an untrusted client."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling.params import MAX_LOGPROBS
from engine.scheduler import SCHEDULING_POLICIES, SchedulingPolicy


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int  # prompt + output tokens a sequence may hold (from the model)
    max_body_bytes: int = 4 << 20  # HTTP request body (413 above)
    max_tokens: int | None = None  # cap on max_tokens; None: up to the context left
    max_n: int = 16  # samples per prompt
    max_logprobs: int = MAX_LOGPROBS  # top-N logprobs per token
    max_prompts: int = 32  # prompts in one /v1/completions batch
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256  # characters in one stop string
    max_stop_token_ids: int = 64
    max_messages: int = 256  # messages in one chat request
    max_concurrent_requests: int = 512  # in flight through this gateway (429 above)
    # the workers' --scheduling-policy: a request may ask for a priority other than 0 only
    # under "priority" (vLLM refuses one under "fcfs" too)
    scheduling_policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        for name in (
            "max_model_len",
            "max_body_bytes",
            "max_n",
            "max_prompts",
            "max_stop_strings",
            "max_stop_string_chars",
            "max_stop_token_ids",
            "max_messages",
            "max_concurrent_requests",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None), got {self.max_tokens}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
