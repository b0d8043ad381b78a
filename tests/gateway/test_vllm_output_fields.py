"""vLLM's ``include_stop_str_in_output``, ``stop_reason`` and ``truncate_prompt_tokens``, and
OpenAI's ``echo``, over HTTP, as vLLM's OpenAI server does them: whole and streamed, with n > 1,
in usage, and refused with a 400 naming the field when a value is out of bounds.

The cluster here is a scripted ``GenerationBackend`` that records the prompts it was asked for
and answers the tokens a test chooses; the demo model's real byte-level BPE tokenizer runs
around it.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from router.detokenizer import StopStringMatcher
from router.gateway.served_model import ServedModel
from router.gateway.truncation import encode_truncated
from tests.gateway.token_script import (
    DEMO_MODEL,
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

TEXT = "Hello world. More text"  # 'H' 'ell' 'o' ' w' 'or' 'ld' '.' ' M' 'ore' ' text'
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 40  # > 512 tokens (the context)


@pytest.fixture
def cluster(model: ServedModel) -> ScriptedCluster:
    """Answers every sample with TEXT's tokens."""
    return ScriptedCluster(model.tokenizer.encode(TEXT))


def _pieces(chunks: list[dict[str, Any]], index: int) -> list[str]:
    """Choice ``index``'s text, chunk by chunk (chat: the content of each delta that has one)."""
    pieces = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] == index:
                text = choice["text"] if "text" in choice else choice["delta"].get("content")
                if text is not None:
                    pieces.append(text)
    return pieces


def _invalid_request_error(response: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of ``response``, a 400 of OpenAI's type invalid_request_error."""
    error = bad_request_error(response)
    assert error["type"] == "invalid_request_error"
    return error


# ---------------------------------------------------------------- include_stop_str_in_output


def test_matcher_keeps_a_stop_string_and_holds_nothing_back() -> None:
    kept = StopStringMatcher(["END"], include_in_output=True)
    assert kept.feed("aE") == "aE"  # "E" may begin "END", but it is sent at once
    assert kept.feed("N") == "N"
    assert kept.feed("Dzz") == "D"  # found across three deltas; what follows it is dropped
    assert kept.stopped and kept.feed("more") == "" and kept.flush() == ""
    released = StopStringMatcher(["END"], include_in_output=True)
    assert released.feed("aEN") == "aEN"
    assert released.feed("x") == "x"  # not "END" after all; nothing was held, nothing is lost
    assert not released.stopped and released.flush() == ""
    earliest = StopStringMatcher(["b", "abc", "ab"], include_in_output=True)
    assert earliest.feed("xxabcd") == "xxab"  # the earliest start, the shorter of two there


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_matched_stop_string_is_kept_whole_and_streamed(
    http: httpx.Client, path: str, model: ServedModel
) -> None:
    """The stop string "ld. " spans three tokens and ends inside " M": kept, the text ends
    "world. " ("M" is cut); trimmed, it ends "wor". Streamed, each token's text leaves with it
    (nothing is held back as a possible stop string), and both choices read the same."""
    prompt = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [USER_HI]}
    body = {**prompt, "max_tokens": 16, "n": 2, "stop": ["ld. ", "zzz"]}
    kept = post_json(http, path, {**body, "include_stop_str_in_output": True})
    trimmed = post_json(http, path, {**body, "include_stop_str_in_output": False})
    for index in (0, 1):
        assert _text(kept, index) == "Hello world. "
        assert _text(trimmed, index) == "Hello wor"
        assert kept["choices"][index]["finish_reason"] == "stop"
    # usage: every token up to " M", the one that completed the stop string, per sample
    assert kept["usage"]["completion_tokens"] == trimmed["usage"]["completion_tokens"] == 2 * 8
    chunks = stream_chunks(
        http, path, {**body, "include_stop_str_in_output": True}, include_usage=True
    )
    for index in (0, 1):
        assert [p for p in _pieces(chunks, index) if p] == [
            "H",
            "ell",
            "o",
            " w",
            "or",
            "ld",
            ".",
            " ",
        ]
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * 8
    held = stream_chunks(
        http, path, {**body, "include_stop_str_in_output": False}, include_usage=True
    )
    assert "".join(_pieces(held, 0)) == "Hello wor"  # "ld" was held back, then trimmed


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_is_shown_only_when_stop_strings_are(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel, include: bool
) -> None:
    """vLLM detokenizes the eos or stop_token_ids token that ends a sample only with
    include_stop_str_in_output; an eos, being special, still shows only with
    skip_special_tokens false."""
    cluster.tokens, cluster.finish_reason = list(model.tokenizer.encode("Hello world.")), "stop"
    body: dict[str, Any] = {"prompt": "hi", "stop_token_ids": [cluster.tokens[-1]]}
    body["include_stop_str_in_output"] = include
    expected = "Hello world." if include else "Hello world"
    assert _text(post_json(http, "/v1/completions", body), 0) == expected
    assert (
        "".join(_pieces(stream_chunks(http, "/v1/completions", body, include_usage=True), 0))
        == expected
    )
    eos = model.tokenizer.eos_token_id
    cluster.tokens = [*model.tokenizer.encode("Hello"), eos]
    del body["stop_token_ids"]
    assert _text(post_json(http, "/v1/completions", body), 0) == "Hello"
    raw = post_json(http, "/v1/completions", {**body, "skip_special_tokens": False})
    assert _text(raw, 0) == ("Hello</s>" if include else "Hello")


