"""SamplingParams: defaults, every validation bound, unknown fields, wrong types, immutability."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

from engine.sampling import SamplingParams
from engine.sampling.params import MAX_LOGIT_BIAS_ENTRIES, LogitBias


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
        ({"logit_bias": {5: 100.5}}, "logit_bias[5] must be in [-100, 100], got 100.5"),
        ({"logit_bias": {5: -101}}, "logit_bias[5] must be in [-100, 100], got -101.0"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias[5] must be finite"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids >= 0, got -1"),
        (
            {"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
            "logit_bias must hold at most 1024 entries, got 1025",
        ),
        ({"allowed_token_ids": []}, "allowed_token_ids must hold at least 1 token id"),
        ({"allowed_token_ids": [4, -2]}, "allowed_token_ids[1] must be >= 0, got -2"),
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
        {"logit_bias": {0: -100, 7: 100, 9: 0}, "allowed_token_ids": [0]},
        {"logit_bias": {i: 1 for i in range(MAX_LOGIT_BIAS_ENTRIES)}, "allowed_token_ids": None},
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
        ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {True: 1.0}}, "logit_bias keys"),
        ({"logit_bias": {5: "1"}}, "logit_bias[5]"),
        ({"logit_bias": {5: None}}, "logit_bias[5]"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"allowed_token_ids": "5"}, "allowed_token_ids"),
        ({"allowed_token_ids": [5.0]}, "allowed_token_ids[0]"),
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


def test_logit_bias_and_allowed_token_ids_are_stored_frozen_and_travel() -> None:
    """As the params go to workers through Ray: hashable, picklable, equal after the trip."""
    params = SamplingParams(logit_bias={9: 1, 3: -100.0}, allowed_token_ids=[7, 3, 7, 9])
    assert isinstance(params.logit_bias, LogitBias)
    assert params.logit_bias == {3: -100.0, 9: 1.0} and params.logit_bias[9] == 1.0
    assert list(params.logit_bias) == [3, 9]  # ascending token ids
    assert isinstance(params.logit_bias[9], float)
    assert params.allowed_token_ids == (3, 7, 9)  # sorted, without duplicates
    with pytest.raises(TypeError):
        params.logit_bias[3] = 0.0  # type: ignore[index]
    same = SamplingParams(logit_bias={3: -100, 9: 1.0}, allowed_token_ids=(9, 3, 7))
    assert params == same and hash(params) == hash(same)
    assert params != SamplingParams(logit_bias={3: -100, 9: 2.0}, allowed_token_ids=(9, 3, 7))
    travelled = pickle.loads(pickle.dumps(params))
    assert travelled == params and hash(travelled) == hash(params)
    assert isinstance(travelled.logit_bias, LogitBias)
    assert dataclasses.replace(params, top_k=4).logit_bias == params.logit_bias
    assert SamplingParams(logit_bias={}) == SamplingParams()  # an empty bias is no bias
    assert SamplingParams().logit_bias is None and SamplingParams().allowed_token_ids is None
