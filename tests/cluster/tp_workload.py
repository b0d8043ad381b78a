"""What the tensor-parallel cluster tests share: a batch of random prompts, the offline engine's
greedy tokens for it on one rank, running it through a cluster, and killing a worker's follower
rank once the cluster is under load."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from engine import LLM, SamplingParams
from router.cluster import Cluster

NUM_REQUESTS = 32
LOAD_DEADLINE_S = 120.0  # how long a test waits for the load it kills a rank under


def random_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 60))] for _ in range(NUM_REQUESTS)
    ]


def offline_tokens(
    model_dir: Path, prompts: list[list[int]], params: SamplingParams, block_size: int
) -> list[list[int]]:
    """The offline engine's greedy tokens on one rank."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=block_size)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts))]


def followers(actor: Any) -> list[Any]:
    """A worker's follower rank actors (rank 1 ..), as its rank 0 actor holds them."""
    return list(ray.get(actor.__ray_call__.remote(lambda self: self._followers)))


async def _generate(cluster: Cluster, prompt: list[int], params: SamplingParams) -> list[int]:
    return [event.token_id async for event in cluster.generate(prompt, params)]


def run_all(cluster: Cluster, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Every prompt's tokens, all submitted at once."""

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(_generate(cluster, p, params) for p in prompts)))

    return asyncio.run(main())


def run_all_killing(
    cluster: Cluster,
    prompts: list[list[int]],
    params: SamplingParams,
    victim: Any,
    loaded: Callable[[Cluster], bool],
) -> tuple[bool, list[list[int]]]:
    """Every prompt's tokens, all submitted at once, with the follower rank ``victim`` killed
    as soon as ``loaded(cluster)`` holds (or at the deadline); and whether it held then."""

    async def main() -> tuple[bool, list[list[int]]]:
        tasks = [asyncio.ensure_future(_generate(cluster, p, params)) for p in prompts]
        deadline = time.monotonic() + LOAD_DEADLINE_S
        while not (held := loaded(cluster)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ray.kill(victim)
        return held, list(await asyncio.gather(*tasks))

    return asyncio.run(main())


def all_running(cluster: Cluster, role: str, num_workers: int) -> bool:
    """Whether ``num_workers`` workers of ``role`` each have a request running."""
    cluster.poll_until_reported(time.monotonic())
    loads = [s.load for s in cluster.worker_statuses() if s.load is not None and s.role == role]
    return len(loads) == num_workers and all(load.num_running > 0 for load in loads)
