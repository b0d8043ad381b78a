"""A prompt's own logprobs over HTTP, as vLLM's OpenAI server shows them: completions' ``echo``
with ``logprobs`` (the prompt's tokens lead each choice's logprobs, whole and streamed),
``max_tokens`` 0 with echo (the prompt alone: lm-eval-harness' loglikelihood requests), and
vLLM's ``prompt_logprobs`` on both endpoints (a list per completion choice, one on a chat
response; refused in a stream), bad values refused naming the field.

The cluster here is a scripted ``GenerationBackend`` whose made-up prompt logprobs
(``scripted_prompt_logprobs``) come with the first token, as the workers send theirs; the demo
model's real tokenizer runs around it. ``test_prompt_logprobs_on_the_engine`` checks the values
against the offline engine.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from engine.sampling.params import SamplingParams
from router.gateway.choice_prompts import add_prompt_logprobs
from router.gateway.openai_request import OpenAIJob
from router.gateway.openai_response import ChoiceText, LogprobsFormatter
from router.gateway.served_model import ServedModel
from router.gateway.spec import GenerationSpec
from router.gateway.text_stream import TextGeneration
from tests.gateway.token_script import (
    USER_HI,
    ScriptedCluster,
    bad_request_error,
    demo_model,  # noqa: F401 (the "model" fixture)
    post_json,
    scripted_gateway_client,  # noqa: F401 (the "http" fixture)
    scripted_prompt_logprobs,
    stream_chunks,
)

pytestmark = pytest.mark.timeout(120)

PROMPT = "Say hi"  # 'S' 'ay' ' h' 'i'
OUTPUT = "Hello world"  # 'H' 'ell' 'o' ' w' 'or' 'ld'


@pytest.fixture
def cluster(model: ServedModel) -> ScriptedCluster:
    """Answers every sample with OUTPUT's tokens."""
    return ScriptedCluster(model.tokenizer.encode(OUTPUT))


