"""GLM-4.5 through chat, as vLLM serves it with ``--tool-call-parser glm45 --reasoning-parser
glm45``: calls in its XML (``<arg_key>`` / ``<arg_value>`` pairs, values typed by the request's
tool schemas), GLM-4.7's form of it (``glm47``: no newlines between the tags), and a thought
that ``</think>`` or a ``<tool_call>`` ends; whole and streamed alike, split at any point.

The cluster is scripted (``token_script``) around the demo model's real tokenizer, with the
tags added as special tokens, as they are in GLM's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.gateway.glm_tool_calls import glm_value
from router.gateway.qwen3_coder_tool_calls import tool_parameters
from router.gateway.reasoning import ReasoningMode, split_reasoning
from router.gateway.served_model import ServedModel
from router.gateway.tool_calls import AutoToolCalls, ChatDeltas, tool_call_choice
from tests.gateway.test_auto_tool_choice import _Streamed, _streamed
from tests.gateway.test_reasoning_parsers import _streamed as _reasoned_stream
from tests.gateway.token_script import (
    DEMO_MODEL,
    USER_HI,
    ScriptedCluster,
    http_client,
    post_json,
    script_answer,
    stream_chunks,
)

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "where": {"type": "object"},
        "note": {"type": ["string", "null"]},  # not "string": read as JSON, as vLLM's
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
]
PARAMETERS = tool_parameters(TOOLS)


def _glm45_call(name: str, **values: str) -> str:
    """One call as GLM-4.5's template renders it."""
    body = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items()
    )
    return f"<tool_call>{name}\n{body}</tool_call>"


def _glm47_call(name: str, **values: str) -> str:
    """One call as GLM-4.7's template renders it: no newlines."""
    body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in values.items())
    return f"<tool_call>{name}{body}</tool_call>"


FORECAST_VALUES = {
    "city": " São Paulo <3 ",  # a string: as written, spaces and a "<" that is no tag kept
    "days": " 3 ",
    "where": '{"lat": -23.5, "tags": ["a", "b"]}',
    "note": "null",
    "extra": "{'a': (1, 2)}",  # not in the schema: a Python literal
}
FORECAST_ARGUMENTS = json.dumps(
    {
        "city": " São Paulo <3 ",
        "days": 3,
        "where": {"lat": -23.5, "tags": ["a", "b"]},
        "note": None,
        "extra": {"a": [1, 2]},
    },
    ensure_ascii=False,
)
CASES = [  # (text, content, calls) as the whole response has them (and the stream)
    ("It is sunny.", "It is sunny.", []),
    (_glm45_call("forecast", **FORECAST_VALUES), None, [("forecast", FORECAST_ARGUMENTS)]),
    (
        "Let me look.\n"
        + _glm45_call("forecast", **FORECAST_VALUES)
        + "\n"
        + _glm45_call("get_time"),
        "Let me look.\n",
        [("forecast", FORECAST_ARGUMENTS), ("get_time", "{}")],
    ),
    (  # GLM-4.7's form; whitespace alone before the calls is no content
        "\n\n" + _glm47_call("forecast", days="4", city="Nice") + _glm47_call("get_time"),
        None,
        [("forecast", '{"days": 4, "city": "Nice"}'), ("get_time", "{}")],
    ),
    (  # a key without a value, and a value cut by </tool_call>, are dropped; text after too
        "<tool_call>forecast\n<arg_key>city</arg_key><arg_key>days</arg_key>"
        "<arg_value>5</arg_value><arg_key>where</arg_key><arg_value>{</tool_call> trailing",
        None,
        [("forecast", '{"days": 5}')],
    ),
    ("<tool_call>forec", "<tool_call>forec", []),  # the name cut short: all content
    ("About <tool_call tags", "About <tool_call tags", []),
]


def _split_stream(parser: str, text: str, splits: list[int], finish: str = "stop") -> _Streamed:
    """``text`` streamed in deltas cut at ``splits``, as a client puts it together."""
    deltas = ChatDeltas(AutoToolCalls(parser, PARAMETERS))
    bounds = [0, *splits, len(text)]
    chunks = []
    for i in range(len(bounds) - 1):
        last = i == len(bounds) - 2
        piece = text[bounds[i] : bounds[i + 1]]
        delta, shown = deltas.delta(0, piece, finish if last else None)
        chunks.append({"choices": [{"index": 0, "delta": delta, "finish_reason": shown}]})
    return _streamed(chunks)


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


@pytest.mark.parametrize("parser", ["glm45", "glm47"])
def test_whole_texts_are_read_as_vllm_reads_them(parser: str) -> None:
    for text, content, calls in CASES:
        message, finish = tool_call_choice(AutoToolCalls(parser, PARAMETERS), text, "stop")
        assert message["content"] == content, text
        assert _calls(message) == calls, text
        assert finish == ("tool_calls" if calls else "stop"), text


def test_any_split_of_the_text_streams_what_the_whole_text_holds() -> None:
    """Two deltas split at every point, and one delta per character: the whole response's
    content and calls, and its finish_reason."""
    for text, content, calls in CASES:
        for splits in [*([s] for s in range(len(text) + 1)), list(range(1, len(text)))]:
            streamed = _split_stream("glm45", text, splits)
            assert streamed.content == (content or ""), (text, splits)
            assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls, (text, splits)
            assert streamed.finish_reason == ("tool_calls" if calls else "stop"), (text, splits)


