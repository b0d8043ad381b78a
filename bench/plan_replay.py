"""A served run's requests simulated again by the planner (bench.plan_accuracy): their send
times, lengths and prompts' token ids (those sharing a system prompt start alike)."""

from __future__ import annotations

import random

from bench.serving.metrics import RequestRecord
from router.planner.plan import Layout, Planner
from router.planner.simulator import Simulation, WorkloadRequest

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
                shared[prefix_id] = tuple(rng.randrange(3, 4000) for _ in range(prefix_len))
            prompt = shared[prefix_id][: max(0, record.prompt_len - 1)]
        rest = record.prompt_len - len(prompt)
        prompts.append(prompt + tuple(rng.randrange(3, 4000) for _ in range(rest)))
    return prompts
