"""Where OpenAI's API and vLLM's server agree, the gateway does as they do: fields it does not
implement are refused naming the field, ``logit_bias`` (string keys), ``allowed_token_ids`` and
``bad_words`` (tokenized as vLLM does) reach the engine's params, vLLM's chat-template options
reach the template, a stop token is not shown, a character cut by max_tokens leaves no U+FFFD,
and every response names its id in X-Request-Id.

The cluster here is a scripted ``GenerationBackend`` that records what it was asked and answers
the tokens a test chooses; the demo model's real byte-level BPE tokenizer runs around it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.gateway.served_model import ServedModel
from tests.engine.test_bad_words import vllm_reference
from tests.gateway.token_script import (
    ScriptedCluster,
    module_gateway_client,  # noqa: F401 - the http fixture
)

pytestmark = pytest.mark.timeout(120)

DEMO_MODEL = Path(__file__).resolve().parents[2] / "engine" / "demo_model" / "assets"
# the demo template, plus a variable that only chat_template_kwargs sets
CHAT_TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{%- for message in messages %}{{ message['role'] | capitalize }}: "
    "{{ message['content'] }}{{ '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}Assistant:{% endif %}"
)
USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def model() -> ServedModel:
    served = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    served.tokenizer.chat_template = CHAT_TEMPLATE  # this module's own copy of the tokenizer
    return served


def _completion(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 16, **fields})


def _chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"messages": USER_HI, **fields})


def _streamed_text(http: httpx.Client, path: str, body: dict[str, Any]) -> str:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    if path.endswith("/chat/completions"):
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    return "".join(c["choices"][0]["text"] for c in chunks)


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "guided_grammar", "root ::= 'a'"),
        ("/v1/completions", "guided_whitespace_pattern", " *"),
        ("/v1/completions", "structured_outputs", {"grammar": "root ::= 'a'"}),
        ("/v1/completions", "length_penalty", 0.5),
        ("/v1/completions", "add_special_tokens", False),
        ("/v1/chat/completions", "add_special_tokens", True),
        ("/v1/chat/completions", "chat_template", "{{ messages }}"),
        ("/v1/chat/completions", "tool_choice", "auto"),
        ("/v1/chat/completions", "response_format", {"type": "structural_tag"}),
    ],
)
def test_fields_that_would_change_the_output_are_refused_by_name(
    http: httpx.Client, path: str, field: str, value: object
) -> None:
    send = _chat if path.endswith("/chat/completions") else _completion
    response = send(http, **{field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert field in error["message"]
    assert error["type"] == "invalid_request_error"


def test_off_values_of_unimplemented_fields_are_accepted(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    cluster.tokens, cluster.finish_reason = model.tokenizer.encode("ok"), "length"
    off = {
        "tool_choice": "none",
        "tools": [],
        "use_beam_search": False,
        "add_special_tokens": False,
        "response_format": {"type": "text"},
    }
    assert _chat(http, **off).status_code == 200
    assert _completion(http, suffix="", add_special_tokens=True).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logit_bias_and_allowed_token_ids_reach_the_sampling_params(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel, path: str
) -> None:
    """OpenAI's string keys become token ids; an empty bias is no bias, as OpenAI reads it."""
    cluster.tokens, cluster.finish_reason = model.tokenizer.encode("ok"), "length"
    send = _chat if path.endswith("/chat/completions") else _completion
    fields = {"logit_bias": {"50": 2.5, "7": -100, "1000": 100}, "allowed_token_ids": [9, 3, 9]}
    response = send(http, **fields)
    assert response.status_code == 200, response.text
    params = cluster.params[-1]
    assert params.logit_bias == {7: -100.0, 50: 2.5, 1000: 100.0}
    assert params.allowed_token_ids == (3, 9)
    assert send(http, logit_bias={}).status_code == 200
    assert cluster.params[-1].logit_bias is None and cluster.params[-1].allowed_token_ids is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_words_reach_the_sampling_params_tokenized_as_vllm_does(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel, path: str
) -> None:
    cluster.tokens, cluster.finish_reason = model.tokenizer.encode("ok"), "length"
    send = _chat if path.endswith("/chat/completions") else _completion
    words = ["hello", " world", "def main", "x"]
    response = send(http, bad_words=words)
    assert response.status_code == 200, response.text
    expected = vllm_reference(model.tokenizer, words)
    assert cluster.params[-1].bad_words_token_ids == tuple(tuple(ids) for ids in expected)
    assert len(expected) > len(words)  # spaced forms were added
    assert send(http, bad_words=[]).status_code == 200
    assert cluster.params[-1].bad_words_token_ids == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("word", "bad_words must be a list of strings"),
        ([1], "bad_words must be a list of strings"),
        (["a"] * 129, "bad_words holds 129 words; at most 128 are allowed"),
        (["a", "x" * 257], "bad_words[1] is 257 characters; at most 256 are allowed"),
        (["a", "  "], "bad_words[1] ('  ') must encode to at least one token"),
        (
            ["x" * 200] * 10,
            "bad_words encode to 20 token sequences of 4000 tokens in all; at most 128 "
            "sequences and 1024 tokens are allowed",
        ),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_bad_words_are_refused_naming_the_field_and_the_limit(
    http: httpx.Client, path: str, value: object, message: str
) -> None:
    send = _chat if path.endswith("/chat/completions") else _completion
    response = send(http, bad_words=value)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "bad_words"
    assert message in error["message"]


