"""vLLM's ``return_token_ids``: on /v1/completions each choice shows its prompt's token ids and
its output's, whole and streamed (the prompt's in each choice's first chunk, the output's chunk
by chunk), the hidden eos included as vLLM counts it; on chat the response shows its prompt's
(streamed: on the role chunks) and each choice its output's.

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


def test_chat_shows_the_prompts_on_the_response_and_each_choices_output(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """Whole: ``prompt_token_ids`` on the response (the rendered chat's), ``token_ids`` on each
    choice. Streamed: the prompt's on each role chunk, the output's on each later chunk."""
    chat = {"messages": [USER_HI], "n": 2, "max_tokens": 32, "return_token_ids": True}
    whole = post_json(http, "/v1/chat/completions", chat)
    prompt = cluster.prompts[-1]  # the rendered chat, as the workers were asked for it
    assert whole["prompt_token_ids"] == prompt
    assert [c["token_ids"] for c in whole["choices"]] == [cluster.tokens] * 2
    assert [c["message"]["content"] for c in whole["choices"]] == [ANSWER] * 2
    chunks = stream_chunks(http, "/v1/chat/completions", chat)
    roles = [c for c in chunks if "role" in c["choices"][0]["delta"]]
    assert len(roles) == 2 and all(c["prompt_token_ids"] == prompt for c in roles)
    rest = [c for c in chunks if c not in roles]
    assert not any("prompt_token_ids" in c for c in rest)
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in rest)
    assert _choice_token_ids(rest, 0) == _choice_token_ids(rest, 1) == cluster.tokens


def test_without_it_chat_shows_no_token_ids_and_a_non_boolean_is_refused(
    http: httpx.Client,
) -> None:
    chat = {"messages": [USER_HI], "max_tokens": 3}
    for flag in ({}, {"return_token_ids": False}):
        off = post_json(http, "/v1/chat/completions", {**chat, **flag})
        assert "prompt_token_ids" not in off and "token_ids" not in off["choices"][0]
        chunks = stream_chunks(http, "/v1/chat/completions", {**chat, **flag})
        assert not any("token_ids" in c for chunk in chunks for c in chunk["choices"])
        assert not any("prompt_token_ids" in chunk for chunk in chunks)
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat)):
        error = bad_request_error(http.post(path, json={**body, "return_token_ids": "yes"}))
        assert error["param"] == "return_token_ids"
