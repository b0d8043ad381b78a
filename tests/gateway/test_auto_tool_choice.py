"""``tool_choice: "auto"`` with the hermes tool-call parser (``--enable-auto-tool-choice
--tool-call-parser hermes``): the output is free, and its text is read for ``<tool_call>``
blocks as vLLM's hermes parser reads them, whole and streamed; without the flags "auto" is
refused naming them.

The cluster is a scripted ``GenerationBackend`` that answers the tokens a test chooses; the
demo model's real byte-level BPE tokenizer runs around it. It spells the tags character by
character (``<``, ``to``, ``ol`` ...), so a stream of one token per character splits each tag
at every point; a second copy of it has the tags as special tokens, as many hermes models do.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import pytest

from router.gateway.served_model import ServedModel
from router.gateway.tool_calls import AutoToolCalls, ChatDeltas, tool_call_choice
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
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
]
PARIS = {"city": "Paris", "unit": "celsius"}
NICE = {"city": "Nice <3", "note": '{"braces"} and </tool_call'}  # tags and braces as data


def _block(name: str, arguments: Any) -> str:
    """A call as hermes models write it (their templates render calls with tojson)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


ONE_CALL = _block("get_weather", PARIS)
CONTENT_THEN_TWO_CALLS = f"Let me look that up.\n\n{ONE_CALL}\n{_block('get_time', {})}"


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None, tool_call_parser="hermes")


