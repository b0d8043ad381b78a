"""``/v1/responses`` (OpenAI's Responses API, as vLLM serves it), judged by the ``openai``
client: text, reasoning and function calls as output items, whole and streamed alike; input
items rendered as the chat messages they stand for; fields it does not serve refused by name.

The cluster is scripted (``token_script``) around the demo model's real tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.responses_store import ResponseStore
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import Gateway
from tests.gateway.token_script import (
    DEMO_MODEL,
    ScriptedCluster,
    module_gateway_client,  # noqa: F401 - the http fixture
    post_json,
    script_answer,
)

pytestmark = pytest.mark.timeout(120)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
KEYS = ["key-a", "key-b"]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def model() -> ServedModel:
    """The demo model reading hermes calls and qwen3 reasoning (``<think>`` is plain text
    there, as it is in the demo vocabulary)."""
    served = ServedModel.load(
        str(DEMO_MODEL),
        "pdserve-demo",
        None,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
    )
    served.tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<tool_call>", "</tool_call>"]}
    )
    return served


@pytest.fixture(scope="module")
def client(http: httpx.Client) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", max_retries=0) as client:
        yield client


def _streamed(client: openai.OpenAI, **request: Any) -> tuple[list[Any], Any]:
    """A streamed response's events, and the response its last event carries."""
    events = list(client.responses.create(model="pdserve-demo", stream=True, **request))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events, events[-1].response


def test_text_comes_back_as_a_message_whole_and_streamed(
    client: openai.OpenAI, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, "</think>It is sunny in Paris.")
    whole = client.responses.create(model="pdserve-demo", input="Weather?")
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "completed" and whole.output_text == "It is sunny in Paris."
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert whole.usage is not None
    assert whole.usage.input_tokens == len(cluster.prompts[-1])
    assert whole.usage.output_tokens == len(cluster.tokens)
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    events, final = _streamed(client, input="Weather?")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "It is sunny in Paris."
    assert events[-1].type == "response.completed"
    assert final.output_text == whole.output_text and final.usage == whole.usage
    kinds = [e.type for e in events if "delta" not in e.type]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_reasoning_then_text_are_two_items(
    client: openai.OpenAI, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, "<think>Paris is in France.</think>Sunny.")
    whole = client.responses.create(model="pdserve-demo", input="Weather?")
    reasoning, message = whole.output
    assert reasoning.type == "reasoning"
    assert reasoning.content is not None and reasoning.content[0].text == "Paris is in France."
    assert whole.output_text == "Sunny."
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens > 0
    events, final = _streamed(client, input="Weather?")
    thought = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(thought) == "Paris is in France."
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Paris is in France."
    assert final.output_text == "Sunny."


def test_function_calls_are_items_whole_and_streamed(
    client: openai.OpenAI, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, "</think>" + CALL_TEXT)
    whole = client.responses.create(model="pdserve-demo", input="Weather?", tools=TOOLS)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert whole.status == "completed"
    events, final = _streamed(client, input="Weather?", tools=TOOLS)
    (streamed,) = final.output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.item_id == streamed.id


def test_input_items_render_as_the_chat_messages_they_stand_for(
    client: openai.OpenAI, http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """instructions, messages with text parts, an earlier call with its reasoning and its
    output: the prompt the chat path renders for the same conversation."""
    script_answer(cluster, model, "</think>Done.")
    arguments = '{"city": "Paris"}'
    client.responses.create(
        model="pdserve-demo",
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "I should call the tool."}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": arguments,
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        tools=TOOLS,
    )
    responses_prompt = cluster.prompts[-1]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call],
            "reasoning": "I should call the tool.",
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    post_json(http, "/v1/chat/completions", {"messages": messages, "tools": chat_tools})
    assert responses_prompt == cluster.prompts[-1]


def test_max_output_tokens_cut_makes_it_incomplete(
    client: openai.OpenAI, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, "</think>A long answer that goes on and on.")
    whole = client.responses.create(model="pdserve-demo", input="hi", max_output_tokens=3)
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert cluster.params[-1].max_tokens == 3
    events, final = _streamed(client, input="hi", max_output_tokens=3)
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"


