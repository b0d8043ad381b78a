"""What the offline API and the workers hand back, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float  # natural log of the token's probability under the raw model distribution
    rank: int  # 1-based rank of the token in that distribution
    decoded_token: str | None = None  # the token's text, when a tokenizer is loaded


# One dict per generated position: token id -> Logprob (the sampled token plus the top-N).
PositionLogprobs = dict[int, Logprob]
# One entry per prompt token, as vLLM's: None for the first (nothing comes before it), then the
# prompt token's Logprob plus the top-N of the distribution it was drawn from (see
# ``request_state.prompt_position_logprobs``).
PromptLogprobs = list[PositionLogprobs | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # token_ids as text, less the stop token and a cut character ("" untokenized)
    token_ids: list[int]  # generated tokens
    cumulative_logprob: float | None  # sum of sampled tokens' logprobs when logprobs were asked
    logprobs: list[PositionLogprobs] | None  # per generated position, when asked
    finish_reason: Literal["stop", "length", "abort"] | None  # None while still generating


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None  # the text prompt, when one was given
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per sample, in index order
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # when params.prompt_logprobs is set
