"""Running a multi-turn workload: conversations arrive on schedule, and each sends its next turn
as soon as the reply to the one before has ended.

A run passes through: warm-up (the first turns of other conversations, one by one, untimed; the
first also asks for the reply's token ids, and a server that refuses or ignores
``return_token_ids`` gets every later request without it) -> conversations started at their
arrival offsets (``arrivals``: gamma gaps between conversations, Poisson by default; a
``max_concurrency`` bounds the conversations in flight) -> in each, turn k+1 sent when turn k's
stream has ended, its prompt turn k's, then the reply's token ids, then the new user tokens
(``conversations.next_prompt``) -> the records, in workload order. A turn that fails ends its
conversation: its later turns are recorded as failed, unsent.

Without the server's token ids a reply's ids are its text encoded again by the tokenizer, which
need not be the ids the server generated: the next prompt then extends the conversation only
up to the reply, and a prefix cache may miss from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Literal

import httpx

from bench.serving.arrivals import ArrivalSpec, send_offsets
from bench.serving.client import EndpointConfig, Reply, stream_reply
from bench.serving.conversations import Conversation, build_conversations, next_prompt
from bench.serving.metrics import RequestRecord
from bench.serving.progress import Progress
from bench.serving.tokens import TokenCodec
from bench.serving.workloads import WorkloadSpec

ReplyIdsSource = Literal["server", "tokenizer"]  # where a run's reply token ids came from


class WarmUpError(RuntimeError):
    """A warm-up request failed (a wrong model name or key would fail every request)."""


async def warm_up_conversations(
    client: httpx.AsyncClient,
    endpoint: EndpointConfig,
    codec: TokenCodec,
    spec: WorkloadSpec,
    num_warmups: int,
    seed: int,
) -> EndpointConfig:
    """Send ``max(num_warmups, 1)`` first turns of a workload of ``seed`` one by one; the
    endpoint to run with: asking for the replies' token ids if the server returned them."""
    conversations = build_conversations(
        dataclasses.replace(spec, num_conversations=max(num_warmups, 1)), codec, seed
    )
    endpoint = dataclasses.replace(endpoint, return_token_ids=True)
    for number, conversation in enumerate(conversations):
        request = conversation.request(0, conversation.first_prompt())
        record, reply = await stream_reply(
            client, endpoint, request, codec.count, time.perf_counter()
        )
        if number == 0:  # the probe: does the server return the replies' token ids?
            if not record.success and "return_token_ids" in record.error:
                endpoint = dataclasses.replace(endpoint, return_token_ids=False)
                record, reply = await stream_reply(
                    client, endpoint, request, codec.count, time.perf_counter()
                )
            elif reply.token_ids is None:
                endpoint = dataclasses.replace(endpoint, return_token_ids=False)
        if not record.success:
            raise WarmUpError(f"warm-up request to {endpoint.url} failed: {record.error}")
    return endpoint


def reply_ids_source(endpoint: EndpointConfig) -> ReplyIdsSource:
    return "server" if endpoint.return_token_ids else "tokenizer"


async def send_conversations(
    client: httpx.AsyncClient,
    endpoint: EndpointConfig,
    codec: TokenCodec,
    conversations: list[Conversation],
    arrivals: ArrivalSpec,
    seed: int,
    progress: Progress,
) -> tuple[list[RequestRecord], float]:
    """Run every conversation from its arrival offset; the records of all turns in workload
    order and the seconds until the last ended."""
    offsets = send_offsets(arrivals, len(conversations), seed)
    bound = arrivals.max_concurrency
    slots = asyncio.Semaphore(bound) if bound is not None else None
    origin = time.perf_counter()

    async def converse(conversation: Conversation) -> list[RequestRecord]:
        async with slots if slots is not None else contextlib.nullcontext():
            return await _converse(client, endpoint, codec, conversation, origin, progress)

    tasks = []
    for conversation, offset in zip(conversations, offsets):
        delay = origin + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(converse(conversation)))
    records = [record for turns in await asyncio.gather(*tasks) for record in turns]
    duration_s = time.perf_counter() - origin
    progress.close()
    return records, duration_s


async def _converse(
    client: httpx.AsyncClient,
    endpoint: EndpointConfig,
    codec: TokenCodec,
    conversation: Conversation,
    origin: float,
    progress: Progress,
) -> list[RequestRecord]:
    """One conversation's turns, each sent when the previous one has ended."""
    records: list[RequestRecord] = []
    prompt = conversation.first_prompt()
    for turn_index in range(len(conversation.turns)):
        request = conversation.request(turn_index, prompt)
        record, reply = await stream_reply(client, endpoint, request, codec.count, origin)
        records.append(record)
        progress.advance(record.success)
        if not record.success:
            break
        if turn_index + 1 < len(conversation.turns):
            next_turn = conversation.turns[turn_index + 1]
            prompt = next_prompt(prompt, reply_token_ids(reply, codec), next_turn)
    error = f"not sent: turn {len(records) - 1} of its conversation failed"
    for turn_index in range(len(records), len(conversation.turns)):  # after a failed turn
        unsent = RequestRecord(
            index=conversation.request(turn_index, prompt).index,
            prompt_len=0,
            output_len=conversation.turns[turn_index].reply_len,
            success=False,
            error=error,
            conversation_id=conversation.conversation_id,
            turn_index=turn_index,
        )
        records.append(unsent)
        progress.advance(False)
    return records


def reply_token_ids(reply: Reply, codec: TokenCodec) -> tuple[int, ...]:
    """The reply's token ids as the server sent them; else its text encoded again."""
    if reply.token_ids is not None:
        return reply.token_ids
    return tuple(codec.encode(reply.text))
