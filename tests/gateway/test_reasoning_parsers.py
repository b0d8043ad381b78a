"""vLLM's reasoning parsers (``pdserve serve --reasoning-parser deepseek_r1|qwen3``): chat output
split into ``message.reasoning`` (the thought, up to ``</think>``) and ``content``, whole and
streamed (``reasoning`` deltas, then ``content`` deltas), per choice; with hermes tool calls read
from the content alone; constraints that would have to start after the thought refused.

The cluster is a scripted ``GenerationBackend`` that answers the tokens a test chooses; the
demo model's real byte-level BPE tokenizer runs around it. It spells the tags character by
character (``<``, ``th``, ``ink``, ``>``), so a stream of one token per character splits each
tag at every point; a second copy of it has the tags as special tokens, as some models do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.gateway.reasoning import ReasoningMode, split_reasoning
from router.gateway.served_model import ServedModel
from router.gateway.tool_calls import AutoToolCalls, ChatDeltas, ToolCallMode, chat_message
from tests.gateway.token_script import (
    DEMO_MODEL,
    USER_HI,
    ScriptedCluster,
    bad_request_error,
    http_client,
    module_gateway_client,  # noqa: F401 - the http fixture
    one_token_per_character,
    post_json,
    script_answer,
    script_tokens,
    stream_chunks,
)

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
THOUGHT = "The user greets me.\nI should greet back."
ANSWER = "Hello! How can I help?"
WITH_TAGS = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"  # Qwen3's first template: both tags
OPENED_IN_PROMPT = f"{THOUGHT}\n</think>\n\n{ANSWER}"  # DeepSeek-R1, QwQ, Qwen3.5: </think> only
TOOLS = [{"type": "function", "function": {"name": "get_time"}}]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


def _served(parser: str, special_tags: bool = False) -> ServedModel:
    """The demo model under ``--reasoning-parser parser`` (qwen3 with hermes tool calls, as
    Qwen3 is served); ``special_tags``: the tags are special tokens (ids 4096 ...)."""
    tool_parser = "hermes" if parser == "qwen3" else None
    served = ServedModel.load(
        str(DEMO_MODEL),
        "pdserve-demo",
        None,
        tool_call_parser=tool_parser,
        reasoning_parser=parser,
    )
    if special_tags:
        tags = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
        served.tokenizer.add_special_tokens({"additional_special_tokens": tags})
    return served


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def model(request: pytest.FixtureRequest) -> ServedModel:
    return _served(request.param)


def _chat(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    return post_json(http, CHAT, {"messages": [USER_HI], **fields})


def _stream(http: httpx.Client, **fields: Any) -> list[dict[str, Any]]:
    return stream_chunks(http, CHAT, {"messages": [USER_HI], **fields})


@dataclasses.dataclass
class _Streamed:
    """One choice's stream put together as a client does."""

    reasoning: str | None  # None: no reasoning delta came
    content: str
    call_names: list[str]
    finish_reason: str | None


def _streamed(chunks: list[dict[str, Any]], index: int = 0) -> _Streamed:
    reasoning: str | None = None
    content, names, finish_reason = "", [], None
    seen_content = False
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            if "reasoning" in delta:
                assert not seen_content, "reasoning after content"
                assert "reasoning_content" not in delta  # vLLM's old name, no longer sent
                reasoning = (reasoning or "") + delta["reasoning"]
            seen_content |= bool(delta.get("content"))
            content += delta.get("content", "")
            names += [c["function"]["name"] for c in delta.get("tool_calls", []) if "id" in c]
            finish_reason = choice["finish_reason"] or finish_reason
    return _Streamed(reasoning, content, names, finish_reason)


def _expected_stream(message: dict[str, Any], finish_reason: str | None) -> _Streamed:
    """What a stream of the whole response's ``message`` puts together to."""
    names = [c["function"]["name"] for c in message.get("tool_calls", [])]
    return _Streamed(message["reasoning"] or None, message["content"] or "", names, finish_reason)


# ---------------------------------------------------------------- the split, whole


