"""Streamed responses: a request's sample deltas as OpenAI's Server-Sent Events chunks.

Order of a stream: for chat, each choice's role chunk (and its echo) with the first token, as
vLLM sends them, then the choices' chunks as their deltas arrive, one per token (chat:
reasoning, content or tool calls, shaped by ``ChatDeltas``, or ``content: ""`` for a token with
nothing to show yet, text held back included, as vLLM sends it; completions: text, possibly
empty, with the echo and logprobs), a last chunk per choice that an Abort call ended, the usage
chunk when asked for (``stream_options.include_usage``; with vLLM's ``continuous_usage_stats``
every chunk carries its choice's usage so far), and ``data: [DONE]``. An error after the 200 is
the stream's last event before ``[DONE]``. ``EventStreamResponse`` aborts the requests as soon
as the client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from router.cluster import RequestFailedError
from router.gateway.choice_prompts import echoed_logprobs, shown
from router.gateway.errors import ApiError, cluster_failed, internal_error
from router.gateway.openai_request import OpenAIJob
from router.gateway.openai_response import (
    ChoiceText,
    Echo,
    LogprobsFormatter,
    ResponseHeader,
    TokenIds,
    Usage,
    chat_chunk,
    completion_chunk,
    output_decoder,
    total_usage,
    usage_chunk,
    with_reasoning_tokens,
)
from router.gateway.service import Gateway, LiveRequest
from router.gateway.text_stream import SampleDelta, TextGeneration, merged_deltas
from router.gateway.tool_calls import ChatDeltas

logger = logging.getLogger(__name__)


class StreamEvents(Protocol):
    """How a stream's chunks go out as server-sent events."""

    def start(self) -> list[bytes]:
        """The events before the first chunk."""
        ...

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """A chunk's events."""
        ...

    def end(self) -> list[bytes]:
        """The events after the last chunk, when the stream did not fail."""
        ...

    def error(self, error: ApiError) -> bytes:
        """The event of a failure after the 200."""
        ...

    def done(self) -> list[bytes]:
        """The stream's last events, whichever way it ended."""
        ...


class ChunkEvents:
    """Chat and completions streams: each chunk one ``data:`` event, an error the body of its
    response, ``data: [DONE]`` last."""

    def start(self) -> list[bytes]:
        return []

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        return [_sse(chunk)]

    def end(self) -> list[bytes]:
        return []

    def error(self, error: ApiError) -> bytes:
        return _sse(error.body())

    def done(self) -> list[bytes]:
        return [b"data: [DONE]\n\n"]


async def event_stream(
    gateway: Gateway,
    job: OpenAIJob,
    header: ResponseHeader,
    generations: list[TextGeneration],
    live: LiveRequest,
    events: StreamEvents | None = None,
) -> AsyncGenerator[bytes, None]:
    """``events``: how the chunks go out (None: as chat's or completions' chunks)."""
    shape = events or ChunkEvents()
    chunks = _chunks(gateway, job, header, generations, live)
    for event in shape.start():
        yield event
    try:  # after the 200, an error is the stream's last event before [DONE]
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                for event in shape.chunk(chunk):
                    yield event
        if live.cut_off is None:
            for event in shape.end():
                yield event
    except RequestFailedError as error:
        gateway.record_outcome("failed")
        yield shape.error(cluster_failed(error))
    except ApiError as error:  # the workers refused the request (text_stream.refused)
        gateway.count_invalid()
        yield shape.error(error)
    except Exception as error:
        logger.exception("stream %s failed", header.id)
        gateway.record_outcome("failed")
        yield shape.error(internal_error(error))
    if live.cut_off is not None:  # the server shut down before it finished
        yield shape.error(live.cut_off)
    for event in shape.done():
        yield event


async def _chunks(
    gateway: Gateway,
    job: OpenAIJob,
    header: ResponseHeader,
    generations: list[TextGeneration],
    live: LiveRequest,
) -> AsyncGenerator[dict[str, Any], None]:
    formatter = job.logprobs_formatter(gateway.model.tokenizer)
    offsets = [0] * (len(generations) * job.n)  # text offsets for completion logprobs
    unfinished = set(range(len(offsets)))
    echo = Echo(job.echo_texts, job.n)
    token_ids = TokenIds(job.returned_prompt_token_ids(), job.n)  # completions' return_token_ids
    chat_deltas = ChatDeltas(job.tool_calls, job.reasoning)  # reasoning, content or calls
    # under a reasoning parser, each choice's output, whose thought's tokens the usage counts
    counted = job.reasoning is not None and job.include_usage
    outputs = [ChoiceText() for _ in offsets] if counted else None
    usage = _ChunkUsage(job, [g.num_prompt_tokens for g in generations for _ in range(job.n)])
    # chat's role chunks go out with the first token, as vLLM sends them (not at the start: a
    # client that times its first chunk times the first token)
    unopened = job.kind == "chat"
    deltas = merged_deltas(generations, live.aborted)
    try:
        async with contextlib.aclosing(deltas):  # aborts in the cluster on any exit
            async for prompt_index, delta in deltas:
                if unopened:
                    unopened = False
                    for chunk in _chat_openers(job, header, echo, usage):
                        yield chunk
                index = prompt_index * job.n + delta.index
                usage.completion_tokens[index] += len(delta.token_ids)
                if delta.finish_reason is not None:
                    unfinished.discard(index)
                if outputs is not None:
                    outputs[index].add(delta)
                if job.kind == "chat":
                    logprobs = formatter.chat(delta.logprobs) if formatter else None
                    message, finish = chat_deltas.delta(index, delta.text, delta.finish_reason)
                    if not message and finish is None:  # a token with nothing to show yet
                        message = {"content": ""}
                    shown_ids = delta.token_ids if job.return_token_ids else None
                    chunk = chat_chunk(
                        header, index, message, finish, logprobs, delta.stop_reason, shown_ids
                    )
                else:
                    generation = generations[prompt_index]
                    chunk = _completion_chunk(
                        job, header, index, delta, echo, token_ids, generation, formatter, offsets
                    )
                yield usage.stamped(chunk, index)
    except (asyncio.CancelledError, anyio.get_cancelled_exc_class(), GeneratorExit):
        gateway.record_outcome("aborted")
        raise
    if live.aborted.is_set():  # an Abort call cut it short: end each choice as gRPC does
        if unopened:
            for chunk in _chat_openers(job, header, echo, usage):
                yield chunk
        for index in sorted(unfinished):
            chunk = _aborted_chunk(job, header, index, echo.first(index), token_ids)
            yield usage.stamped(chunk, index)
    gateway.record_ended(generations, live)
    if job.include_usage:
        name = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        yield usage_chunk(header, name, _usage(job, generations, outputs))


