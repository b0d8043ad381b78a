"""Bad input over HTTP: each case gets the right status and an OpenAI-shaped error naming the
problem, and the server answers a well-formed request right after it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from router.gateway.server import GatewayServer
from tests.gateway.conftest import API_KEYS, LIMITS, MODEL_NAME

pytestmark = pytest.mark.timeout(240)

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _completion(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **fields}).encode()


def _chat(**fields: Any) -> bytes:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


# (id, path, raw body, headers, status, words the message must contain, param)
CASES: list[tuple[str, str, bytes, dict[str, str], int, str, str | None]] = [
    ("malformed json", COMPLETIONS, b'{"model": ', AUTH, 400, "not valid JSON", None),
    ("body not an object", COMPLETIONS, b"[1, 2]", AUTH, 400, "JSON object", None),
    (
        "json nested too deep",
        COMPLETIONS,
        b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        AUTH,
        400,
        "not valid JSON",
        None,
    ),
    (
        "integer of too many digits",
        COMPLETIONS,
        b'{"prompt": [' + b"1" * 5001 + b"]}",
        AUTH,
        400,
        "not valid JSON",
        None,
    ),
    (
        "number beyond a float",
        COMPLETIONS,
        b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}",
        AUTH,
        400,
        "temperature is too large",
        "temperature",
    ),
    (
        "repetition_penalty that underflows",
        COMPLETIONS,
        _completion(repetition_penalty=1e-300),
        AUTH,
        400,
        "repetition_penalty must be in [1e-6, 1e6]",
        "repetition_penalty",
    ),
    (
        "max_completion_tokens zero",
        CHAT,
        _chat(max_completion_tokens=0),
        AUTH,
        400,
        "max_completion_tokens must be >= 1",
        "max_completion_tokens",
    ),
    (
        "max_completion_tokens beyond the context",
        CHAT,
        _chat(max_completion_tokens=100_000),
        AUTH,
        400,
        "max_completion_tokens asks for 100000",
        "max_completion_tokens",
    ),
    ("invalid utf-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', AUTH, 400, "UTF-8", None),
    ("lone surrogate", COMPLETIONS, b'{"prompt": "a\\ud800b"}', AUTH, 400, "surrogate", "prompt"),
    ("missing prompt", COMPLETIONS, b"{}", AUTH, 400, "prompt is required", "prompt"),
    ("prompt wrong type", COMPLETIONS, _completion(prompt=5), AUTH, 400, "prompt must", "prompt"),
    ("empty prompt list", COMPLETIONS, _completion(prompt=[]), AUTH, 400, "not empty", "prompt"),
    (
        "max_tokens string",
        COMPLETIONS,
        _completion(max_tokens="10"),
        AUTH,
        400,
        "max_tokens must be an integer",
        "max_tokens",
    ),
    (
        "max_tokens negative",
        COMPLETIONS,
        _completion(max_tokens=-1),
        AUTH,
        400,
        ">= 1",
        "max_tokens",
    ),
    ("max_tokens zero", COMPLETIONS, _completion(max_tokens=0), AUTH, 400, ">= 1", "max_tokens"),
    (
        "max_tokens huge",
        COMPLETIONS,
        _completion(max_tokens=10**9),
        AUTH,
        400,
        "maximum context length",
        "max_tokens",
    ),
    (
        "n over the cap",
        COMPLETIONS,
        _completion(n=LIMITS["max_n"] + 1),
        AUTH,
        400,
        "n must be <=",
        "n",
    ),
    ("n zero", COMPLETIONS, _completion(n=0), AUTH, 400, "n must be >= 1", "n"),
    ("logprobs over 20", COMPLETIONS, _completion(logprobs=21), AUTH, 400, "<= 20", "logprobs"),
    (
        "top_logprobs over 20",
        CHAT,
        _chat(logprobs=True, top_logprobs=21),
        AUTH,
        400,
        "top_logprobs must be <= 20",
        "top_logprobs",
    ),
    (
        "top_logprobs without logprobs",
        CHAT,
        _chat(top_logprobs=2),
        AUTH,
        400,
        "requires logprobs",
        "top_logprobs",
    ),
    (
        "prompt too long",
        COMPLETIONS,
        _completion(prompt=[5] * 600),
        AUTH,
        400,
        "maximum context length",
        "prompt",
    ),
    (
        "token id outside the vocabulary",
        COMPLETIONS,
        _completion(prompt=[3, 99999]),
        AUTH,
        400,
        "outside the vocabulary",
        "prompt",
    ),
    (
        "unknown model",
        COMPLETIONS,
        _completion(model="gpt-9"),
        AUTH,
        404,
        "does not exist",
        "model",
    ),
    ("empty messages", CHAT, _chat(messages=[]), AUTH, 400, "at least one message", "messages"),
    (
        "invalid role",
        CHAT,
        _chat(messages=[{"role": "wizard", "content": "hi"}]),
        AUTH,
        400,
        "role must be one of",
        "messages[0].role",
    ),
    (
        "content wrong type",
        CHAT,
        _chat(messages=[{"role": "user", "content": 5}]),
        AUTH,
        400,
        "must be a string",
        "messages[0].content",
    ),
    (
        "too many messages",
        CHAT,
        _chat(messages=[{"role": "user", "content": "x"}] * (LIMITS["max_messages"] + 1)),
        AUTH,
        400,
        "at most",
        "messages",
    ),
    ("huge stop list", COMPLETIONS, _completion(stop=["a"] * 1000), AUTH, 400, "at most", "stop"),
    (
        "chat text far beyond the context",
        CHAT,
        _chat(
            messages=[
                {"role": "system", "content": "x" * 9000},
                {"role": "user", "content": "y" * 9000},
            ]
        ),
        AUTH,
        400,
        "messages is 18000 characters, far beyond",
        "messages",
    ),
    ("stop too long", COMPLETIONS, _completion(stop=["x" * 300]), AUTH, 400, "characters", "stop"),
    ("stop wrong type", COMPLETIONS, _completion(stop=5), AUTH, 400, "stop must be", "stop"),
    (
        "temperature wrong type",
        COMPLETIONS,
        _completion(temperature="hot"),
        AUTH,
        400,
        "must be a number",
        "temperature",
    ),
    (
        "temperature negative",
        COMPLETIONS,
        _completion(temperature=-1),
        AUTH,
        400,
        ">= 0",
        "temperature",
    ),
    ("top_p zero", COMPLETIONS, _completion(top_p=0), AUTH, 400, "(0, 1]", "top_p"),
    (
        "penalty out of range",
        COMPLETIONS,
        _completion(presence_penalty=3),
        AUTH,
        400,
        "[-2, 2]",
        "presence_penalty",
    ),
    ("seed too big", COMPLETIONS, _completion(seed=2**70), AUTH, 400, "64-bit", "seed"),
    (
        "logit_bias key not a token id",
        COMPLETIONS,
        _completion(logit_bias={"abc": 1}),
        AUTH,
        400,
        'logit_bias["abc"] is not a token id',
        "logit_bias",
    ),
    (
        "logit_bias id outside the vocabulary",
        COMPLETIONS,
        _completion(logit_bias={"5": 1, "99999": -100}),
        AUTH,
        400,
        'logit_bias["99999"] is outside the vocabulary [0, 1024)',
        "logit_bias",
    ),
    (
        "logit_bias negative id",
        CHAT,
        _chat(logit_bias={"-1": 5}),
        AUTH,
        400,
        'logit_bias["-1"] is outside the vocabulary [0, 1024)',
        "logit_bias",
    ),
    (
        "logit_bias id of 5000 digits",
        COMPLETIONS,
        _completion(logit_bias={"7" * 5000: 1}),
        AUTH,
        400,
        "is outside the vocabulary [0, 1024)",
        "logit_bias",
    ),
    (
        "logit_bias over 100",
        COMPLETIONS,
        _completion(logit_bias={"5": 100.5}),
        AUTH,
        400,
        'logit_bias["5"] must be in [-100, 100], got 100.5',
        "logit_bias",
    ),
    (
        "logit_bias under -100",
        CHAT,
        _chat(logit_bias={"5": -150}),
        AUTH,
        400,
        'logit_bias["5"] must be in [-100, 100], got -150',
        "logit_bias",
    ),
    (
        "logit_bias too many entries",
        COMPLETIONS,
        _completion(logit_bias={str(i): 1 for i in range(1025)}),
        AUTH,
        400,
        "logit_bias holds 1025 entries; at most 1024 are allowed",
        "logit_bias",
    ),
    (
        "logit_bias not an object",
        COMPLETIONS,
        _completion(logit_bias=[[5, 1]]),
        AUTH,
        400,
        "logit_bias must be an object mapping token ids to biases, got a list",
        "logit_bias",
    ),
    (
        "logit_bias value a string",
        CHAT,
        _chat(logit_bias={"5": "high"}),
        AUTH,
        400,
        'logit_bias["5"] must be a number, got a string',
        "logit_bias",
    ),
    (
        "logit_bias value a boolean",
        COMPLETIONS,
        _completion(logit_bias={"5": True}),
        AUTH,
        400,
        'logit_bias["5"] must be a number, got bool',
        "logit_bias",
    ),
    (
        "logit_bias id given twice",
        COMPLETIONS,
        _completion(logit_bias={"5": 1, "05": 2}),
        AUTH,
        400,
        'logit_bias["05"] names token id 5 a second time',
        "logit_bias",
    ),
    (
        "allowed_token_ids empty",
        COMPLETIONS,
        _completion(allowed_token_ids=[]),
        AUTH,
        400,
        "allowed_token_ids must hold at least 1 token id",
        "allowed_token_ids",
    ),
    (
        "allowed_token_ids id outside the vocabulary",
        CHAT,
        _chat(allowed_token_ids=[5, 5000]),
        AUTH,
        400,
        "allowed_token_ids[1] is token id 5000, outside the vocabulary [0, 1024)",
        "allowed_token_ids",
    ),
    (
        "allowed_token_ids negative id",
        COMPLETIONS,
        _completion(allowed_token_ids=[-2]),
        AUTH,
        400,
        "allowed_token_ids[0] is token id -2, outside the vocabulary",
        "allowed_token_ids",
    ),
    (
        "allowed_token_ids not a list",
        COMPLETIONS,
        _completion(allowed_token_ids=5),
        AUTH,
        400,
        "allowed_token_ids must be a list of integers",
        "allowed_token_ids",
    ),
    (
        "allowed_token_ids not integers",
        CHAT,
        _chat(allowed_token_ids=[5, 1.5, "7"]),
        AUTH,
        400,
        "allowed_token_ids must be a list of integers",
        "allowed_token_ids",
    ),
    (
        "prompt_logprobs over 20",
        COMPLETIONS,
        _completion(prompt_logprobs=21),
        AUTH,
        400,
        "prompt_logprobs must be an integer in [0, 20], got 21",
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs -1",
        CHAT,
        _chat(prompt_logprobs=-1),
        AUTH,
        400,
        "prompt_logprobs must be an integer in [0, 20], got -1",
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs in a stream",
        CHAT,
        _chat(prompt_logprobs=2, stream=True),
        AUTH,
        400,
        "prompt_logprobs is not available with stream",
        "prompt_logprobs",
    ),
    (
        "truncate_prompt_tokens zero",
        COMPLETIONS,
        _completion(truncate_prompt_tokens=0),
        AUTH,
        400,
        "truncate_prompt_tokens must be >= 1, or -1 for the context less max_tokens; got 0",
        "truncate_prompt_tokens",
    ),
    (
        "truncate_prompt_tokens a boolean",
        CHAT,
        _chat(truncate_prompt_tokens=True),
        AUTH,
        400,
        "truncate_prompt_tokens must be an integer, got bool",
        "truncate_prompt_tokens",
    ),
    (
        "truncate_prompt_tokens beyond the context",
        COMPLETIONS,
        _completion(truncate_prompt_tokens=511),
        AUTH,
        400,
        "truncate_prompt_tokens must be <= 510 (the context length of 512 tokens less "
        "max_tokens (2)), got 511",
        "truncate_prompt_tokens",
    ),
    (
        "priority under fcfs",
        CHAT,
        _chat(priority=-1),
        AUTH,
        400,
        "priority must be 0 on this server, got -1",
        "priority",
    ),
    (
        "priority a string",
        COMPLETIONS,
        _completion(priority="1"),
        AUTH,
        400,
        "priority must be an integer, got str",
        "priority",
    ),
    (
        "include_stop_str_in_output not a boolean",
        CHAT,
        _chat(include_stop_str_in_output="yes"),
        AUTH,
        400,
        "include_stop_str_in_output must be a boolean, got str",
        "include_stop_str_in_output",
    ),
    (
        "stream_options without stream",
        COMPLETIONS,
        _completion(stream_options={"include_usage": True}),
        AUTH,
        400,
        "only allowed when stream",
        "stream_options",
    ),
    (
        "continuous_usage_stats not a boolean",
        COMPLETIONS,
        _completion(stream=True, stream_options={"continuous_usage_stats": "yes"}),
        AUTH,
        400,
        "stream_options.continuous_usage_stats must be a boolean, got str",
        "stream_options.continuous_usage_stats",
    ),
    (
        "oversized body",
        COMPLETIONS,
        _completion(prompt="x" * (LIMITS["max_body_bytes"] + 1)),
        AUTH,
        413,
        "larger than",
        None,
    ),
    ("missing key", COMPLETIONS, _completion(), {}, 401, "missing API key", None),
    (
        "wrong key",
        COMPLETIONS,
        _completion(),
        {"Authorization": "Bearer sk-wrong"},
        401,
        "incorrect",
        None,
    ),
    (
        "not a bearer key",
        COMPLETIONS,
        _completion(),
        {"Authorization": "Basic abc"},
        401,
        "Bearer",
        None,
    ),
    ("unknown route", "/v1/engines", b"{}", AUTH, 404, "Not Found", None),
]


@pytest.fixture(scope="module")
def http(gateway_server: GatewayServer) -> httpx.Client:
    return httpx.Client(base_url=gateway_server.http_url, timeout=60)


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "words", "param"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(
    http: httpx.Client,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    words: str,
    param: str | None,
) -> None:
    response = http.post(
        path, content=body, headers={"Content-Type": "application/json", **headers}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]
    assert error["param"] == param
    ok = http.post(COMPLETIONS, content=_completion(max_tokens=1), headers=AUTH)
    assert ok.status_code == 200, ok.text


def test_every_route_but_health_needs_a_key(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    for path in ("/v1/models", f"/v1/models/{MODEL_NAME}", "/metrics"):
        assert http.get(path).status_code == 401
        assert http.get(path, headers=AUTH).status_code == 200
    assert http.get("/v1/models/other", headers=AUTH).status_code == 404
