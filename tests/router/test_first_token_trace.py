"""The router's part of a first token's trace: ``Cluster.generate`` yields the first token with
every stamp from the cluster's entry to its own yield, in path order, whichever worker sampled
it (a prefill worker, a colocated one, or a decode worker that prefilled the prompt itself).

Workers run their engine loops in this process (``loop_actors``); only Ray is left out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.messages import TokenEvent
from engine.messages.first_token import HOPS, STAMPS
from engine.sampling.params import SamplingParams
from router.local_prefill import LocalPrefillRule
from tests.router.fake_actors import use_fake_ray
from tests.router.loop_actors import loop_cluster

# the stamps the router and worker take (the gateway's come before and after)
ROUTER_STAMPS = STAMPS[STAMPS.index("entered") : STAMPS.index("yielded") + 1]


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    use_fake_ray(monkeypatch)
    yield


async def _events(cluster: object, prompt: list[int], max_tokens: int) -> list[TokenEvent]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    stream = cluster.generate(prompt, params, request_id="r1")  # type: ignore[attr-defined]
    return [event async for event in stream]


@pytest.mark.parametrize(
    ("num_prefill", "local_prefill", "worker"),
    [
        (1, LocalPrefillRule(), "prefill-0"),
        (0, None, "decode-0"),
        (1, LocalPrefillRule(8), "decode-0"),
    ],
    ids=["prefill-worker", "colocated", "local-prefill"],
)
def test_the_first_token_is_yielded_with_every_router_stamp_in_order(
    llama_dir: Path, num_prefill: int, local_prefill: LocalPrefillRule | None, worker: str
) -> None:
    config = {} if local_prefill is None else {"local_prefill": local_prefill}
    workers = loop_cluster(llama_dir, num_prefill, **config)
    try:
        before = time.time()
        # from a prefill worker only the first token comes (no hand-off): ask for one
        events = asyncio.run(
            asyncio.wait_for(
                _events(workers.cluster, [5, 6, 7, 8], 1 if worker != "decode-0" else 3), 30
            )
        )
        after = time.time()
    finally:
        workers.stop()
    first, *rest = events
    trace = first.first_token_trace
    assert trace is not None and trace.worker_id == worker
    stamps = [trace.stamp(name) for name in ROUTER_STAMPS]
    assert None not in stamps, dict(zip(ROUTER_STAMPS, stamps, strict=True))
    path = [before, *stamps, after]
    assert path == sorted(path), dict(zip(ROUTER_STAMPS, stamps, strict=True))
    submitted = trace.submit_sent_at
    assert submitted is not None and trace.submit_returned_at is not None
    assert submitted <= trace.submit_returned_at <= after
    hops = trace.hops()
    assert list(hops) == list(HOPS[HOPS.index("place") : HOPS.index("event_loop") + 1])
    assert all(event.first_token_trace is None for event in rest)
