"""Tool calling on /v1/chat/completions, the forms vLLM implements with structured outputs: a
named ``tool_choice`` and ``"required"`` constrain the output (the spec reaches the workers) and
return it as ``tool_calls``, whole and streamed as vLLM shapes them; ``"none"`` renders the
tools but leaves the output free; ``"auto"`` and bad tools are refused naming the field; tool
turns of a conversation reach the chat template.

The cluster here is a scripted ``GenerationBackend`` that records what it was asked and answers
the tokens a test chooses; the demo model's real byte-level BPE tokenizer runs around it, with
a chat template (this module's) that prints the tools, the tool calls and their results.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from engine.structured.spec import StructuredOutputSpec
from router.gateway.call_scanner import CallScanner
from router.gateway.served_model import ServedModel
from router.gateway.tool_calls import ChatDeltas, ForcedToolCalls
from tests.gateway.token_script import (
    DEMO_MODEL,
    USER_HI,
    ScriptedCluster,
    bad_request_error,
    module_gateway_client,  # noqa: F401 - the http fixture
    post_json,
    script_answer,
    stream_chunks,
)

pytestmark = pytest.mark.timeout(120)

# prints the tools, each assistant tool call (its arguments iterated, so an object) and each
# tool result
TOOL_TEMPLATE = (
    "{%- if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}Assistant calls:{% for call in message.tool_calls %} "
    "{{ call.id }}={{ call.function.name }}("
    "{%- for key, value in call.function.arguments.items() %}{{ key }}={{ value }}{% endfor %})"
    "{%- endfor %}"
    "{%- elif message.role == 'tool' %}Result of {{ message.tool_call_id }}: "
    "{{ message.content }}"
    "{%- else %}{{ message.role | capitalize }}: {{ message.content }}{% endif %}{{ '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}Assistant:{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_time"}},
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
CALLS = (
    '[{"name": "get_weather", "parameters": {"city": "Nice"}}, '
    '{"name": "get_time", "parameters": {}}]'
)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def model() -> ServedModel:
    served = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    served.tokenizer.chat_template = TOOL_TEMPLATE  # this module's own copy of the tokenizer
    return served


def _chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"messages": [USER_HI], **fields})


def _whole(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    """The 200 answer to a chat of USER_HI with ``fields``."""
    return post_json(http, "/v1/chat/completions", {"messages": [USER_HI], **fields})


def _required_schema(*tools: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """vLLM's "required" schema of (name, parameters) tools (no $refs to rebase)."""
    alternatives = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
        }
        for name, params in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}


