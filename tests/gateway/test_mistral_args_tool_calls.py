"""``tool_choice: "auto"`` with vLLM's ``mistral`` tool-call parser reading the calls of Mistral
tokenizers v11 and later (Mistral Small 3.1+, Magistral, Devstral ...): ``[TOOL_CALLS]name[ARGS]
{...}``, one call after another, some with ``[CALL_ID]`` and the model's own id before
``[ARGS]``; whole and streamed. (The array of tokenizers before v11 is read as before:
``test_llama_and_mistral_tool_calls``.)

The cluster is scripted (``token_script``) around the demo model's real tokenizer, with
``[TOOL_CALLS]``, ``[ARGS]`` and ``[CALL_ID]`` added as special tokens, as they are in a v11+
vocabulary; "auto" keeps special tokens in the text the parser reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.gateway.served_model import ServedModel
from router.gateway.tool_calls import AutoToolCalls, ChatDeltas, tool_call_choice
from tests.gateway.test_auto_tool_choice import PARIS, TOOLS, _split_stream, _Streamed, _streamed
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
V11_TOKENS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
# brackets, braces, quotes and the format's tags as data, in nested arguments
BRACKETS = {
    "city": "Nice; [TOOL_CALLS] {braces} ] [ARGS]",
    "note": 'Zürich "quoted" \\ [x]',
    "days": [1, [2, {"at": "}"}]],
    "where": {"lat": 43.7, "tags": ["[", "{"]},
}


def _call(name: str, arguments: Any, call_id: str | None = None) -> str:
    """A call as a v11+ Mistral model writes it (its template renders arguments with tojson)."""
    named = name if call_id is None else f"{name}[CALL_ID]{call_id}"
    return f"[TOOL_CALLS]{named}[ARGS]{json.dumps(arguments, ensure_ascii=False)}"


WEATHER_CALL = ("get_weather", json.dumps(PARIS))
TIME_CALL = ("get_time", "{}")

# (text, content, calls) as the whole response has them, and the stream
CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    (_call("get_weather", PARIS), None, [WEATHER_CALL]),
    (
        "Let me look that up.\n" + _call("get_weather", PARIS) + _call("get_time", {}),
        "Let me look that up.\n",
        [WEATHER_CALL, TIME_CALL],
    ),
    (
        _call("get_weather", PARIS, "a1B2c3D4e") + _call("get_time", {}, "Z9y8X7w6V"),
        None,
        [WEATHER_CALL, TIME_CALL],
    ),
    (
        _call("get_weather", BRACKETS),
        None,
        [("get_weather", json.dumps(BRACKETS, ensure_ascii=False))],
    ),
]


def _model() -> ServedModel:
    served = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None, tool_call_parser="mistral")
    served.tokenizer.add_special_tokens({"additional_special_tokens": V11_TOKENS})
    return served


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def served(cluster: ScriptedCluster) -> Iterator[tuple[ServedModel, httpx.Client]]:
    model = _model()
    with http_client(cluster, model) as client:
        yield model, client


def _chat(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    return post_json(http, CHAT, {"messages": [USER_HI], "tools": TOOLS, **fields})


def _stream(http: httpx.Client, **fields: Any) -> list[dict[str, Any]]:
    return stream_chunks(http, CHAT, {"messages": [USER_HI], "tools": TOOLS, **fields})


def _check_ids(call_ids: list[str]) -> None:
    """As vLLM's: Mistral's templates take 9 alphanumeric characters (the model's own
    [CALL_ID] ids are not kept)."""
    for call_id in call_ids:
        assert len(call_id) == 9 and call_id.isalnum(), call_id
    assert not {"a1B2c3D4e", "Z9y8X7w6V"} & set(call_ids)


def _whole(text: str, finish_reason: str = "stop") -> tuple[dict[str, Any], str | None]:
    return tool_call_choice(AutoToolCalls("mistral"), text, finish_reason)


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    _check_ids([call["id"] for call in message["tool_calls"]])
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def _one_delta_per_character(text: str) -> _Streamed:
    """``text`` streamed a character a delta, as a client puts it together."""
    deltas = ChatDeltas(AutoToolCalls("mistral"))
    chunks = []
    for at, char in enumerate(text):
        finish = "stop" if at == len(text) - 1 else None
        delta, shown_finish = deltas.delta(0, char, finish)
        chunks.append({"choices": [{"index": 0, "delta": delta, "finish_reason": shown_finish}]})
    return _streamed(chunks)


def test_a_tokenizer_with_args_is_served() -> None:
    """A vocabulary with [ARGS] (v11+) is served with the mistral parser, as vLLM serves it."""
    model = _model()
    served = ServedModel("m", 16, model.vocab_size, model.tokenizer, tool_call_parser="mistral")
    assert "[ARGS]" in served.tokenizer.get_vocab()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_content_and_calls_whole_and_streamed(
    served: tuple[ServedModel, httpx.Client], cluster: ScriptedCluster, case: int
) -> None:
    """The arguments are the object as the model wrote it, whole and streamed (vLLM's)."""
    model, http = served
    text, content, calls = CASES[case]
    script_answer(cluster, model, text)
    (whole,) = _chat(http, tool_choice="auto")["choices"]
    assert whole["message"]["content"] == content
    assert _calls(whole["message"]) == calls
    assert whole["finish_reason"] == "tool_calls"
    assert cluster.params[-1].skip_special_tokens is False
    streamed = _streamed(_stream(http, tool_choice="auto"))
    _check_ids([call["id"] for call in streamed.calls])
    assert streamed.content == (content or "")
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls
    assert streamed.finish_reason == "tool_calls"


def test_calls_cut_by_max_tokens_are_content_and_length(cluster: ScriptedCluster) -> None:
    """Cut inside the second call: the whole response is content; the stream has sent the
    first call whole and ends with ``length``."""
    model = _model()
    text = CASES[1][0]
    script_answer(cluster, model, text, stop=False)
    num_tokens = len(cluster.tokens) - 2  # inside the second call's arguments
    cut = model.tokenizer.decode(cluster.tokens[:num_tokens])
    with http_client(cluster, model) as http:
        (whole,) = _chat(http, max_tokens=num_tokens)["choices"]
        assert whole["message"] == {"role": "assistant", "content": cut, "tool_calls": []}
        assert whole["finish_reason"] == "length"
        streamed = _streamed(_stream(http, max_tokens=num_tokens))
        assert streamed.finish_reason == "length"
        assert (streamed.calls[0]["name"], streamed.calls[0]["arguments"]) == WEATHER_CALL
        assert streamed.calls[1]["name"] == "get_time"


SPLIT_TEXTS = [
    *(text for text, _, _ in CASES),
    # spaces around the name and before the object, text after a call dropped
    "Sure [x] {y}. [TOOL_CALLS] get_time [ARGS] {} and then [TOOL_CALLS]get_weather[ARGS]"
    + json.dumps(BRACKETS)
    + " trailing",
]


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_any_split_streams_what_the_whole_text_holds(text: str) -> None:
    """Two deltas, split at every point, and a character a delta: the content and calls the
    whole response has, the calls indexed 0, 1 ... in order (``_streamed`` checks it)."""
    whole, finish_reason = _whole(text)
    calls = _calls(whole)
    assert calls and finish_reason == "tool_calls"
    streams = [_split_stream("mistral", text, split) for split in range(len(text) + 1)]
    for split, streamed in enumerate([*streams, _one_delta_per_character(text)]):
        assert streamed.content == (whole["content"] or ""), split
        assert [(c["name"], c["arguments"]) for c in streamed.calls] == calls, split
        assert streamed.finish_reason == finish_reason, split


def test_spaces_and_trailing_text_are_read_as_vllm_reads_the_calls() -> None:
    message, _ = _whole(SPLIT_TEXTS[4])
    assert message["content"] == "Sure [x] {y}. "
    assert _calls(message) == [("get_time", "{}"), ("get_weather", json.dumps(BRACKETS))]


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS]get_weather[ARGS]{"city": }',  # not JSON
        '[TOOL_CALLS]get_weather[ARGS]["Paris"]',  # not an object
        "[TOOL_CALLS]get_weather[ARGS]",  # no arguments
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',  # cut
        "[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e",  # no [ARGS]
        "Sure. [TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e{}",
    ],
)
def test_calls_that_do_not_parse_are_content(text: str) -> None:
    """As the array's: the whole text is content, no calls, finish_reason as the sample's."""
    assert _whole(text) == ({"role": "assistant", "content": text, "tool_calls": []}, "stop")


@pytest.mark.parametrize(
    ("malformed", "streamed_names"),
    [
        ("[TOOL_CALLS]get_time", ["get_weather"]),  # no [ARGS]
        ("[TOOL_CALLS]get time[ARGS]{}", ["get_weather"]),  # not a name
        ('[TOOL_CALLS]get_time[ARGS]{"at": }', ["get_weather", "get_time"]),  # not JSON
    ],
)
def test_a_malformed_call_after_a_call_makes_the_whole_text_content(
    malformed: str, streamed_names: list[str]
) -> None:
    """The whole response reads it as content; a stream has sent the calls before it by the
    time it could know, and sends no header for a call without a name."""
    text = _call("get_weather", PARIS) + malformed
    assert _whole(text) == ({"role": "assistant", "content": text, "tool_calls": []}, "stop")
    for split in range(len(text) + 1):
        streamed = _split_stream("mistral", text, split)
        assert [c["name"] for c in streamed.calls] == streamed_names, split
        assert streamed.calls[0]["arguments"] == WEATHER_CALL[1], split
