"""Phi-3: fused qkv and gate_up tensors in the checkpoint (each rank reads its rows of them),
and LongRoPE, whose long frequencies take over when a sequence passes the pre-training length.

Greedy identity with transformers within the pre-training length, in every engine mode, is in
the suites that run every architecture of ``tests.conftest.ARCHITECTURES``. Past it, the
engine matches transformers for prompts longer than the pre-training length prefilled whole.
A sequence that crosses it while decoding differs: transformers then recomputes the whole
sequence's KV with the long frequencies, the engine keeps its cached keys (as vLLM does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_config import parse_model_config
from engine.model_loader import load_model
from tests.engine.hf_reference import hf_greedy
from tests.fixtures.tiny_models import make_tiny_model

SHORT = [1.0, 1.2, 1.5, 2.0, 2.6, 3.3, 4.1, 5.0]
LONG = [1.0, 2.0, 4.0, 8.0, 12.0, 20.0, 30.0, 40.0]


def _raw(**rope: Any) -> dict[str, Any]:
    return {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "original_max_position_embeddings": 128,
        "rope_scaling": {"short_factor": SHORT, "long_factor": LONG, **rope},
    }


def test_longrope_scale_follows_transformers() -> None:
    rope = parse_model_config(_raw(type="su")).rope  # Phi-3's early name for longrope
    assert rope.scaling_type == "longrope" and rope.factor == 4.0
    assert rope.attention_factor == pytest.approx(
        (1 + torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(128.0)).item()) ** 0.5
    )
    assert (
        parse_model_config(_raw(type="longrope", attention_factor=1.25)).rope.attention_factor
        == 1.25
    )
    with pytest.raises(ValueError, match="needs the lists short_factor and long_factor"):
        parse_model_config(_raw(type="longrope", long_factor=None))


def test_a_factor_list_of_the_wrong_length_is_named(tmp_path: Path) -> None:
    raw = _raw(type="longrope", short_factor=SHORT[:5])
    with pytest.raises(
        ValueError, match="longrope short_factor has 5 entries; head_dim 16 needs 8"
    ):
        load_model(tmp_path, parse_model_config(raw), torch.float32, torch.device("cpu"), "dummy")


def test_a_sliding_window_within_the_context_applies_to_every_layer() -> None:
    config = parse_model_config({**_raw(type="longrope"), "sliding_window": 256})
    assert (config.sliding_window, config.sliding_layers) == (256, (0, 1))


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pre-trained on 128 positions, extended to 512."""
    return make_tiny_model(
        tmp_path_factory.mktemp("phi3-long"),
        "Phi3ForCausalLM",
        seed=13,
        max_position_embeddings=512,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": SHORT,
            "long_factor": LONG,
        },
    )


def _prefilling_whole_prompts(model_dir: Path) -> LLM:
    """An engine whose step budget takes each test prompt whole (blocks of 8)."""
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        block_size=8,
        max_num_batched_tokens=1024,
    )


def test_prompts_past_the_pretraining_length_take_the_long_frequencies(
    long_context_dir: Path,
) -> None:
    """Prompts past 128 tokens (long frequencies throughout) batched with prompts within it
    (short), each prompt prefilled whole; those within stop before they would cross."""
    rng = torch.Generator().manual_seed(3)
    lengths_and_outputs = ((129, 30), (200, 40), (300, 24), (60, 40), (100, 28))
    prompts = [torch.randint(3, 1000, (n,), generator=rng).tolist() for n, _ in lengths_and_outputs]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for _, m in lengths_and_outputs]
    outputs = _prefilling_whole_prompts(long_context_dir).generate(prompts, params)
    for prompt, (_, max_tokens), output in zip(prompts, lengths_and_outputs, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(long_context_dir, prompt, max_tokens)


def test_a_long_prompt_never_reuses_the_cached_blocks_of_a_short_one(
    long_context_dir: Path,
) -> None:
    """The same 112 leading tokens, first as a whole prompt (short frequencies), then inside a
    prompt of 200 (long ones): the second computes its own KV and matches transformers."""
    rng = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(3, 1000, (200,), generator=rng).tolist()
    llm = _prefilling_whole_prompts(long_context_dir)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    (short,) = llm.generate([long_prompt[:112]], params)
    (long,) = llm.generate([long_prompt], params)
    (again,) = llm.generate([long_prompt], params)
    assert short.outputs[0].token_ids == hf_greedy(long_context_dir, long_prompt[:112], 12)
    assert long.num_cached_tokens == 0
    assert long.outputs[0].token_ids == hf_greedy(long_context_dir, long_prompt, 12)
    assert again.num_cached_tokens == 192  # long prompts share their blocks
    assert again.outputs[0].token_ids == long.outputs[0].token_ids
