"""MiniMax-M2 through chat, as vLLM serves it with ``--tool-call-parser minimax_m2`` and
``--reasoning-parser minimax_m2`` (or ``minimax_m2_append_think``): calls in
``<minimax:tool_call>`` blocks of ``<invoke name="...">`` with ``<parameter name="...">``
values typed by the request's tool schemas, whole and streamed alike, split at any point; the
thought split off at ``</think>``, or kept in the content with ``<think>`` before it.

The cluster is scripted (``token_script``) around the demo model's real tokenizer, with the
tags added as special tokens, as they are in MiniMax's vocabulary.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.gateway.minimax_tool_calls import minimax_value
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
        "days": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "hot": {"type": "boolean"},
        "where": {"type": "object"},
        "unit": {"enum": ["c", "f"]},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
]
PARAMETERS = tool_parameters(TOOLS)


def _invoke(name: str, **values: str) -> str:
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in values.items())
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def _block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


FORECAST_INVOKE = _invoke(
    "forecast",
    city=" Zürich <3 ",  # a string, stripped; a "<" that is no tag
    days="3",
    hot="yes",
    where='{"lat": 47.4}',
    unit="c",
    extra="None",  # not in the schema, and null
)
FORECAST_ARGUMENTS = json.dumps(
    {
        "city": "Zürich <3",
        "days": 3,
        "hot": True,
        "where": {"lat": 47.4},
        "unit": "c",
        "extra": None,
    },
    ensure_ascii=False,
)
CASES = [  # (text, content, calls) as the whole response has them (and the stream)
    ("It is sunny.", "It is sunny.", []),
    (_block(FORECAST_INVOKE), None, [("forecast", FORECAST_ARGUMENTS)]),
    (
        "Let me look.\n" + _block(FORECAST_INVOKE, _invoke("get_time")) + " trailing",
        "Let me look.\n",
        [("forecast", FORECAST_ARGUMENTS), ("get_time", "{}")],
    ),
    (  # two blocks; a parameter cut by </invoke> dropped
        _block("<invoke name='get_time'><parameter name=\"tz\">UT</invoke>")
        + "\n"
        + _block(_invoke("forecast", days="4")),
        None,
        [("get_time", "{}"), ("forecast", '{"days": 4}')],
    ),
    ('<minimax:tool_call>\n<invoke name="forec', '<minimax:tool_call>\n<invoke name="forec', []),
    ("<minimax:tool_call></minimax:tool_call>", "<minimax:tool_call></minimax:tool_call>", []),
]


def _split_stream(text: str, splits: list[int], finish: str = "stop") -> _Streamed:
    deltas = ChatDeltas(AutoToolCalls("minimax_m2", PARAMETERS))
    bounds = [0, *splits, len(text)]
    chunks = []
    for i in range(len(bounds) - 1):
        last = i == len(bounds) - 2
        delta, shown = deltas.delta(0, text[bounds[i] : bounds[i + 1]], finish if last else None)
        chunks.append({"choices": [{"index": 0, "delta": delta, "finish_reason": shown}]})
    return _streamed(chunks)


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_whole_texts_are_read_as_vllm_reads_them() -> None:
    for text, content, calls in CASES:
        message, finish = tool_call_choice(AutoToolCalls("minimax_m2", PARAMETERS), text, "stop")
        assert message["content"] == content, text
        assert _calls(message) == calls, text
        assert finish == ("tool_calls" if calls else "stop"), text


def test_any_split_of_the_text_streams_what_the_whole_text_holds() -> None:
    for text, content, calls in CASES:
        for splits in [*([s] for s in range(len(text) + 1)), list(range(1, len(text)))]:
            streamed = _split_stream(text, splits)
            assert streamed.content == (content or ""), (text, splits)
            assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls, (text, splits)
            assert streamed.finish_reason == ("tool_calls" if calls else "stop"), (text, splits)


def test_a_call_cut_by_max_tokens_says_length() -> None:
    text = (
        _block()[: -len("</minimax:tool_call>")]
        + '<invoke name="forecast"><parameter name="days">2</parameter><parameter name="ci'
    )
    message, finish = tool_call_choice(AutoToolCalls("minimax_m2", PARAMETERS), text, "length")
    assert _calls(message) == [("forecast", '{"days": 2}')] and finish == "length"
    streamed = _split_stream(text, [30], "length")
    assert streamed.finish_reason == "length" and streamed.calls[0]["arguments"] == '{"days": 2'


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        ("4.0", {"type": "number"}, 4),
        ("inf", {"type": "number"}, "inf"),  # JSON has no infinities
        ("on", {"type": "boolean"}, True),
        ("maybe", {"type": "boolean"}, "maybe"),
        ("NIL", {"type": "string"}, None),
        ("[1, 2]", {"type": ["array", "null"]}, [1, 2]),
        ("12", {"enum": [1, 2, 12]}, 12),  # typed by its enum's values
        ("12", {"oneOf": [{"type": "string"}, {"type": "integer"}]}, 12),  # integer first
        ("12", None, "12"),  # not in the schema: a string
        ("12", {"type": "custom"}, 12),  # a type none reads: JSON
        ("NaN", {"type": "custom"}, "NaN"),
    ],
)
def test_values_are_typed_as_vllm_types_them(text: str, schema: Any, value: Any) -> None:
    assert json.dumps(minimax_value(text, schema)) == json.dumps(value)


THOUGHT = "The user wants the forecast."


def test_the_thought_is_split_off_or_kept_in_the_content() -> None:
    text = f"{THOUGHT}</think>\nIt is sunny."
    assert split_reasoning(ReasoningMode("minimax_m2"), text) == (THOUGHT, "\nIt is sunny.")
    assert split_reasoning(ReasoningMode("minimax_m2_append_think"), text) == (
        None,
        "<think>" + text,
    )
    for at in range(len(text) + 1):
        deltas = ChatDeltas(None, ReasoningMode("minimax_m2_append_think"))
        first, _ = deltas.delta(0, text[:at], None)
        second, _ = deltas.delta(0, text[at:], "stop")
        assert "reasoning" not in first and "reasoning" not in second
        assert first.get("content", "") + second.get("content", "") == "<think>" + text


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


def _served(reasoning_parser: str) -> ServedModel:
    model = ServedModel.load(
        str(DEMO_MODEL),
        "pdserve-demo",
        None,
        tool_call_parser="minimax_m2",
        reasoning_parser=reasoning_parser,
    )
    tags = ["<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"]
    model.tokenizer.add_special_tokens({"additional_special_tokens": tags})
    return model


def test_a_thought_then_calls_over_http_whole_and_streamed(cluster: ScriptedCluster) -> None:
    model = _served("minimax_m2")
    answer = f"{THOUGHT}</think>\nLet me look.\n{_block(FORECAST_INVOKE)}"
    script_answer(cluster, model, answer)
    body = {"messages": [USER_HI], "tools": TOOLS}
    with http_client(cluster, model) as http:
        (whole,) = post_json(http, CHAT, body)["choices"]
        message = whole["message"]
        assert (message["reasoning"], message["content"]) == (THOUGHT, "\nLet me look.\n")
        assert _calls(message) == [("forecast", FORECAST_ARGUMENTS)]
        assert whole["finish_reason"] == "tool_calls"
        streamed = _reasoned_stream(stream_chunks(http, CHAT, body))
        assert streamed.reasoning == THOUGHT and streamed.content == "\nLet me look.\n"
        assert streamed.call_names == ["forecast"]


def test_append_think_keeps_the_thought_in_the_content_over_http(cluster: ScriptedCluster) -> None:
    model = _served("minimax_m2_append_think")
    script_answer(cluster, model, f"{THOUGHT}</think>\nIt is sunny.")
    body = {"messages": [USER_HI]}
    with http_client(cluster, model) as http:
        (whole,) = post_json(http, CHAT, body)["choices"]
        expected = f"<think>{THOUGHT}</think>\nIt is sunny."
        assert (whole["message"]["reasoning"], whole["message"]["content"]) == (None, expected)
        streamed = _reasoned_stream(stream_chunks(http, CHAT, body))
        assert streamed.reasoning is None and streamed.content == expected
