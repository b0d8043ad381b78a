"""KV cache sizing: explicit count, byte budget, CPU default, and the too-small error."""

from pathlib import Path

import pytest
import torch

from engine.kv_cache.budget import (
    CPU_KV_CACHE_BYTES_ENV,
    KVBudget,
    KVLayout,
    gpu_kv_bytes,
    num_kv_blocks,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32)
CPU = torch.device("cpu")


def test_bytes_per_block_counts_layers_k_and_v() -> None:
    assert LAYOUT.bytes_per_block == 2 * 2 * 8 * 2 * 16 * 4
    assert LAYOUT.shape(10) == (2, 2, 10, 8, 2, 16)


def test_explicit_count_wins() -> None:
    assert num_kv_blocks(KVBudget(num_blocks=7, memory_bytes=1 << 30), LAYOUT, CPU) == 7


def test_byte_budget_is_divided_into_whole_blocks() -> None:
    budget = KVBudget(memory_bytes=10 * LAYOUT.bytes_per_block + 5)
    assert num_kv_blocks(budget, LAYOUT, CPU) == 10


def test_cpu_default_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_KV_CACHE_BYTES_ENV, str(3 * LAYOUT.bytes_per_block))
    assert num_kv_blocks(KVBudget(), LAYOUT, CPU) == 3
    monkeypatch.delenv(CPU_KV_CACHE_BYTES_ENV)
    blocks = num_kv_blocks(KVBudget(), LAYOUT, CPU)
    assert 0 < blocks * LAYOUT.bytes_per_block <= 4 << 30


def test_too_small_budget_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        num_kv_blocks(KVBudget(memory_bytes=10), LAYOUT, CPU)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        KVBudget(num_blocks=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        KVBudget(memory_fraction=1.5)


GIB = 1 << 30


def test_one_worker_on_a_gpu_gets_its_share_less_weights_and_activations() -> None:
    # 80 GiB GPU: 0.5 GiB CUDA context, 16 GiB of weights; 2 GiB peak activations
    free = 80 * GIB - GIB // 2 - 16 * GIB
    assert gpu_kv_bytes(80 * GIB, free, 16 * GIB, 0.9, 2 * GIB) == 72 * GIB - 18 * GIB


def test_two_workers_sharing_a_gpu_each_get_their_share() -> None:
    """Prefill and decode workers of 0.5 GPU at utilization 0.9: 0.45 of the GPU each. The
    second is charged for its own weights, not for the first one's cache."""
    total, context, weights, peak, share = 80 * GIB, GIB // 2, 16 * GIB, 2 * GIB, 0.45
    first = gpu_kv_bytes(total, total - context - weights, weights, share, peak)
    assert first == int(total * share) - weights - peak
    free_now = total - context - weights - first - context - weights  # and the second's own
    second = gpu_kv_bytes(total, free_now, weights, share, peak)
    assert second == first > 0
    # charging the device-wide use instead (as before) left the second nothing
    assert int(total * share) - (total - free_now) - peak < 0


def test_a_share_is_capped_by_what_is_free() -> None:
    """Another process holds most of the GPU: the cache fits what is left."""
    assert gpu_kv_bytes(80 * GIB, 10 * GIB, 16 * GIB, 0.9, 2 * GIB) == 8 * GIB


def test_worst_case_profile_step_runs_through_the_real_runner(llama_dir: Path) -> None:
    from engine.attention.torch_ref import TorchAttentionBackend
    from engine.memory_profile import peak_activation_bytes, run_worst_case_step
    from engine.model_config import load_model_config
    from engine.model_loader import load_model

    config = load_model_config(llama_dir)
    model = load_model(llama_dir, config, torch.float32, CPU)
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, 16, torch.float32)
    # a budget larger than max_model_len is split over several prompt-length sequences
    run_worst_case_step(
        model, layout, TorchAttentionBackend(), CPU, 1200, config.max_position_embeddings
    )
    assert (
        peak_activation_bytes(
            model,
            layout,
            TorchAttentionBackend(),
            CPU,
            max_num_batched_tokens=64,
            max_num_sample_rows=4,
            max_model_len=512,
            vocab_size=1024,
        )
        == 0
    )  # only measured on CUDA