def test_an_assistant_turn_with_null_content_is_accepted(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    cluster.tokens, cluster.finish_reason = model.tokenizer.encode("ok"), "length"
    messages = [*USER_HI, {"role": "assistant", "content": None}, {"role": "user", "content": "?"}]
    response = http.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 200, response.text


def test_chat_template_options_reach_the_template(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    cluster.tokens, cluster.finish_reason = model.tokenizer.encode("ok"), "length"

    def rendered(**fields: Any) -> str:
        response = _chat(http, **fields)
        assert response.status_code == 200, response.text
        return str(model.tokenizer.decode(cluster.prompts[-1], skip_special_tokens=True))

    assert rendered() == "User: hi\nAssistant:"
    assert rendered(add_generation_prompt=False) == "User: hi\n"
    assert rendered(chat_template_kwargs={"greeting": "Howdy"}) == "Howdy\nUser: hi\nAssistant:"
    reserved = _chat(http, chat_template_kwargs={"tokenize": True})
    assert reserved.status_code == 400
    assert reserved.json()["error"]["param"] == "chat_template_kwargs"
    messages = [*USER_HI, {"role": "assistant", "content": "Sure, the"}]
    response = http.post(
        "/v1/chat/completions",
        json={"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert response.status_code == 200, response.text
    prompt = model.tokenizer.decode(cluster.prompts[-1], skip_special_tokens=True)
    assert prompt.endswith("Assistant: Sure, the")  # left open for the reply to extend


def test_a_stop_token_is_counted_but_not_shown(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """vLLM drops the eos or stop_token_ids token that ended a sample from its text."""
    cluster.tokens = model.tokenizer.encode("Hello world.")
    cluster.finish_reason = "stop"  # the engine's "stop": the last token is a stop token
    stop_id = cluster.tokens[-1]
    body = {"prompt": "hi", "max_tokens": 16, "stop_token_ids": [stop_id]}
    whole = _completion(http, stop_token_ids=[stop_id]).json()
    assert whole["choices"][0]["text"] == "Hello world"
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == len(cluster.tokens)
    assert _streamed_text(http, "/v1/completions", body) == "Hello world"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_character_cut_by_max_tokens_leaves_no_replacement_character(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel, path: str
) -> None:
    cluster.tokens, cluster.finish_reason = model.tokenizer.encode("Hi 🦊 狐狸"), "stop"
    whole_text = model.tokenizer.decode(cluster.tokens)
    # every cut: inside the fox (4 bytes over several tokens), between, inside 狐 and 狸
    for max_tokens in range(1, len(cluster.tokens)):
        cut = str(model.tokenizer.decode(cluster.tokens[:max_tokens]))
        expected = cut.rstrip("\ufffd")
        assert whole_text.startswith(expected)
        body: dict[str, Any] = {"max_tokens": max_tokens}
        if path == "/v1/completions":
            body["prompt"] = "hi"
            response = http.post(path, json=body).json()
            text = response["choices"][0]["text"]
        else:
            body["messages"] = USER_HI
            response = http.post(path, json=body).json()
            text = response["choices"][0]["message"]["content"]
        assert text == expected, max_tokens
        assert response["choices"][0]["finish_reason"] == "length"
        assert _streamed_text(http, path, body) == expected, max_tokens


def test_responses_name_their_id_in_x_request_id(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    cluster.tokens, cluster.finish_reason = model.tokenizer.encode("ok"), "length"
    whole = _completion(http)
    assert whole.headers["x-request-id"] == whole.json()["id"]
    with http.stream(
        "POST", "/v1/chat/completions", json={"messages": USER_HI, "stream": True}
    ) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
        assert r.headers["x-request-id"] == first["id"]