def _chat(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    return post_json(http, CHAT, {"messages": [USER_HI], "tools": TOOLS, **fields})


def _stream(http: httpx.Client, **fields: Any) -> list[dict[str, Any]]:
    return stream_chunks(http, CHAT, {"messages": [USER_HI], "tools": TOOLS, **fields})


@dataclasses.dataclass
class _Streamed:
    """One choice's stream put together as a client does."""

    content: str
    calls: list[dict[str, Any]]  # {"id", "name", "arguments"}, by index
    finish_reason: str | None


def _streamed(chunks: list[dict[str, Any]], index: int = 0) -> _Streamed:
    content, finish_reason = "", None
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            content += choice["delta"].get("content", "")
            for entry in choice["delta"].get("tool_calls", []):
                if "id" in entry:  # a call's header opens it
                    assert entry["index"] == len(calls) and entry["type"] == "function"
                    calls[entry["index"]] = {"id": entry["id"], **entry["function"]}
                else:
                    assert set(entry) == {"index", "function"}
                    calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
            finish_reason = choice["finish_reason"] or finish_reason
    return _Streamed(content, [calls[i] for i in sorted(calls)], finish_reason)


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert len(call["id"]) == len("chatcmpl-tool-") + 32
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


# ---------------------------------------------------------------- whole and streamed


@pytest.mark.parametrize("choice", [{}, {"tool_choice": "auto"}])
def test_content_alone_is_content_and_the_output_is_free(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel, choice: dict[str, Any]
) -> None:
    """ "auto" sent, or the default with tools, as OpenAI's."""
    script_answer(cluster, model, "It is sunny in Paris.")
    (whole,) = _chat(http, **choice)["choices"]
    assert whole["message"] == {
        "role": "assistant",
        "content": "It is sunny in Paris.",
        "tool_calls": [],
    }
    assert whole["finish_reason"] == "stop"
    params = cluster.params[-1]
    assert params.structured_outputs is None and params.skip_special_tokens is False
    streamed = _streamed(_stream(http, **choice))
    assert streamed == _Streamed("It is sunny in Paris.", [], "stop")


def test_one_call_is_a_tool_call_with_null_content(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, ONE_CALL)
    body = _chat(http, tool_choice="auto")
    (whole,) = body["choices"]
    assert whole["message"]["content"] is None  # as vLLM, when the text is calls alone
    assert _calls(whole["message"]) == [("get_weather", json.dumps(PARIS))]
    assert whole["finish_reason"] == "tool_calls"
    assert body["usage"]["completion_tokens"] == len(cluster.tokens)
    chunks = _stream(http, tool_choice="auto")
    streamed = _streamed(chunks)
    assert streamed.content == "" and streamed.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == [
        ("get_weather", json.dumps(PARIS))
    ]


def test_content_then_two_calls(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, CONTENT_THEN_TWO_CALLS)
    (whole,) = _chat(http)["choices"]
    message = whole["message"]
    assert message["content"] == "Let me look that up.\n\n"  # as written, as vLLM keeps it
    assert _calls(message) == [("get_weather", json.dumps(PARIS)), ("get_time", "{}")]
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert whole["finish_reason"] == "tool_calls"
    streamed = _streamed(_stream(http))
    assert streamed.content == "Let me look that up.\n\n"
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == _calls(message)
    assert streamed.finish_reason == "tool_calls"


def test_arguments_first_and_non_ascii_and_tags_in_strings(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """Hermes 2 Pro may write ``arguments`` before ``name``: the stream sends them with the
    header once the name comes. A ``<`` or a brace inside a string is data (a block runs to
    the first ``</tool_call>`` though, as vLLM's does, so none is in these strings)."""
    data = {"city": "Zürich <3", "note": '{"braces"} </tool'}
    text = f'<tool_call>\n{{"arguments": {json.dumps(data)}, "name": "get_weather"}}\n</tool_call>'
    script_answer(cluster, model, text)
    (whole,) = _chat(http)["choices"]
    assert _calls(whole["message"]) == [("get_weather", json.dumps(data, ensure_ascii=False))]
    streamed = _streamed(_stream(http))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.calls] == [
        ("get_weather", data)
    ]


@pytest.mark.parametrize(
    ("block", "streamed_arguments"),
    [
        # the name never comes: the stream sends no call for it
        ("<tool_call>\nget_weather(city='Paris')\n</tool_call>", [json.dumps(PARIS)]),
        # the name comes, the arguments are broken: the stream has sent them as written, as
        # vLLM's does (it cannot take them back)
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
            [json.dumps(PARIS), '{"city": }'],
        ),
    ],
)
def test_a_malformed_block_makes_the_whole_text_content(
    http: httpx.Client,
    cluster: ScriptedCluster,
    model: ServedModel,
    block: str,
    streamed_arguments: list[str],
) -> None:
    """As vLLM's parser: a block that does not parse leaves the whole text as content, calls
    that parsed before it included. A stream has sent those calls by then."""
    text = f"Sure.\n{ONE_CALL}\n{block}"
    script_answer(cluster, model, text)
    (whole,) = _chat(http)["choices"]
    assert whole["message"] == {"role": "assistant", "content": text, "tool_calls": []}
    assert whole["finish_reason"] == "stop"
    streamed = _streamed(_stream(http))
    assert streamed.content == "Sure.\n" and streamed.finish_reason == "tool_calls"
    assert [c["arguments"] for c in streamed.calls] == streamed_arguments


def test_a_block_cut_by_max_tokens_is_content_and_length(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, CONTENT_THEN_TWO_CALLS, stop=False)
    second_block = _num_tokens_until(model, cluster.tokens, "</tool_call>\n<tool_call>")
    cut = model.tokenizer.decode(cluster.tokens[: second_block + 4])
    (whole,) = _chat(http, max_tokens=second_block + 4)["choices"]
    assert whole["message"] == {"role": "assistant", "content": cut, "tool_calls": []}
    assert whole["finish_reason"] == "length"
    streamed = _streamed(_stream(http, max_tokens=second_block + 4))
    assert streamed.finish_reason == "length"  # the second call's block was cut
    assert streamed.calls[0]["arguments"] == json.dumps(PARIS)
    # cut after the first block: its call is whole, so both say tool_calls, as vLLM's
    first_block = _num_tokens_until(model, cluster.tokens, "</tool_call>")
    (whole,) = _chat(http, max_tokens=first_block)["choices"]
    assert _calls(whole["message"]) == [("get_weather", json.dumps(PARIS))]
    assert whole["finish_reason"] == "tool_calls"
    streamed = _streamed(_stream(http, max_tokens=first_block))
    assert streamed.calls == [{**streamed.calls[0], "arguments": json.dumps(PARIS)}]
    assert streamed.finish_reason == "tool_calls"


