"""``tool_choice: "auto"`` with vLLM's ``deepseek_v3`` (DeepSeek-V3, R1-0528) and
``deepseek_v31`` (DeepSeek-V3.1 and later) tool-call parsers: whole and streamed alike, split
at any point, as vLLM's parsers read the text.

The cluster is scripted (``token_script``) around the demo model's real tokenizer, with
DeepSeek's call tags added as special tokens, as they are in DeepSeek's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.gateway.deepseek_tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from router.gateway.served_model import ServedModel
from router.gateway.tool_calls import AutoToolCalls, tool_call_choice
from tests.gateway.test_auto_tool_choice import PARIS, _split_stream, _streamed
from tests.gateway.test_llama_and_mistral_tool_calls import _chat, _stream
from tests.gateway.token_script import DEMO_MODEL, ScriptedCluster, http_client, script_answer

pytestmark = pytest.mark.timeout(120)

TAGS = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP]
NICE = {"city": "Nice\n```", "note": "Zürich"}  # a fence inside the arguments' strings
PARSERS = ["deepseek_v3", "deepseek_v31"]
ARGS = json.dumps(PARIS)


def _call(parser: str, name: str, arguments: Any) -> str:
    """One call's block as the parser's model writes it."""
    text = json.dumps(arguments, ensure_ascii=False)
    if parser == "deepseek_v3":
        return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{text}\n```{CALL_END}"
    return f"{CALL_BEGIN}{name}{SEP}{text}{CALL_END}"


def _calls_text(parser: str, *calls: tuple[str, Any], between: str = "") -> str:
    return CALLS_BEGIN + between.join(_call(parser, n, a) for n, a in calls) + CALLS_END


def _cases(parser: str) -> list[tuple[str, str | None, list[tuple[str, str]]]]:
    """(text, content, calls) as the whole response has them (and the stream, the same)."""
    weather = ("get_weather", json.dumps(PARIS))
    nice = ("get_weather", json.dumps(NICE, ensure_ascii=False))
    return [
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        (_calls_text(parser, ("get_weather", PARIS)), None, [weather]),
        (
            "Let me look.\n"
            + _calls_text(parser, ("get_weather", NICE), ("get_time", {}), between="\n"),
            "Let me look.\n",
            [nice, ("get_time", "{}")],
        ),
        (_calls_text(parser, ("get_weather", PARIS)) + "trailing text", None, [weather]),
    ]


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


def _model(parser: str) -> ServedModel:
    served = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None, tool_call_parser=parser)
    served.tokenizer.add_special_tokens({"additional_special_tokens": TAGS})
    return served


@pytest.fixture(scope="module", params=PARSERS)
def served(
    request: pytest.FixtureRequest, cluster: ScriptedCluster
) -> Iterator[tuple[str, ServedModel, httpx.Client]]:
    model = _model(request.param)
    with http_client(cluster, model) as client:
        yield request.param, model, client


def _whole_calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


@pytest.mark.parametrize("case", range(4))
def test_content_or_calls_whole_and_streamed(
    served: tuple[str, ServedModel, httpx.Client], cluster: ScriptedCluster, case: int
) -> None:
    parser, model, http = served
    text, content, calls = _cases(parser)[case]
    script_answer(cluster, model, text)
    (whole,) = _chat(http)["choices"]
    assert whole["message"]["content"] == content
    assert _whole_calls(whole["message"]) == calls
    assert whole["finish_reason"] == ("tool_calls" if calls else "stop")
    assert cluster.params[-1].skip_special_tokens is False  # the tags stay in the text read
    streamed = _streamed(_stream(http))
    assert streamed.content == (content or "")
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls
    assert streamed.finish_reason == whole["finish_reason"]


@pytest.mark.parametrize("parser", PARSERS)
def test_any_split_of_the_text_streams_what_the_whole_text_holds(parser: str) -> None:
    """Two deltas, split at every point: the content and calls of the whole response, the
    arguments as written (V3's closing fence not in them)."""
    texts = [text for text, _, _ in _cases(parser)] + [f"A text ending in {CALLS_BEGIN[:5]}"]
    for text in texts:
        whole, finish_reason = tool_call_choice(AutoToolCalls(parser), text, "stop")
        calls = _whole_calls(whole)
        for split in range(len(text) + 1):
            streamed = _split_stream(parser, text, split)
            assert streamed.content == (whole["content"] or ""), split
            assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls, split
            assert streamed.finish_reason == finish_reason, split


@pytest.mark.parametrize("parser", PARSERS)
def test_a_block_that_does_not_parse_makes_the_whole_text_content(parser: str) -> None:
    """As pdserve's other parsers: nothing generated is lost, finish_reason the sample's."""
    texts = [
        # not JSON: the arguments' closing brace missing
        CALLS_BEGIN + _call(parser, "get_weather", PARIS).replace(ARGS, ARGS[:-1]),
        CALLS_BEGIN + _call(parser, "", PARIS),  # no name
        CALLS_BEGIN + _call(parser, "get_weather", [1, 2]),  # not an object
        CALLS_BEGIN + _call(parser, "get_weather", PARIS)[: -len(CALL_END)],  # cut
        CALLS_BEGIN + CALLS_END,  # no calls
    ]
    for text in texts:
        message, finish_reason = tool_call_choice(AutoToolCalls(parser), text, "stop")
        assert message == {"role": "assistant", "content": text, "tool_calls": []}, text
        assert finish_reason == "stop"


@pytest.mark.parametrize("parser", PARSERS)
def test_calls_cut_by_max_tokens_finish_with_length(parser: str, cluster: ScriptedCluster) -> None:
    text = _cases(parser)[2][0]
    model = _model(parser)
    script_answer(cluster, model, text, stop=False)
    num_tokens = len(cluster.tokens) - 6  # inside the second call's arguments
    with http_client(cluster, model) as http:
        (whole,) = _chat(http, max_tokens=num_tokens)["choices"]
        assert whole["finish_reason"] == "length" and whole["message"]["tool_calls"] == []
        streamed = _streamed(_stream(http, max_tokens=num_tokens))
        assert streamed.finish_reason == "length"
        assert streamed.calls[0]["arguments"] == json.dumps(NICE, ensure_ascii=False)
