"""A served run's requests simulated again by the planner (bench.plan_accuracy): their send
times, lengths and prompts' token ids (those sharing a system prompt start alike; a
conversation's next turn holds its earlier turn's prompt and reply)."""

from __future__ import annotations

import random

from bench.serving.metrics import RequestRecord
from router.planner.plan import Layout, Planner
from router.planner.simulator import SAMPLED_TOKEN, Simulation, WorkloadRequest

Prompts = list[tuple[int, ...]]  # each request's prompt token ids, as simulated


def replay(
    planner: Planner,
    layout: Layout,
    records: tuple[RequestRecord, ...],
    prompts: Prompts | None = None,
) -> Simulation:
    """The planner's simulation of ``layout`` serving the requests as they were sent (with
    ``prompts``' token ids, by default each its own)."""
    prompts = prompts or replay_prompts(records)
    requests = [
        WorkloadRequest(r.send_time_s, prompt, r.output_len)
        for r, prompt in zip(records, prompts, strict=True)
    ]
    return Simulation(planner.cluster(layout), requests)


def replay_prompts(
    records: tuple[RequestRecord, ...],
    prefix_ids: list[int | None] | None = None,
    prefix_len: int = 0,
) -> Prompts:
    """Token ids for the requests' prompts, of their lengths: those of one ``prefix_ids`` start
    with the same ``prefix_len`` tokens (a shared system prompt), the rest drawn for each."""
    rng = random.Random(0)
    shared: dict[int, tuple[int, ...]] = {}
    prompts = []
    for i, record in enumerate(records):
        prefix_id = None if prefix_ids is None else prefix_ids[i]
        prompt: tuple[int, ...] = ()
        if prefix_id is not None and prefix_len:
            if prefix_id not in shared:
                shared[prefix_id] = _tokens(rng, prefix_len)
            prompt = shared[prefix_id][: max(0, record.prompt_len - 1)]
        rest = record.prompt_len - len(prompt)
        prompts.append(prompt + _tokens(rng, rest))
    return prompts


def replay_conversations(records: tuple[RequestRecord, ...], system_len: int) -> Prompts:
    """Token ids for a multi-turn run's prompts (bench/serving/conversations.py): every
    conversation's first turn starts with one system prompt of ``system_len`` tokens, and each
    next turn with its earlier turn's prompt and reply (as the simulation samples it), then new
    tokens to its served length."""
    rng = random.Random(0)
    system = _tokens(rng, system_len)
    order = sorted(
        range(len(records)),
        key=lambda i: (records[i].conversation_id or 0, records[i].turn_index or 0),
    )
    prompts: list[tuple[int, ...]] = [()] * len(records)
    history: dict[int, tuple[int, ...]] = {}  # conversation -> its last prompt and reply
    for i in order:
        record = records[i]
        conversation = record.conversation_id
        before = system if conversation is None else history.get(conversation, system)
        before = before[: max(0, record.prompt_len - 1)]
        prompt = before + _tokens(rng, record.prompt_len - len(before))
        prompts[i] = prompt
        if conversation is not None:
            history[conversation] = prompt + (SAMPLED_TOKEN,) * record.output_tokens
    return prompts


def _tokens(rng: random.Random, num_tokens: int) -> tuple[int, ...]:
    """``num_tokens`` token ids drawn from ``rng`` (none special in the tiny vocabulary)."""
    return tuple(rng.randrange(3, 4000) for _ in range(num_tokens))
