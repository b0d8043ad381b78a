"""An engine's bookkeeping for one request, and the RequestOutput built from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    PromptLogprobs,
    RequestOutput,
)
from engine.sampling import PromptTokenLogprobs, SamplingParams, TokenLogprobs
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    params: SamplingParams
    num_samples: int  # samples this engine produces (n, or the unfinished ones it was handed)
    seqs: dict[int, Sequence] = field(default_factory=dict)  # by sample index
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # by sample index
    arrived_at: float = field(default_factory=time.monotonic)  # when the engine took it
    queue_seconds: float | None = None  # arrival to first scheduled step; None while waiting
    # the prompt logprobs computed so far, chunk by chunk in position order; None when this
    # engine does not give them (not asked, or the request was resumed or received here)
    prompt_logprobs_chunks: list[PromptTokenLogprobs] | None = None

    @property
    def parent(self) -> Sequence:
        return self.seqs[min(self.seqs)]

    @property
    def is_finished(self) -> bool:
        return len(self.seqs) == self.num_samples and all(s.is_finished for s in self.seqs.values())

    @property
    def is_handed_off(self) -> bool:
        """Every sample is finished or waits, handed off, for the decode side."""
        done = (SequenceStatus.FINISHED, SequenceStatus.HANDED_OFF)
        return len(self.seqs) == self.num_samples and all(
            s.status in done for s in self.seqs.values()
        )

    def record(self, seq: Sequence, token_logprobs: TokenLogprobs | None) -> None:
        self.seqs.setdefault(seq.sample_index, seq)
        if token_logprobs is not None:
            self.logprobs.setdefault(seq.sample_index, []).append(token_logprobs)

    def record_prompt_logprobs(self, chunk: PromptTokenLogprobs) -> None:
        assert self.prompt_logprobs_chunks is not None, "prompt logprobs were not asked"
        self.prompt_logprobs_chunks.append(chunk)

    @property
    def prompt_logprobs(self) -> PromptTokenLogprobs | None:
        """Every prompt position's logprobs so far, in one object (None when not given here)."""
        if self.prompt_logprobs_chunks is None:
            return None
        return PromptTokenLogprobs.concat(self.prompt_logprobs_chunks)

    def output(self) -> RequestOutput:
        completions = []
        for index in sorted(self.seqs):
            seq = self.seqs[index]
            token_lps = self.logprobs.get(index)
            completions.append(
                CompletionOutput(
                    index=index,
                    text="",
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=(
                        sum(lp.sampled_logprob for lp in token_lps) if token_lps else None
                    ),
                    logprobs=[position_logprobs(lp) for lp in token_lps] if token_lps else None,
                    finish_reason=seq.finish_reason,
                )
            )
        parent = self.parent
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=self.is_finished,
            num_cached_tokens=parent.num_cached_prompt_tokens,
            prompt_logprobs=prompt_position_logprobs(self.prompt_logprobs),
        )


def position_logprobs(lp: TokenLogprobs) -> PositionLogprobs:
    """One position's logprobs by token. A token's rank is 1 + the number of tokens strictly
    more likely, as ``sampled_rank`` counts it: tied tokens share a rank (ranked by their
    place in the top list, a sampled token tied for first read rank 2 here and 1 elsewhere)."""
    position = {}
    rank = 0
    for place, (token, logprob) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
        if place == 1 or logprob < lp.top_logprobs[place - 2]:  # the list is descending
            rank = place
        position[token] = Logprob(logprob, rank)
    position.setdefault(lp.sampled_token_id, Logprob(lp.sampled_logprob, lp.sampled_rank))
    return position


def prompt_position_logprobs(lps: PromptTokenLogprobs | None) -> PromptLogprobs | None:
    """vLLM's ``RequestOutput.prompt_logprobs``: None for position 0, then per position the
    prompt token first, with its own rank (the number of tokens at least as likely), then the
    top-N ranked by place (1..N), as vLLM's ``LogprobsProcessor._make_logprob_dict`` builds
    them; a prompt token among the top-N keeps its place there and takes that rank."""
    if lps is None:
        return None
    assert lps.first_position == 1, "prompt logprobs must cover the prompt from position 1"
    result: PromptLogprobs = [None]
    for token, logprob, rank, top_ids, top_lps in zip(
        lps.token_ids, lps.logprobs, lps.ranks, lps.top_token_ids, lps.top_logprobs
    ):
        position = {token: Logprob(logprob, rank)}
        for place, (top_id, top_lp) in enumerate(zip(top_ids, top_lps), start=1):
            position[top_id] = Logprob(top_lp, place)
        result.append(position)
    return result
