"""Workloads: exact prompt lengths from the tiny tokenizer, per-seed reproducibility, shared
prefixes that really share their token ids."""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from bench.serving.tokens import TokenCodec
from bench.serving.workloads import BenchRequest, WorkloadSpec, build_requests, exact_length_text


@pytest.fixture(scope="module")
def codec(tokenizer_dir: Path) -> TokenCodec:
    return TokenCodec.load(tokenizer_dir)


def _assert_exact(codec: TokenCodec, requests: list[BenchRequest]) -> None:
    for request in requests:
        assert len(codec.encode(request.prompt)) == request.prompt_len


def test_codec_draws_no_special_or_partial_tokens(codec: TokenCodec) -> None:
    special = set(codec.tokenizer.all_special_ids)
    assert special.isdisjoint(codec.sampleable_token_ids)
    assert all("\ufffd" not in codec.decode([i]) for i in codec.sampleable_token_ids)


@pytest.mark.parametrize("num_tokens", [0, 1, 2, 7, 64, 300])
def test_exact_length_text_round_trips(codec: TokenCodec, num_tokens: int) -> None:
    rng = random.Random(num_tokens)
    for _ in range(20):
        text, token_ids = exact_length_text(codec, rng, num_tokens)
        assert len(token_ids) == num_tokens
        assert codec.encode(text) == token_ids


def test_fixed_workload_has_the_requested_lengths(codec: TokenCodec) -> None:
    spec = WorkloadSpec(kind="fixed", input_len=48, output_len=9)
    requests = build_requests(spec, codec, 30, seed=0)
    assert [r.index for r in requests] == list(range(30))
    assert {r.prompt_len for r in requests} == {48}
    assert {r.output_len for r in requests} == {9}
    _assert_exact(codec, requests)
    assert len({r.prompt for r in requests}) == 30  # random prompts, not one repeated


def test_uniform_workload_stays_in_its_ranges(codec: TokenCodec) -> None:
    spec = WorkloadSpec(kind="uniform", input_range=(5, 40), output_range=(2, 6))
    requests = build_requests(spec, codec, 60, seed=3)
    assert all(5 <= r.prompt_len <= 40 and 2 <= r.output_len <= 6 for r in requests)
    assert len({r.prompt_len for r in requests}) > 10
    assert {r.output_len for r in requests} == {2, 3, 4, 5, 6}
    _assert_exact(codec, requests)


def test_chat_like_workload_is_long_tailed_and_clipped(codec: TokenCodec) -> None:
    spec = WorkloadSpec(
        kind="chat-like", input_len=40, output_len=20, input_range=(4, 400), output_range=(1, 200)
    )
    requests = build_requests(spec, codec, 200, seed=1)
    inputs = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    assert all(4 <= n <= 400 for n in inputs) and all(1 <= n <= 200 for n in outputs)
    assert 28 <= statistics.median(inputs) <= 56  # lognormal median = input_len
    assert 14 <= statistics.median(outputs) <= 28
    assert statistics.mean(inputs) > statistics.median(inputs)  # a right tail
    assert max(inputs) > 3 * 40
    _assert_exact(codec, requests)


@pytest.mark.parametrize("kind", ["fixed", "uniform", "chat-like", "shared-prefix"])
def test_workloads_are_reproducible_per_seed(codec: TokenCodec, kind: str) -> None:
    spec = WorkloadSpec(
        kind=kind,  # type: ignore[arg-type]
        input_len=16,
        input_range=(4, 32),
        output_range=(1, 8),
        prefix_len=24,
        suffix_range=(2, 6),
    )
    first = build_requests(spec, codec, 12, seed=7)
    assert build_requests(spec, codec, 12, seed=7) == first
    assert build_requests(spec, codec, 12, seed=8) != first


def test_shared_prefix_requests_share_their_prefix_tokens(codec: TokenCodec) -> None:
    spec = WorkloadSpec(
        kind="shared-prefix", num_prefixes=3, prefix_len=50, suffix_range=(3, 12), output_len=5
    )
    requests = build_requests(spec, codec, 40, seed=2)
    _assert_exact(codec, requests)
    prefixes: dict[int | None, set[tuple[int, ...]]] = defaultdict(set)
    for request in requests:
        token_ids = codec.encode(request.prompt)
        assert 50 + 3 <= request.prompt_len <= 50 + 12
        assert request.output_len == 5
        prefixes[request.prefix_id].add(tuple(token_ids[:50]))
    assert set(prefixes) == {0, 1, 2}
    assert all(len(group) == 1 for group in prefixes.values())  # one prefix per group
    assert len(set.union(*prefixes.values())) == 3  # and the groups differ


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadSpec(kind="sharegpt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="input_range"):
        WorkloadSpec(input_range=(10, 5))
    with pytest.raises(ValueError, match="output"):
        WorkloadSpec(output_len=0)
