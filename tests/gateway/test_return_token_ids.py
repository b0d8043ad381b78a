"""vLLM's ``return_token_ids`` on /v1/completions: each choice shows its prompt's token ids and
its output's, whole and streamed (the prompt's in each choice's first chunk, the output's chunk
by chunk), the hidden eos included as vLLM counts it; refused on chat, which does not implement
it.

The cluster here is a scripted ``GenerationBackend`` (no Ray); the demo model's tokenizer runs
around it.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from router.gateway.served_model import ServedModel
from tests.gateway.token_script import (
    USER_HI,
    ScriptedCluster,
    bad_request_error,
    demo_model,  # noqa: F401 (the "model" fixture)
    post_json,
    script_answer,
    scripted_gateway_client,  # noqa: F401 (the "http" fixture)
    stream_chunks,
)

pytestmark = pytest.mark.timeout(120)

ANSWER = "Hello world. More text"


@pytest.fixture
def cluster(model: ServedModel) -> ScriptedCluster:
    cluster = ScriptedCluster()
    script_answer(cluster, model, ANSWER)  # ends with eos: finish_reason "stop"
    return cluster


def _choice_token_ids(chunks: list[dict[str, Any]], index: int) -> list[int]:
    return [
        token_id
        for chunk in chunks
        for choice in chunk["choices"]
        if choice["index"] == index
        for token_id in choice["token_ids"]
    ]


def test_a_whole_response_shows_prompt_and_output_token_ids(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    prompt_ids = [5, 17, 300, 2, 999]  # token ids as sent, an eos among them
    body = {"prompt": prompt_ids, "max_tokens": 32, "return_token_ids": True}
    answer = post_json(http, "/v1/completions", body)
    (choice,) = answer["choices"]
    assert choice["text"] == ANSWER
    assert choice["prompt_token_ids"] == prompt_ids == cluster.prompts[-1]
    assert choice["token_ids"] == cluster.tokens  # the eos that ended it too, as vLLM
    assert choice["token_ids"][-1] == model.tokenizer.eos_token_id
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"]


def test_text_prompts_and_several_choices_show_their_own_prompt(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    body = {"prompt": ["one", "two words"], "n": 2, "max_tokens": 4, "return_token_ids": True}
    choices = post_json(http, "/v1/completions", body)["choices"]
    encoded = [list(model.tokenizer.encode(text)) for text in ("one", "two words")]
    assert [c["prompt_token_ids"] for c in choices] == [encoded[0]] * 2 + [encoded[1]] * 2
    assert all(c["token_ids"] == cluster.tokens[:4] for c in choices)


def test_a_stream_shows_the_prompt_once_and_the_output_per_chunk(
    http: httpx.Client, cluster: ScriptedCluster
) -> None:
    prompt_ids = [7, 8, 9, 10]
    body = {"prompt": prompt_ids, "n": 2, "max_tokens": 32, "return_token_ids": True}
    chunks = stream_chunks(http, "/v1/completions", body, include_usage=True)
    for index in (0, 1):
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert all(len(c["token_ids"]) <= 1 for c in mine)  # a chunk per token
        assert _choice_token_ids(chunks, index) == cluster.tokens
        assert "".join(c["text"] for c in mine) == ANSWER
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 2 * len(cluster.tokens)


def test_without_it_no_token_ids_are_shown(http: httpx.Client) -> None:
    for flag in ({}, {"return_token_ids": False}):
        body = {"prompt": [7, 8], "max_tokens": 3, **flag}
        (choice,) = post_json(http, "/v1/completions", body)["choices"]
        assert "token_ids" not in choice and "prompt_token_ids" not in choice
        chunks = stream_chunks(http, "/v1/completions", body)
        assert not any("token_ids" in c for chunk in chunks for c in chunk["choices"])


def test_chat_refuses_it_and_a_non_boolean_is_refused(http: httpx.Client) -> None:
    chat = {"messages": [USER_HI], "return_token_ids": True}
    error = bad_request_error(http.post("/v1/chat/completions", json=chat))
    assert error["param"] == "return_token_ids"
    off = post_json(http, "/v1/chat/completions", {**chat, "return_token_ids": False})
    assert "token_ids" not in off["choices"][0]
    wrong = {"prompt": "hi", "return_token_ids": "yes"}
    error = bad_request_error(http.post("/v1/completions", json=wrong))
    assert error["param"] == "return_token_ids"
