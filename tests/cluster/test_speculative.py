"""Speculative decoding on the cluster (``--speculative-config``): greedy output is the offline
engine's without speculation, token for token, and the decode workers draft while the prefill
workers never do. Prompts repeat a random block three times, so prompt lookup finds n-grams.
With a draft model (the target itself here), a decode worker's drafter computes its own cache of
each prompt handed off to it: then every greedy draft stands."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from engine import LLM, SamplingParams
from engine.speculative.config import SpeculativeConfig
from router.cluster import Cluster
from tests.engine.hf_reference import hf_greedy
from tests.engine.mtp_reference import reference_drafts
from tests.engine.test_mtp import glm_bigram_dir
from tests.fixtures.local_cluster import local_cluster_config

__all__ = ["glm_bigram_dir"]  # fixtures

pytestmark = pytest.mark.timeout(180)

SPECULATIVE = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1)


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    blocks = [[random.Random(seed).randrange(3, 1000) for _ in range(8)] for seed in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return [block * 3 for block in blocks], [params] * len(blocks)


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[list[int]]:
    """The offline engine's greedy tokens, without speculation."""
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    return [o.outputs[0].token_ids for o in llm.generate(*_workload())]


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, ray_session: None, llama_dir: Path
) -> Iterator[Cluster]:
    num_prefill, method = request.param
    speculative = SPECULATIVE
    if method == "draft_model":
        speculative = SpeculativeConfig(3, method=method, model=str(llama_dir))
    config = local_cluster_config(
        llama_dir, num_prefill=num_prefill, num_decode=1, speculative=speculative
    )
    started = Cluster.start(config)
    yield started
    started.shutdown()


def _run_all(cluster: Cluster) -> list[list[int]]:
    async def collect(prompt: list[int], params: SamplingParams) -> list[int]:
        return [event.token_id async for event in cluster.generate(prompt, params)]

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(collect(p, s) for p, s in zip(*_workload()))))

    return asyncio.run(main())


def _speculates(actor: object) -> bool:
    ref = actor.__ray_call__.remote(  # type: ignore[attr-defined]
        lambda self: self.worker.loop.engine.scheduler.proposer is not None
    )
    return bool(ray.get(ref))


@pytest.mark.parametrize(
    "cluster",
    [(1, "ngram"), (0, "ngram"), (1, "draft_model")],
    ids=["1p1d", "colocated", "1p1d-draft-model"],
    indirect=True,
)
def test_greedy_requests_match_the_offline_engine_and_the_decode_worker_drafts(
    cluster: Cluster, expected: list[list[int]]
) -> None:
    assert _run_all(cluster) == expected
    workers = cluster.pool.workers.values()
    assert {w.worker_id: _speculates(w.actor) for w in workers} == {
        w.worker_id: w.role == "decode" for w in workers
    }
    cluster.poll_until_reported(time.monotonic())
    counters = {s.worker_id: s.load.counters for s in cluster.worker_statuses() if s.load}
    decode = counters["decode-0"]
    # drafts were checked and some stood: those steps emitted several tokens of a request
    assert decode.num_draft_tokens > 0 and decode.num_accepted_draft_tokens > 0, decode
    assert decode.num_accepted_draft_tokens <= decode.num_draft_tokens
    if "prefill-0" in counters:
        assert counters["prefill-0"].num_draft_tokens == 0
    if cluster.config.speculative and cluster.config.speculative.method == "draft_model":
        assert decode.num_accepted_draft_tokens == decode.num_draft_tokens, decode


def _record_drafts(actor_self: Any) -> None:
    """On a decode worker's actor: keep (a sequence's tokens, the drafts made to follow them)
    of each draft its prediction layer makes, in ``actor_self.drafts_made``."""
    drafter = actor_self.worker.loop.engine.runner.drafter
    draft_after = drafter.draft_after
    made: list[tuple[list[int], tuple[int, ...]]] = []

    def recording(output: Any, step: Any) -> None:
        draft_after(output, step)
        for entry in step.ordered:
            drafted = drafter._drafts.get(entry.seq.seq_id)
            if drafted is not None:
                made.append((list(entry.seq.token_ids), drafted[1]))

    drafter.draft_after = recording
    actor_self.drafts_made = made


@pytest.mark.timeout(300)
def test_a_prediction_layers_kv_crosses_from_two_prefill_ranks_to_one_decode_rank(
    ray_session: None, glm_bigram_dir: Path
) -> None:
    """GLM-4.5 (grouped-query attention), the prefill worker of two ranks each computing its
    KV head's share of the prediction layer's slot, the decode worker of one receiving both:
    greedy output is transformers', and every draft is what transformers' modules compute over
    the whole context (tests/engine/mtp_reference.py): the layer's KV arrived whole."""
    speculative = SpeculativeConfig(3, method="mtp")
    config = local_cluster_config(
        glm_bigram_dir, num_prefill=1, num_decode=1, prefill_tp=2, speculative=speculative
    )
    cluster = Cluster.start(config)
    try:
        decode = cluster.pool.workers["decode-0"].actor
        ray.get(decode.__ray_call__.remote(_record_drafts))
        prompts = [[(29 * i + 7 * j) % 900 + 5 for j in range(19 + 5 * i)] for i in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

        async def collect(prompt: list[int]) -> list[int]:
            return [event.token_id async for event in cluster.generate(prompt, params)]

        async def main() -> list[list[int]]:
            return list(await asyncio.gather(*(collect(p) for p in prompts)))

        assert asyncio.run(main()) == [hf_greedy(glm_bigram_dir, p, 16) for p in prompts]
        made = ray.get(decode.__ray_call__.remote(lambda self: self.drafts_made))
    finally:
        cluster.shutdown()
    assert made
    for tokens, drafts in made:
        assert list(drafts) == reference_drafts(glm_bigram_dir, tokens, len(drafts))
