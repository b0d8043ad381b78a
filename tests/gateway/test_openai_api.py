"""The official ``openai`` client against a running gateway: outputs identical to the offline
engine, streaming and not, n, stop strings, logprobs, seeds and usage."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine import LLM, SamplingParams
from router.gateway.server import GatewayServer
from tests.gateway.conftest import API_KEYS, MODEL_NAME

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox 🦊 jumps, 狐狸"]


@pytest.fixture(scope="module")
def client(gateway_server: GatewayServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=gateway_server.http_url + "/v1", api_key=API_KEYS[0], max_retries=0
    ) as client:
        yield client


@pytest.fixture(scope="module")
def offline(chat_model_dir: Path) -> LLM:
    return LLM(str(chat_model_dir), dtype="float32", device="cpu", block_size=8)


def _greedy(max_tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)  # type: ignore[arg-type]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_greedy_completions_match_the_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPTS, _greedy(24))
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=24, temperature=0
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice, output in zip(response.choices, expected):
        assert choice.text == output.outputs[0].text
        assert choice.finish_reason == output.outputs[0].finish_reason
    assert response.usage is not None
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    num_generated = sum(len(o.outputs[0].token_ids) for o in expected)
    assert response.usage.completion_tokens == num_generated
    assert response.usage.total_tokens == response.usage.prompt_tokens + num_generated


def test_token_id_prompts_are_accepted(client: openai.OpenAI, offline: LLM) -> None:
    token_ids = offline.tokenizer.encode(PROMPTS[0])
    expected = offline.generate([token_ids], _greedy(12))[0].outputs[0]
    response = client.completions.create(
        model=MODEL_NAME, prompt=token_ids, max_tokens=12, temperature=0
    )
    assert response.choices[0].text == expected.text


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate([PROMPTS[2]], _greedy(40, ignore_eos=True))[0].outputs[0]
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    # a character cut short by max_tokens is dropped, here and offline, as vLLM does
    assert "".join(pieces) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}


TERSE_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
]


def _offline_chat(offline: LLM, messages: list[dict[str, str]]) -> tuple[list[int], Any]:
    """The prompt the model's template makes of ``messages``, and the offline engine's greedy
    output for it (20 tokens at most)."""
    rendered = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = offline.tokenizer.encode(rendered, add_special_tokens=False)
    return prompt_ids, offline.generate([prompt_ids], _greedy(20))[0].outputs[0]


def test_chat_uses_the_models_template(client: openai.OpenAI, offline: LLM) -> None:
    messages = TERSE_CHAT
    prompt_ids, expected = _offline_chat(offline, messages)
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=20,
        temperature=0,
    )
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.usage is not None and response.usage.prompt_tokens == len(prompt_ids)
    streamed = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == expected.text


def test_responses_generate_what_the_offline_engine_does(
    client: openai.OpenAI, offline: LLM
) -> None:
    """/v1/responses over the real cluster: instructions and input rendered by the model's
    template, greedy text equal to the offline engine's, whole and streamed."""
    prompt_ids, expected = _offline_chat(offline, TERSE_CHAT)
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "instructions": "You are terse.",
        "input": "Name a prime.",
        "max_output_tokens": 20,
        "temperature": 0,
    }
    whole = client.responses.create(**request)
    assert whole.output_text == expected.text
    assert whole.usage is not None and whole.usage.input_tokens == len(prompt_ids)
    assert whole.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    events = list(client.responses.create(stream=True, **request))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == expected.text and events[-1].response.output_text == expected.text


def test_n_samples_and_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        response = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[0],
            max_tokens=16,
            temperature=1.0,
            n=2,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        assert response.usage is not None and response.usage.completion_tokens == 32
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first = sample(7)
    assert len(first) == 2 and first[0] != first[1]
    assert sample(7) == first
    assert sample(8) != first


def test_stop_string_ends_and_is_trimmed(client: openai.OpenAI, offline: LLM) -> None:
    full = offline.generate([PROMPTS[1]], _greedy(40, ignore_eos=True))[0].outputs[0].text
    stop = full[10:13]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=40,
        temperature=0,
        stop=[stop, "\x00never"],
        extra_body={"ignore_eos": True},
    )
    choice = response.choices[0]
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=40,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_stop_string_kept_with_include_stop_str_in_output(
    client: openai.OpenAI, offline: LLM
) -> None:
    """vLLM's include_stop_str_in_output: the text ends with the stop string, streamed or not."""
    full = offline.generate([PROMPTS[1]], _greedy(40, ignore_eos=True))[0].outputs[0].text
    stop = full[10:13]
    assert stop.strip() and full.index(stop) == 10, f"pick another stop string from {full!r}"
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPTS[1],
        "max_tokens": 40,
        "temperature": 0,
        "stop": stop,
        "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True},
    }
    response = client.completions.create(**request)
    assert response.choices[0].text == full[:13]
    assert response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**request, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:13]


def test_truncated_prompt_generates_from_its_last_tokens(
    client: openai.OpenAI, offline: LLM
) -> None:
    """truncate_prompt_tokens: the output is the offline engine's from the prompt's last k
    tokens, and usage counts those k."""
    prompt_ids = offline.tokenizer.encode(PROMPTS[2])
    expected = offline.generate([prompt_ids[-5:]], _greedy(12, ignore_eos=True))[0].outputs[0]
    whole = offline.generate([prompt_ids], _greedy(12, ignore_eos=True))[0].outputs[0]
    assert expected.text != whole.text, "the cut must change the output for this to show"
    for prompt in (PROMPTS[2], prompt_ids):
        response = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5},
        )
        assert response.choices[0].text == expected.text
        assert response.usage is not None and response.usage.prompt_tokens == 5


