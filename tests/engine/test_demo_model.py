"""The bundled demo model: its assets, a torch-free import, parity with transformers, and text
that reads like words (checked against a random-weight control of the same shape)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from engine.demo_model.corpus import corpus_words
from tests.engine.hf_reference import hf_greedy

MAX_ASSET_BYTES = 20 * 1024 * 1024
PARITY_PROMPTS = ("Return the", "This module provides", "If the file", "Raise ValueError if")
WORD_PROMPTS = ("Return the", "This module provides", "The default value is", "Create a new")
WORD_MAX_TOKENS = 100
MIN_KNOWN_WORD_FRACTION = 0.7
_WORD = re.compile(r"[A-Za-z]+")


@cache
def known_words() -> frozenset[str]:
    return corpus_words(min_length=2)


def known_word_fraction(texts: list[str]) -> float:
    words = [w.lower() for text in texts for w in _WORD.findall(text) if len(w) >= 2]
    assert len(words) >= 20, f"too few words to judge: {words}"
    return sum(w in known_words() for w in words) / len(words)


def known_word_fractions(llm: LLM) -> dict[str, float]:
    """Known-word fraction of greedy and of seeded sampled continuations of ``WORD_PROMPTS``.

    Both count: greedy decoding of random weights tends to repeat one whole-word token
    (" objects objects ..."), which passes a greedy-only check; sampling exposes the noise.
    """
    greedy = SamplingParams(temperature=0.0, max_tokens=WORD_MAX_TOKENS)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=WORD_MAX_TOKENS)
    fractions = {}
    for name, params in (("greedy", greedy), ("sampled", sampled)):
        outputs = llm.generate(list(WORD_PROMPTS), params)
        fractions[name] = known_word_fraction([o.outputs[0].text for o in outputs])
    return fractions


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    return LLM(str(DEMO_MODEL_DIR), dtype="float32", device="cpu")


def test_assets_are_a_small_llama() -> None:
    names = {p.name for p in DEMO_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "training.json"} <= names
    assert sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir()) <= MAX_ASSET_BYTES
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 64
    assert config["dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert DEMO_MODEL_NAME == "pdserve-demo"


def test_import_does_not_load_torch() -> None:
    code = "import sys, engine.demo_model; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"


def test_greedy_matches_transformers(demo_llm: LLM) -> None:
    assert demo_llm.tokenizer is not None
    prompts = [list(demo_llm.tokenizer.encode(p)) for p in PARITY_PROMPTS]
    outputs = demo_llm.generate(list(PARITY_PROMPTS), SamplingParams(temperature=0, max_tokens=32))
    expected = [hf_greedy(DEMO_MODEL_DIR, p, 32) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_greedy_text_reads_like_words(demo_llm: LLM) -> None:
    fractions = known_word_fractions(demo_llm)
    assert min(fractions.values()) >= MIN_KNOWN_WORD_FRACTION, fractions


def test_random_weights_do_not_read_like_words(tmp_path: Path) -> None:
    """The control that shows the word check can fail: same shape and tokenizer, random weights."""
    for item in DEMO_MODEL_DIR.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, tmp_path / item.name)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", load_format="dummy")
    fractions = known_word_fractions(llm)
    assert min(fractions.values()) < MIN_KNOWN_WORD_FRACTION, fractions


def test_chat_template_renders() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What does the os module provide?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("System: Answer briefly.\nUser: What does the os module provide?\nAssistant:")
    without = tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert without == "User: What does the os module provide?\n"
    assert torch.tensor(tokenizer.encode(text)).max() < tokenizer.vocab_size
