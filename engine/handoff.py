"""What a prefill engine hands to a decode engine when prefill and decode run apart.

The prefill side runs the prompt, samples each sample's first token and keeps the prompt's KV
blocks under a lease; the ``PrefillResult`` travels (through the router) to the decode side,
which reserves blocks, receives the KV into them and admits the samples that are not finished.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling import SamplingParams, TokenLogprobs


@dataclass(frozen=True, slots=True)
class SampleStart:
    index: int  # which of the request's n samples
    first_token_id: int  # the token the prefill side sampled
    logprobs: TokenLogprobs | None  # its logprobs, when asked
    finish_reason: str | None  # set when the first token already ended this sample
    generator_state: bytes | None  # seeded samples: RNG state after the first draw


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None  # tenant salt, so the decode side's prefix hashes match
    samples: tuple[SampleStart, ...]  # one per sample, in index order
    block_ids: list[int]  # prefill-side blocks holding the prompt's KV, under lease
    num_cached_tokens: int  # prompt tokens the prefill side served from its prefix cache
    priority: int = 0  # the request's scheduling priority, kept on the decode side

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def unfinished_samples(self) -> tuple[SampleStart, ...]:
        return tuple(s for s in self.samples if s.finish_reason is None)


@dataclass(frozen=True, slots=True)
class Reservation:
    """A decode worker's answer to a prefill worker's reserve: blocks for the prompt's KV, and
    the KV channel it keeps open for their transfer."""

    block_ids: list[int]
    # the channel the prefill worker asked for, pinned open on the decode side until the
    # receive ends; None when the decode side has no such channel open (it closed it)
    channel_id: str | None
