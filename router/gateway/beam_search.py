"""A ``use_beam_search`` request served: each prompt's search (engine/beam_search.py) asks the
cluster for one token of every running beam at a time, with the top log-probabilities it ranks
them by, each ask the prompt and the beam so far (the workers' prefix caches hold the rest, the
tenant's salt kept); the response's choices are each prompt's beams, best first, as vLLM's.

Life of a request here: admitted like any other (its ``n`` beams counted as ``n`` samples) ->
a step's asks go to the cluster together, one request each -> the searches advance -> when every
search is done, one whole response. A client that leaves, or an Abort call, aborts the asks in
flight (status 499: a search cut short has no beams to show); a server that shuts down answers
503 as for any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response

from engine.beam_search import BeamSearch, BeamSearchSequence
from engine.outputs import Logprob, PositionLogprobs
from engine.sampling.messages import TokenLogprobs
from engine.sampling.params import SamplingParams
from router.cluster import RequestFailedError
from router.gateway.auth import Caller
from router.gateway.errors import ApiError, cluster_failed, internal_error, refused
from router.gateway.openai_request import OpenAIJob
from router.gateway.openai_response import (
    ChoiceText,
    Decode,
    ResponseHeader,
    Usage,
)
from router.gateway.service import Gateway
from router.gateway.spec import GenerationSpec
from router.gateway.text_stream import GenerationBackend

logger = logging.getLogger("router.gateway")


async def respond_beams(
    gateway: Gateway,
    job: OpenAIJob,
    header: ResponseHeader,
    caller: Caller,
    disconnected: Coroutine[Any, Any, None],
) -> Response:
    """The whole response of a beam search job (``job.beam_search`` set); ``disconnected``
    returns when the client leaves."""
    with gateway.admitted(header.id, caller, job.specs) as live:
        eos = frozenset(gateway.model.eos_token_ids)
        task = asyncio.create_task(search_beams(gateway.backend, job, header.id, eos))
        client_gone = asyncio.create_task(disconnected)
        aborted = asyncio.create_task(live.aborted.wait())
        try:
            await asyncio.wait({task, client_gone, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            client_gone.cancel()
            aborted.cancel()
        if not task.done():  # the client left, an Abort call came, or the server stops
            task.cancel()
            gateway.record_outcome("aborted")
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if live.cut_off is not None:
                raise live.cut_off
            return Response(status_code=499)
        try:
            results = task.result()
        except RequestFailedError as error:
            gateway.record_outcome("failed")
            raise cluster_failed(error) from error
        except ApiError:
            gateway.count_invalid()
            raise
        except Exception as error:
            logger.exception("request %s failed", header.id)
            gateway.record_outcome("failed")
            raise internal_error(error) from error
    gateway.record_outcome("ok")
    decode = _decoder(gateway, job)
    choices = [_choice(job, beam, decode) for prompt in results.beams for beam in prompt]
    usage = Usage(
        sum(len(spec.prompt_token_ids) for spec in job.specs),
        sum(len(choice.token_ids) for choice in choices),
        sum(results.cached_tokens),
    )
    body = job.response_body(header, choices, usage, gateway.model.tokenizer, decode)
    return JSONResponse(body, headers={"X-Request-Id": header.id})


@dataclass(slots=True)
class BeamResults:
    beams: list[list[BeamSearchSequence]]  # per prompt, best first
    cached_tokens: list[int]  # per prompt: its tokens the prefix cache served on the first ask


async def search_beams(
    backend: GenerationBackend, job: OpenAIJob, request_id: str, eos: frozenset[int]
) -> BeamResults:
    """Each prompt's search run to its end; ApiError(400) for asks the workers refuse."""
    assert job.beam_search is not None
    searches = [
        BeamSearch(spec.prompt_token_ids, job.beam_search.params(spec, job.n), eos)
        for spec in job.specs
    ]
    cached: list[int] = []
    asks = itertools.count()
    while running := [(s, spec) for s, spec in zip(searches, job.specs) if not s.done]:
        pending = [(s, spec, ids) for s, spec in running for ids in s.pending()]
        answers = await asyncio.gather(
            *(
                _top_logprobs(
                    backend,
                    spec,
                    ids,
                    max(search.candidates_per_beam, job.logprobs or 0),
                    f"{request_id}-beam-{next(asks)}",
                )
                for search, spec, ids in pending
            )
        )
        if not cached:  # the first step: one ask per prompt, its prompt alone
            cached = [num_cached for _, num_cached in answers]
        positions = iter(position for position, _ in answers)
        for search, _ in running:
            search.advance([next(positions) for _ in search.pending()])
    return BeamResults([search.best() for search in searches], cached)


async def _top_logprobs(
    backend: GenerationBackend,
    spec: GenerationSpec,
    token_ids: list[int],
    num_top: int,
    request_id: str,
) -> tuple[PositionLogprobs, int]:
    """The top ``num_top`` log-probabilities of the position after ``token_ids``, and how many
    of ``token_ids`` the prefix cache served."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=num_top)
    events = backend.generate(
        token_ids,
        params,
        request_id=request_id,
        cache_salt=spec.cache_salt,
        priority=spec.priority,
    )
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                top = event.logprobs
                if top is None:
                    raise RuntimeError(f"{request_id}: the workers sent no logprobs")
                position = {
                    token_id: Logprob(logprob, rank)
                    for rank, (token_id, logprob) in enumerate(
                        zip(top.top_token_ids, top.top_logprobs), start=1
                    )
                }
                position.setdefault(
                    top.sampled_token_id, Logprob(top.sampled_logprob, top.sampled_rank)
                )
                return position, event.num_cached_tokens
    except ValueError as error:
        raise refused(error) from error
    raise RuntimeError(f"{request_id}: the cluster ended the ask without a token")


def _choice(job: OpenAIJob, beam: BeamSearchSequence, decode: Decode) -> ChoiceText:
    """One beam as a choice: its text without an eos that ended it (shown only under
    ``include_stop_str_in_output``), its tokens (usage, return_token_ids) and logprobs."""
    token_ids = beam.output_token_ids
    text = decode(beam.shown_token_ids(job.specs[0].include_stop_str_in_output))
    logprobs = [_token_logprobs(t, p, job.logprobs or 0) for t, p in zip(token_ids, beam.logprobs)]
    return ChoiceText(text, list(token_ids), logprobs, beam.finish_reason)


def _token_logprobs(token_id: int, position: PositionLogprobs, num_top: int) -> TokenLogprobs:
    chosen = position[token_id]
    top = sorted(position.items(), key=lambda item: -item[1].logprob)[:num_top]
    return TokenLogprobs(
        token_id,
        chosen.logprob,
        chosen.rank,
        tuple(t for t, _ in top),
        tuple(lp.logprob for _, lp in top),
    )


def _decoder(gateway: Gateway, job: OpenAIJob) -> Decode:
    tokenizer = gateway.model.tokenizer
    skip_special_tokens = job.specs[0].params.skip_special_tokens
    return lambda token_ids: str(
        tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
    )