def _streamed_calls(chunks: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """Choice ``index``'s streamed tool calls put together as a client does: the entry with an
    id opens a call, the others add to its arguments."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            assert "content" not in choice["delta"] or choice["delta"]["content"] == ""
            for entry in choice["delta"].get("tool_calls", []):
                if "id" in entry:
                    assert entry["index"] not in calls and entry["type"] == "function"
                    calls[entry["index"]] = {"id": entry["id"], **entry["function"]}
                else:
                    assert set(entry) == {"index", "function"}
                    assert set(entry["function"]) == {"arguments"}
                    calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def _finish_reasons(chunks: list[dict[str, Any]]) -> dict[int, str]:
    return {
        choice["index"]: choice["finish_reason"]
        for chunk in chunks
        for choice in chunk["choices"]
        if choice["finish_reason"] is not None
    }


# ---------------------------------------------------------------- a named function


def test_a_named_function_constrains_the_output_to_its_parameters(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, ARGUMENTS)
    body = _whole(http, tools=TOOLS, tool_choice=NAMED)
    assert cluster.params[-1].structured_outputs == StructuredOutputSpec.from_json_schema(WEATHER)
    (choice,) = body["choices"]
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] == ""
    (call,) = message["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) == 14 + 32
    assert call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    assert choice["finish_reason"] == "stop"  # the sample's, as vLLM (and OpenAI) for a named call
    # the tools reach the template whatever the choice
    assert model.tokenizer.decode(cluster.prompts[-1]).startswith("Tools: get_time get_weather\n")


def test_a_named_function_without_parameters_takes_none(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, "{}")
    named = {"type": "function", "function": {"name": "get_time"}}
    body = _whole(http, tools=TOOLS, tool_choice=named)
    expected = StructuredOutputSpec.from_json_schema(NO_ARGUMENTS)
    assert cluster.params[-1].structured_outputs == expected
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_a_named_function_streams_its_arguments_per_choice(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, ARGUMENTS)
    body = {"messages": [USER_HI], "tools": TOOLS, "tool_choice": NAMED, "n": 2}
    chunks = stream_chunks(http, "/v1/chat/completions", body, include_usage=True)
    ids = set()
    for index in (0, 1):
        first = next(c for c in chunks[2:] if c["choices"][0]["index"] == index)
        (header,) = first["choices"][0]["delta"]["tool_calls"]
        assert header["index"] == 0 and header["function"]["name"] == "get_weather"
        (call,) = _streamed_calls(chunks, index)
        assert call["name"] == "get_weather" and call["arguments"] == ARGUMENTS
        ids.add(call["id"])
    assert len(ids) == 2  # each choice its own call
    assert _finish_reasons(chunks) == {0: "tool_calls", 1: "tool_calls"}  # as vLLM streams it
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(cluster.tokens)


def test_a_named_call_cut_by_max_tokens_keeps_its_partial_arguments(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, ARGUMENTS, stop=False)
    body = {"messages": [USER_HI], "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 4}
    whole = post_json(http, "/v1/chat/completions", body)["choices"][0]
    cut = model.tokenizer.decode(cluster.tokens[:4])
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == cut
    assert whole["finish_reason"] == "length"
    chunks = stream_chunks(http, "/v1/chat/completions", body)
    assert _streamed_calls(chunks, 0)[0]["arguments"] == cut
    assert _finish_reasons(chunks) == {0: "length"}  # cut arguments: length, not tool_calls


# ---------------------------------------------------------------- "required"


def test_required_constrains_the_output_to_an_array_of_calls(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, CALLS)
    body = _whole(http, tools=TOOLS, tool_choice="required")
    schema = _required_schema(("get_time", NO_ARGUMENTS), ("get_weather", WEATHER))
    assert cluster.params[-1].structured_outputs == StructuredOutputSpec.from_json_schema(schema)
    (choice,) = body["choices"]
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "stop"
    calls = choice["message"]["tool_calls"]
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": json.dumps({"city": "Nice"})},
        {"name": "get_time", "arguments": "{}"},
    ]
    assert len({c["id"] for c in calls}) == 2
    _chat(http, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    one_call = {**schema, "maxItems": 1}
    assert cluster.params[-1].structured_outputs == StructuredOutputSpec.from_json_schema(one_call)


def test_required_streams_each_call_as_it_comes(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, CALLS)
    body = {"messages": [USER_HI], "tools": TOOLS, "tool_choice": "required", "n": 2}
    chunks = stream_chunks(http, "/v1/chat/completions", body)
    for index in (0, 1):
        calls = _streamed_calls(chunks, index)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Nice"}),
            ("get_time", {}),
        ]
        assert calls[0]["arguments"] == '{"city": "Nice"}'  # the value's text, as generated
    assert _finish_reasons(chunks) == {0: "tool_calls", 1: "tool_calls"}


def test_required_text_cut_short_is_returned_as_content(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, CALLS, stop=False)
    body = {"messages": [USER_HI], "tools": TOOLS, "tool_choice": "required", "max_tokens": 12}
    (choice,) = post_json(http, "/v1/chat/completions", body)["choices"]
    assert choice["message"]["content"] == model.tokenizer.decode(cluster.tokens[:12])
    assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] == "length"


def test_the_required_stream_scanner_reads_any_cut_of_the_array() -> None:
    """Scanned in any pieces, the streamed calls are the array's, whatever values they hold
    (strings with escapes and brackets, nested containers, scalars)."""
    text = (
        '[{"name": "a", "parameters": {"s": "x\\"}],{", "n": [1, {"m": null}]}},\n'
        ' {"name": "b", "parameters": 12 }, {"name":"c","parameters":"}"}]'
    )
    expected = [(item["name"], item["parameters"]) for item in json.loads(text)]
    for size in (1, 2, 3, 5, 8, len(text)):
        deltas = ChatDeltas(ForcedToolCalls(None))
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        chunks = [
            {"choices": [{"index": 0, "delta": deltas.delta(0, piece, None)[0]}]}
            for piece in pieces
        ]
        calls = _streamed_calls(chunks, 0)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected, size
        assert calls[1]["arguments"] == "12"  # no space around the value


def test_a_call_is_announced_once_under_its_first_name() -> None:
    """A second "name" in a call object (not JSON the constraint admits) is not read: the call
    has one header, and the next call the next index."""
    scanner = CallScanner()
    entries = scanner.feed(
        '[{"name": "a", "name": "b", "parameters": {}}, {"name": "c", "parameters": 1}]'
    )
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in entries] == [
        (0, "a", "{}"),
        (1, "c", "1"),
    ]


def test_required_without_tools_is_none_as_vllm_reads_it(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, "plain")
    body = _whole(http, tools=[], tool_choice="required")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "plain"}
    assert cluster.params[-1].structured_outputs is None


# ---------------------------------------------------------------- "none"


def test_none_renders_the_tools_but_leaves_the_output_free(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, "It is sunny.")
    body = {"messages": [USER_HI], "tools": TOOLS, "tool_choice": "none"}
    whole = post_json(http, "/v1/chat/completions", body)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert cluster.params[-1].structured_outputs is None
    assert "Tools: get_time get_weather" in model.tokenizer.decode(cluster.prompts[-1])
    streamed = stream_chunks(http, "/v1/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in streamed)
    assert text == "It is sunny." and _finish_reasons(streamed) == {0: "stop"}
    with_format = {**body, "response_format": {"type": "json_object"}}  # one constraint: fine
    post_json(http, "/v1/chat/completions", with_format)
    assert cluster.params[-1].structured_outputs == StructuredOutputSpec(json_object=True)


# ---------------------------------------------------------------- multi-turn


def test_tool_calls_and_their_results_reach_the_template(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, "Sunny in Paris.")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    ]
    body = {"messages": messages, "tools": TOOLS, "tool_choice": "none"}
    reply = post_json(http, "/v1/chat/completions", body)
    assert reply["choices"][0]["message"]["content"] == "Sunny in Paris."
    assert model.tokenizer.decode(cluster.prompts[-1]) == (
        "Tools: get_time get_weather\n"
        "User: Weather in Paris?\n"
        "Assistant calls: call_1=get_weather(city=Paris) call_2=get_time()\n"
        "Result of call_1: 21 C, sunny\n"
        "Result of call_2: noon\n"
        "Assistant:"
    )


def test_tool_call_arguments_that_are_not_a_json_object_reach_the_template_as_empty(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """As vLLM: a call's arguments cut short in the history do not fail every later turn."""
    script_answer(cluster, model, "ok")
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": '}},
        {"id": "c2", "function": {"name": "g", "arguments": {"b": 1}}},
    ]
    messages = [USER_HI, {"role": "assistant", "tool_calls": calls}]
    post_json(http, "/v1/chat/completions", {"messages": messages})
    assert "Assistant calls: c1=f() c2=g(b=1)\n" in model.tokenizer.decode(cluster.prompts[-1])


