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
class SamplerOutput:
    """What one sampler call returns, one entry per input row."""

    sampled_token_ids: list[int]  # [B] the chosen token of each row
    logprobs: list[TokenLogprobs | None]  # [B] None where params.logprobs is None
