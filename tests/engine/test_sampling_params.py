"""SamplingParams: defaults, every validation bound, unknown fields, wrong types, immutability."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

from engine.sampling import SamplingParams


def make(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**kwargs)


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, 0)
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert params.seed is None and params.stop_token_ids == ()
    assert (params.max_tokens, params.min_tokens, params.logprobs) == (16, 0, None)
    assert params.ignore_eos is False and params.skip_special_tokens is True
    assert not params.greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be >= -1"),
        ({"min_p": -0.01}, "min_p must be in [0, 1], got -0.01"),
        ({"min_p": 1.01}, "min_p must be in [0, 1], got 1.01"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in [1e-6, 1e6], got 0.0"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty must be in [1e-6, 1e6], got 1e-300"),
        ({"repetition_penalty": 1e300}, "repetition_penalty must be in [1e-6, 1e6], got 1e+300"),
        ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5"),
        ({"presence_penalty": 2.01}, "presence_penalty must be in [-2, 2], got 2.01"),
        ({"frequency_penalty": -2.01}, "frequency_penalty must be in [-2, 2], got -2.01"),
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3.0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1 (or None), got 0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens (4), got 5"),
        ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids[1] must be >= 0, got -1"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"top_p": float("inf")}, "top_p must be finite"),
    ],
)
def test_each_bound_is_enforced(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        make(**kwargs)
    assert message in str(excinfo.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 1.0},
        {"top_p": 1e-6, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1e-3},
        {"presence_penalty": -2, "frequency_penalty": 2, "max_tokens": 1, "min_tokens": 1},
        {"max_tokens": None, "min_tokens": 10_000, "logprobs": 0, "seed": -5},
        {"logprobs": 20, "stop_token_ids": (0, 7), "seed": 2**70},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    make(**kwargs)


def test_unknown_field_is_a_value_error_listing_valid_fields() -> None:
    with pytest.raises(ValueError) as excinfo:
        make(bogus=1)
    message = str(excinfo.value)
    assert "bogus" in message
    for name in ("temperature", "top_p", "max_tokens", "skip_special_tokens"):
        assert name in message


def test_positional_arguments_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="keyword"):
        SamplingParams(2)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": 2.0}, "n"),
        ({"top_k": "3"}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"seed": False}, "seed"),
        ({"logprobs": True}, "logprobs"),
        ({"min_tokens": None}, "min_tokens"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids[0]"),
        ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ],
)
def test_wrong_types_are_value_errors_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        make(**kwargs)
    assert str(excinfo.value).startswith(field + " must be")


def test_values_are_normalized() -> None:
    params = SamplingParams(temperature=1, stop_token_ids=[5, 6], frequency_penalty=1)
    assert isinstance(params.temperature, float) and params.temperature == 1.0
    assert isinstance(params.frequency_penalty, float)
    assert params.stop_token_ids == (5, 6)


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_immutable_hashable_picklable_and_replace_validates() -> None:
    params = SamplingParams(temperature=0.5, seed=3, stop_token_ids=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.7  # type: ignore[misc]
    assert hash(params) == hash(SamplingParams(temperature=0.5, seed=3, stop_token_ids=(1,)))
    assert pickle.loads(pickle.dumps(params)) == params
    assert dataclasses.replace(params, top_k=4).top_k == 4
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(params, top_k=-3)
