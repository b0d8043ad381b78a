"""A prompt's logprobs through the gateway on a real 1 prefill + 1 decode cluster, equal to the
offline engine's ``RequestOutput.prompt_logprobs`` for the same prompt: completions' ``echo``
with ``logprobs`` (whole, streamed, and ``max_tokens`` 0 as lm-eval-harness scores a
continuation), and vLLM's ``prompt_logprobs`` on chat."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.outputs import PromptLogprobs
from router.gateway.server import GatewayServer
from tests.gateway.conftest import API_KEYS, MODEL_NAME

pytestmark = pytest.mark.timeout(240)

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}
PROMPT = "def fibonacci(n):\n    return"
ABS = 1e-4  # logprobs of two runs of the same fp32 model, batched differently


@pytest.fixture(scope="module")
def http(gateway_server: GatewayServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway_server.http_url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def offline(chat_model_dir: Path) -> LLM:
    return LLM(str(chat_model_dir), dtype="float32", device="cpu", block_size=8)


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _offline_prompt_logprobs(offline: LLM, prompt_ids: list[int], num_top: int) -> PromptLogprobs:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=num_top)
    [output] = offline.generate([prompt_ids], params)
    assert output.prompt_logprobs is not None
    return output.prompt_logprobs


def _assert_vllm_list_equals(listed: list[Any], expected: PromptLogprobs) -> None:
    """The gateway's JSON list against the offline one: same token ids in the same order, same
    ranks and decoded tokens, logprobs within ABS."""
    assert len(listed) == len(expected) and listed[0] is None and expected[0] is None
    for entries, want in zip(listed[1:], expected[1:]):
        assert want is not None
        assert list(entries) == [str(token_id) for token_id in want]
        for token_id, logprob in want.items():
            got = entries[str(token_id)]
            assert got["rank"] == logprob.rank
            assert got["decoded_token"] == logprob.decoded_token
            assert math.isclose(got["logprob"], logprob.logprob, abs_tol=ABS)


def _assert_close(got: list[Any], want: list[Any]) -> None:
    """Lists of floats, Nones or {text: float}, equal but for float noise within ABS."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, dict):
            assert list(g) == list(w)
            assert all(math.isclose(g[k], w[k], abs_tol=ABS) for k in w)
        elif w is None:
            assert g is None
        else:
            assert math.isclose(g, w, abs_tol=ABS)


def test_echo_with_logprobs_equals_the_offline_engines_prompt_logprobs(
    http: httpx.Client, offline: LLM
) -> None:
    prompt_ids = list(offline.tokenizer.encode(PROMPT))
    num_top = 2
    params = SamplingParams(
        temperature=0.0, max_tokens=4, logprobs=num_top, prompt_logprobs=num_top, ignore_eos=True
    )
    [expected] = offline.generate([prompt_ids], params)
    prompt_lps, completion = expected.prompt_logprobs, expected.outputs[0]
    assert prompt_lps is not None and completion.logprobs is not None
    body = {
        "prompt": PROMPT,
        "echo": True,
        "logprobs": num_top,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    choice = _post(http, "/v1/completions", body)["choices"][0]
    assert choice["text"] == PROMPT + completion.text
    logprobs = choice["logprobs"]
    decode = offline.tokenizer.decode
    token_ids = prompt_ids + completion.token_ids
    assert logprobs["tokens"] == [decode([t]) for t in token_ids]
    prompt_positions = [p for p in prompt_lps[1:] if p is not None]
    assert len(prompt_positions) == len(prompt_ids) - 1
    # a prompt token outside the top ones, so the echoed alternatives are logprobs + 1
    assert any(len(position) == num_top + 1 for position in prompt_positions)
    want_logprobs: list[Any] = [None]
    want_top: list[Any] = [None]
    for token_id, position in zip(prompt_ids[1:], prompt_positions):
        want_logprobs.append(position[token_id].logprob)
        # the prompt token first, then the top ones: logprobs + 1 at most, as vLLM shows them
        entries = list(position.values())[: num_top + 1]
        want_top.append({lp.decoded_token: lp.logprob for lp in entries})
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        want_logprobs.append(position[token_id].logprob)
        want_top.append(None)  # the generated part is checked by the completions tests
    _assert_close(logprobs["token_logprobs"], want_logprobs)
    n = len(prompt_ids)
    _assert_close(logprobs["top_logprobs"][:n], want_top[:n])
    lengths = [len(decode([t])) for t in token_ids]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(token_ids))]
    _assert_vllm_list_equals(choice["prompt_logprobs"], prompt_lps)

    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    streamed: dict[str, list[Any]] = {key: [] for key in logprobs}
    for line in lines[:-1]:
        for key in streamed:
            streamed[key] += json.loads(line)["choices"][0]["logprobs"][key]
    assert streamed["tokens"] == logprobs["tokens"]
    assert streamed["text_offset"] == logprobs["text_offset"]
    _assert_close(streamed["token_logprobs"], logprobs["token_logprobs"])
    _assert_close(streamed["top_logprobs"], logprobs["top_logprobs"])


def test_loglikelihood_of_a_continuation_as_lm_eval_harness_asks(
    gateway_server: GatewayServer, offline: LLM
) -> None:
    """lm-eval-harness' request (echo, logprobs 1, max_tokens 0, through the openai client):
    the continuation's summed logprob and greediness from the prompt tokens' logprobs."""
    context, continuation = "import os\nimport", " sys"
    full_ids = list(offline.tokenizer.encode(context + continuation))
    num_context = len(offline.tokenizer.encode(context))
    expected = _offline_prompt_logprobs(offline, full_ids, 1)
    want = sum(p[t].logprob for p, t in zip(expected[num_context:], full_ids[num_context:]) if p)
    want_greedy = all(
        p[t].rank == 1 for p, t in zip(expected[num_context:], full_ids[num_context:]) if p
    )
    with openai.OpenAI(
        base_url=gateway_server.http_url + "/v1", api_key=API_KEYS[0], max_retries=0
    ) as client:
        response = client.completions.create(
            model=MODEL_NAME,
            prompt=context + continuation,
            echo=True,
            logprobs=1,
            max_tokens=0,
            temperature=0,
        )
    choice = response.choices[0]
    assert choice.text == context + continuation
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == len(full_ids) and logprobs.token_logprobs[0] is None
    got = sum(lp for lp in logprobs.token_logprobs[num_context:] if lp is not None)
    assert math.isclose(got, want, abs_tol=ABS * len(full_ids))
    greedy = all(
        max(top.values()) == lp
        for top, lp in zip(
            logprobs.top_logprobs[num_context:], logprobs.token_logprobs[num_context:]
        )
        if top is not None and lp is not None
    )
    assert greedy == want_greedy


def test_chat_prompt_logprobs_equal_the_offline_engines(http: httpx.Client, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Sort a list"}]
    rendered = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = list(offline.tokenizer.encode(rendered, add_special_tokens=False))
    expected = _offline_prompt_logprobs(offline, prompt_ids, 3)
    body = {"messages": messages, "prompt_logprobs": 3, "max_tokens": 2, "temperature": 0}
    response = _post(http, "/v1/chat/completions", body)
    assert response["usage"]["prompt_tokens"] == len(prompt_ids)
    _assert_vllm_list_equals(response["prompt_logprobs"], expected)