def test_settings_reach_the_sampler_and_are_echoed(
    client: openai.OpenAI, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, '</think>{"city": "Paris"}')
    fmt = {"type": "json_schema", "name": "place", "schema": WEATHER, "strict": True}
    whole = client.responses.create(
        model="pdserve-demo",
        input="hi",
        temperature=0.5,
        top_p=0.9,
        text={"format": fmt},
        metadata={"team": "a"},
        store=True,  # accepted; this gateway keeps none (no --responses-store-size)
    )
    params = cluster.params[-1]
    assert (params.temperature, params.top_p) == (0.5, 0.9)
    assert params.structured_outputs is not None  # the schema constrains the output
    assert whole.temperature == 0.5 and whole.metadata == {"team": "a"}
    assert whole.text.format.type == "json_schema" and whole.store is False


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "mcp_call"}]}, "input[0].type"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"include": "message.output_text.logprobs"}, "include"),
    ],
)
def test_what_it_does_not_serve_is_refused_naming_the_field(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    body = {"model": "pdserve-demo", "input": "hi", **fields}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_the_output_texts_logprobs_when_include_asks_whole_and_streamed(
    client: openai.OpenAI, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """include message.output_text.logprobs: chat's entries of every output token, with
    top_logprobs alternatives; streamed per output_text delta, the done events the message's
    (the eos token's too; not those of the </think> tokens, sent before any text, as vLLM's
    stream); top_logprobs alone shows none, as vLLM."""
    answer = "</think>It is sunny."
    script_answer(cluster, model, answer)
    include = ["message.output_text.logprobs"]
    whole = client.responses.create(
        model="pdserve-demo", input="Weather?", include=include, top_logprobs=2
    )
    assert cluster.params[-1].logprobs == 2
    (part,) = whole.output[-1].content
    texts = [model.tokenizer.decode([t]) for t in cluster.tokens]  # the answer's, then eos
    assert [entry.token for entry in part.logprobs] == texts  # the </think> tokens too
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert part.logprobs[0].bytes == list(texts[0].encode())
    events, last = _streamed(client, input="Weather?", include=include, top_logprobs=2)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [entry.token for e in deltas for entry in e.logprobs]
    assert "".join(streamed).endswith("It is sunny.")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [entry.token for entry in done.logprobs] == [*streamed, "</s>"]  # eos's, no text
    finished = last.output[-1].content[0].logprobs
    assert [(e.token, e.logprob) for e in finished] == [(e.token, e.logprob) for e in done.logprobs]
    plain = client.responses.create(model="pdserve-demo", input="Weather?", top_logprobs=2)
    assert plain.output[-1].content[0].logprobs == [] and cluster.params[-1].logprobs is None


# ---------------------------------------------------------------- kept responses


@pytest.fixture(scope="module")
def kept(cluster: ScriptedCluster, model: ServedModel) -> Iterator[tuple[str, ResponseStore]]:
    """A gateway keeping the last 3 responses, with two API keys; its base URL and store."""
    store = ResponseStore(3)
    limits = RequestLimits(max_model_len=model.max_model_len)
    gateway = Gateway(cluster, model, limits, ApiKeys(KEYS), responses=store)
    server = GatewayServer(gateway, "127.0.0.1", 0, None)
    server.start()
    try:
        yield server.http_url, store
    finally:
        server.stop()


def _client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)


def test_previous_response_id_continues_the_kept_conversation(
    kept: tuple[str, ResponseStore], cluster: ScriptedCluster, model: ServedModel
) -> None:
    """Turn 2 renders turn 1's input and output before its own input (turn 1's instructions
    not carried over, as OpenAI's); a call and its output continue as tool turns; streamed
    responses are kept too."""
    url, _ = kept
    client = _client(url, KEYS[0])
    script_answer(cluster, model, "</think>Sunny.")
    first = client.responses.create(model="pdserve-demo", instructions="Be brief.", input="Hi?")
    assert first.store is True
    script_answer(cluster, model, "</think>" + CALL_TEXT)
    events = list(
        client.responses.create(
            model="pdserve-demo",
            previous_response_id=first.id,
            input="Weather?",
            tools=TOOLS,  # type: ignore[arg-type]
            stream=True,
        )
    )
    second = events[-1].response
    assert second.previous_response_id == first.id
    (call,) = second.output
    script_answer(cluster, model, "</think>Done.")
    client.responses.create(
        model="pdserve-demo",
        previous_response_id=second.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=TOOLS,  # type: ignore[arg-type]
    )
    prompt = cluster.prompts[-1]
    chat_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": call.arguments},
    }
    messages = [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
        post_json(http, "/v1/chat/completions", {"messages": messages, "tools": chat_tools})
    assert prompt == cluster.prompts[-1]


def test_a_kept_response_is_read_back_by_its_own_key_only(
    kept: tuple[str, ResponseStore], cluster: ScriptedCluster, model: ServedModel
) -> None:
    url, _ = kept
    script_answer(cluster, model, "</think>Sunny.")
    mine = _client(url, KEYS[0]).responses.create(model="pdserve-demo", input="Hi?")
    assert _client(url, KEYS[0]).responses.retrieve(mine.id).output_text == "Sunny."
    other = _client(url, KEYS[1])
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as refused:
        other.responses.create(model="pdserve-demo", input="Hi", previous_response_id=mine.id)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_store_false_keeps_nothing_and_the_oldest_make_room(
    kept: tuple[str, ResponseStore], cluster: ScriptedCluster, model: ServedModel
) -> None:
    url, store = kept
    client = _client(url, KEYS[0])
    script_answer(cluster, model, "</think>Sunny.")
    unkept = client.responses.create(model="pdserve-demo", input="Hi?", store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    made = [client.responses.create(model="pdserve-demo", input="Hi?").id for _ in range(4)]
    assert len(store) == 3
    with pytest.raises(openai.NotFoundError):  # the oldest was let go
        client.responses.create(model="pdserve-demo", input="Hi", previous_response_id=made[0])
    for response_id in made[1:]:
        assert client.responses.retrieve(response_id).id == response_id