def _num_tokens_until(model: ServedModel, token_ids: list[int], text: str) -> int:
    """The fewest of ``token_ids`` whose text holds ``text``."""
    for num_tokens in range(len(token_ids) + 1):
        if text in model.tokenizer.decode(token_ids[:num_tokens]):
            return num_tokens
    raise AssertionError(f"{text!r} is not in the tokens' text")


def test_each_of_n_choices_is_read_for_calls_of_its_own(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, CONTENT_THEN_TWO_CALLS)
    whole = _chat(http, n=2)["choices"]
    assert [_calls(choice["message"]) for choice in whole] == [
        [("get_weather", json.dumps(PARIS)), ("get_time", "{}")]
    ] * 2
    chunks = _stream(http, n=2)
    ids = set()
    for index in (0, 1):
        streamed = _streamed(chunks, index)
        assert streamed.content == "Let me look that up.\n\n"
        assert [(c["name"], c["arguments"]) for c in streamed.calls] == _calls(whole[0]["message"])
        assert streamed.finish_reason == "tool_calls"
        ids |= {c["id"] for c in streamed.calls}
    assert len(ids) == 4


def test_a_stream_of_one_character_per_token_splits_the_tags_at_every_point(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """Each character its own delta: a content delta never holds part of a tag."""
    script_tokens(cluster, one_token_per_character(model, CONTENT_THEN_TWO_CALLS), model)
    chunks = _stream(http)
    for chunk in chunks:
        assert "<" not in chunk["choices"][0]["delta"].get("content", "")
    streamed = _streamed(chunks)
    assert streamed.content == "Let me look that up.\n\n"
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == [
        ("get_weather", json.dumps(PARIS)),
        ("get_time", "{}"),
    ]
    assert streamed.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "text",
    [
        CONTENT_THEN_TWO_CALLS,
        f"x<y, <tool_calls> and <tool-call> are text{_block('get_weather', NICE)}",
        "Text ending where a tag could start <tool_ca",  # released at the end
        '<<tool_call>\n{"name": "get_time", "arguments": {}}</tool_call>trailing text',
    ],
)
def test_any_split_of_the_text_streams_what_the_whole_text_holds(text: str) -> None:
    """Two deltas, split at every point: the content and calls the whole response has."""
    whole, finish_reason = _whole_choice(text)
    for split in range(len(text) + 1):
        streamed = _split_stream("hermes", text, split)
        assert streamed.content == (whole["content"] or ""), split
        calls = [(c["name"], json.loads(c["arguments"])) for c in streamed.calls]
        assert calls == [(n, json.loads(a)) for n, a in _calls(whole)], split
        assert streamed.finish_reason == finish_reason, split


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (
            f'<tool_call>\n{{"arguments": {{}}}}\n</tool_call>\n{_block("get_time", {})}',
            ["get_time"],
        ),
        (
            f'<tool_call>{{"name": 5}} {{"name": "get_time", "arguments": {{}}}}</tool_call>'
            f"{_block('get_weather', PARIS)}",
            ["get_time", "get_weather"],
        ),
    ],
)
def test_streamed_calls_are_numbered_on_across_blocks(text: str, names: list[str]) -> None:
    """The calls a stream sends are numbered 0, 1, 2 ... across blocks (``_streamed`` checks
    each header's index), a call object whose name never comes taking no index."""
    for split in range(len(text) + 1):
        streamed = _split_stream("hermes", text, split)
        assert [c["name"] for c in streamed.calls] == names, split


def _split_stream(parser: str, text: str, split: int) -> _Streamed:
    """``text`` streamed in two deltas, split at ``split``, as a client puts it together."""
    deltas = ChatDeltas(AutoToolCalls(parser))
    chunks = []
    for piece, finish in ((text[:split], None), (text[split:], "stop")):
        delta, shown_finish = deltas.delta(0, piece, finish)
        chunks.append({"choices": [{"index": 0, "delta": delta, "finish_reason": shown_finish}]})
    return _streamed(chunks)


def _whole_choice(text: str) -> tuple[dict[str, Any], str | None]:
    return tool_call_choice(AutoToolCalls("hermes"), text, "stop")