# ---------------------------------------------------------------- stop_reason


def _stop_reasons(http: httpx.Client, body: dict[str, Any]) -> list[Any]:
    """The first choice's stop_reason each way it is returned: completions whole and streamed
    (the last chunk's; null on every chunk before it), chat whole and streamed (on the last
    chunk only, with its finish_reason)."""
    completion = {"prompt": "hi", **body}
    chat = {"messages": [USER_HI], **body}
    whole = post_json(http, "/v1/completions", completion)["choices"][0]
    chunks = [c["choices"][0] for c in stream_chunks(http, "/v1/completions", completion)]
    assert all(c["stop_reason"] is None for c in chunks[:-1])
    chat_whole = post_json(http, "/v1/chat/completions", chat)["choices"][0]
    chat_chunks = [c["choices"][0] for c in stream_chunks(http, "/v1/chat/completions", chat)]
    assert all("stop_reason" not in c for c in chat_chunks if c["finish_reason"] is None)
    finish_reasons = {whole["finish_reason"], chunks[-1]["finish_reason"]}
    finish_reasons |= {chat_whole["finish_reason"], chat_chunks[-1]["finish_reason"]}
    assert len(finish_reasons) == 1
    return [
        whole["stop_reason"],
        chunks[-1]["stop_reason"],
        chat_whole["stop_reason"],
        chat_chunks[-1]["stop_reason"],
    ]


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """vLLM's stop_reason: the stop string matched (of several, the first in the text), the
    stop_token_ids token, or null for the tokenizer's eos and for max_tokens."""
    assert _stop_reasons(http, {"stop": ["xyz", "More", "ld"]}) == ["ld"] * 4
    cluster.tokens, cluster.finish_reason = list(model.tokenizer.encode("Hello world.")), "stop"
    stop_token = cluster.tokens[-1]
    assert _stop_reasons(http, {"stop_token_ids": [stop_token]}) == [stop_token] * 4
    script_answer(cluster, model, "Hello")  # ended by the eos
    assert _stop_reasons(http, {}) == [None] * 4
    script_answer(cluster, model, "Hello", stop=False)  # ended by max_tokens
    assert _stop_reasons(http, {}) == [None] * 4


# ---------------------------------------------------------------- truncate_prompt_tokens


