"""The host-memory tier of the KV cache (``kv_offload_gb``) in the engine: a block evicted to the
host and brought back is bitwise what it was (float and 8-bit caches); greedy outputs with
offload, shared prefixes evicted and preempted sequences coming back from the host, equal
transformers and the engine without offload, with async scheduling off and on, for a sliding
window model and over two tensor-parallel ranks; the engine's KV events add up to what its tiers
hold; the configuration's refusals. (The bookkeeping alone: tests/engine/test_host_tier.py.)"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig
from engine.kv_cache.budget import KVBudget, KVLayout
from engine.kv_cache.host_copies import HostCopier, host_cache_like
from engine.kv_cache.kv_events import KVEventLog
from engine.kv_cache.prefix_hash import extend_block_hashes
from engine.llm_engine import LLMEngine
from engine.model_config import load_model_config
from engine.scheduler import SchedulerConfig
from tests.engine.hf_reference import hf_greedy
from tests.fixtures.tiny_models import make_tiny_model

BLOCK_SIZE = 4
NUM_TOKENS = 10  # generated per prompt


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


def offload_gb(model_dir: Path, num_slots: int, tp_size: int = 1, element_bytes: int = 4) -> float:
    """The ``kv_offload_gb`` whose host tier holds ``num_slots`` blocks of BLOCK_SIZE tokens
    of the model's cache (a rank's, of ``tp_size`` ranks)."""
    config = load_model_config(model_dir)
    dtype = {4: torch.float32, 1: torch.uint8}[element_bytes]
    layout = KVLayout(
        config.cache_groups.num_slots,
        max(1, config.num_kv_heads // tp_size),
        config.head_dim,
        BLOCK_SIZE,
        dtype,
        config.kv_planes,
    )
    return (num_slots + 0.5) * layout.bytes_per_block / (1 << 30)


def workload(seed: int = 3) -> list[list[int]]:
    """Nine prompts of 37 to 61 tokens, three on each of three 36-token prefixes, interleaved."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1024) for _ in range(36)] for _ in range(3)]
    return [prefixes[i % 3] + [rng.randrange(3, 1024) for _ in range(1 + 3 * i)] for i in range(9)]


_expected: dict[str, list[list[int]]] = {}


def expected(model_dir: Path) -> list[list[int]]:
    if str(model_dir) not in _expected:
        _expected[str(model_dir)] = [hf_greedy(model_dir, p, NUM_TOKENS) for p in workload()]
    return _expected[str(model_dir)]


def tight_llm(model_dir: Path, num_host_slots: int, num_kv_blocks: int = 24, **options: Any) -> LLM:
    """A cache of ``num_kv_blocks`` blocks of 4 tokens (24: two of the workload's requests do
    not fit at once), chunks of 16 tokens, and a host tier of ``num_host_slots`` blocks (0:
    none)."""
    gb = offload_gb(model_dir, num_host_slots, options.get("tensor_parallel_size", 1))
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=16,
        kv_offload_gb=gb if num_host_slots else 0.0,
        **options,
    )


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(workload(), params)]


def assert_the_host_tier_served(llm: LLM) -> None:
    counters = llm.engine.counters()
    assert llm.engine.num_preemptions > 0
    assert counters.num_prefix_cache_host_hit_tokens > 0
    assert counters.num_kv_offloaded_bytes > 0 and counters.num_kv_loaded_bytes > 0
    block_bytes = llm.engine.runner.host_copier.block_bytes  # type: ignore[union-attr]
    assert counters.num_kv_loaded_bytes % block_bytes == 0


# ---- bitwise ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_the_copier_moves_blocks_bit_for_bit(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]
    bits = torch.randint(0, 256, (3, 2, 6, 4, 2, 8), dtype=torch.uint8, generator=generator)
    if dtype == torch.float32:
        bits = torch.randint(0, 256, (3, 2, 6, 4, 2, 32), dtype=torch.uint8, generator=generator)
    cache = bits.view(dtype)
    original = bits.clone()
    host = host_cache_like(cache, 5)
    assert host.shape == (5, 3, 2, 4, 2, 8) and host.dtype == dtype and not host.is_pinned()
    copier = HostCopier(cache, host)
    copier.swap([(4, 0), (1, 3)], [])
    bits[:, :, [1, 4]] = 0
    copier.swap([], [(0, 4), (3, 1)])  # back into the blocks they came from
    assert torch.equal(bits, original)
    copier.swap([], [(0, 2)])  # block 4's content into block 2 as well
    assert torch.equal(bits[:, :, 2], original[:, :, 4])
    assert copier.num_bytes_moved == (2 * copier.block_bytes, 3 * copier.block_bytes)


def _one_prompt_cached(
    model_dir: Path, kv_cache_dtype: str
) -> tuple[LLM, list[int], list[bytes], list[int]]:
    """An engine of 16 device blocks and a host tier of 32, after one prompt of 49 tokens (its
    twelve full blocks cached): the engine, the prompt, its blocks' hashes and device blocks."""
    element_bytes = 4 if kv_cache_dtype == "auto" else 1
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        num_kv_blocks=16,
        kv_cache_dtype=kv_cache_dtype,
        kv_offload_gb=offload_gb(model_dir, 32, element_bytes=element_bytes),
    )
    prompt = workload()[4]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, BLOCK_SIZE, None)
    blocks = [llm.engine.block_manager.pool.cached_block(h) for h in hashes]
    assert None not in blocks
    return llm, prompt, hashes, [b for b in blocks if b is not None]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_a_block_evicted_to_the_host_and_brought_back_is_bitwise_what_it_was(
    llama_dir: Path, kv_cache_dtype: str
) -> None:
    """A prompt's blocks, cached; other prompts take the whole device cache (they go to the
    host); the prompt again takes them back from the host, into other device blocks, bit for
    bit."""
    llm, prompt, hashes, blocks = _one_prompt_cached(llama_dir, kv_cache_dtype)
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=1)
    pool, host = engine.block_manager.pool, engine.block_manager.host
    assert host is not None
    before = engine.kv_cache[:, :, blocks].clone()
    llm.generate([[7] * 60, [8] * 60], params)  # fifteen blocks each
    assert all(pool.cached_block(h) is None and host.slot_of(h) is not None for h in hashes)
    (again,) = llm.generate([prompt], params)
    assert again.num_cached_tokens == 48
    assert engine.counters().num_prefix_cache_host_hit_tokens == 48
    back = [pool.cached_block(h) for h in hashes]
    assert back != blocks
    after = engine.kv_cache[:, :, back]
    assert after.dtype == before.dtype
    assert torch.equal(after.view(torch.uint8), before.view(torch.uint8))


