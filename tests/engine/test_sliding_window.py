"""Sliding-window attention (Mistral's ``sliding_window``, Qwen2's per-layer windows): greedy
decoding matches transformers token for token in every engine mode, with windows shorter than
the prompts, crossing block boundaries, and chunks that end inside and outside the window."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.model_config import load_model_config
from engine.sequence import Sequence
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_parity import (
    engine_tokens,
    greedy_params,
    make_prompts,
    reference,
    shared_prefix_prompts,
)
from tests.fixtures.tiny_models import make_tiny_model


@pytest.fixture(scope="module", params=["mistral", "qwen2-mixed"])
def windowed_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral with a 20-token window on every layer; Qwen2 with a 27-token window on its
    last two of three layers (the first sees the whole context)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "mistral":
        return make_tiny_model(root, "MistralForCausalLM", seed=21, sliding_window=20)
    return make_tiny_model(
        root,
        "Qwen2ForCausalLM",
        seed=22,
        use_sliding_window=True,
        sliding_window=27,
        max_window_layers=1,
    )


def _llm(model_dir: Path, **options: object) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        **options,  # type: ignore[arg-type]
    )


def test_the_window_reaches_the_layers_transformers_gives_it(windowed_dir: Path) -> None:
    config = load_model_config(windowed_dir)
    expected = (20, (0, 1)) if "mistral" in windowed_dir.name else (27, (1, 2))
    assert (config.sliding_window, config.sliding_layers) == expected


@pytest.mark.parametrize(
    "mode",
    ["batched", "chunked", "preempted", "torch-backend", "triton-backend"],
)
def test_greedy_matches_transformers(windowed_dir: Path, mode: str) -> None:
    options: dict[str, object] = {
        "batched": {"enable_prefix_caching": False},
        # chunks of 13 tokens: they end inside, at and past a window's start
        "chunked": {"max_num_batched_tokens": 13, "block_size": 8},
        # sequences give back blocks outside their windows: fewer blocks to preempt (Qwen2's
        # three cache groups of one layer each take a block per group: blocks a third the size)
        "preempted": {
            "block_size": 8,
            "max_num_batched_tokens": 32,
            "num_kv_blocks": 14 if "mistral" in windowed_dir.name else 100,
        },
        "torch-backend": {"attention_backend": "torch", "block_size": 4},
        # Triton's kernels (in its interpreter without a GPU), chunks ending inside a window
        "triton-backend": {
            "attention_backend": "triton",
            "block_size": 8,
            "max_num_batched_tokens": 24,
        },
    }[mode]
    llm = _llm(windowed_dir, **options)
    prompts = make_prompts(seed=1)
    expected = reference(windowed_dir, prompts, "plain")
    if mode == "triton-backend":  # the interpreter is slow: the prompts of 17 to 100 tokens
        outputs = llm.generate(prompts[2:6], greedy_params()[2:6])
        assert [o.outputs[0].token_ids for o in outputs] == expected[2:6]
        return
    assert engine_tokens(llm, prompts) == expected
    if mode == "preempted":
        assert llm.engine.num_preemptions > 0


def test_prefix_cache_hits_match_transformers(windowed_dir: Path) -> None:
    prompts = shared_prefix_prompts(seed=2)
    llm = _llm(windowed_dir, block_size=8, max_num_batched_tokens=96)
    first = engine_tokens(llm, prompts)
    second = llm.generate(prompts, greedy_params())
    assert first == reference(windowed_dir, prompts, "shared-prefix")
    assert [o.outputs[0].token_ids for o in second] == first
    assert all(o.num_cached_tokens >= 64 for o in second)


@pytest.fixture(scope="module")
def tp2(windowed_dir: Path) -> Iterator[LLM]:
    llm = _llm(windowed_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=60.0, block_size=8)
    yield llm
    llm.close()


def test_two_ranks_match_transformers(tp2: LLM, windowed_dir: Path) -> None:
    prompts = make_prompts(seed=1)
    assert engine_tokens(tp2, prompts) == reference(windowed_dir, prompts, "plain")


def _window_model(tmp_path: Path, kind: str) -> Path:
    """A model whose every layer slides (Mistral), or whose sliding layers (0 and 2) surround a
    full one (Gemma 2: three KV cache groups of one layer); a window of 20 either way."""
    if kind == "mistral":
        return make_tiny_model(tmp_path, "MistralForCausalLM", seed=23, sliding_window=20)
    return make_tiny_model(tmp_path, "Gemma2ForCausalLM", seed=24, sliding_window=20)


def _held_blocks(seq: Sequence) -> list[int]:
    """The blocks ``seq`` holds in each of its KV cache groups."""
    return [len(t) - released for t, released in zip(seq.block_tables, seq.num_released_blocks)]


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_sequence_past_its_window_holds_only_the_blocks_its_window_reaches(
    tmp_path: Path, kind: str
) -> None:
    """Window 20, blocks of 8: a 100-token prompt in chunks of 16, then 100 tokens decoded;
    once the window has moved on, the sequence holds at most ceil(20 / 8) + 1 blocks of each
    sliding layer (and a chunk's new ones while prefilling), every block of each full layer,
    and its tokens still match transformers."""
    model_dir = _window_model(tmp_path, kind)
    llm = _llm(model_dir, block_size=8, max_num_batched_tokens=16)
    prompt = make_prompts(seed=7)[5]  # 100 tokens
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    engine = llm.engine
    windows = engine.model_config.cache_groups.windows
    assert windows == ((20,) if kind == "mistral" else (None, 20, 20))
    engine.add_request("long", prompt, params)
    held: dict[int, list[int]] = {group: [] for group in range(len(windows))}
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [event.token_id for event in engine.step().new_tokens]
        for seq in engine.scheduler.running:
            for group, num_held in enumerate(_held_blocks(seq)):
                held[group].append(num_held)
                if windows[group] is None:
                    assert num_held == -(-seq.num_computed_tokens // 8)  # every block
    window_blocks = -(-20 // 8) + 1
    for group, window in enumerate(windows):
        if window is not None:
            assert max(held[group]) <= window_blocks + 2  # the window's and a chunk's 16 slots
            assert max(held[group][-90:]) <= window_blocks  # decoding
    assert engine.block_manager.usage == 0.0  # all given back at the end
    expected = hf_greedy(model_dir, prompt, 100)
    assert tokens[: len(expected)] == expected


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_hand_off_moves_only_the_blocks_the_next_tokens_window_reaches(
    tmp_path: Path, kind: str
) -> None:
    """Window 20, blocks of 8: a prefill engine hands a decode engine, of each sliding layer,
    the prompt's blocks from the first one the window of the token after the prompt reaches
    (the older ones stay behind), and of each full layer every block; the decode engine
    reserves that many, and the split engines' greedy tokens equal transformers'. A prompt
    shorter than the window moves all."""
    model_dir = _window_model(tmp_path, kind)
    prefill = _llm(model_dir, block_size=8).engine
    decode = _llm(model_dir, block_size=8, num_kv_blocks=160).engine
    windows = prefill.model_config.cache_groups.windows
    prompts = make_prompts(seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        prefill.add_request(f"r{index}", prompt, params, prefill_only=True)
    handed = []
    while prefill.has_unfinished_requests() and len(handed) < len(prompts):
        handed += prefill.step().handed_off
    for result in handed:
        num_blocks = -(-result.num_prompt_tokens // 8)
        left_behind = max(result.num_prompt_tokens - 20 + 1, 0) // 8
        assert len(result.block_ids) == sum(
            num_blocks - (0 if window is None else left_behind) for window in windows
        )
        destination = decode.reserve_blocks(result.request_id, result.num_prompt_tokens)
        assert destination is not None and len(destination) == len(result.block_ids)
        decode.kv_cache[:, :, destination] = prefill.kv_cache[:, :, result.block_ids]
        decode.admit_prefilled(result, kv_received=True)
        prefill.release_lease(result.request_id)
    assert any(len(r.block_ids) < len(windows) * -(-r.num_prompt_tokens // 8) for r in handed)
    outputs = {}
    while decode.has_unfinished_requests():
        for out in decode.step().finished:
            outputs[out.request_id] = out.outputs[0].token_ids
    for index, prompt in enumerate(prompts):
        expected = hf_greedy(model_dir, prompt, 12)
        assert outputs[f"r{index}"][: len(expected)] == expected
    assert decode.block_manager.usage == 0.0 and prefill.block_manager.usage == 0.0