def test_echo_prepends_the_prompt(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate([PROMPTS[0]], _greedy(8, ignore_eos=True))[0].outputs[0].text
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPTS[0],
        "max_tokens": 8,
        "temperature": 0,
        "echo": True,
        "extra_body": {"ignore_eos": True},
    }
    response = client.completions.create(**request)
    assert response.choices[0].text == PROMPTS[0] + expected
    chunks = [c.choices[0].text for c in client.completions.create(**request, stream=True)]
    assert chunks[0].startswith(PROMPTS[0]) and "".join(chunks) == PROMPTS[0] + expected


def test_completion_logprobs_match_the_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate([PROMPTS[0]], _greedy(8, logprobs=3, ignore_eos=True))[0]
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=8,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.tokens is not None
    completion = expected.outputs[0]
    assert completion.logprobs is not None
    for position, token_id in enumerate(completion.token_ids):
        want = completion.logprobs[position][token_id].logprob
        assert math.isclose(logprobs.token_logprobs[position], want, abs_tol=1e-4)
        assert logprobs.tokens[position] == offline.tokenizer.decode([token_id])
        assert 3 <= len(logprobs.top_logprobs[position]) <= 4
    assert "".join(logprobs.tokens) == response.choices[0].text


def test_chat_top_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs
    assert content is not None and content.content is not None
    assert len(content.content) == 5
    for entry in content.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-6)


FORCED_TOKEN = 77  # a +100 bias makes greedy decoding pick it at every position
ALLOWED = [40, 41, 300, 777]
# field -> (what the openai client sends, the SamplingParams keywords that mean the same)
CONSTRAINTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "logit_bias": ({"logit_bias": {str(FORCED_TOKEN): 100}}, {"logit_bias": {FORCED_TOKEN: 100}}),
    "allowed_token_ids": (
        {"extra_body": {"allowed_token_ids": ALLOWED, "ignore_eos": True}},
        {"allowed_token_ids": ALLOWED},
    ),
}


def _expected_under(
    offline: LLM, prompt_ids: list[int], constraint: str, **params: object
) -> tuple[list[int], str]:
    """The offline engine's greedy tokens and text under ``constraint``, checked to differ from
    those without it (so the HTTP answer matching them shows the field took effect)."""
    [free] = offline.generate([prompt_ids], _greedy(8, ignore_eos=True))
    [out] = offline.generate([prompt_ids], _greedy(8, ignore_eos=True, **params))
    tokens = out.outputs[0].token_ids
    if constraint == "logit_bias":
        assert tokens == [FORCED_TOKEN] * 8
    else:
        assert set(tokens) <= set(ALLOWED)
    assert out.outputs[0].text != free.outputs[0].text
    return tokens, out.outputs[0].text


def _request(constraint: str, stream: bool, **fields: Any) -> dict[str, Any]:
    """Keywords of an ``openai`` client call: ``fields``, greedy, 8 tokens, the constraint."""
    request: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0}
    request["stream"] = stream
    request.update(fields)
    request.update(CONSTRAINTS[constraint][0])
    request.setdefault("extra_body", {"ignore_eos": True})
    return request


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("constraint", sorted(CONSTRAINTS))
def test_completions_honour_logit_bias_and_allowed_token_ids(
    client: openai.OpenAI, offline: LLM, constraint: str, stream: bool
) -> None:
    prompt_ids = offline.tokenizer.encode(PROMPTS[0])
    _, text = _expected_under(offline, prompt_ids, constraint, **CONSTRAINTS[constraint][1])
    request = _request(constraint, stream, prompt=PROMPTS[0])
    if stream:
        chunks = client.completions.create(**request)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    else:
        response = client.completions.create(**request)
        assert response.choices[0].text == text
        assert response.usage is not None and response.usage.completion_tokens == 8


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("constraint", sorted(CONSTRAINTS))
def test_chat_honours_logit_bias_and_allowed_token_ids(
    client: openai.OpenAI, offline: LLM, constraint: str, stream: bool
) -> None:
    messages = [{"role": "user", "content": "Name a prime."}]
    rendered = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = offline.tokenizer.encode(rendered, add_special_tokens=False)
    _, text = _expected_under(offline, prompt_ids, constraint, **CONSTRAINTS[constraint][1])
    request = _request(constraint, stream, messages=messages)
    if stream:
        chunks = client.chat.completions.create(**request)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    else:
        response = client.chat.completions.create(**request)
        assert response.choices[0].message.content == text


def test_logprobs_under_a_bias_are_the_raw_ones(client: openai.OpenAI, offline: LLM) -> None:
    """As vLLM's default (raw_logprobs): the forced token keeps its unbiased logprob."""
    params = _greedy(4, ignore_eos=True, logprobs=2, logit_bias={FORCED_TOKEN: 100})
    [expected] = offline.generate([PROMPTS[0]], params)
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=4,
        temperature=0,
        logprobs=2,
        logit_bias={str(FORCED_TOKEN): 100},
        extra_body={"ignore_eos": True},
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None
    completion = expected.outputs[0]
    assert completion.token_ids == [FORCED_TOKEN] * 4 and completion.logprobs is not None
    for position, token_logprob in enumerate(logprobs.token_logprobs):
        raw = completion.logprobs[position][FORCED_TOKEN]
        assert raw.rank > 1  # not the model's own choice: its logprob was not biased
        assert math.isclose(token_logprob, raw.logprob, abs_tol=1e-4)
        assert max(logprobs.top_logprobs[position].values()) > token_logprob
