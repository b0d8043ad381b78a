"""``tool_choice: "auto"`` with vLLM's ``llama3_json`` (and its other name ``llama4_json``) and
``mistral`` tool-call parsers: whole and streamed, as vLLM's parsers read the text.

The cluster is scripted (``token_script``) around the demo model's real tokenizer, with
``<|python_tag|>`` and ``[TOOL_CALLS]`` added as special tokens, as they are in Llama 3 and
Mistral vocabularies; "auto" keeps special tokens in the text the parser reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.gateway.served_model import ServedModel
from router.gateway.tool_calls import AutoToolCalls, tool_call_choice
from tests.gateway.test_auto_tool_choice import (
    PARIS,
    TOOLS,
    _split_stream,
    _Streamed,
    _streamed,
)
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
NICE = {"city": "Nice; {braces} ]", "note": "Zürich"}  # separators and brackets as data


def _llama(name: str, arguments: Any, key: str = "parameters") -> str:
    """A call as Llama 3 writes it (its template renders calls with tojson)."""
    return json.dumps({"name": name, key: arguments})


def _mistral(*calls: tuple[str, Any]) -> str:
    return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])


WEATHER_CALL = ("get_weather", json.dumps(PARIS))
TIME_CALL = ("get_time", "{}")

# per parser: (text, content, calls) as the whole response has them (and the stream, the same)
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, str]]]]] = {
    "llama3_json": [
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        (_llama("get_weather", PARIS), None, [WEATHER_CALL]),
        (
            f"<|python_tag|>{_llama('get_weather', PARIS)}; {_llama('get_time', {}, 'arguments')}",
            None,
            [WEATHER_CALL, TIME_CALL],
        ),
        ("<|python_tag|>no object after the tag", "<|python_tag|>no object after the tag", []),
    ],
    "mistral": [
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        (_mistral(("get_weather", PARIS)), None, [WEATHER_CALL]),
        (
            "Let me look that up.\n" + _mistral(("get_weather", PARIS), ("get_time", {})),
            "Let me look that up.\n",
            [WEATHER_CALL, TIME_CALL],
        ),
        ("A text ending where the tag could start [TOOL_CA", None, []),  # content: the text
    ],
}
PARSERS = ["llama3_json", "llama4_json", "mistral"]


def _cases(parser: str) -> list[tuple[str, str | None, list[tuple[str, str]]]]:
    cases = CASES["llama3_json" if parser == "llama4_json" else parser]
    return [
        (text, text if not calls and content is None else content, calls)
        for text, content, calls in cases
    ]


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


def _model(parser: str) -> ServedModel:
    served = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None, tool_call_parser=parser)
    served.tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|python_tag|>", "[TOOL_CALLS]"]}
    )
    return served


@pytest.fixture(scope="module", params=PARSERS)
def served(
    request: pytest.FixtureRequest, cluster: ScriptedCluster
) -> Iterator[tuple[str, ServedModel, httpx.Client]]:
    model = _model(request.param)
    with http_client(cluster, model) as client:
        yield request.param, model, client


def _calls(parser: str, message: dict[str, Any]) -> list[tuple[str, str]]:
    for call in message["tool_calls"]:
        assert call["type"] == "function"
        _check_id(parser, call["id"])
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def _check_id(parser: str, call_id: str) -> None:
    if parser == "mistral":  # as vLLM's: Mistral's templates take 9 alphanumeric characters
        assert len(call_id) == 9 and call_id.isalnum(), call_id
    else:
        assert call_id.startswith("chatcmpl-tool-") and len(call_id) == 14 + 32, call_id


def _chat(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    return post_json(http, CHAT, {"messages": [USER_HI], "tools": TOOLS, **fields})


def _stream(http: httpx.Client, **fields: Any) -> list[dict[str, Any]]:
    return stream_chunks(http, CHAT, {"messages": [USER_HI], "tools": TOOLS, **fields})


@pytest.mark.parametrize("case", range(4))
def test_content_or_calls_whole_and_streamed(
    served: tuple[str, ServedModel, httpx.Client], cluster: ScriptedCluster, case: int
) -> None:
    parser, model, http = served
    text, content, calls = _cases(parser)[case]
    script_answer(cluster, model, text)
    (whole,) = _chat(http, tool_choice="auto")["choices"]
    assert whole["message"]["content"] == content
    assert _calls(parser, whole["message"]) == calls
    assert whole["finish_reason"] == ("tool_calls" if calls else "stop")
    assert cluster.params[-1].skip_special_tokens is False
    streamed = _streamed(_stream(http, tool_choice="auto"))
    for call in streamed.calls:
        _check_id(parser, call["id"])
    assert streamed.content == (content or "")
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls
    assert streamed.finish_reason == whole["finish_reason"]


def test_each_of_n_choices_is_read_for_calls_of_its_own(
    served: tuple[str, ServedModel, httpx.Client], cluster: ScriptedCluster
) -> None:
    parser, model, http = served
    text, content, calls = _cases(parser)[2]
    script_answer(cluster, model, text)
    whole = _chat(http, n=2)["choices"]
    assert [(c["message"]["content"], _calls(parser, c["message"])) for c in whole] == [
        (content, calls)
    ] * 2
    chunks = _stream(http, n=2)
    ids = set()
    for index in (0, 1):
        streamed = _streamed(chunks, index)
        assert streamed.content == (content or "") and streamed.finish_reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls
        ids |= {c["id"] for c in streamed.calls}
    assert len(ids) == 4


# ---------------------------------------------------------------- malformed and cut


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": }}',  # not JSON
        '{"function": "get_weather", "parameters": {}}',  # no name
        '{"name": "get_weather"}',  # neither arguments nor parameters
        f'{_llama("get_weather", PARIS)}; {{"name": "get_time", "parameters": {{}}',  # cut
        "Use {braces} for sets, then " + _llama("get_weather", PARIS),  # a "{" that is text
    ],
)
def test_llama_an_object_that_does_not_parse_makes_the_whole_text_content(text: str) -> None:
    """As vLLM's: content, no calls, finish_reason as the sample's."""
    message, finish_reason = tool_call_choice(AutoToolCalls("llama3_json"), text, "stop")
    assert message == {"role": "assistant", "content": text, "tool_calls": []}
    assert finish_reason == "stop"


def test_llama_calls_anywhere_in_a_whole_text_but_only_at_its_start_in_a_stream() -> None:
    """vLLM's whole response reads every object in the text and drops the rest; its stream
    reads calls only from a text that starts with "{" or <|python_tag|>: both kept."""
    text = f"Here you are: {_llama('get_weather', PARIS)}"
    message, finish_reason = tool_call_choice(AutoToolCalls("llama3_json"), text, "stop")
    assert message["content"] is None and finish_reason == "tool_calls"
    assert _calls("llama3_json", message) == [WEATHER_CALL]
    streamed = _split_stream("llama3_json", text, 5)
    assert streamed == _Streamed(text, [], "stop")


@pytest.mark.parametrize(
    ("text", "content"),
    [
        # the array is not JSON: vLLM's content is the text after the tag, stripped
        (
            'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }}]',
            '[{"name": "get_weather", "arguments": {"city": }}]',
        ),
        ("Sure. [TOOL_CALLS] get_weather(city='Paris')", "get_weather(city='Paris')"),
        # not an array of named objects, or two tags: vLLM fails the request; the text here
        ('[TOOL_CALLS] {"name": "get_time", "arguments": {}}', None),
        ("[TOOL_CALLS] [1, 2]", None),
        (f"{_mistral(('get_time', {}))}{_mistral(('get_time', {}))}", None),
    ],
)
def test_mistral_calls_that_do_not_parse_are_content(text: str, content: str | None) -> None:
    message, finish_reason = tool_call_choice(AutoToolCalls("mistral"), text, "stop")
    assert message == {"role": "assistant", "content": content or text, "tool_calls": []}
    assert finish_reason == "stop"


def test_mistral_reads_the_first_json_value_after_the_tag() -> None:
    """As vLLM's (``raw_decode``): text after the array is dropped; a call without arguments
    takes ``{}``."""
    text = '[TOOL_CALLS] [{"name": "get_time"}] and some trailing text'
    message, _ = tool_call_choice(AutoToolCalls("mistral"), text, "stop")
    assert message["content"] is None and _calls("mistral", message) == [TIME_CALL]


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_calls_cut_by_max_tokens_are_content_and_length(
    parser: str, cluster: ScriptedCluster
) -> None:
    text = _cases(parser)[2][0]
    model = _model(parser)
    script_answer(cluster, model, text, stop=False)
    num_tokens = len(cluster.tokens) - 3  # inside the second call
    cut = model.tokenizer.decode(cluster.tokens[:num_tokens])
    with http_client(cluster, model) as http:
        (whole,) = _chat(http, max_tokens=num_tokens)["choices"]
        assert whole["finish_reason"] == "length" and whole["message"]["tool_calls"] == []
        if parser == "llama3_json":
            assert whole["message"]["content"] == cut
        streamed = _streamed(_stream(http, max_tokens=num_tokens))
        assert streamed.finish_reason == "length"
        assert streamed.calls[0]["arguments"] == json.dumps(PARIS)


# ---------------------------------------------------------------- any split


SPLIT_TEXTS = {
    "llama3_json": [
        *(text for text, _, _ in CASES["llama3_json"]),
        f"<|python_tag|>{_llama('get_weather', NICE)};{_llama('get_time', {})} trailing",
        f'{{"parameters": {json.dumps(NICE)}, "name": "get_weather"}}',
        "<|python_ta",  # released at the end
        "<|python_tag|",
    ],
    "mistral": [
        *(text for text, _, _ in CASES["mistral"]),
        f"x[y] [TOOL_CALL] is text{_mistral(('get_weather', NICE), ('get_time', {}))} trailing",
        "[TOOL_CALLS] " + json.dumps([{"arguments": NICE, "name": "get_weather"}]),
    ],
}


@pytest.mark.parametrize(
    ("parser", "text"), [(parser, text) for parser, texts in SPLIT_TEXTS.items() for text in texts]
)
def test_any_split_of_the_text_streams_what_the_whole_text_holds(parser: str, text: str) -> None:
    """Two deltas, split at every point: the content and calls the whole response has."""
    whole, finish_reason = tool_call_choice(AutoToolCalls(parser), text, "stop")
    calls = [(n, json.loads(a)) for n, a in _calls(parser, whole)]
    for split in range(len(text) + 1):
        streamed = _split_stream(parser, text, split)
        assert streamed.content == (whole["content"] or ""), split
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.calls] == calls, split
        assert streamed.finish_reason == finish_reason, split


# a call object whose name never comes, then a call: (the whole response reads such a text as
# content; a stream has sent the call by the time it could know)
NAMELESS_THEN_A_CALL = {
    "llama3_json": '{"city": "Paris"}; ' + _llama("get_time", {}),
    "mistral": "[TOOL_CALLS] "
    + json.dumps([{"name": 5, "arguments": PARIS}, {"name": "get_time", "arguments": {}}]),
}


@pytest.mark.parametrize("parser", list(NAMELESS_THEN_A_CALL))
def test_a_call_object_without_a_name_takes_no_index(parser: str) -> None:
    """The calls a stream sends are numbered 0, 1, 2 ... (``_streamed`` checks each header's
    index): an object whose name never comes sends nothing and leaves no gap."""
    text = NAMELESS_THEN_A_CALL[parser]
    for split in range(len(text) + 1):
        streamed = _split_stream(parser, text, split)
        assert [(c["name"], c["arguments"]) for c in streamed.calls] == [TIME_CALL], split