def test_a_prompt_is_cut_to_its_last_tokens(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """Text and token-id prompts alike; usage counts the tokens kept, streamed or not."""
    text_ids = list(model.tokenizer.encode("The quick brown fox jumps over"))
    token_ids = list(range(100, 120))
    body = {"prompt": ["The quick brown fox jumps over", token_ids], "truncate_prompt_tokens": 5}
    response = post_json(http, "/v1/completions", {**body, "max_tokens": 3})
    assert cluster.prompts[-2:] == [text_ids[-5:], token_ids[-5:]]
    assert response["usage"]["prompt_tokens"] == 10
    assert response["usage"]["completion_tokens"] == 2 * 3
    chunks = stream_chunks(http, "/v1/completions", {**body, "max_tokens": 3}, include_usage=True)
    assert chunks[-1]["usage"]["prompt_tokens"] == 10
    short = post_json(http, "/v1/completions", {"prompt": [1, 2, 3], "truncate_prompt_tokens": 5})
    assert cluster.prompts[-1] == [1, 2, 3] and short["usage"]["prompt_tokens"] == 3


def test_a_chat_is_cut_after_its_template(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    rendered = model.tokenizer.apply_chat_template([USER_HI], tokenize=False)
    rendered += "Assistant:"
    full = list(model.tokenizer.encode(rendered, add_special_tokens=False))
    body = {"messages": [USER_HI], "max_tokens": 2, "truncate_prompt_tokens": 3}
    response = post_json(http, "/v1/chat/completions", body)
    assert cluster.prompts[-1] == full[-3:]
    assert response["usage"]["prompt_tokens"] == 3


def test_a_prompt_too_long_for_the_context_fits_once_truncated(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """vLLM takes a prompt longer than the context when truncate_prompt_tokens cuts it to fit,
    -1 included (the context less max_tokens); the same prompt untruncated is refused."""
    full = list(model.tokenizer.encode(LONG_PROMPT))
    assert len(full) > model.max_model_len
    refused = _invalid_request_error(http.post("/v1/completions", json={"prompt": LONG_PROMPT}))
    assert refused["code"] == "context_length_exceeded"
    body = {"prompt": LONG_PROMPT, "max_tokens": 10}
    response = post_json(http, "/v1/completions", {**body, "truncate_prompt_tokens": 100})
    assert cluster.prompts[-1] == full[-100:] and response["usage"]["prompt_tokens"] == 100
    response = post_json(http, "/v1/completions", {**body, "truncate_prompt_tokens": -1})
    assert cluster.prompts[-1] == full[-(model.max_model_len - 10) :]
    chat = {"messages": [{"role": "user", "content": LONG_PROMPT}], "truncate_prompt_tokens": -1}
    response = post_json(http, "/v1/chat/completions", chat)  # max_tokens unset: one token's room
    assert response["usage"]["prompt_tokens"] == model.max_model_len - 1
    # far more text than the context holds: refused unread, unless it is to be truncated
    huge = LONG_PROMPT * 6
    assert (
        _invalid_request_error(http.post("/v1/completions", json={"prompt": huge}))["param"]
        == "prompt"
    )
    response = post_json(http, "/v1/completions", {"prompt": huge, "truncate_prompt_tokens": 50})
    assert response["usage"]["prompt_tokens"] == 50


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        ("/v1/completions", 0, "truncate_prompt_tokens must be >= 1, or -1"),
        ("/v1/completions", -2, "truncate_prompt_tokens must be >= 1, or -1"),
        ("/v1/completions", True, "truncate_prompt_tokens must be an integer, got bool"),
        ("/v1/completions", "8", "truncate_prompt_tokens must be an integer, got str"),
        ("/v1/completions", 2.5, "truncate_prompt_tokens must be an integer, got float"),
        (
            "/v1/completions",
            503,
            "truncate_prompt_tokens must be <= 502 (the context length of 512 tokens less "
            "max_tokens (10)), got 503",
        ),
        (
            "/v1/chat/completions",
            513,
            "truncate_prompt_tokens must be <= 512 (the context length of 512 tokens), got 513",
        ),
    ],
)
def test_bad_truncate_prompt_tokens_is_refused_naming_the_limit(
    http: httpx.Client, path: str, value: object, words: str
) -> None:
    if path == "/v1/completions":
        body: dict[str, Any] = {"prompt": "hi", "max_tokens": 10}
    else:
        body = {"messages": [USER_HI]}
    error = _invalid_request_error(http.post(path, json={**body, "truncate_prompt_tokens": value}))
    assert error["param"] == "truncate_prompt_tokens"
    assert words in error["message"]
    assert http.post(path, json=body).status_code == 200  # still serving


def test_a_chat_limit_names_max_completion_tokens(http: httpx.Client) -> None:
    body = {"messages": [USER_HI], "max_completion_tokens": 12, "truncate_prompt_tokens": 501}
    message = _invalid_request_error(http.post("/v1/chat/completions", json=body))["message"]
    assert "must be <= 500 (the context length of 512 tokens less max_completion_tokens" in message


def test_text_truncation_keeps_the_tokens_a_tokenizer_adds(model: ServedModel) -> None:
    """A tokenizer that adds a BOS keeps it, as its own left truncation (vLLM's) does."""
    backend = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    bos_id = backend.token_to_id("<s>")
    backend.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>")
    text = "The quick brown fox jumps over the lazy dog"
    full = tokenizer.encode(text)
    assert full[0] == bos_id
    tokenizer.truncation_side = "left"  # this test's own tokenizer: vLLM's setting
    for keep in (2, 5, len(full) - 1, len(full), len(full) + 3):
        reference = tokenizer(text, truncation=True, max_length=keep)["input_ids"]
        assert encode_truncated(tokenizer, text, keep) == reference, keep
        assert len(reference) == min(keep, len(full))
    plain = model.tokenizer.encode(text)  # the demo tokenizer adds nothing: the last tokens
    assert encode_truncated(model.tokenizer, text, 4) == plain[-4:]
    assert encode_truncated(model.tokenizer, text, None) == plain


# ---------------------------------------------------------------- echo


def test_completion_echo_starts_each_choice_with_its_prompt(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """Whole: each choice's text is its prompt's then the output; streamed, a choice's first
    chunk carries the prompt (with its first text, as vLLM sends it). Usage is unchanged."""
    cluster.tokens = list(model.tokenizer.encode("Hello world"))
    token_ids = list(model.tokenizer.encode(" and good night"))
    body = {"prompt": ["Say:", token_ids], "n": 2, "echo": True}
    response = post_json(http, "/v1/completions", body)
    texts = [_text(response, i) for i in range(4)]
    assert texts == ["Say:Hello world"] * 2 + [" and good nightHello world"] * 2
    plain = post_json(http, "/v1/completions", {**body, "echo": False})
    assert [_text(plain, i) for i in range(4)] == ["Hello world"] * 4
    assert response["usage"] == plain["usage"]
    chunks = stream_chunks(http, "/v1/completions", body, include_usage=True)
    for index, prompt in enumerate(["Say:", "Say:", " and good night", " and good night"]):
        pieces = _pieces(chunks, index)
        assert pieces[0] == prompt + "H"
        assert "".join(pieces) == texts[index]
    assert chunks[-1]["usage"] == plain["usage"]


def test_echo_of_a_truncated_token_prompt_is_its_decoded_kept_tokens(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    cluster.tokens = list(model.tokenizer.encode("!"))
    token_ids = list(model.tokenizer.encode("one two three"))
    body = {"prompt": token_ids, "echo": True, "truncate_prompt_tokens": 2}
    expected = model.tokenizer.decode(token_ids[-2:]) + "!"
    assert _text(post_json(http, "/v1/completions", body), 0) == expected
    assert (
        "".join(_pieces(stream_chunks(http, "/v1/completions", body, include_usage=True), 0))
        == expected
    )


@pytest.mark.parametrize(
    ("messages", "fields", "echoed"),
    [
        ([USER_HI, {"role": "assistant", "content": "Sure: "}], {}, "Sure: "),
        ([USER_HI], {}, ""),  # the reply is the assistant's; the last message is not
        ([USER_HI], {"add_generation_prompt": False}, "hi"),  # the reply goes on the user's
    ],
)
def test_chat_echo_repeats_the_last_message_of_the_replys_role(
    http: httpx.Client,
    cluster: ScriptedCluster,
    messages: list[dict[str, str]],
    fields: dict[str, Any],
    echoed: str,
) -> None:
    """vLLM's chat echo: the last message starts the reply when it has the reply's role; the
    stream sends it in a chunk of its own after the role chunks, as vLLM does."""
    body = {"messages": messages, "echo": True, "n": 2, **fields}
    response = post_json(http, "/v1/chat/completions", body)
    for index in (0, 1):
        assert response["choices"][index]["message"]["content"] == echoed + TEXT
    chunks = stream_chunks(http, "/v1/chat/completions", body, include_usage=True)
    for index in (0, 1):
        pieces = [p for p in _pieces(chunks, index) if p]
        assert "".join(pieces) == echoed + TEXT
        if echoed:
            assert pieces[0] == echoed


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"echo": "yes"}, "echo must be a boolean"),
        ({"echo": 1}, "echo must be a boolean"),
    ],
)
def test_bad_echo_is_refused_naming_echo(
    http: httpx.Client, body: dict[str, Any], words: str
) -> None:
    error = _invalid_request_error(http.post("/v1/completions", json={"prompt": "hi", **body}))
    assert error["param"] == "echo"
    assert words in error["message"]
    assert http.post("/v1/completions", json={"prompt": "hi", "logprobs": 2}).status_code == 200


def test_bad_include_stop_str_in_output_is_refused_by_name(http: httpx.Client) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [USER_HI]}),
    ):
        error = _invalid_request_error(
            http.post(path, json={**body, "include_stop_str_in_output": 1})
        )
        assert error["param"] == "include_stop_str_in_output"
        assert "include_stop_str_in_output must be a boolean" in error["message"]


def _text(response: dict[str, Any], index: int) -> str:
    choice = response["choices"][index]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])
