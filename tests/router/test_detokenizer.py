"""Streaming detokenization with a byte-level BPE tokenizer, and stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from router.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "def add(x, y):\n    return x + y  # plain ASCII",
    "Hello 😀🚀 world 世界 こんにちは naïve café 👩‍👩‍👧",
    "🙂" * 7 + "中文字符" * 3,
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_rebuild_the_text_and_never_split_a_character(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(token) for token in tokenizer.encode(text)]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert any(
        len(tokenizer.decode([t])) and "\ufffd" in tokenizer.decode([t])
        for t in tokenizer.encode(TEXTS[1])
    )  # the tokenizer really splits characters


def test_random_token_streams_match_a_full_decode(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    for _ in range(20):
        token_ids = [rng.randrange(3, 1024) for _ in range(40)]
        detok = IncrementalDetokenizer(tokenizer)
        streamed = "".join(detok.push(t) for t in token_ids) + detok.flush()
        assert streamed == tokenizer.decode(token_ids)


def _stream(matcher: StopStringMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(piece) for piece in pieces)
    return out + matcher.flush()


def test_stop_string_is_trimmed_even_across_deltas() -> None:
    matcher = StopStringMatcher(["\n\n", "END"])
    assert _stream(matcher, ["Hello", " wor", "ld\n", "\nmore"]) == "Hello world"
    assert matcher.stopped
    matcher = StopStringMatcher(["END"])
    assert _stream(matcher, ["aE", "N", "Dz"]) == "a"


def test_possible_stop_prefix_is_held_back_then_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == "go "  # "ST" could start "STOP"
    assert matcher.feed("ART") == "START"
    assert matcher.flush() == ""
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("end ST") == "end "
    assert matcher.flush() == "ST"  # the sample ended: nothing is lost
    assert not matcher.stopped


def test_earliest_stop_wins_and_nothing_follows() -> None:
    matcher = StopStringMatcher(["b", "abc"])
    assert matcher.feed("xxabcd") == "xx"  # "abc" starts before "b"
    assert matcher.feed("more") == ""