# ---------------------------------------------------------------- refusals


def _tools_with(index: int, function: Any) -> list[Any]:
    tools: list[Any] = [dict(t) for t in TOOLS] + [{"type": "function", "function": {"name": "x"}}]
    tools[index] = {"type": "function", "function": function}
    return tools


ASSISTANT_CALL = {"role": "assistant", "content": None}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": TOOLS}, "tool_choice", 'tool_choice "auto"'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "tool-call parser"),
        ({"tool_choice": "auto"}, "tool_choice", '"required", "none" or a named function'),
        ({"tools": {"a": 1}, "tool_choice": "none"}, "tools", "must be a list"),
        (
            {"tools": [TOOLS[0]] * 129, "tool_choice": "none"},
            "tools",
            "holds 129 tools; at most 128",
        ),
        ({"tools": ["f"], "tool_choice": "none"}, "tools[0]", "must be an object"),
        (
            {"tools": [{"type": "code_interpreter"}], "tool_choice": "none"},
            "tools[0].type",
            "must be 'function'",
        ),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools[0].function", "name"),
        (
            {"tools": _tools_with(2, {"name": "bad name"}), "tool_choice": "none"},
            "tools[2].function.name",
            "^[a-zA-Z0-9_-]{1,64}$",
        ),
        (
            {"tools": _tools_with(2, {"name": "a" * 65}), "tool_choice": "none"},
            "tools[2].function.name",
            "1 to 64",
        ),
        (
            {"tools": _tools_with(2, {"name": "get_time"}), "tool_choice": "none"},
            "tools[2].function.name",
            "also tools[0]",
        ),
        (
            {"tools": _tools_with(2, {"name": "x", "parameters": "{}"}), "tool_choice": "none"},
            "tools[2].function.parameters",
            "must be a JSON schema",
        ),
        (
            {"tools": _tools_with(2, {"name": "x", "description": 5}), "tool_choice": "none"},
            "tools[2].function.description",
            "must be a string",
        ),
        (
            {"tools": _tools_with(2, {"name": "x", "strict": "yes"}), "tool_choice": "none"},
            "tools[2].function.strict",
            "boolean",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope' is not one of the tools (get_time, get_weather)",
        ),
        ({"tool_choice": NAMED}, "tool_choice", "needs tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [], "tool_choice": NAMED}, "tool_choice", "(tools is empty)"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "name"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'always'"),
        (
            {
                "tools": _tools_with(1, {"name": "w", "parameters": {"type": "object", "not": {}}}),
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
            "tools[1].function.parameters: keyword 'not' is not supported",
        ),
        (
            {
                "tools": _tools_with(1, {"name": "w", "parameters": {"patternProperties": {}}}),
                "tool_choice": {"type": "function", "function": {"name": "w"}},
            },
            "tools[1].function.parameters",
            "patternProperties",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"},
            "parallel_tool_calls",
            "boolean",
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "response_format",
            "response_format and tool_choice each constrain the output",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"},
            "guided_regex",
            "send at most one",
        ),
        ({"tools": TOOLS, "tool_choice": NAMED, "echo": True}, "echo", "tool calls"),
        (
            {"tools": TOOLS, "tool_choice": NAMED, "ignore_eos": True},
            "tool_choice",
            "cannot be combined with ignore_eos",
        ),
        (
            {"messages": [USER_HI, {**ASSISTANT_CALL, "tool_calls": {"id": "c"}}]},
            "messages[1].tool_calls",
            "must be a list",
        ),
        (
            {
                "messages": [
                    USER_HI,
                    {**ASSISTANT_CALL, "tool_calls": [{"id": "c", "function": {}}]},
                ]
            },
            "messages[1].tool_calls[0].function.name",
            "non-empty string",
        ),
        (
            {
                "messages": [
                    USER_HI,
                    {
                        **ASSISTANT_CALL,
                        "tool_calls": [{"id": 7, "function": {"name": "f", "arguments": "{}"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].id",
            "must be a string",
        ),
        (
            {
                "messages": [
                    USER_HI,
                    {**ASSISTANT_CALL, "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "string of JSON",
        ),
        (
            {
                "messages": [
                    USER_HI,
                    {**ASSISTANT_CALL, "tool_calls": [{"type": "web", "function": {"name": "f"}}]},
                ]
            },
            "messages[1].tool_calls[0].type",
            "'function'",
        ),
        (
            {"messages": [{**USER_HI, "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0]",
            "only allowed on assistant messages",
        ),
        (
            {"messages": [USER_HI, {"role": "tool", "content": "21 C"}]},
            "messages[1].tool_call_id",
            "must be a string",
        ),
        (
            {"messages": [USER_HI, {"role": "tool", "tool_call_id": "c"}]},
            "messages[1].content",
            "must be a string or a list of text parts",
        ),
    ],
)
def test_bad_tools_are_refused_naming_the_field(
    http: httpx.Client,
    cluster: ScriptedCluster,
    model: ServedModel,
    fields: dict[str, Any],
    param: str,
    words: str,
) -> None:
    error = bad_request_error(_chat(http, **fields))
    assert error["param"] == param and words in error["message"], error
    script_answer(cluster, model, "ok")
    assert _chat(http).status_code == 200  # the server stays up


def test_tools_are_refused_on_completions(http: httpx.Client) -> None:
    body = {"prompt": "hi", "tools": TOOLS, "tool_choice": "required"}
    error = bad_request_error(http.post("/v1/completions", json=body))
    assert error["param"] == "tools"
