"""``tool_choice: "auto"`` with vLLM's ``kimi_k2`` tool-call parser (Kimi K2, a DeepSeek-V3
model): calls between ``<|tool_calls_section_begin|>`` and its end, each with the id the model
gives it (``functions.NAME:INDEX``), kept as the call's id, whole and streamed alike, split at
any point; and its ``kimi_k2`` reasoning parser (Kimi K2 Thinking), whose thought the calls'
section ends too.

The cluster is scripted (``token_script``) around the demo model's real tokenizer, with Kimi's
call tags added as special tokens, as they are in Kimi's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.gateway.kimi_tool_calls import (
    ARGUMENTS_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGINS,
    SECTION_ENDS,
)
from router.gateway.reasoning import ReasoningMode, split_reasoning
from router.gateway.served_model import ServedModel
from router.gateway.tool_calls import AutoToolCalls, tool_call_choice
from tests.gateway.test_auto_tool_choice import PARIS, _split_stream, _streamed
from tests.gateway.test_llama_and_mistral_tool_calls import _chat, _stream
from tests.gateway.test_reasoning_parsers import _streamed as _reasoned_stream
from tests.gateway.token_script import DEMO_MODEL, ScriptedCluster, http_client, script_answer

pytestmark = pytest.mark.timeout(120)

TAGS = [*SECTION_BEGINS, *SECTION_ENDS, CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END]
NICE = {"city": "Nice <3", "note": "Zürich"}


def _call(call_id: str, arguments: Any, space: str = "") -> str:
    """One call's block as Kimi K2 writes it (``space``: around its id and arguments)."""
    text = json.dumps(arguments, ensure_ascii=False)
    return f"{CALL_BEGIN}{space}{call_id}{space}{ARGUMENTS_BEGIN}{space}{text}{space}{CALL_END}"


def _section(*blocks: str, singular: bool = False) -> str:
    begin, end = (
        (SECTION_BEGINS[1], SECTION_ENDS[1]) if singular else (SECTION_BEGINS[0], SECTION_ENDS[0])
    )
    return begin + "".join(blocks) + end


WEATHER = ("functions.get_weather:0", "get_weather", json.dumps(PARIS))
CASES = [  # (text, content, calls as (id, name, arguments)), whole and streamed alike
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    (_section(_call("functions.get_weather:0", PARIS)), None, [WEATHER]),
    (
        "Let me look.\n"
        + _section(_call("functions.get_weather:0", NICE, " \n"), _call("get_time:1", {})),
        "Let me look.\n",
        [
            ("functions.get_weather:0", "get_weather", json.dumps(NICE, ensure_ascii=False)),
            ("get_time:1", "get_time", "{}"),
        ],
    ),
    (  # the singular tags, and text after the section (dropped)
        _section(_call("functions.get_weather:0", PARIS), singular=True) + " trailing",
        None,
        [WEATHER],
    ),
    (f"A text ending in {SECTION_BEGINS[0][:6]}", f"A text ending in {SECTION_BEGINS[0][:6]}", []),
]


def _whole(text: str, finish: str = "stop") -> tuple[dict[str, Any], str | None]:
    return tool_call_choice(AutoToolCalls("kimi_k2"), text, finish)


def _calls(message: dict[str, Any]) -> list[tuple[str, str, str]]:
    for call in message["tool_calls"]:
        assert call["type"] == "function"
    return [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]


def test_whole_texts_are_read_as_vllm_reads_them() -> None:
    for text, content, calls in CASES:
        message, finish = _whole(text)
        assert message["content"] == content, text
        assert _calls(message) == calls, text
        assert finish == ("tool_calls" if calls else "stop"), text


def test_any_split_of_the_text_streams_what_the_whole_text_holds() -> None:
    """Two deltas split at every point: the content and the calls, ids included."""
    for text, content, calls in CASES:
        for split in range(len(text) + 1):
            streamed = _split_stream("kimi_k2", text, split)
            assert streamed.content == (content or ""), split
            got = [(c["id"], c["name"], c["arguments"]) for c in streamed.calls]
            assert got == calls, (text, split)
            assert streamed.finish_reason == ("tool_calls" if calls else "stop"), split


