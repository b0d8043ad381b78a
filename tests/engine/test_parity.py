"""Greedy decoding matches Hugging Face transformers token for token, in every engine mode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.kv_cache.block_manager import BlockManager
from engine.model_config import load_model_config
from engine.outputs import RequestOutput
from tests.conftest import ARCHITECTURES
from tests.engine.hf_reference import hf_greedy

PROMPT_LENGTHS = (1, 3, 17, 40, 64, 100, 211, 300)
OUTPUT_LENGTHS = (64, 5, 16, 1, 33, 8, 64, 20)


def make_prompts(seed: int, vocab_size: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def shared_prefix_prompts(seed: int, vocab_size: int = 1024) -> list[list[int]]:
    """Prompts that share long prefixes (as system prompts do), of varied suffix lengths."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (70, 130)]
    return [
        prefixes[i % 2] + [rng.randrange(3, vocab_size) for _ in range(1 + 9 * i)] for i in range(8)
    ]


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n) for n in OUTPUT_LENGTHS]


_reference_cache: dict[tuple[str, str], list[list[int]]] = {}


def reference(model_dir: Path, prompts: list[list[int]], key: str) -> list[list[int]]:
    cache_key = (str(model_dir), key)
    if cache_key not in _reference_cache:
        _reference_cache[cache_key] = [
            hf_greedy(model_dir, p, n) for p, n in zip(prompts, OUTPUT_LENGTHS, strict=True)
        ]
    return _reference_cache[cache_key]


def engine_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, greedy_params())
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_greedy_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    model_dir = model_dirs[arch]
    prompts = make_prompts(seed=1)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_prefix_caching=False)
    assert llm.engine.runner.attn_backend.name == "cpu"  # what "auto" takes on CPU
    assert engine_tokens(llm, prompts) == reference(model_dir, prompts, "plain")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    model_dir = model_dirs[arch]
    prompts = make_prompts(seed=1)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=32)
    assert engine_tokens(llm, prompts) == reference(model_dir, prompts, "plain")
    assert llm.engine.stats.num_steps > sum(PROMPT_LENGTHS) // 32


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefix_cache_hits_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    model_dir = model_dirs[arch]
    prompts = shared_prefix_prompts(seed=2)
    expected = reference(model_dir, prompts, "shared-prefix")
    # a small step budget admits later prompts after the shared prefixes are computed
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=96
    )
    run_shared_prefixes_twice(llm, prompts, expected)


def run_shared_prefixes_twice(
    llm: LLM, prompts: list[list[int]], expected: list[list[int]]
) -> list[RequestOutput]:
    """Generate the shared-prefix prompts twice, checking the tokens and the prefix-cache hits
    (within the first batch, then of everything); returns the first run's outputs."""
    first = llm.generate(prompts, greedy_params())
    second = llm.generate(prompts, greedy_params())
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    assert sum(o.num_cached_tokens > 0 for o in first) >= 4  # shared prefixes within one batch
    assert all(o.num_cached_tokens >= 64 for o in second)  # everything seen before
    return first


def preempting_blocks(model_dir: Path, step_tokens: int) -> int:
    """The fewest KV blocks of 8 tokens that hold the longest request of ``make_prompts``
    (chunked by ``step_tokens``), so the others are preempted for it: 40 where one block table
    serves every layer; where sliding and full layers keep tables of their own (KV cache
    groups), 40 for each full table and a window and a step's tokens for each sliding one."""
    config = load_model_config(model_dir)
    manager = BlockManager(1, 8, enable_prefix_caching=False, cache_groups=config.cache_groups)
    longest = max(p + o for p, o in zip(PROMPT_LENGTHS, OUTPUT_LENGTHS, strict=True))
    return manager.max_blocks_held(longest, step_tokens)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_preemption_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    """Chunks of 32 tokens, and a cache that holds the longest request and little more."""
    model_dir = model_dirs[arch]
    prompts = make_prompts(seed=1)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=8,
        max_num_batched_tokens=32,
        num_kv_blocks=preempting_blocks(model_dir, 32),
    )
    assert engine_tokens(llm, prompts) == reference(model_dir, prompts, "plain")
    assert llm.engine.num_preemptions > 0


