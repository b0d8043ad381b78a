"""The prompt's part of each choice of an OpenAI response: vLLM's ``prompt_logprobs`` (whole
responses) and, under completions' ``echo``, the prompt's logprobs entries (with ``logprobs``)
and the prompt alone (``max_tokens`` 0), as vLLM's OpenAI server shows them.

A choice is ``prompt index * n + sample``; every choice of a prompt shows the same prompt
logprobs, which the workers send once with the prompt's first token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from router.gateway.openai_request import OpenAIJob
from router.gateway.openai_response import ChoiceText, Echo, LogprobsFormatter
from router.gateway.prompt_logprobs import (
    decode_prompt,
    echo_completion_logprobs,
    vllm_prompt_logprobs,
)
from router.gateway.text_stream import SampleDelta, TextGeneration


def shown(job: OpenAIJob, delta: SampleDelta) -> SampleDelta:
    """``delta`` as its choice shows it: echo with max_tokens 0 shows no generated token (the
    one the workers had to generate), only the finish reason, as vLLM does."""
    if not job.echo_only:
        return delta
    return dataclasses.replace(delta, text="", token_ids=[], logprobs=[])


def add_prompt_logprobs(
    job: OpenAIJob,
    choices: Sequence[ChoiceText],
    generations: Sequence[TextGeneration],
    formatter: LogprobsFormatter,
    aborted: bool,
) -> None:
    """Give each choice of a whole response its prompt's logprobs, where the job shows them;
    each prompt is decoded once for both views (vLLM's list, whose tokens are their texts, and
    echo's entries, which show tokens as the logprobs do: ``token_id:ID`` under
    ``return_tokens_as_token_ids``) and all its choices.

    A request an Abort call cut short before its first token has none to give; otherwise a
    prompt the workers sent none for is a server fault (RuntimeError)."""
    if not (job.show_prompt_logprobs or job.echo_logprobs):
        return
    for prompt_index, generation in enumerate(generations):
        if aborted and generation.prompt_logprobs is None:
            continue
        scored = generation.scored_prompt()
        prompt = decode_prompt(scored, formatter.token_text)
        listed = vllm_prompt_logprobs(prompt) if job.show_prompt_logprobs else None
        echoed = None
        if job.echo_logprobs and job.logprobs is not None:
            if formatter.as_token_ids:
                prompt = decode_prompt(scored, formatter.shown_token)
            echoed = echo_completion_logprobs(prompt, job.logprobs)
        for choice in choices[prompt_index * job.n : (prompt_index + 1) * job.n]:
            choice.prompt_logprobs, choice.echo_logprobs = listed, echoed


def echoed_logprobs(
    job: OpenAIJob,
    echo: Echo,
    index: int,
    generation: TextGeneration,
    formatter: LogprobsFormatter,
    offset: int,
) -> dict[str, list[Any]] | None:
    """The prompt's logprobs entries that lead choice ``index``'s next stream chunk: its first
    (the one that carries the echo) under echo with logprobs; else None. Read before the echo
    is handed out (``echo.first``)."""
    if not job.echo_logprobs or job.logprobs is None or not echo.pending(index):
        return None
    prompt = decode_prompt(generation.scored_prompt(), formatter.shown_token)
    return echo_completion_logprobs(prompt, job.logprobs, offset)