def test_a_block_that_does_not_parse_makes_the_whole_text_content() -> None:
    """As pdserve's other parsers: nothing generated is lost, finish_reason the sample's."""
    arguments = json.dumps(PARIS)
    texts = [
        _section(_call("functions.get_weather:0", PARIS)).replace(arguments, arguments[:-1]),
        _section(_call("functions.get_weather", PARIS)),  # no :INDEX
        _section(_call("functions.get_weather:0", [1, 2])),  # not an object
        _section(_call("functions.get_weather:0", PARIS))[: -len(SECTION_ENDS[0] + CALL_END)],
        _section(),  # no calls
    ]
    for text in texts:
        message, finish_reason = _whole(text)
        assert message == {"role": "assistant", "content": text, "tool_calls": []}, text
        assert finish_reason == "stop"


THOUGHT = "The user wants the weather."


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        (f"<think>{THOUGHT}</think>It is sunny.", THOUGHT, "It is sunny."),
        (f"{THOUGHT}</think>It is sunny.", THOUGHT, "It is sunny."),  # <think> in the prompt
        (f"{THOUGHT}{CASES[1][0]}", THOUGHT, CASES[1][0]),  # the calls end the thought
        (f"<think>{THOUGHT}", THOUGHT, None),  # cut in the thought
    ],
)
def test_the_thought_ends_at_think_or_at_the_calls(
    text: str, reasoning: str, content: str | None
) -> None:
    assert split_reasoning(ReasoningMode("kimi_k2"), text) == (reasoning, content)
    assert split_reasoning(ReasoningMode("kimi_k2", thinking=False), text) == (None, text)


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def served(cluster: ScriptedCluster) -> Iterator[tuple[ServedModel, httpx.Client]]:
    model = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None, tool_call_parser="kimi_k2")
    model.tokenizer.add_special_tokens({"additional_special_tokens": TAGS})
    with http_client(cluster, model) as client:
        yield model, client


@pytest.mark.parametrize("case", range(4))
def test_calls_over_http_keep_their_ids(
    served: tuple[ServedModel, httpx.Client], cluster: ScriptedCluster, case: int
) -> None:
    model, http = served
    text, content, calls = CASES[case]
    script_answer(cluster, model, text)
    (whole,) = _chat(http)["choices"]
    assert whole["message"]["content"] == content
    assert _calls(whole["message"]) == calls
    assert whole["finish_reason"] == ("tool_calls" if calls else "stop")
    assert cluster.params[-1].skip_special_tokens is False  # the tags stay in the text read
    streamed = _streamed(_stream(http))
    assert streamed.content == (content or "")
    assert [(c["id"], c["name"], c["arguments"]) for c in streamed.calls] == calls
    assert streamed.finish_reason == whole["finish_reason"]


def test_a_call_cut_by_max_tokens_finishes_with_length(
    served: tuple[ServedModel, httpx.Client], cluster: ScriptedCluster
) -> None:
    model, http = served
    script_answer(cluster, model, CASES[2][0], stop=False)
    num_tokens = len(cluster.tokens) - 6  # inside the second call's arguments
    (whole,) = _chat(http, max_tokens=num_tokens)["choices"]
    assert whole["finish_reason"] == "length" and whole["message"]["tool_calls"] == []
    streamed = _streamed(_stream(http, max_tokens=num_tokens))
    assert streamed.finish_reason == "length"
    assert streamed.calls[0]["arguments"] == json.dumps(NICE, ensure_ascii=False)


def test_kimi_k2_thinking_then_calls_over_http(cluster: ScriptedCluster) -> None:
    """Both of Kimi's parsers: the thought is the reasoning, the calls (their ids kept) come
    from the rest, whole and streamed; chat_template_kwargs thinking false: no reasoning."""
    model = ServedModel.load(
        str(DEMO_MODEL),
        "pdserve-demo",
        None,
        tool_call_parser="kimi_k2",
        reasoning_parser="kimi_k2",
    )
    model.tokenizer.add_special_tokens(
        {"additional_special_tokens": [*TAGS, "<think>", "</think>"]}
    )
    text, _, calls = CASES[1]
    script_answer(cluster, model, f"{THOUGHT}{text}")
    with http_client(cluster, model) as http:
        (whole,) = _chat(http)["choices"]
        message = whole["message"]
        assert (message["reasoning"], message["content"]) == (THOUGHT, None)
        assert _calls(message) == calls and whole["finish_reason"] == "tool_calls"
        streamed = _reasoned_stream(_stream(http))
        assert streamed.reasoning == THOUGHT and streamed.content == ""
        assert streamed.call_names == ["get_weather"]
        script_answer(cluster, model, "It is sunny.")
        (off,) = _chat(http, chat_template_kwargs={"thinking": False})["choices"]
        assert (off["message"]["reasoning"], off["message"]["content"]) == (None, "It is sunny.")