# ---------------------------------------------------------------- special tokens


@pytest.fixture(scope="module")
def special_model() -> ServedModel:
    """The demo model with ``<tool_call>`` and ``</tool_call>`` as special tokens (ids 4096 and
    4097, past the model's vocabulary: only the script writes them)."""
    served = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None, tool_call_parser="hermes")
    served.tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<tool_call>", "</tool_call>"]}
    )
    return served


def test_tags_that_are_special_tokens_are_read_with_special_tokens_kept(
    cluster: ScriptedCluster, special_model: ServedModel
) -> None:
    """As vLLM's hermes parser: "auto" keeps special tokens in the text it reads, whatever
    skip_special_tokens says; the tags never reach the content."""
    tokenizer = special_model.tokenizer
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    arguments = tokenizer.encode('\n{"name": "get_time", "arguments": {}}\n')
    script_tokens(cluster, [*tokenizer.encode("On it."), start, *arguments, end], special_model)
    with http_client(cluster, special_model) as http:
        for skip in (None, True):
            fields = {} if skip is None else {"skip_special_tokens": skip}
            (whole,) = _chat(http, **fields)["choices"]
            assert whole["message"]["content"] == "On it."
            assert _calls(whole["message"]) == [("get_time", "{}")]
            assert cluster.params[-1].skip_special_tokens is False
            streamed = _streamed(_stream(http, **fields))
            assert streamed.content == "On it." and streamed.calls[0]["name"] == "get_time"
        # "none" reads no calls: special tokens are skipped, as by default
        (plain,) = _chat(http, tool_choice="none")["choices"]
        assert plain["message"]["content"] == 'On it.\n{"name": "get_time", "arguments": {}}\n'


# ---------------------------------------------------------------- refusals and the flag off


def test_auto_without_the_flags_is_refused_naming_them(cluster: ScriptedCluster) -> None:
    plain = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    with http_client(cluster, plain) as http:
        for choice in ({}, {"tool_choice": "auto"}):
            body = {"messages": [USER_HI], "tools": TOOLS, **choice}
            error = bad_request_error(http.post(CHAT, json=body))
            assert error["param"] == "tool_choice", error
            assert "--enable-auto-tool-choice" in error["message"]
            assert "--tool-call-parser" in error["message"]


def test_auto_with_other_fields(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, "plain")
    # tools: [] reads no calls, as vLLM; no tools at all is refused, as for "required"
    body = post_json(http, CHAT, {"messages": [USER_HI], "tools": [], "tool_choice": "auto"})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "plain"}
    error = bad_request_error(http.post(CHAT, json={"messages": [USER_HI], "tool_choice": "auto"}))
    assert error["param"] == "tool_choice" and "needs tools" in error["message"]
    error = bad_request_error(
        http.post(CHAT, json={"messages": [USER_HI], "tools": TOOLS, "echo": True})
    )
    assert error["param"] == "echo"
    # parallel_tool_calls is ignored, as vLLM ignores it with "auto"; checked to be a boolean
    script_answer(cluster, model, CONTENT_THEN_TWO_CALLS)
    assert len(_chat(http, parallel_tool_calls=False)["choices"][0]["message"]["tool_calls"]) == 2
    error = bad_request_error(
        http.post(CHAT, json={"messages": [USER_HI], "tools": TOOLS, "parallel_tool_calls": 1})
    )
    assert error["param"] == "parallel_tool_calls"
    # a constraint of the client's own still applies: the tools add none
    _chat(http, response_format={"type": "json_object"})
    assert cluster.params[-1].structured_outputs is not None


def test_an_unknown_parser_is_refused_naming_the_supported_ones() -> None:
    supported = (
        "hermes, llama3_json, llama4_json, mistral, deepseek_v3, deepseek_v31, pythonic, "
        "llama4_pythonic, kimi_k2, qwen3_coder, qwen3_xml, glm45, glm47, minimax_m2, openai"
    )
    with pytest.raises(
        ValueError, match=f"unknown tool-call parser 'granite' .supported: {supported}"
    ):
        ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None, tool_call_parser="granite")