@pytest.mark.parametrize(
    ("text", "deepseek_r1", "qwen3"),
    [
        (OPENED_IN_PROMPT, (f"{THOUGHT}\n", f"\n\n{ANSWER}"), None),
        (WITH_TAGS, (f"\n{THOUGHT}\n", f"\n\n{ANSWER}"), None),
        # no </think>: the thought was cut, all of it reasoning (thinking on)
        (THOUGHT, (THOUGHT, None), None),
        (f"<think>{THOUGHT}", (THOUGHT, None), None),
        ("", ("", None), None),
        # stopped right after the thought: null content; an empty thought is ""
        (f"{THOUGHT}</think>", (THOUGHT, None), None),
        (f"</think>{ANSWER}", ("", ANSWER), None),
        # the first </think> ends it; what follows is content as written
        ("a</think>b</think><think>c", ("a", "b</think><think>c"), None),
        ("a<think>b</think>c", ("ab", "c"), None),  # vLLM's whole response drops the "a"
        # qwen3: <tool_call> before </think> ends the thought and stays for the tool parser
        (f"{THOUGHT}{CALL}", (f"{THOUGHT}{CALL}", None), (THOUGHT, CALL)),
        (CALL, (CALL, None), (None, CALL)),
        (f"a</think>b{CALL}", ("a", f"b{CALL}"), None),
        ("x<think", ("x<think", None), None),  # a tag that never completes is text
    ],
)
def test_a_whole_text_splits_as_vllms_parsers_split_it(
    text: str,
    deepseek_r1: tuple[str | None, str | None],
    qwen3: tuple[str | None, str | None] | None,
) -> None:
    assert split_reasoning(ReasoningMode("deepseek_r1"), text) == deepseek_r1
    assert split_reasoning(ReasoningMode("qwen3"), text) == (qwen3 or deepseek_r1)
    # qwen3 with enable_thinking false: all content, not read for tags
    assert split_reasoning(ReasoningMode("qwen3", thinking=False), text) == (None, text)


def test_an_unknown_parser_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(
        ValueError,
        match="'granite' .supported: deepseek_r1, deepseek_v3, qwen3, glm45, kimi_k2, minimax_m2, "
        "minimax_m2_append_think, openai_gptoss",
    ):
        ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None, reasoning_parser="granite")


# ---------------------------------------------------------------- the split, streamed

_TEXTS = [
    OPENED_IN_PROMPT,
    WITH_TAGS,
    THOUGHT,
    f"{THOUGHT}</think>",
    "x < y </thin> <think>a</think>b</think>",
    f"Thinking.</think>\n\nLet me check.\n{CALL}",
    f"Thinking.{CALL}",
    "x<think",
]
_MODES: list[tuple[ReasoningMode, ToolCallMode | None]] = [
    (ReasoningMode("deepseek_r1"), None),
    (ReasoningMode("qwen3"), None),
    (ReasoningMode("qwen3"), AutoToolCalls("hermes")),
    (ReasoningMode("qwen3", thinking=False), AutoToolCalls("hermes")),
]


