"""The sampler's input rows and its output, exchanged with the model runner once per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sampling.params import SamplingParams

if TYPE_CHECKING:  # torch-free at run time: TokenLogprobs travels to the router
    import torch


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample from: the request's params and the context penalties need."""

    params: SamplingParams  # how to choose the token
    prompt_token_ids: Sequence[int]  # the prompt; the repetition penalty covers prompt + output
    output_token_ids: Sequence[int]  # generated so far; presence/frequency penalties use these
    generator: torch.Generator | None  # per-sequence RNG when params.seed is set, else None
    banned_token_ids: Sequence[int] = ()  # never sampled this step (eos + stop ids < min_tokens)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token under the raw (unprocessed) model distribution."""

    sampled_token_id: int  # the token the sampler chose
    sampled_logprob: float  # its log-probability
    sampled_rank: int  # 1-based rank of that logprob (1 = most likely)
    top_token_ids: tuple[int, ...]  # the N most likely tokens, N = params.logprobs, desc
    top_logprobs: tuple[float, ...]  # their log-probabilities, same order


@dataclass(frozen=True, slots=True)
class PromptTokenLogprobs:
    """Logprobs of consecutive prompt tokens, each under the raw distribution the model gives
    for it from the tokens before it (vLLM's ``prompt_logprobs``).

    One step's chunk of a prompt yields one; a request's chunks, concatenated, cover positions
    1 .. num_prompt_tokens - 1 (position 0 has no logprob: nothing comes before it).
    """

    first_position: int  # prompt position of the first entry (>= 1)
    token_ids: tuple[int, ...]  # [num_positions] the prompt token at each position
    logprobs: tuple[float, ...]  # [num_positions] its logprob
    # [num_positions] its rank as vLLM counts it: the number of tokens at least as likely,
    # itself included (1 = most likely)
    ranks: tuple[int, ...]
    top_token_ids: tuple[tuple[int, ...], ...]  # [num_positions][N] most likely, N = params'
    top_logprobs: tuple[tuple[float, ...], ...]  # [num_positions][N] their logprobs, desc

    @property
    def num_positions(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        """One past the last position covered."""
        return self.first_position + len(self.token_ids)

    @classmethod
    def concat(cls, chunks: Sequence[PromptTokenLogprobs]) -> PromptTokenLogprobs:
        """One object covering ``chunks``, which must be adjacent and in position order."""
        for before, after in zip(chunks, chunks[1:]):
            if after.first_position != before.end_position:
                raise ValueError(
                    f"prompt logprobs chunks are not adjacent: one ends at position "
                    f"{before.end_position}, the next starts at {after.first_position}"
                )
        if len(chunks) == 1:
            return chunks[0]
        return cls(
            first_position=chunks[0].first_position if chunks else 1,
            token_ids=tuple(t for c in chunks for t in c.token_ids),
            logprobs=tuple(lp for c in chunks for lp in c.logprobs),
            ranks=tuple(r for c in chunks for r in c.ranks),
            top_token_ids=tuple(t for c in chunks for t in c.top_token_ids),
            top_logprobs=tuple(t for c in chunks for t in c.top_logprobs),
        )


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """What one sampler call returns, one entry per input row."""

    sampled_token_ids: list[int]  # [B] the chosen token of each row
    logprobs: list[TokenLogprobs | None]  # [B] None where params.logprobs is None