def test_blocks_a_hand_off_reservation_evicts_go_to_the_host_before_the_kv_lands(
    llama_dir: Path,
) -> None:
    """A decode worker's reservation for a hand-off takes the whole device cache: the cached
    blocks it evicts are copied to the host at once (the received KV overwrites them outside
    any step), and a prompt over them takes them back bit for bit."""
    llm, prompt, hashes, blocks = _one_prompt_cached(llama_dir, "auto")
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=1)
    pool = engine.block_manager.pool
    before = engine.kv_cache[:, :, blocks].clone()
    reserved = engine.reserve_blocks("handed-off", 16 * BLOCK_SIZE)
    assert reserved is not None and set(blocks) <= set(reserved)
    engine.kv_cache[:, :, reserved] = 7.0  # the received KV lands
    assert engine.counters().num_kv_offloaded_bytes > 0
    engine.cancel_reservation("handed-off")
    (again,) = llm.generate([prompt], params)
    assert again.num_cached_tokens == 48
    back = [pool.cached_block(h) for h in hashes]
    assert torch.equal(engine.kv_cache[:, :, back], before)


# ---- greedy outputs ---------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-step", "async"])
def test_greedy_outputs_with_offload_equal_transformers_and_the_engine_without(
    llama_dir: Path, async_scheduling: bool
) -> None:
    """The workload on a cache too small for two of its requests at once: shared prefixes are
    evicted to the host and taken back from it, and preempted sequences come back from it."""
    llm = tight_llm(llama_dir, 48, async_scheduling=async_scheduling)
    outputs = generate(llm)
    assert outputs == expected(llama_dir)
    assert_the_host_tier_served(llm)
    if not async_scheduling:
        assert generate(tight_llm(llama_dir, 0)) == outputs


def test_a_sliding_window_model_with_offload_matches_transformers(tmp_path: Path) -> None:
    """Qwen2 with a 10-token window on its last two of three layers (a full and two windowed
    cache groups of a layer each, a block of each for every 4 tokens; the windowed ones hold 8
    blocks at most): each group's blocks go to the host and come back on their own."""
    model_dir = make_tiny_model(
        tmp_path,
        "Qwen2ForCausalLM",
        seed=22,
        use_sliding_window=True,
        sliding_window=10,
        max_window_layers=1,
    )
    llm = tight_llm(model_dir, 96, num_kv_blocks=40)
    assert llm.engine.block_manager.windows == (None, 10, 10)
    assert generate(llm) == expected(model_dir)
    assert_the_host_tier_served(llm)


def test_two_tensor_parallel_ranks_with_offload_match_transformers(llama_dir: Path) -> None:
    """Each rank keeps its own KV heads' blocks in its own host buffer; rank 0 sends the swaps."""
    llm = tight_llm(llama_dir, 48, tensor_parallel_size=2, async_scheduling=True)
    try:
        assert generate(llm) == expected(llama_dir)
        assert_the_host_tier_served(llm)
    finally:
        llm.close()


# ---- KV events --------------------------------------------------------------------------
def test_the_engines_kv_events_add_up_to_what_its_tiers_hold(llama_dir: Path) -> None:
    """Every step's events, replayed in order, equal the device and host tiers' holdings."""
    engine = LLMEngine(
        LoadConfig(str(llama_dir), "float32", "cpu"),
        CacheConfig(
            BLOCK_SIZE, budget=KVBudget(num_blocks=24), kv_offload_gb=offload_gb(llama_dir, 12)
        ),
        SchedulerConfig(max_num_batched_tokens=16, async_scheduling=True),
        record_kv_events=True,
    )
    log = KVEventLog()
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    for index, prompt in enumerate(workload()):
        engine.add_request(str(index), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        log.append(engine.take_kv_events())
        assert log.holdings() == engine.block_manager.cached_block_hashes()
    held = engine.block_manager.cached_block_hashes()
    assert held[("host", 0)] and held[("device", 0)]
    assert engine.block_manager.host is not None
    assert engine.block_manager.host.num_cached_blocks == 12  # full: it evicted, too


# ---- refusals ---------------------------------------------------------------------------
def test_the_configuration_refuses_a_negative_size_and_offload_without_prefix_caching() -> None:
    with pytest.raises(ValueError, match="kv_offload_gb must be >= 0"):
        CacheConfig(kv_offload_gb=-1.0)
    with pytest.raises(ValueError, match="kv_offload_gb .* needs enable_prefix_caching"):
        CacheConfig(enable_prefix_caching=False, kv_offload_gb=1.0)
    assert CacheConfig(enable_prefix_caching=False).kv_offload_gb == 0.0


def test_a_size_that_holds_no_block_is_refused_naming_it(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"kv_offload_gb \(1e-09\) holds no KV block"):
        LLM(str(llama_dir), dtype="float32", device="cpu", kv_offload_gb=1e-9)
