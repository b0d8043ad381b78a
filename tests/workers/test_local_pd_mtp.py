"""A prediction layer's KV crosses the hand-off (speculative decoding's ``"method": "mtp"``): the
prefill worker computes it from its hidden states into the blocks it hands off, one more slot of
the model's cache, and the decode worker's drafts attend to it. Without it, drafts after the
hand-off would read what the decode worker's blocks held before, not what transformers'
modules compute over the whole context."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode_worker.worker import DecodeWorker
from engine import GenerateRequest, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from kv_transfer.policy import TransferConfig
from prefill_worker.worker import PrefillWorker
from tests.engine.hf_reference import hf_greedy
from tests.engine.mtp_reference import reference_drafts
from tests.engine.test_mtp import bigram_dir, drafts_made
from tests.workers.local_peer import LocalDecodePeer
from tests.workers.output_collector import OutputCollector
from tests.workers.test_local_pd import GATEWAY, _cache, _load

__all__ = ["bigram_dir", "drafts_made"]  # fixtures

MAX_TOKENS = 16


@pytest.mark.timeout(300)
def test_the_decode_workers_drafts_read_the_layers_kv_the_prefill_worker_computed(
    bigram_dir: Path, drafts_made: list[tuple[list[int], tuple]]
) -> None:
    speculative = SpeculativeConfig(3, method="mtp")
    transfer = TransferConfig(transport="gloo", timeout_s=10.0)
    scheduler = SchedulerConfig(max_num_batched_tokens=16)  # the prompts' layer KV in chunks
    decode = DecodeWorker("d0", _load(bigram_dir), _cache(), scheduler, transfer, speculative)
    prefill = PrefillWorker(
        "p0", _load(bigram_dir), _cache(), scheduler, transfer, {"d0": LocalDecodePeer(decode)},
        speculative=speculative,
    )  # fmt: skip
    collector = OutputCollector([prefill.next_batch, decode.next_batch], GATEWAY)
    try:
        prompts = [[(29 * i + 7 * j) % 900 + 5 for j in range(19 + 5 * i)] for i in range(3)]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            prefill.submit(GenerateRequest(f"m{i}", prompt, params, GATEWAY), "d0")
        collector.wait_finished([(f"m{i}", 0) for i in range(len(prompts))])
        assert not collector.failures
        for i, prompt in enumerate(prompts):
            assert collector.output(f"m{i}") == hf_greedy(bigram_dir, prompt, MAX_TOKENS)
        assert prefill.engine.stats.num_draft_tokens == 0  # computes the layer's KV, never drafts
        assert decode.engine.stats.num_accepted_draft_tokens > 0
        assert drafts_made
        for tokens, drafts in drafts_made:
            assert list(drafts) == reference_drafts(bigram_dir, tokens, len(drafts))
    finally:
        collector.close()
        prefill.shutdown()
        decode.shutdown()