@pytest.mark.parametrize("text", _TEXTS)
@pytest.mark.parametrize(("reasoning", "tools"), _MODES)
def test_any_split_of_the_text_streams_what_the_whole_text_holds(
    text: str, reasoning: ReasoningMode, tools: ToolCallMode | None
) -> None:
    """Two deltas, split at every point, then one per character: the reasoning, content and
    calls of the whole response, reasoning first, no tag shown."""
    message, finish_reason = chat_message(text, "stop", tools, reasoning)
    expected = _expected_stream(message, finish_reason)
    splits = [[text[:at], text[at:]] for at in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        deltas = ChatDeltas(tools, reasoning)
        chunks = []
        for i, piece in enumerate(pieces):
            finish = "stop" if i == len(pieces) - 1 else None
            delta, shown_finish = deltas.delta(0, piece, finish)
            assert "think>" not in delta.get("reasoning", ""), pieces
            chunks.append(
                {"choices": [{"index": 0, "delta": delta, "finish_reason": shown_finish}]}
            )
        assert _streamed(chunks) == expected, pieces


# ---------------------------------------------------------------- over HTTP


@pytest.mark.parametrize("text", [OPENED_IN_PROMPT, WITH_TAGS])
def test_the_thought_is_reasoning_and_the_rest_content(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel, text: str
) -> None:
    script_answer(cluster, model, text)
    body = _chat(http)
    (whole,) = body["choices"]
    thought = f"\n{THOUGHT}\n" if text.startswith("<think>") else f"{THOUGHT}\n"
    assert whole["message"] == {
        "role": "assistant",
        "content": f"\n\n{ANSWER}",
        "reasoning": thought,  # current vLLM's field (reasoning_content before)
    }
    assert whole["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(cluster.tokens)
    assert cluster.params[-1].skip_special_tokens is False  # the tags stay in the text read
    chunks = _stream(http)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert _streamed(chunks) == _Streamed(thought, f"\n\n{ANSWER}", [], "stop")


def test_no_end_tag_is_all_reasoning_with_null_content(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """Cut by max_tokens inside the thought, or never closed: as vLLM's parsers read it."""
    script_answer(cluster, model, OPENED_IN_PROMPT, stop=False)
    cut = len(model.tokenizer.encode(THOUGHT)) + 4  # "\n", then "<", "/", "th" of the tag
    assert model.tokenizer.decode(cluster.tokens[:cut]) == f"{THOUGHT}\n</th"
    (whole,) = _chat(http, max_tokens=cut)["choices"]
    # the tag that never completed is text of the thought (held back, then released)
    thought = f"{THOUGHT}\n</th"
    assert whole["message"] == {"role": "assistant", "content": None, "reasoning": thought}
    assert whole["finish_reason"] == "length"
    assert _streamed(_stream(http, max_tokens=cut)) == _Streamed(thought, "", [], "length")


def test_each_of_n_choices_is_split_on_its_own(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, OPENED_IN_PROMPT)
    whole = _chat(http, n=2)["choices"]
    assert [c["message"]["reasoning"] for c in whole] == [f"{THOUGHT}\n"] * 2
    chunks = _stream(http, n=2)
    for index in (0, 1):
        assert _streamed(chunks, index) == _Streamed(f"{THOUGHT}\n", f"\n\n{ANSWER}", [], "stop")


def test_a_stream_of_one_character_per_token_never_shows_a_tag(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_tokens(cluster, one_token_per_character(model, WITH_TAGS), model)
    chunks = _stream(http)
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        assert "<" not in delta.get("reasoning", "") + delta.get("content", ""), delta
    assert _streamed(chunks) == _Streamed(f"\n{THOUGHT}\n", f"\n\n{ANSWER}", [], "stop")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_tags_that_are_special_tokens_are_read_with_special_tokens_kept(
    cluster: ScriptedCluster, parser: str
) -> None:
    """The parser reads the tags from the text: special tokens stay in it whatever
    skip_special_tokens says (as the hermes path keeps them); the tags never reach a client."""
    special = _served(parser, special_tags=True)
    tokenizer = special.tokenizer
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert start >= 4096 and end >= 4096
    thought, answer = tokenizer.encode(THOUGHT), tokenizer.encode(ANSWER)
    script_tokens(cluster, [start, *thought, end, *answer], special)
    with http_client(cluster, special) as http:
        for fields in ({}, {"skip_special_tokens": True}):
            (whole,) = _chat(http, **fields)["choices"]
            assert (whole["message"]["reasoning"], whole["message"]["content"]) == (THOUGHT, ANSWER)
            assert cluster.params[-1].skip_special_tokens is False
            assert _streamed(_stream(http, **fields)) == _Streamed(THOUGHT, ANSWER, [], "stop")


def test_include_reasoning_false_leaves_out_the_reasoning_and_the_logprobs(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """As vLLM: reasoning null, no reasoning deltas, and logprobs null (they would show it)."""
    script_answer(cluster, model, OPENED_IN_PROMPT)
    fields = {"include_reasoning": False, "logprobs": True, "top_logprobs": 2}
    (whole,) = _chat(http, **fields)["choices"]
    assert whole["message"] == {"role": "assistant", "content": f"\n\n{ANSWER}", "reasoning": None}
    assert whole["logprobs"] is None and cluster.params[-1].logprobs is None
    chunks = _stream(http, **fields)
    assert _streamed(chunks) == _Streamed(None, f"\n\n{ANSWER}", [], "stop")
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)
    # true is the default: the logprobs cover the reasoning's tokens and the content's
    (whole,) = _chat(http, include_reasoning=True, logprobs=True)["choices"]
    assert whole["logprobs"]["content"][0]["token"] == model.tokenizer.decode(cluster.tokens[:1])
    error = bad_request_error(http.post(CHAT, json={"messages": [USER_HI], "include_reasoning": 1}))
    assert error["param"] == "include_reasoning"


def test_completions_are_not_split(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """vLLM applies reasoning parsers to chat only."""
    script_answer(cluster, model, OPENED_IN_PROMPT)
    body = post_json(http, "/v1/completions", {"prompt": "hi", "max_tokens": 64})
    assert body["choices"][0]["text"] == OPENED_IN_PROMPT
    assert "reasoning" not in body["choices"][0]
    assert cluster.params[-1].skip_special_tokens is True


# ---------------------------------------------------------------- qwen3's own rules


@pytest.fixture(scope="module")
def qwen3_http(cluster: ScriptedCluster) -> Iterator[tuple[httpx.Client, ServedModel]]:
    served = _served("qwen3")
    with http_client(cluster, served) as client:
        yield client, served


def test_qwen3_with_thinking_off_is_all_content(
    qwen3_http: tuple[httpx.Client, ServedModel], cluster: ScriptedCluster
) -> None:
    """enable_thinking false: the template closes the thought in the prompt, the output is
    content; special tokens are skipped as the request says, and a constraint applies from the
    first token, as vLLM's does once the prompt ended the reasoning."""
    http, model = qwen3_http
    script_answer(cluster, model, ANSWER)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    (whole,) = _chat(http, **off)["choices"]
    assert whole["message"] == {"role": "assistant", "content": ANSWER, "reasoning": None}
    assert cluster.params[-1].skip_special_tokens is True
    assert _streamed(_stream(http, **off)) == _Streamed(None, ANSWER, [], "stop")
    _chat(http, response_format={"type": "json_object"}, **off)
    spec = cluster.params[-1].structured_outputs
    assert spec is not None and spec.json_object and spec.after_token_ids == ()
    prefill = [USER_HI, {"role": "assistant", "content": "Sure: "}]
    (echoed,) = _chat(http, messages=prefill, echo=True, **off)["choices"]  # content too
    assert echoed["message"]["content"] == f"Sure: {ANSWER}"
    # vLLM's reasoning_effort "none" turns it off too, unless the kwargs turn it on
    (whole,) = _chat(http, reasoning_effort="none")["choices"]
    assert whole["message"] == {"role": "assistant", "content": ANSWER, "reasoning": None}
    # thinking on (the default), a reply without tags is a thought never closed, as vLLM's
    on = {"enable_thinking": True}
    (whole,) = _chat(http, reasoning_effort="none", chat_template_kwargs=on)["choices"]
    assert whole["message"] == {"role": "assistant", "content": None, "reasoning": ANSWER}


@pytest.mark.parametrize(
    ("text", "thought", "content"),
    [
        (f"{THOUGHT}</think>\n\nLet me check.\n{CALL}", THOUGHT, "\n\nLet me check.\n"),
        (f"<think>{THOUGHT}</think>{CALL}", THOUGHT, None),
        (f"{THOUGHT}\n{CALL}", f"{THOUGHT}\n", None),  # <tool_call> ends the thought
    ],
)
def test_qwen3_tool_calls_are_read_from_the_content_alone(
    qwen3_http: tuple[httpx.Client, ServedModel],
    cluster: ScriptedCluster,
    text: str,
    thought: str,
    content: str | None,
) -> None:
    http, model = qwen3_http
    script_answer(cluster, model, text)
    (whole,) = _chat(http, tools=TOOLS)["choices"]
    message = whole["message"]
    assert (message["reasoning"], message["content"]) == (thought, content)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    assert whole["finish_reason"] == "tool_calls"
    streamed = _streamed(_stream(http, tools=TOOLS))
    assert streamed == _Streamed(thought, content or "", ["get_time"], "tool_calls")
    # tool_choice "none": the same split, the calls left as content
    (plain,) = _chat(http, tools=TOOLS, tool_choice="none")["choices"]
    assert plain["message"]["reasoning"] == thought
    assert plain["message"]["content"].endswith(CALL) and "tool_calls" not in plain["message"]


def test_a_call_in_a_thought_cut_short_is_no_call(
    qwen3_http: tuple[httpx.Client, ServedModel], cluster: ScriptedCluster
) -> None:
    http, model = qwen3_http
    script_answer(cluster, model, f"{THOUGHT}</think>{CALL}", stop=False)
    cut = len(model.tokenizer.encode(THOUGHT)) - 1
    (whole,) = _chat(http, tools=TOOLS, max_tokens=cut)["choices"]
    assert whole["message"]["content"] is None and whole["message"]["tool_calls"] == []
    assert whole["finish_reason"] == "length"


# ---------------------------------------------------------------- constraints after the thought

_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": _SCHEMA},
            }
        },
        {"structured_outputs": {"regex": "[a-z]+"}},
        {"guided_json": _SCHEMA},
    ],
)
def test_a_constraint_starts_after_the_thought(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel, fields: dict[str, Any]
) -> None:
    """As vLLM applies structured outputs under a reasoning parser: the workers leave the
    reasoning free and constrain the output from the token after </think> (before, refused);
    include_reasoning false changes nothing there."""
    end = tuple(model.tokenizer.encode("</think>", add_special_tokens=False))
    for include in (True, False):
        script_answer(cluster, model, OPENED_IN_PROMPT)
        _chat(http, messages=[USER_HI], include_reasoning=include, **fields)
        spec = cluster.params[-1].structured_outputs
        assert spec is not None and spec.after_token_ids == end


def test_echo_is_refused_while_thinking(http: httpx.Client, model: ServedModel) -> None:
    body = {"messages": [USER_HI, {"role": "assistant", "content": "x"}], "echo": True}
    error = bad_request_error(http.post(CHAT, json=body))
    assert error["param"] == "echo", error
    assert f"--reasoning-parser {model.reasoning_parser}" in error["message"]


def test_a_server_without_a_reasoning_parser_does_not_split(cluster: ScriptedCluster) -> None:
    plain = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    script_answer(cluster, plain, OPENED_IN_PROMPT)
    with http_client(cluster, plain) as http:
        (whole,) = _chat(http, include_reasoning=False)["choices"]
        assert whole["message"] == {"role": "assistant", "content": OPENED_IN_PROMPT}
        _chat(http, response_format={"type": "json_object"})


# ---------------------------------------------------------------- deepseek_v3's own rules


def test_deepseek_v3_thinks_only_when_the_request_turns_thinking_on(
    cluster: ScriptedCluster,
) -> None:
    """DeepSeek-V3.1's hybrid thinking, as vLLM's deepseek_v3 parser: chat_template_kwargs
    ``thinking`` (its template's variable) or ``enable_thinking`` true splits as deepseek_r1;
    otherwise (reasoning_effort alone included) the output is all content, and a constraint
    holds from the first token."""
    served = _served("deepseek_v3")
    script_answer(cluster, served, OPENED_IN_PROMPT)
    with http_client(cluster, served) as http:
        for kwargs in ({"thinking": True}, {"enable_thinking": True}):
            (whole,) = _chat(http, chat_template_kwargs=kwargs)["choices"]
            assert (whole["message"]["reasoning"], whole["message"]["content"]) == (
                f"{THOUGHT}\n",
                f"\n\n{ANSWER}",
            )
            streamed = _streamed(_stream(http, chat_template_kwargs=kwargs))
            assert streamed == _Streamed(f"{THOUGHT}\n", f"\n\n{ANSWER}", [], "stop")
        for fields in (
            {},
            {"chat_template_kwargs": {"thinking": False}},
            {"reasoning_effort": "high"},
        ):
            (whole,) = _chat(http, **fields)["choices"]
            expected = {"role": "assistant", "content": OPENED_IN_PROMPT, "reasoning": None}
            assert whole["message"] == expected, fields
            assert _streamed(_stream(http, **fields)) == _Streamed(
                None, OPENED_IN_PROMPT, [], "stop"
            )
        _chat(http, response_format={"type": "json_object"})
        spec = cluster.params[-1].structured_outputs
        assert spec is not None and spec.after_token_ids == ()