def _chat_openers(
    job: OpenAIJob, header: ResponseHeader, echo: Echo, usage: _ChunkUsage
) -> list[dict[str, Any]]:
    """A chat stream's first chunks: each choice's role (with its prompt's token ids under
    vLLM's return_token_ids, as vLLM sends them), then its echoed last message."""
    choices = range(len(usage.completion_tokens))
    prompts = job.returned_prompt_token_ids()  # (chat: one prompt)
    chunks = []
    for index in choices:
        chunk = chat_chunk(header, index, {"role": "assistant", "content": ""}, None, None)
        if prompts is not None:
            chunk["prompt_token_ids"] = list(prompts[0])
        chunks.append(usage.stamped(chunk, index))
    for index in choices:
        if text := echo.first(index):
            chunk = chat_chunk(header, index, {"content": text}, None, None)
            chunks.append(usage.stamped(chunk, index))
    return chunks


def _usage(
    job: OpenAIJob, generations: list[TextGeneration], outputs: list[ChoiceText] | None
) -> Usage:
    """The request's usage, with the tokens of the choices' thought under a reasoning parser
    (``outputs``: the choices' outputs then)."""
    usage = total_usage(generations)
    if outputs is None:
        return usage
    return with_reasoning_tokens(usage, outputs, job.reasoning, output_decoder(generations[0]))


def _completion_chunk(
    job: OpenAIJob,
    header: ResponseHeader,
    index: int,
    delta: SampleDelta,
    echo: Echo,
    token_ids: TokenIds,
    generation: TextGeneration,
    formatter: LogprobsFormatter | None,
    offsets: list[int],
) -> dict[str, Any]:
    """Choice ``index``'s chunk of ``delta``: its first carries the echo (and, with logprobs,
    the prompt's entries first) and, under return_token_ids, the prompt's token ids;
    ``offsets[index]`` moves on by the tokens' text, as the whole response counts it."""
    delta = shown(job, delta)
    logprobs = None
    if formatter is not None:
        offset = offsets[index]
        head = echoed_logprobs(job, echo, index, generation, formatter, offset)
        logprobs = formatter.completion(delta.logprobs, offset, head)
        offsets[index] += sum(map(len, logprobs["tokens"]))
    delta = dataclasses.replace(delta, text=echo.first(index) + delta.text)
    return completion_chunk(header, index, delta, logprobs, token_ids)


def _aborted_chunk(
    job: OpenAIJob, header: ResponseHeader, index: int, echo: str, token_ids: TokenIds
) -> dict[str, Any]:
    """The last chunk of a choice that an Abort call ended: no text but its echo, if it had not
    been sent yet (and its prompt's token ids under return_token_ids); finish_reason "abort"."""
    if job.kind == "chat":
        return chat_chunk(header, index, {}, "abort", None)
    delta = SampleDelta(index % job.n, echo, [], [], "abort")
    return completion_chunk(header, index, delta, None, token_ids)


@dataclass(slots=True)
class _ChunkUsage:
    """What a stream's chunks carry as ``usage`` when it was asked for: null until the usage
    chunk, or under vLLM's ``continuous_usage_stats`` each chunk's choice's usage so far (its
    prompt's tokens, the choice's completion tokens: 0 in chat's role chunk)."""

    job: OpenAIJob
    prompt_tokens: list[int]  # per choice
    completion_tokens: list[int] = field(init=False)  # per choice, the tokens streamed so far

    def __post_init__(self) -> None:
        self.completion_tokens = [0] * len(self.prompt_tokens)

    def stamped(self, chunk: dict[str, Any], index: int) -> dict[str, Any]:
        if not self.job.include_usage:
            return chunk
        chunk["usage"] = None
        if self.job.continuous_usage:
            prompt, completion = self.prompt_tokens[index], self.completion_tokens[index]
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        return chunk


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (and abort the requests) as soon as the client leaves.

    Starlette only notices a disconnect on the next write under ASGI 2.4; this listens for it
    all along, so a queued request is aborted too. The events' generator is closed on the way
    out, whichever way that is: a cancellation that lands while a chunk is being sent never
    reaches the generator, which would otherwise be left to the garbage collector, and the
    requests would run on in the cluster until it came round.
    """

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        on_close: Callable[[], object],
        request_id: str | None = None,
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if request_id is not None:  # the response's id, as OpenAI's x-request-id
            headers["X-Request-Id"] = request_id
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._on_close = on_close  # after the generator: gives the request's slot back

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self._events.aclose()
            finally:
                self._on_close()
