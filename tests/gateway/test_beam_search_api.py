"""vLLM's ``use_beam_search`` over HTTP on a real 1 prefill + 1 decode cluster: each prompt's
``n`` choices are the beams the offline ``LLM.beam_search`` finds (itself checked against
transformers in tests/engine/test_beam_search.py), best first, on both endpoints, through the
``openai`` client; and what a search cannot give is refused naming the field, the server
serving on."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine import LLM, BeamSearchParams
from router.gateway.auth import Caller
from router.gateway.errors import ApiError
from router.gateway.limits import RequestLimits
from router.gateway.openai_request import OpenAIJob, parse_job
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from tests.gateway.conftest import API_KEYS, MODEL_NAME
from tests.gateway.test_gateway_behaviour import _num_generated_when_idle

pytestmark = pytest.mark.timeout(240)

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}
PROMPTS = ["def fibonacci(n):\n    return", "import numpy as"]


@pytest.fixture(scope="module")
def http(gateway_server: GatewayServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway_server.http_url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def offline(chat_model_dir: Path) -> LLM:
    return LLM(str(chat_model_dir), dtype="float32", device="cpu", block_size=8)


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(path, json={"model": MODEL_NAME, "use_beam_search": True, **body})


def test_completion_choices_are_the_offline_beams(
    gateway_server: GatewayServer, offline: LLM
) -> None:
    client = openai.OpenAI(base_url=f"{gateway_server.http_url}/v1", api_key=API_KEYS[0])
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS,
        n=3,
        max_tokens=8,
        logprobs=2,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    )
    expected = offline.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8))
    assert len(response.choices) == 6
    for index, choice in enumerate(response.choices):
        beam = expected[index // 3].sequences[index % 3]
        extra = choice.model_extra or {}
        assert extra["token_ids"] == beam.output_token_ids
        assert extra["prompt_token_ids"] == beam.tokens[: beam.num_prompt_tokens]
        assert choice.finish_reason == beam.finish_reason
        output = beam.output_token_ids
        shown = output[:-1] if beam.finish_reason == "stop" else output
        assert choice.text == offline.tokenizer.decode(shown, skip_special_tokens=True)
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        chosen = [p[t].logprob for t, p in zip(beam.output_token_ids, beam.logprobs)]
        assert choice.logprobs.token_logprobs == pytest.approx(chosen, abs=1e-4)
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs or [])
    assert response.usage is not None
    assert response.usage.completion_tokens == sum(
        len(s.output_token_ids) for output in expected for s in output.sequences
    )


def test_chat_choices_are_the_offline_beams_of_the_rendered_prompt(
    http: httpx.Client, offline: LLM
) -> None:
    body = {
        "messages": [{"role": "user", "content": "Write a loop"}],
        "n": 2,
        "max_tokens": 6,
        "length_penalty": 0.5,
        "early_stopping": "never",
        "return_token_ids": True,
    }
    response = _post(http, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    result = response.json()
    params = BeamSearchParams(
        beam_width=2, max_tokens=6, length_penalty=0.5, early_stopping="never"
    )
    (expected,) = offline.beam_search([result["prompt_token_ids"]], params)
    got = [choice["token_ids"] for choice in result["choices"]]
    assert got == [s.output_token_ids for s in expected.sequences]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", True),
        ("echo", True),
        ("temperature", 0.7),
        ("top_p", 0.5),
        ("stop", ["x"]),
        ("presence_penalty", 0.5),
        ("response_format", {"type": "json_object"}),
        ("early_stopping", "sometimes"),
        ("length_penalty", "long"),
        ("use_beam_search", "yes"),
    ],
)
def test_what_a_search_cannot_give_is_refused_by_name(
    http: httpx.Client, field: str, value: object
) -> None:
    path = "/v1/chat/completions" if field == "response_format" else "/v1/completions"
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi"}]}
        if path.endswith("chat/completions")
        else {"prompt": "hi"}
    )
    response = _post(http, path, {**prompt, "n": 2, "max_tokens": 4, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    # the server serves on
    served = _post(http, "/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 2})
    assert served.status_code == 200 and len(served.json()["choices"]) == 2


def test_a_search_option_without_a_search_is_refused(http: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "use_beam_search": False, "length_penalty": 0.5}
    response = http.post("/v1/completions", json={"model": MODEL_NAME, **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "length_penalty"


@pytest.mark.parametrize(("eos_ids", "widest"), [((2,), 10), ((2, 3), 6)])
def test_n_is_bounded_by_the_logprobs_a_step_reads(
    served_model: ServedModel, eos_ids: tuple[int, ...], widest: int
) -> None:
    """Each step reads the top max(2, 1 + #eos) x n log-probabilities of a beam, at most 20."""
    model = dataclasses.replace(served_model, eos_token_ids=eos_ids)
    limits = RequestLimits(max_model_len=model.max_model_len, max_n=16)

    def job(n: int) -> OpenAIJob:
        body = {"prompt": "hi", "n": n, "max_tokens": 4, "use_beam_search": True}
        return parse_job("completion", body, model, limits, Caller(None))

    assert job(widest).beam_search is not None
    with pytest.raises(ApiError) as refused:
        job(widest + 1)
    assert refused.value.param == "n" and f"n must be at most {widest}" in str(refused.value)


def test_a_client_that_leaves_stops_the_search(
    http: httpx.Client, gateway_server: GatewayServer
) -> None:
    """Each step is n one-token asks: a search of 4 beams x 200 tokens would ask ~800; leaving
    after 50 ms stops it (its asks in flight aborted, no step after them)."""
    before = _num_generated_when_idle(http)
    body = {"model": MODEL_NAME, "prompt": "x", "n": 4, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gateway_server.http_url + "/v1/completions",
            json={**body, "use_beam_search": True},
            headers=AUTH,
            timeout=httpx.Timeout(5.0, read=0.05),
        )
    assert _num_generated_when_idle(http) - before < 200
    served = _post(http, "/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 2})
    assert served.status_code == 200
