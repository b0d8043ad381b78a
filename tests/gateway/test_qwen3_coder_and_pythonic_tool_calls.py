"""``tool_choice: "auto"`` with vLLM's ``qwen3_coder`` / ``qwen3_xml`` (Qwen3-Coder's XML calls,
typed by the request's tool schemas) and ``pythonic`` / ``llama4_pythonic`` (a Python list of
calls) tool-call parsers: whole and streamed alike, split at any point.

The cluster is scripted (``token_script``) around the demo model's real tokenizer, with
``<tool_call>`` and ``</tool_call>`` added as special tokens, as they are in Qwen's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.gateway.qwen3_coder_tool_calls import tool_parameters, typed_value
from router.gateway.served_model import ServedModel
from router.gateway.tool_calls import AutoToolCalls, ChatDeltas, tool_call_choice
from tests.gateway.test_auto_tool_choice import _Streamed, _streamed
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
        "hot": {"type": "boolean"},
        "rain": {"type": "number"},
        "where": {"type": "object"},
        "hours": {"type": ["array", "null"]},
        "since": {"type": "integer"},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
]
PARAMETERS = tool_parameters(TOOLS)


def _xml_call(name: str, **values: str) -> str:
    """One call as Qwen3-Coder writes it (its template renders calls so)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


FORECAST_CALL = _xml_call(
    "forecast",
    city="São Paulo <3",  # non-ASCII, and a "<" that is no tag
    days="3",
    hot="True",
    rain="2.50",
    where='{"lat": -23.5, "tags": ["a", "b"]}',
    hours="[1, 2]",
    since="yesterday",  # not an integer: kept as text
    extra="null",  # not in the schema, and null
)
FORECAST_ARGUMENTS = json.dumps(
    {
        "city": "São Paulo <3",
        "days": 3,
        "hot": True,
        "rain": 2.5,
        "where": {"lat": -23.5, "tags": ["a", "b"]},
        "hours": [1, 2],
        "since": "yesterday",
        "extra": None,
    },
    ensure_ascii=False,
)
QWEN3_CODER_CASES = [  # (text, content, calls) as the whole response has them (and the stream)
    ("It is sunny.", "It is sunny.", []),
    (FORECAST_CALL, None, [("forecast", FORECAST_ARGUMENTS)]),
    (
        "Let me look.\n\n" + FORECAST_CALL + "\n" + _xml_call("get_time"),
        "Let me look.\n\n",
        [("forecast", FORECAST_ARGUMENTS), ("get_time", "{}")],
    ),
    (  # without </parameter> and </function>: each ends where the next tag starts
        "<tool_call>\n<function=forecast>\n<parameter=days>\n4\n<parameter=city>\nNice\n"
        "</tool_call>trailing text",
        None,
        [("forecast", '{"days": 4, "city": "Nice"}')],
    ),
    (  # no <tool_call>: the function alone is read, as vLLM's parser does
        "Sure. <function=get_time>\n</function>",
        "Sure. ",
        [("get_time", "{}")],
    ),
    ("<tool_call>\n<function=forec", "<tool_call>\n<function=forec", []),  # name cut short
    ("About <function= tags", "About <function= tags", []),
]
PYTHONIC_CASES = [
    ("It is sunny.", "It is sunny.", []),
    (
        '[forecast(city="Paris", days=3, where={"lat": -1.5}, hours=(1, 2)), get_time()]\n',
        None,
        [
            ("forecast", '{"city": "Paris", "days": 3, "where": {"lat": -1.5}, "hours": [1, 2]}'),
            ("get_time", "{}"),
        ],
    ),
    (
        "[ forecast (hot=True, rain=None, city='Zürich')]",
        None,
        [("forecast", '{"hot": true, "rain": null, "city": "Zürich"}')],
    ),
    ("[1] Smith et al., 2020", "[1] Smith et al., 2020", []),
    ('[forecast(city="Paris")] and more', '[forecast(city="Paris")] and more', []),
    ('[forecast("Paris")]', '[forecast("Paris")]', []),  # a positional argument
    ("[forecast(days=len(x))]", "[forecast(days=len(x))]", []),  # not a literal
    ("[]", "[]", []),
    (" [get_time()]", " [get_time()]", []),  # it must open the reply
]
LLAMA4_CASES = [
    ("<|python_start|>[get_time()]<|python_end|>", None, [("get_time", "{}")]),
    ("[get_time()]", None, [("get_time", "{}")]),
    ("<|python_start|>not calls<|python_end|>", "<|python_start|>not calls<|python_end|>", []),
]
CASES = {
    "qwen3_coder": QWEN3_CODER_CASES,
    "qwen3_xml": QWEN3_CODER_CASES,
    "pythonic": PYTHONIC_CASES,
    "llama4_pythonic": PYTHONIC_CASES[:3] + LLAMA4_CASES,
}


def _whole(parser: str, text: str, finish: str = "stop") -> tuple[dict[str, Any], str | None]:
    return tool_call_choice(AutoToolCalls(parser, PARAMETERS), text, finish)


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


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


@pytest.mark.parametrize("parser", list(CASES))
def test_whole_texts_are_read_as_vllm_reads_them(parser: str) -> None:
    for text, content, calls in CASES[parser]:
        message, finish = _whole(parser, text)
        assert message["content"] == content, text
        assert _calls(message) == calls, text
        assert finish == ("tool_calls" if calls else "stop"), text


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic", "llama4_pythonic"])
def test_any_split_of_the_text_streams_what_the_whole_text_holds(parser: str) -> None:
    """Two deltas split at every point, and one delta per character: the whole response's
    content and calls, and its finish_reason."""
    for text, content, calls in CASES[parser]:
        for splits in [*([s] for s in range(len(text) + 1)), list(range(1, len(text)))]:
            streamed = _split_stream(parser, text, splits)
            assert streamed.content == (content or ""), (text, splits)
            assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls, (text, splits)
            assert streamed.finish_reason == ("tool_calls" if calls else "stop"), (text, splits)