def test_parallel_greedy_samples_are_identical(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    prompt = make_prompts(seed=3)[4]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, n=3))
    expected = hf_greedy(llama_dir, prompt, 20)
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]


@pytest.mark.parametrize("mode", ["batched", "chunked", "prefix-cache"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_backends_match_transformers(llama_dir: Path, backend: str, mode: str) -> None:
    """The backends "auto" does not pick on this CPU (it picks the C decode kernel, which the
    tests above run): the torch reference, and Triton (its interpreter without a GPU)."""
    llm_args: dict[str, int | bool] = {"enable_prefix_caching": False}
    prompts, key = make_prompts(seed=1), "plain"
    if mode == "chunked":
        llm_args = {"max_num_batched_tokens": 32}
    elif mode == "prefix-cache":
        llm_args = {"block_size": 8, "max_num_batched_tokens": 96}
        prompts, key = shared_prefix_prompts(seed=2), "shared-prefix"
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", attention_backend=backend, **llm_args)
    assert llm.engine.runner.attn_backend.name == backend
    expected, params = reference(llama_dir, prompts, key), greedy_params()
    if backend == "triton":  # its interpreter runs each kernel program in Python: half the
        # requests (the first four of the prefix-cache ones, which share both prefixes)
        half = slice(0, 4) if mode == "prefix-cache" else slice(0, None, 2)
        prompts, expected, params = prompts[half], expected[half], params[half]
    for _ in range(2 if mode == "prefix-cache" else 1):
        outputs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_prompt_aborted_mid_block_then_sent_again_matches_transformers(llama_dir: Path) -> None:
    """The first chunk of a prompt ends inside its second block; the request is aborted (as a
    client that disconnects) and sent again: only the full first block is a cache hit."""
    prompt = make_prompts(seed=5)[3][:20]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=6)
    llm.engine.add_request("first", prompt, params)
    llm.engine.step()  # 6 prompt tokens: block 0 full, block 1 half written
    llm.engine.abort_request("first")
    (again,) = llm.generate([prompt], params)
    assert again.num_cached_tokens == 4
    assert again.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 10)


def test_preempted_chunked_prefills_with_shared_prefixes_match_transformers(
    llama_dir: Path,
) -> None:
    """Chunks of 9 tokens end inside blocks of 4, and 12 blocks force preemptions: a preempted
    sequence that comes back must find only fully written blocks of its own in the cache."""
    rng = random.Random(9)
    # the draws of the random search that found this case, before it drew the prompts
    rng.choice([2, 4, 8]), rng.choice([3, 5, 6, 7, 9, 13]), rng.randrange(3, 7)
    base = [rng.randrange(3, 1024) for _ in range(40)]
    prompts = []
    for _ in range(5):
        length = rng.randrange(1, 40)
        shared = rng.random() < 0.5
        prompts.append(base[:length] if shared else [rng.randrange(3, 1024) for _ in range(length)])
    assert [len(p) for p in prompts] == [25, 27, 25, 2, 35]
    max_tokens = (8, 6, 17, 2, 12)
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=2 if i == 2 else 1)
        for i, m in enumerate(max_tokens)
    ]
    llm = LLM(
        str(llama_dir),
        dtype="float32",
        device="cpu",
        block_size=4,
        max_num_batched_tokens=9,
        num_kv_blocks=12,
    )
    outputs = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0
    for prompt, num_tokens, output in zip(prompts, max_tokens, outputs, strict=True):
        expected = hf_greedy(llama_dir, prompt, num_tokens)
        assert [sample.token_ids for sample in output.outputs] == [expected] * len(output.outputs)