def test_each_argument_streams_once_its_value_ended() -> None:
    deltas = ChatDeltas(AutoToolCalls("glm45", PARAMETERS))
    first, _ = deltas.delta(0, "<tool_call>forecast\n<arg_key>days</arg_key><arg_value>1", None)
    assert first["tool_calls"][0]["function"] == {"name": "forecast", "arguments": "{"}
    second, _ = deltas.delta(0, "2</arg_value>\n<arg_key>city</arg_key><arg_value>Pa", None)
    assert second["tool_calls"] == [{"index": 0, "function": {"arguments": '"days": 12'}}]
    third, finish = deltas.delta(0, "ris</arg_value>\n</tool_call>", "stop")
    assert [e["function"]["arguments"] for e in third["tool_calls"]] == [', "city": "Paris"', "}"]
    assert finish == "tool_calls"


def test_a_call_cut_by_max_tokens_says_length() -> None:
    text = "<tool_call>forecast\n<arg_key>days</arg_key><arg_value>1</arg_value><arg_value>Ni"
    message, finish = tool_call_choice(AutoToolCalls("glm45", PARAMETERS), text, "length")
    assert _calls(message) == [("forecast", '{"days": 1}')] and finish == "length"
    streamed = _split_stream("glm45", text, [20], "length")
    assert streamed.finish_reason == "length"
    assert streamed.calls[0]["arguments"] == '{"days": 1'  # what ended before the cut, no }


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        (" 42 ", {"type": "integer"}, 42),
        (" 42 ", {"type": "string"}, " 42 "),
        ("42", None, 42),  # not in the schema: read as JSON
        ("true", {"type": "boolean"}, True),
        ("True", {"type": "boolean"}, True),  # a Python literal
        ("NaN", {"type": "number"}, "NaN"),  # JSON has no NaN
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a set: no JSON for it
        ("Paris", {"type": ["string", "null"]}, "Paris"),
        ("null", {"type": "string"}, "null"),  # a string stays one
    ],
)
def test_values_are_typed_as_vllm_types_them(text: str, schema: Any, value: Any) -> None:
    assert json.dumps(glm_value(text, schema)) == json.dumps(value)


THOUGHT = "The user wants the forecast."
REASONING_CASES = [  # (text, reasoning, content) as glm45 splits them
    (f"<think>{THOUGHT}</think>\nIt is sunny.", THOUGHT, "\nIt is sunny."),
    (f"{THOUGHT}</think>It is sunny.", THOUGHT, "It is sunny."),  # <think> in the prompt
    (f"<think>{THOUGHT}\n<tool_call>get_time\n</tool_call>", f"{THOUGHT}\n", None),
    (f"<think>{THOUGHT}", THOUGHT, None),  # cut in the thought
]


@pytest.mark.parametrize(("text", "reasoning", "content"), REASONING_CASES)
def test_the_thought_ends_at_think_or_at_a_call(
    text: str, reasoning: str, content: str | None
) -> None:
    split = split_reasoning(ReasoningMode("glm45"), text)
    if "<tool_call>" in text:  # the call stays for the tool-call parser
        assert split == (reasoning, text[text.index("<tool_call>") :])
    else:
        assert split == (reasoning, content)
    assert split_reasoning(ReasoningMode("glm45", thinking=False), text) == (None, text)


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def served(cluster: ScriptedCluster) -> Iterator[tuple[ServedModel, httpx.Client]]:
    model = ServedModel.load(
        str(DEMO_MODEL), "pdserve-demo", None, tool_call_parser="glm45", reasoning_parser="glm45"
    )
    tags = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    tags += ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
    model.tokenizer.add_special_tokens({"additional_special_tokens": tags})
    with http_client(cluster, model) as client:
        yield model, client


def test_a_thought_then_calls_over_http_whole_and_streamed(
    served: tuple[ServedModel, httpx.Client], cluster: ScriptedCluster
) -> None:
    """GLM-4.5 thinks, then calls: the thought is the reasoning, the calls are read from the
    rest, typed by the request's tools; whole and streamed alike."""
    model, http = served
    call = _glm45_call("forecast", **FORECAST_VALUES)
    script_answer(cluster, model, f"<think>{THOUGHT}</think>\nLet me look.\n{call}")
    body = {"messages": [USER_HI], "tools": TOOLS}
    (whole,) = post_json(http, CHAT, body)["choices"]
    message = whole["message"]
    assert (message["reasoning"], message["content"]) == (THOUGHT, "\nLet me look.\n")
    assert _calls(message) == [("forecast", FORECAST_ARGUMENTS)]
    assert whole["finish_reason"] == "tool_calls"
    assert cluster.params[-1].skip_special_tokens is False  # the tags stay in the text read
    streamed = _reasoned_stream(stream_chunks(http, CHAT, body))
    assert streamed.reasoning == THOUGHT and streamed.content == "\nLet me look.\n"
    assert streamed.call_names == ["forecast"] and streamed.finish_reason == "tool_calls"


def test_thinking_off_is_all_content(
    served: tuple[ServedModel, httpx.Client], cluster: ScriptedCluster
) -> None:
    """``enable_thinking: false`` (GLM's template variable) or ``reasoning_effort: "none"``:
    the template closes the thought in the prompt, the output is content and calls."""
    model, http = served
    script_answer(cluster, model, "Sure.\n" + _glm45_call("get_time"))
    for off in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template_kwargs": {"thinking": False}},
        {"reasoning_effort": "none"},
    ):
        body = {"messages": [USER_HI], "tools": TOOLS, **off}
        (whole,) = post_json(http, CHAT, body)["choices"]
        message = whole["message"]
        assert (message["reasoning"], message["content"]) == (None, "Sure.\n"), off
        assert _calls(message) == [("get_time", "{}")], off
