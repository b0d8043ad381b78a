"""A prompt's own logprobs, as the front doors show them: vLLM's ``prompt_logprobs`` and the
prompt half of OpenAI's ``echo`` with ``logprobs``.

The workers compute them when ``SamplingParams.prompt_logprobs`` is set and send them once, on
the request's first token event (``TokenEvent.prompt_logprobs``: positions 1 .. of the prompt;
the first token has nothing before it). Here they become:

- vLLM's ``prompt_logprobs`` list: ``None`` for the first prompt token, then per token
  ``{token id: {"logprob", "rank", "decoded_token"}}``, the prompt token first with its own
  rank, then the N most likely tokens ranked by place (a prompt token among them keeps its
  first place in the dict and takes that rank), as vLLM's ``LogprobsProcessor`` builds them.
- the prompt's entries of a completion choice's ``logprobs`` under ``echo``: the first token
  with null ``token_logprobs`` and ``top_logprobs``, then each with at most ``logprobs + 1``
  alternatives (the prompt token first, then the top ones), as vLLM's
  ``_create_completion_logprobs`` takes them.

Logprobs of -inf are shown as -9999.0, as vLLM clamps them (JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.sampling.messages import PromptTokenLogprobs

_MIN_LOGPROB = -9999.0  # what vLLM shows for -inf

TokenText = Callable[[int], str]  # a token id decoded on its own


@dataclass(frozen=True, slots=True)
class ScoredPrompt:
    """One prompt's token ids and the logprobs the workers computed for them."""

    token_ids: Sequence[int]  # [num_prompt_tokens] the prompt as generated from
    logprobs: PromptTokenLogprobs  # positions 1 .. num_prompt_tokens - 1

    def __post_init__(self) -> None:
        expected = tuple(self.token_ids[1:])
        if self.logprobs.first_position != 1 or self.logprobs.token_ids != expected:
            raise RuntimeError(
                f"the workers' prompt logprobs cover positions {self.logprobs.first_position} .. "
                f"{self.logprobs.end_position - 1}, not the prompt's 1 .. {len(expected)}"
            )

    def positions(self) -> list[list[tuple[int, float, int]]]:
        """Per position from 1: (token id, logprob, rank) in vLLM's order, the prompt token
        first, then the top N by place, without repeating a token."""
        lps = self.logprobs
        result = []
        for token, logprob, rank, top_ids, top_lps in zip(
            lps.token_ids, lps.logprobs, lps.ranks, lps.top_token_ids, lps.top_logprobs
        ):
            entries = {token: (logprob, rank)}
            for place, (top_id, top_lp) in enumerate(zip(top_ids, top_lps), start=1):
                entries[top_id] = (top_lp, place)  # a prompt token among them keeps its place
            result.append([(t, lp, r) for t, (lp, r) in entries.items()])
        return result


def scored_prompt(token_ids: Sequence[int], logprobs: PromptTokenLogprobs | None) -> ScoredPrompt:
    """The prompt with its logprobs; a RuntimeError (a server fault) when the workers sent none
    although they were asked."""
    if logprobs is None:
        raise RuntimeError("the workers sent no prompt logprobs although they were asked")
    return ScoredPrompt(token_ids, logprobs)


PromptEntry = tuple[int, str, float, int]  # (token id, its text, logprob, rank)


@dataclass(frozen=True, slots=True)
class DecodedPrompt:
    """A scored prompt with its tokens' texts, decoded once for both of its views (vLLM's
    ``prompt_logprobs`` list and the echo's entries)."""

    token_texts: list[str]  # [num_prompt_tokens] each prompt token's text
    positions: list[list[PromptEntry]]  # per position from 1, as ``ScoredPrompt.positions``


def decode_prompt(prompt: ScoredPrompt, token_text: TokenText) -> DecodedPrompt:
    """``prompt`` with the text of each of its tokens and their alternatives."""
    positions = [
        [(token, token_text(token), logprob, rank) for token, logprob, rank in entries]
        for entries in prompt.positions()
    ]
    first = [token_text(token) for token in prompt.token_ids[:1]]  # (nothing before it)
    return DecodedPrompt([*first, *(entries[0][1] for entries in positions)], positions)


def vllm_prompt_logprobs(prompt: DecodedPrompt) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` in JSON: None, then per position the token id (a string key)
    -> its logprob, rank and decoded text."""
    result: list[dict[str, dict[str, Any]] | None] = [None]
    for entries in prompt.positions:
        result.append(
            {
                str(token): {
                    "logprob": shown_logprob(logprob),
                    "rank": rank,
                    "decoded_token": text,
                }
                for token, text, logprob, rank in entries
            }
        )
    return result


def echo_completion_logprobs(
    prompt: DecodedPrompt, num_top: int, offset: int = 0
) -> dict[str, list[Any]]:
    """The prompt's entries of a completion choice's ``logprobs`` (echo), text offsets from
    ``offset`` by each token's text, as the generated tokens' are."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    positions: list[list[PromptEntry] | None] = [None, *prompt.positions]
    for text, entries in zip(prompt.token_texts, positions):
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if entries is None:  # the first token: nothing before it
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(shown_logprob(entries[0][2]))
        top_logprobs.append({t: shown_logprob(lp) for _, t, lp, _ in entries[: num_top + 1]})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def shown_logprob(logprob: float) -> float:
    """A logprob as JSON can hold it: -inf (a token no row could sample) as vLLM's -9999.0."""
    return max(logprob, _MIN_LOGPROB)
