"""A prefill worker and a decode worker in two processes sharing one device, as the cluster runs
them with fractional GPUs. ``--kv-transport auto`` picks ``shm`` on CPU and ``cuda_ipc`` on a
GPU (marked ``gpu``; the GPU machine has no Ray, so tests/workers/decode_process.py stands in
for the actor call layer) from the locality the decode process reports. Greedy tokens must be
transformers' in both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import GenerateRequest
from engine.engine_config import CacheConfig, LoadConfig
from engine.kv_cache.budget import KVBudget
from engine.scheduler import SchedulerConfig
from kv_transfer.policy import TransferConfig
from prefill_worker.worker import PrefillWorker
from tests.engine.test_parity import greedy_params, make_prompts, reference
from tests.workers.decode_process import DecodeProcess
from tests.workers.output_collector import OutputCollector

GATEWAY = "test-gateway"


@pytest.mark.parametrize(
    ("device", "expected_transport"),
    [
        ("cpu", "shm"),
        pytest.param(
            "cuda",
            "cuda_ipc",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_prefill_and_decode_processes_on_one_device_match_transformers(
    llama_dir: Path, device: str, expected_transport: str
) -> None:
    load = LoadConfig(str(llama_dir), dtype="float32", device=device)
    cache = CacheConfig(block_size=8, budget=KVBudget(num_blocks=400))
    scheduler = SchedulerConfig(max_num_batched_tokens=128)
    transfer = TransferConfig(transport="auto", timeout_s=30.0)
    decode = DecodeProcess("d0", load, cache, scheduler, transfer)
    prefill = PrefillWorker("p0", load, cache, scheduler, transfer, {"d0": decode})
    collector = OutputCollector([prefill.next_batch, decode.remote.next_batch], GATEWAY)
    try:
        prompts, params = make_prompts(seed=1), greedy_params()
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            prefill.submit(GenerateRequest(f"r{i}", prompt, p, GATEWAY), "d0")
        collector.wait_finished([(f"r{i}", 0) for i in range(len(prompts))], timeout_s=120)
        assert not collector.failures
        outputs = [collector.output(f"r{i}") for i in range(len(prompts))]
        assert outputs == reference(llama_dir, prompts, "plain")
        assert collector.num_duplicates == 0
        # every request that decodes past its first token took its KV across, once
        decoding = sum(1 for p in params if p.max_tokens > 1)
        sent = prefill.load().counters.num_kv_transfers
        assert sent == decode.remote.load().counters.num_kv_transfers == decoding
        assert prefill.load().kv_usage == 0.0 and decode.remote.load().kv_usage == 0.0
        assert prefill.channel_transports() == {"d0": expected_transport}
    finally:
        collector.close()
        prefill.shutdown()
        decode.close()