class Texts:
    """Token ids decoded one at a time, as the logprobs show them."""

    def __init__(self, model: ServedModel) -> None:
        self.tokenizer = model.tokenizer

    def __call__(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def offsets(self, token_ids: list[int]) -> list[int]:
        """Each token's text offset, counting the texts of the tokens before it."""
        lengths = [len(self(t)) for t in token_ids]
        return [sum(lengths[:i]) for i in range(len(token_ids))]


def test_echo_with_logprobs_leads_each_choice_with_its_prompts_tokens(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """vLLM's shape: the prompt's tokens first, the first with null logprob and top; each with
    at most logprobs + 1 alternatives (the prompt token first); then the generated tokens, text
    offsets running on. The workers are asked for the prompt's logprobs with logprobs' N."""
    text = Texts(model)
    prompt = list(model.tokenizer.encode(PROMPT))
    out = cluster.tokens[:2]
    assert len(prompt) == 4
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2, "n": 2}
    response = post_json(http, "/v1/completions", body)
    assert cluster.params[-1].prompt_logprobs == 1 and cluster.params[-1].logprobs == 1
    # scripted: position p's token has logprob -p/2, rank 1 at odd p; at even p token 901 is
    # more likely (-p/2 / 2); output position q's token has -(q + 1)/4 and rank 1
    expected_logprobs = {
        "tokens": [text(t) for t in prompt + out],
        "token_logprobs": [None, -0.5, -1.0, -1.5, -0.25, -0.5],
        "top_logprobs": [
            None,
            {text(prompt[1]): -0.5},
            {text(prompt[2]): -1.0, text(901): -0.5},
            {text(prompt[3]): -1.5},
            {text(out[0]): -0.25},
            {text(out[1]): -0.5},
        ],
        "text_offset": text.offsets(prompt + out),
    }
    expected_prompt_logprobs = [
        None,
        {str(prompt[1]): {"logprob": -0.5, "rank": 1, "decoded_token": text(prompt[1])}},
        {
            str(prompt[2]): {"logprob": -1.0, "rank": 6, "decoded_token": text(prompt[2])},
            "901": {"logprob": -0.5, "rank": 1, "decoded_token": text(901)},
        },
        {str(prompt[3]): {"logprob": -1.5, "rank": 1, "decoded_token": text(prompt[3])}},
    ]
    for choice in response["choices"]:
        assert choice["text"] == PROMPT + model.tokenizer.decode(out)
        assert choice["logprobs"] == expected_logprobs
        # vLLM's choices carry the prompt logprobs it computed for echo, as its own field too
        assert choice["prompt_logprobs"] == expected_prompt_logprobs
    assert list(response["choices"][0]["prompt_logprobs"][2]) == [str(prompt[2]), "901"]


def test_each_prompt_of_a_batch_leads_its_own_choices(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    text = Texts(model)
    ids = list(model.tokenizer.encode(" and good night"))
    body = {"prompt": [PROMPT, ids], "echo": True, "logprobs": 0, "max_tokens": 1, "n": 2}
    response = post_json(http, "/v1/completions", body)
    prompts = [list(model.tokenizer.encode(PROMPT)), ids]
    assert cluster.prompts[-2:] == prompts
    for index, choice in enumerate(response["choices"]):
        prompt = prompts[index // 2]
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [text(t) for t in prompt + cluster.tokens[:1]]
        assert len(choice["prompt_logprobs"]) == len(prompt)
        # logprobs 0: the token itself, where it is not the most likely one too
        assert [None if top is None else list(top) for top in logprobs["top_logprobs"]] == [
            None,
            *([text(t)] for t in prompt[1:]),
            [text(cluster.tokens[0])],
        ]


def test_prompt_logprobs_set_with_echo_are_what_the_workers_compute(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """An explicit prompt_logprobs wins over logprobs' N (as vLLM's to_sampling_params); the
    echoed entries still hold at most logprobs + 1 alternatives."""
    text = Texts(model)
    prompt = list(model.tokenizer.encode(PROMPT))
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "prompt_logprobs": 3, "max_tokens": 1}
    choice = post_json(http, "/v1/completions", body)["choices"][0]
    assert cluster.params[-1].prompt_logprobs == 3
    assert choice["logprobs"]["top_logprobs"][2] == {text(prompt[2]): -1.0, text(901): -0.25}
    assert list(choice["prompt_logprobs"][2]) == [str(prompt[2]), "901", "902", "903"]
    assert list(choice["prompt_logprobs"][1]) == [str(prompt[1]), "901", "902"]


def test_streamed_echo_with_logprobs_equals_the_whole_response(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """Each choice's first chunk carries the prompt's text and its tokens' logprobs; joined,
    the chunks' logprobs are the whole response's (text offsets included)."""
    ids = list(model.tokenizer.encode(" and good night"))
    body = {"prompt": [PROMPT, ids], "echo": True, "logprobs": 2, "max_tokens": 5, "n": 2}
    whole = post_json(http, "/v1/completions", body)
    chunks = stream_chunks(http, "/v1/completions", body)
    assert cluster.params[-1].prompt_logprobs == 2  # computed for a stream's echo, as vLLM
    prompts = [list(model.tokenizer.encode(PROMPT)), ids]
    for index, choice in enumerate(whole["choices"]):
        joined: dict[str, list[Any]] = {key: [] for key in choice["logprobs"]}
        pieces = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        first = pieces[0]["logprobs"]
        assert len(first["tokens"]) > len(prompts[index // 2])
        assert first["token_logprobs"][0] is None and first["top_logprobs"][0] is None
        for piece in pieces:
            assert "prompt_logprobs" not in piece  # vLLM's stream chunks have no such field
            for key in joined:
                joined[key] += piece["logprobs"][key]
        assert joined == choice["logprobs"]
        assert "".join(p["text"] for p in pieces) == choice["text"]


@pytest.mark.parametrize("logprobs", [None, 3])
def test_max_tokens_0_with_echo_returns_the_prompt_alone(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel, logprobs: int | None
) -> None:
    """lm-eval-harness' loglikelihood request: the choice is the prompt, its logprobs the
    prompt's. As vLLM, the workers generate one token (not shown, counted in usage)."""
    text = Texts(model)
    prompt = list(model.tokenizer.encode(PROMPT))
    body: dict[str, Any] = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "n": 2}
    if logprobs is not None:
        body["logprobs"] = logprobs
    response = post_json(http, "/v1/completions", body)
    assert cluster.params[-1].max_tokens == 1
    for choice in response["choices"]:
        assert choice["text"] == PROMPT
        assert choice["finish_reason"] == "length"
        if logprobs is None:
            assert choice["logprobs"] is None and "prompt_logprobs" not in choice
        else:
            assert choice["logprobs"]["tokens"] == [text(t) for t in prompt]
            assert choice["logprobs"]["token_logprobs"] == [None, -0.5, -1.0, -1.5]
            assert choice["logprobs"]["text_offset"] == text.offsets(prompt)
    assert response["usage"]["completion_tokens"] == 2
    chunks = stream_chunks(http, "/v1/completions", body)
    for index, choice in enumerate(response["choices"]):
        [piece] = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert piece["text"] == PROMPT and piece["finish_reason"] == "length"
        assert piece["logprobs"] == choice["logprobs"]


def test_max_tokens_0_without_echo_is_refused(http: httpx.Client) -> None:
    error = bad_request_error(
        http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    )
    assert error["param"] == "max_tokens"
    assert "max_tokens must be >= 1, got 0 (0 is allowed only with echo" in error["message"]
    error = bad_request_error(
        http.post("/v1/chat/completions", json={"messages": [USER_HI], "max_tokens": 0})
    )
    assert error["param"] == "max_tokens"


def test_prompt_logprobs_on_completions_are_vllms_list_on_each_choice(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    text = Texts(model)
    ids = list(model.tokenizer.encode(" and good night"))
    body = {"prompt": [PROMPT, ids], "prompt_logprobs": 2, "max_tokens": 2, "n": 2}
    response = post_json(http, "/v1/completions", body)
    assert cluster.params[-1].prompt_logprobs == 2 and cluster.params[-1].logprobs is None
    for index, choice in enumerate(response["choices"]):
        prompt = [list(model.tokenizer.encode(PROMPT)), ids][index // 2]
        assert choice["text"] == model.tokenizer.decode(cluster.tokens[:2])  # no echo
        assert choice["logprobs"] is None
        listed = choice["prompt_logprobs"]
        assert listed[0] is None and len(listed) == len(prompt)
        for position, entries in enumerate(listed[1:], start=1):
            token = prompt[position]
            first = next(iter(entries))
            assert first == str(token)  # the prompt token first
            assert entries[first]["logprob"] == -position / 2
            assert entries[first]["decoded_token"] == text(token)
            assert entries[first]["rank"] == (1 if position % 2 else 7)
            assert [e["rank"] for k, e in entries.items() if k != first] == (
                [2] if position % 2 else [1, 2]
            )


def test_prompt_logprobs_on_chat_are_vllms_list_on_the_response(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    body = {"messages": [USER_HI], "prompt_logprobs": 0, "max_tokens": 2, "n": 2}
    response = post_json(http, "/v1/chat/completions", body)
    prompt = cluster.prompts[-1]
    assert cluster.params[-1].prompt_logprobs == 0
    listed = response["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(prompt)
    assert [list(entries) for entries in listed[1:]] == [[str(t)] for t in prompt[1:]]
    assert all("prompt_logprobs" not in choice for choice in response["choices"])
    plain = post_json(http, "/v1/chat/completions", {"messages": [USER_HI], "max_tokens": 2})
    assert "prompt_logprobs" not in plain and cluster.params[-1].prompt_logprobs is None


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": [USER_HI]})],
)
def test_prompt_logprobs_are_refused_in_a_stream_as_vllm_does(
    http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    response = http.post(path, json={**body, "stream": True, "prompt_logprobs": 1})
    error = bad_request_error(response)
    assert error["param"] == "prompt_logprobs"
    assert "not available with stream" in error["message"]
    chunks = stream_chunks(http, path, {**body, "prompt_logprobs": 0})  # 0: accepted, as vLLM does
    assert all("prompt_logprobs" not in chunk for chunk in chunks)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (-1, "prompt_logprobs must be an integer in [0, 20], got -1 (vLLM's -1"),
        (-2, "prompt_logprobs must be an integer in [0, 20], got -2"),
        (21, "prompt_logprobs must be an integer in [0, 20], got 21"),
        ("2", "prompt_logprobs must be an integer, got str"),
        (1.5, "prompt_logprobs must be an integer, got float"),
        (True, "prompt_logprobs must be an integer, got bool"),
    ],
)
@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": [USER_HI]})],
)
def test_bad_prompt_logprobs_are_refused_naming_the_field_and_the_limit(
    http: httpx.Client, path: str, body: dict[str, Any], value: object, words: str
) -> None:
    error = bad_request_error(http.post(path, json={**body, "prompt_logprobs": value}))
    assert error["param"] == "prompt_logprobs"
    assert words in error["message"]


def test_bad_logprobs_with_echo_are_refused_naming_logprobs(http: httpx.Client) -> None:
    """echo asks the workers for logprobs' N of prompt logprobs: a bad N is logprobs' fault."""
    for value, words in ((-1, "logprobs must be >= 0, got -1"), (21, "logprobs must be <= 20")):
        body = {"prompt": PROMPT, "echo": True, "logprobs": value}
        error = bad_request_error(http.post("/v1/completions", json=body))
        assert error["param"] == "logprobs"
        assert words in error["message"]


def test_minus_infinity_is_shown_as_minus_9999_as_vllm_does(
    http: httpx.Client, cluster: ScriptedCluster
) -> None:
    """JSON has no infinity: vLLM clamps a -inf logprob to -9999.0."""
    cluster.first_prompt_logprob = float("-inf")
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1}
    choice = post_json(http, "/v1/completions", body)["choices"][0]
    assert choice["logprobs"]["token_logprobs"][1] == -9999.0
    assert list(choice["logprobs"]["top_logprobs"][1].values()) == [-9999.0]
    assert [e["logprob"] for e in choice["prompt_logprobs"][1].values()] == [-9999.0]


def test_echo_with_logprobs_decodes_each_prompt_token_and_alternative_once() -> None:
    """A whole response shows the prompt twice (vLLM's prompt_logprobs and the echo's entries)
    on each of its n choices. Before, every prompt token and alternative was decoded once for
    each of the two; now once in all."""
    prompt = [5, 6, 7, 8]
    spec = GenerationSpec(prompt, SamplingParams(logprobs=2, prompt_logprobs=2), (), None)
    generation = TextGeneration(None, None, spec, "r")
    generation.prompt_logprobs = scripted_prompt_logprobs(prompt, 2)
    job = OpenAIJob(
        "completion", [spec], 2, False, False, 2, ["echo"], True, show_prompt_logprobs=True
    )
    choices = [ChoiceText(), ChoiceText()]
    decoded: list[int] = []

    class Tokenizer:  # counts what it decodes
        def decode(self, token_ids: list[int]) -> str:
            decoded.extend(token_ids)
            return f"<{token_ids[0]}>"

    add_prompt_logprobs(job, choices, [generation], LogprobsFormatter(Tokenizer()), aborted=False)
    # position 1 and 3: the prompt token then 901 (the top 2); position 2: itself, 901, 902
    assert sorted(decoded) == sorted([5, 6, 901, 7, 901, 902, 8, 901])
    for choice in choices:
        assert choice.echo_logprobs is not None and choice.prompt_logprobs is not None
        assert choice.echo_logprobs["tokens"] == ["<5>", "<6>", "<7>", "<8>"]
        assert choice.echo_logprobs["text_offset"] == [0, 3, 6, 9]
        assert choice.echo_logprobs["top_logprobs"][2] == {
            "<7>": -1.0,
            "<901>": -1 / 3,
            "<902>": -2 / 3,
        }
        assert choice.prompt_logprobs[2]["902"]["decoded_token"] == "<902>"


def test_return_tokens_as_token_ids_shows_each_logprobs_token_by_its_id(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """vLLM's return_tokens_as_token_ids: every token of the logprobs (the echoed prompt's, the
    generated ones, their alternatives) is "token_id:ID", text offsets counted by those, whole
    and streamed; vLLM's prompt_logprobs keep their decoded text; chat's entries too."""
    text = Texts(model)
    prompt = list(model.tokenizer.encode(PROMPT))
    out = cluster.tokens[:2]

    def shown(token_id: int) -> str:
        return f"token_id:{token_id}"

    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2}
    body["return_tokens_as_token_ids"] = True
    (choice,) = post_json(http, "/v1/completions", body)["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [shown(t) for t in prompt + out]
    assert logprobs["top_logprobs"][2] == {shown(prompt[2]): -1.0, shown(901): -0.5}
    assert logprobs["top_logprobs"][4] == {shown(out[0]): -0.25}
    lengths = [len(shown(t)) for t in prompt + out]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
    assert choice["text"] == PROMPT + model.tokenizer.decode(out)  # the text is the text
    assert choice["prompt_logprobs"][1][str(prompt[1])]["decoded_token"] == text(prompt[1])
    chunks = stream_chunks(http, "/v1/completions", body)
    joined: dict[str, list[Any]] = {key: [] for key in logprobs}
    for chunk in chunks:
        for key in joined:
            joined[key] += chunk["choices"][0]["logprobs"][key]
    assert joined == logprobs
    chat = {"messages": [USER_HI], "logprobs": True, "top_logprobs": 1, "max_tokens": 2}
    chat["return_tokens_as_token_ids"] = True
    (chat_choice,) = post_json(http, "/v1/chat/completions", chat)["choices"]
    entries = chat_choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [shown(t) for t in out]
    assert entries[0]["bytes"] == list(shown(out[0]).encode())
    assert [t["token"] for t in entries[0]["top_logprobs"]] == [shown(out[0])]
    streamed = stream_chunks(http, "/v1/chat/completions", chat)
    tokens = [
        e["token"]
        for c in streamed
        if c["choices"]
        for e in (c["choices"][0].get("logprobs") or {}).get("content", [])
    ]
    assert tokens == [shown(t) for t in out]
    bad = {**body, "return_tokens_as_token_ids": "yes"}
    error = bad_request_error(http.post("/v1/completions", json=bad))
    assert error["param"] == "return_tokens_as_token_ids"