def test_a_qwen3_coder_call_streams_each_parameter_once_its_value_ended() -> None:
    deltas = ChatDeltas(AutoToolCalls("qwen3_coder", PARAMETERS))
    head = "<tool_call>\n<function=forecast>\n<parameter=days>\n1"
    first, _ = deltas.delta(0, head, None)
    assert first["tool_calls"][0]["function"] == {"name": "forecast", "arguments": "{"}
    second, _ = deltas.delta(0, "2\n</parameter>\n<parameter=city>\nPa", None)
    assert second["tool_calls"] == [{"index": 0, "function": {"arguments": '"days": 12'}}]
    third, finish = deltas.delta(0, "ris\n</parameter>\n</function>\n</tool_call>", "stop")
    assert [e["function"]["arguments"] for e in third["tool_calls"]] == [', "city": "Paris"', "}"]
    assert finish == "tool_calls"


def test_a_call_cut_by_max_tokens_says_length() -> None:
    text = "<tool_call>\n<function=forecast>\n<parameter=days>\n1\n</parameter>\n<parameter=ci"
    message, finish = _whole("qwen3_coder", text, "length")
    assert message["content"] == text and message["tool_calls"] == []  # a name cut short
    streamed = _split_stream("qwen3_coder", text, [20], "length")
    assert streamed.finish_reason == "length"
    assert streamed.calls[0]["arguments"] == '{"days": 1'  # what ended before the cut
    cut_list = '[forecast(city="Par'
    message, finish = _whole("pythonic", cut_list, "length")
    assert (message["content"], finish) == (cut_list, "length")
    streamed = _split_stream("pythonic", cut_list, [3], "length")
    assert (streamed.content, streamed.calls, streamed.finish_reason) == (cut_list, [], "length")


def test_pythonic_content_goes_out_as_soon_as_it_cannot_be_calls() -> None:
    deltas = ChatDeltas(AutoToolCalls("pythonic"))
    assert deltas.delta(0, "[forec", None)[0] == {}  # may be a call list: held
    assert deltas.delta(0, "ast]", None)[0] == {"content": "[forecast]"}  # cannot be: sent
    assert deltas.delta(0, " more", "stop") == ({"content": " more"}, "stop")


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        ("-7", {"type": "int64"}, -7),
        ("4.0", {"type": "number"}, 4),
        ("0.25", {"type": "float"}, 0.25),
        ("inf", {"type": "number"}, "inf"),  # JSON has no infinities
        ("nan", {"type": "number"}, "nan"),
        ("FALSE", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, False),  # not true: false, as vLLM
        ("NULL", {"type": "string"}, None),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),  # a Python literal
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a set: no JSON for it
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("12", {"type": ["integer", "null"]}, 12),
        ("12", {"enum": ["12"]}, "12"),  # no type: a string
        ("12", None, "12"),  # not in the schema
        ("1e5", {"type": "custom"}, 100000.0),  # any other type: a literal
    ],
)
def test_values_are_typed_by_the_schema(text: str, schema: Any, value: Any) -> None:
    assert json.dumps(typed_value(text, schema)) == json.dumps(value)  # as the arguments write it


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module", params=["qwen3_coder", "pythonic"])
def served(
    request: pytest.FixtureRequest, cluster: ScriptedCluster
) -> Iterator[tuple[str, ServedModel, httpx.Client]]:
    model = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None, tool_call_parser=request.param)
    model.tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<tool_call>", "</tool_call>"]}
    )
    with http_client(cluster, model) as client:
        yield request.param, model, client


@pytest.mark.parametrize("case", range(3))
def test_calls_over_http_whole_and_streamed(
    served: tuple[str, ServedModel, httpx.Client], cluster: ScriptedCluster, case: int
) -> None:
    """The request's tools type the values (qwen3_coder); the calls come back whole and
    streamed alike."""
    parser, model, http = served
    text, content, calls = CASES[parser][case]
    script_answer(cluster, model, text)
    body = {"messages": [USER_HI], "tools": TOOLS}
    (whole,) = post_json(http, CHAT, body)["choices"]
    assert whole["message"]["content"] == content
    assert _calls(whole["message"]) == calls
    assert whole["finish_reason"] == ("tool_calls" if calls else "stop")
    assert cluster.params[-1].skip_special_tokens is False  # the tags stay in the text read
    streamed = _streamed(stream_chunks(http, CHAT, body))
    assert streamed.content == (content or "")
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls
    assert streamed.finish_reason == whole["finish_reason"]


def test_the_values_types_come_from_this_requests_tools(
    served: tuple[str, ServedModel, httpx.Client], cluster: ScriptedCluster
) -> None:
    """qwen3_coder: a tool that declares no parameters leaves every value as written (pythonic:
    the literal written types it)."""
    parser, model, http = served
    answer = _xml_call("forecast", days="3") if parser == "qwen3_coder" else '[forecast(days="3")]'
    script_answer(cluster, model, answer)
    tools = [{"type": "function", "function": {"name": "forecast"}}]
    (whole,) = post_json(http, CHAT, {"messages": [USER_HI], "tools": tools})["choices"]
    assert _calls(whole["message"]) == [("forecast", '{"days": "3"}')]
